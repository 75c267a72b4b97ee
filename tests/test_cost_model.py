"""The step cost model (profiles: measured, saved, from curve files) and the online acceptance calibrator."""

import json
import math
from pathlib import Path

import pytest
import torch

from tetris_hf import cost_model
from tetris_hf.cost_model import (
    AcceptanceCalibrator,
    CostProfile,
    StepCostModel,
    cost_model_for,
    load_profile,
    profile_from_curve,
)
from tiny_models import noisy_copy, tiny_llama

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def grid_profile(target_ms, draft_ms) -> CostProfile:
    """``target_ms(rows, tokens)`` and ``draft_ms(rows)`` over rows {1, 4, 16} x tokens {1, 2, 4, 8}."""
    rows, tokens = (1, 4, 16), (1, 2, 4, 8)
    return CostProfile({(r, t): target_ms(r, t) for r in rows for t in tokens}, {r: draft_ms(r) for r in rows})


def test_cost_model_is_exact_on_the_grid_and_linear_between():
    profile = grid_profile(lambda r, t: 10 + 2 * r + 3 * r * t, lambda r: 1 + 0.5 * r)
    model = StepCostModel(profile)
    assert model.verify_seconds(4, 2) == pytest.approx((10 + 8 + 24) / 1000)
    assert model.verify_seconds(4, 3) == pytest.approx((10 + 8 + 36) / 1000)  # between tokens 2 and 4
    assert model.verify_seconds(10, 1) == pytest.approx((10 + 20 + 30) / 1000)  # between rows 4 and 16
    assert model.verify_seconds(32, 8) == pytest.approx((10 + 64 + 768) / 1000)  # extrapolated along both
    assert model.draft_seconds(8) == pytest.approx(5 / 1000)
    assert model.step_seconds(4, 3, 2) == pytest.approx(3 * 3 / 1000 + (10 + 8 + 36) / 1000)


def test_noisy_profile_is_made_monotone():
    noisy = {(1, 1): 25.0, (1, 2): 34.0, (1, 4): 31.0, (1, 8): 24.0, (8, 1): 22.0, (8, 2): 25.0, (8, 4): 25.5,
             (8, 8): 25.3}
    model = StepCostModel(CostProfile(noisy, {1: 17.0, 8: 13.0}))
    for rows in (1, 3, 8, 20):
        times = [model.verify_seconds(rows, tokens) for tokens in range(1, 12)]
        assert times == sorted(times)
    for tokens in (1, 2, 5, 8):
        times = [model.verify_seconds(rows, tokens) for rows in range(1, 30)]
        assert times == sorted(times)
    assert model.draft_seconds(8) >= model.draft_seconds(1)


def test_profile_round_trips_through_json_and_dict(tmp_path):
    profile = grid_profile(lambda r, t: r * t + 1.5, lambda r: 0.25 * r)
    profile.meta["device"] = "cpu"
    path = profile.save(tmp_path / "sub" / "profile.json")
    for loaded in (load_profile(path), load_profile(str(path)), load_profile(json.loads(path.read_text()))):
        assert loaded.target == profile.target and loaded.draft == profile.draft and loaded.meta == profile.meta
    with pytest.raises(ValueError, match="format"):
        load_profile({"target": [], "draft": []})
    with pytest.raises(ValueError, match="bad target timing"):
        CostProfile({(0, 1): 1.0}, {1: 1.0})


def test_curve_files_of_each_shape_become_profiles(tmp_path):
    by_model = [{"model": "big", "B": b, "L": l, "ms": 10.0 * b + l} for b in (1, 8) for l in (1, 4)]
    by_model += [{"model": "small", "B": b, "L": 1, "ms": 1.0 + b} for b in (1, 8)]
    by_layers = [{"layers": 30, "B": b, "L": l, "ms": 20.0 + b * l} for b in (1, 16) for l in (1, 8)]
    by_layers += [{"layers": n, "B": b, "L": 1, "ms": float(n)} for n in (4, 2) for b in (1, 16)]
    (tmp_path / "a.json").write_text(json.dumps({"env": {}, "rows": by_model}))
    (tmp_path / "b.json").write_text(json.dumps(by_layers))
    a = profile_from_curve(tmp_path / "a.json")
    assert a.target[(8, 4)] == 84.0 and a.draft == {1: 2.0, 8: 9.0}
    b = load_profile(tmp_path / "b.json")
    assert b.meta["target"] == "layers=30" and b.draft == {1: 4.0, 16: 4.0}  # first draft in file order
    assert load_profile(f"{tmp_path / 'b.json'}:layers=30:layers=2").draft == {1: 2.0, 16: 2.0}
    with pytest.raises(ValueError, match="no draft model"):
        profile_from_curve(tmp_path / "b.json", draft="layers=3")


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared/data is not beside the repository")
def test_shared_h200_and_cpu_curves_load():
    h200 = StepCostModel(profile_from_curve(SHARED_DATA / "h200_curve_8b.json"))
    assert h200.profile.meta["target"] == "target8b-bf16" and h200.profile.meta["draft"] == "draft1b"
    assert 0.020 < h200.verify_seconds(1, 1) < 0.030 and h200.verify_seconds(128, 8) > 0.1
    assert h200.verify_seconds(256, 8) > h200.verify_seconds(128, 8)  # extrapolated beyond the grid
    cpu = StepCostModel(profile_from_curve(SHARED_DATA / "cpu_curve_smol.json"))
    assert cpu.verify_seconds(16, 8) == pytest.approx(0.4619)
    smol = StepCostModel(profile_from_curve(SHARED_DATA / "h200_curve_smol.json"))
    assert smol.profile.meta["target"] == "layers=30"


def test_measured_profile_is_cached_in_memory_and_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TETRIS_HF_CACHE", str(tmp_path))
    cost_model.clear_memory_cache()
    target = tiny_llama(48, num_layers=2, seed=5)
    draft = tiny_llama(48, num_layers=1, seed=6)
    first = cost_model_for(target, draft, num_rows=3, max_tokens=3)
    assert set(first.profile.target) == {(r, t) for r in (1, 3) for t in (1, 2, 3)}
    assert set(first.profile.draft) == {1, 3}
    files = list((tmp_path / "cost-profiles").glob("*.json"))
    assert len(files) == 1

    def no_measuring(*args, skip=None, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(cost_model, "measure_profile", no_measuring)
    assert cost_model_for(target, draft, num_rows=2, max_tokens=2).profile.target == first.profile.target
    cost_model.clear_memory_cache()  # from disk now
    assert cost_model_for(target, draft, num_rows=3, max_tokens=3).profile.target == first.profile.target

    measured = []
    real = cost_model.__dict__["_timed_forwards"]

    def counting(model, rows, tokens, *args, **kwargs):
        measured.append((rows, tuple(tokens)))
        return real(model, rows, tokens, *args, **kwargs)

    monkeypatch.undo()
    monkeypatch.setenv("TETRIS_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_model, "_timed_forwards", counting)
    wider = cost_model_for(target, draft, num_rows=5, max_tokens=3)  # only rows 4 and 5 are new
    assert {rows for rows, _ in measured} == {4, 5}
    assert {(r, t) for r in (1, 3, 4, 5) for t in (1, 2, 3)} <= set(wider.profile.target)
    other_draft = noisy_copy(target, 0.1)  # same architecture as the target: a different key from `draft`
    assert cost_model.profile_key(target, other_draft) != cost_model.profile_key(target, draft)
    cost_model.clear_memory_cache()


def test_calibrator_converges_on_a_stream_with_known_acceptance():
    truth = lambda q: 0.05 + 0.9 * q ** 2  # noqa: E731  (far from the prior "acceptance = q")
    generator = torch.Generator().manual_seed(0)
    calibrator = AcceptanceCalibrator(num_bins=10, memory=None)
    for _ in range(40):
        q = torch.rand(500, generator=generator)
        calibrator.update_cells(q, torch.rand(500, generator=generator) < truth(q))
    centres = calibrator.centres
    bin_truth = torch.stack([truth(torch.linspace(lo, lo + 0.1, 101)).mean() for lo in centres - 0.05])
    assert torch.allclose(calibrator.means(), bin_truth.double(), atol=0.03)
    assert torch.allclose(calibrator.predict(centres), calibrator.means())


def test_calibrator_learns_from_verified_prefixes_only():
    """Rows drafted K cells each accepted with probability a(q); verification reveals the accepted prefix and the
    first rejection, nothing after it. The conditional estimate must still converge to a(q)."""
    truth = lambda q: 0.2 + 0.6 * q  # noqa: E731
    generator = torch.Generator().manual_seed(1)
    calibrator = AcceptanceCalibrator(num_bins=5, memory=None)
    for _ in range(300):
        q = torch.rand(16, 6, generator=generator)
        accept = torch.rand(16, 6, generator=generator) < truth(q)
        verify = torch.randint(0, 7, (16,), generator=generator)
        first_reject = torch.where(accept.all(dim=1), 6, (~accept).long().argmax(dim=1))
        calibrator.update(q.log(), verify, torch.minimum(first_reject, verify))
    bin_truth = torch.tensor([truth(c) for c in calibrator.centres.tolist()], dtype=torch.float64)
    assert torch.allclose(calibrator.means(), bin_truth, atol=0.04)


def test_calibrator_forgets_with_memory():
    calibrator = AcceptanceCalibrator(num_bins=1, prior_strength=1.0, memory=200.0)
    q = torch.full((100,), 0.5)
    for _ in range(20):
        calibrator.update_cells(q, torch.ones(100, dtype=torch.bool))
    assert calibrator.means()[0] > 0.95
    for _ in range(20):
        calibrator.update_cells(q, torch.zeros(100, dtype=torch.bool))
    assert calibrator.means()[0] < 0.05
    assert math.isclose(float(AcceptanceCalibrator(4).predict(torch.tensor(0.0))), 0.125)


def test_upper_confidence_bounds_narrow_to_the_mean_as_cells_are_seen():
    calibrator = AcceptanceCalibrator(4, memory=None)
    probs = torch.linspace(0, 1, 9)
    assert (calibrator.upper_bounds(2.0) > calibrator.means()).all()
    assert (calibrator.predict(probs, optimism=2.0) >= calibrator.predict(probs)).all()
    unseen_gap = float(calibrator.upper_bounds(2.0)[0] - calibrator.means()[0])
    accepted = torch.rand(1000, generator=torch.Generator().manual_seed(0)) < 0.3
    calibrator.update_cells(torch.full((1000,), 0.1), accepted)
    seen_gap = float(calibrator.upper_bounds(2.0)[0] - calibrator.means()[0])
    assert seen_gap < 0.04 < 0.2 < unseen_gap  # 2 standard deviations: ~0.3 from the prior alone, ~0.03 after 1000
    assert float(calibrator.upper_bounds(50.0).max()) == 1.0
