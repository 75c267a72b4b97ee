"""``tetris-hf simulate``: recorded traces are valid, and the replay reproduces known acceptance analytically."""

import argparse
import json

import pytest
import torch

from tetris_hf.tools import simulate
from tetris_hf.tools.cli import UsageError
from tetris_hf.cost_model import CostProfile, StepCostModel
from tetris_hf.goodput import expected_tokens_geometric
from tetris_hf.options import TetrisOptions
from tetris_hf.strategies import FixedWindow
from test_greedy_exactness import pick_eos, target_alone
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, tiny_llama

K = 5


def test_recorded_traces_are_valid_and_account_for_every_token(tmp_path):
    target = tiny_llama(64, num_layers=2, seed=7)
    draft = noisy_copy(target, 0.3, 7)
    prompts = random_prompts(5, 64, seed=7)
    eos = pick_eos(target, prompts)
    references = target_alone(target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    rows = simulate.record_traces(target, draft, input_ids, mask, num_draft_tokens=K, first_request=10,
                                  max_new_tokens=18, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    emitted = {}
    for row in rows:
        assert len(row["log_probs"]) == len(row["accept"]) <= K
        assert all(value <= 0 for value in row["log_probs"])
        assert 0 <= row["accepted"] <= row["verified"] <= K
        flags = row["accept"]
        assert flags[: row["accepted"]] == [1] * row["accepted"]  # the accepted prefix
        if row["accepted"] < row["verified"]:
            assert flags[row["accepted"]] == 0  # then the first rejection, then cells never reached
        assert all(flag is None for flag in flags[row["accepted"] + (row["accepted"] < row["verified"]):])
        emitted[row["request"]] = emitted.get(row["request"], 0) + row["emitted"]
    assert emitted == {10 + i: len(reference) for i, reference in enumerate(references)}
    assert sum(row["accepted"] for row in rows) > 0

    path = simulate.write_traces(tmp_path / "t.jsonl", rows, {"num_draft_tokens": K, "target": "tiny"})
    traces = simulate.read_traces([path])
    assert traces.num_draft_tokens == K and len(traces.requests) == 5
    assert traces.num_steps == sum(1 for row in rows if row["verified"] == K)
    assert all(lp.shape[1] == K and len(lp) == len(a) for lp, a in traces.requests)


def synthetic_traces(tmp_path, acceptance: float, num_requests=40, steps=100, seed=0):
    """Cells accepted independently with probability ``acceptance``; draft log-probs random (uninformative)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for request in range(num_requests):
        for step in range(steps):
            accept = (torch.rand(K, generator=generator) < acceptance).tolist()
            accepted = accept.index(False) if False in accept else K
            rows.append({"request": request, "step": step, "log_probs": (-torch.rand(K, generator=generator)).tolist(),
                         "accept": None, "accepted": accepted, "verified": K, "emitted": accepted + 1})
    return simulate.write_traces(tmp_path / f"synthetic-{acceptance}.jsonl", rows, {"num_draft_tokens": K})


FLAT = CostProfile({(r, t): 10.0 + r * t for r in (1, 8, 64) for t in (1, 2, 4, 8)}, {1: 1.0, 8: 2.0, 64: 4.0})


@pytest.mark.parametrize("acceptance", [0.3, 0.8])
def test_fixed_k_replay_gives_the_geometric_tokens_per_step(tmp_path, acceptance):
    traces = simulate.read_traces([synthetic_traces(tmp_path, acceptance)])
    cost = StepCostModel(FLAT)
    for k in (1, 3, 5):
        batch_size, steps = 16, 300
        result = simulate.replay(FixedWindow(TetrisOptions(num_assistant_tokens=k)), traces, cost, batch_size, steps)
        expected = expected_tokens_geometric(acceptance, k)
        assert result.tokens / (batch_size * steps) == pytest.approx(expected, rel=0.03)
        assert result.seconds == pytest.approx(steps * cost.step_seconds(batch_size, k, k))
        assert result.verified == k * batch_size * steps


def test_replay_cli_writes_table_and_json(tmp_path, capsys):
    trace_path = synthetic_traces(tmp_path, 0.7, num_requests=8, steps=30)
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps([{"model": "t", "B": b, "L": l, "ms": 20.0 + 0.5 * b * l} for b in (1, 4, 16)
                                 for l in (1, 2, 4, 8)] + [{"model": "d", "B": b, "L": 1, "ms": 2.0} for b in (1, 16)]))
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    args = parser.parse_args(["replay", "--traces", str(trace_path), "--curve", str(curve), "--batch-sizes", "1,4,32",
                              "--fixed-k", "1,2,3", "--row-steps", "64", "--min-steps", "16",
                              "--output", str(tmp_path / "out")])
    assert simulate.main(args) == 0
    printed = capsys.readouterr().out
    assert "adaptive" in printed and "best TETRIS" in printed
    report = json.loads((tmp_path / "out" / "simulate.json").read_text())
    (curve_report,) = report["curves"]
    assert [r["batch_size"] for r in curve_report["results"]] == [1, 4, 32]
    runs = curve_report["results"][0]["runs"]
    assert {"no-SD", "fixed k=1", "tetris k=1 e=2", "dsd", "adaptive"} <= set(runs)
    assert "Prefix semantics" in report["assumptions"]
    # cheap verification, acceptance 0.7: speculation pays and adaptive finds it
    assert runs["adaptive"]["tokens_per_second"] > 1.2 * runs["no-SD"]["tokens_per_second"]
    with pytest.raises(UsageError, match="bad traces"):
        simulate.main(parser.parse_args(["replay", "--traces", str(tmp_path / "none.jsonl"), "--curve", str(curve)]))
