"""examples/loop_overhead.py on tiny models: both runs make the same target forwards, and the timer adds up."""

import importlib.util
from pathlib import Path

import pytest

from tiny_models import PAD, left_pad, noisy_copy, random_prompts, tiny_llama

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "loop_overhead.py"


@pytest.fixture(scope="module")
def loop_overhead():
    spec = importlib.util.spec_from_file_location("loop_overhead", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plain_generate_and_the_loop_drafting_nothing_make_the_same_forwards(loop_overhead):
    target = tiny_llama(64, seed=71)
    input_ids, mask = left_pad(random_prompts(3, 64, seed=72))
    summary = loop_overhead.measure(target, noisy_copy(target, 0.3, seed=73),
                                    {"input_ids": input_ids, "attention_mask": mask}, 6, PAD, repeats=2)
    assert list(summary) == ["plain generate()", "tetris_budget=0", "fixed k=2", "tetris k=2 e=2"]
    for name in ("plain generate()", "tetris_budget=0"):
        assert summary[name]["calls"] == 6  # one target forward per new token, the first reading the prompt
        assert summary[name]["draft"] == 0  # nothing drafted
    for name, row in summary.items():
        assert 0 < row["prompt"] < row["forwards"] < row["wall"]
        assert 0 < row["outside"] < row["wall"]
        assert row["outside_per_step"] == pytest.approx(row["outside"] / row["calls"], rel=0.5)
    for name in ("fixed k=2", "tetris k=2 e=2"):
        assert summary[name]["draft"] > 0 and summary[name]["calls"] <= 6


def test_another_checkout_runs_side_by_side_and_its_tokens_are_compared(loop_overhead):
    # This checkout stands in for "another" one: imported again under another name, its runs come out as the same
    # forwards and tokens, and custom_generate="tetris" still resolves to the package imported first.
    before = loop_overhead.load_other_checkout(EXAMPLE.parents[1], "tetris_hf_compared")
    assert before.generate is not loop_overhead.tetris_hf.generate
    target = tiny_llama(64, seed=74)
    input_ids, mask = left_pad(random_prompts(2, 64, seed=75))
    summary = loop_overhead.measure(target, noisy_copy(target, 0.3, seed=76),
                                    {"input_ids": input_ids, "attention_mask": mask}, 5, PAD, repeats=1, before=before)
    for name in ("tetris_budget=0", "fixed k=2", "tetris k=2 e=2"):
        ours, theirs = summary[name], summary[name + loop_overhead.BEFORE]
        assert ours["calls"] == theirs["calls"] and ours["same"] and theirs["same"]
    from transformers.generation.utils import GenerationMixin
    assert GenerationMixin.load_custom_generate.__module__ == "tetris_hf.generation"


def test_compare_with_a_folder_without_the_package_is_refused(loop_overhead, tmp_path):
    with pytest.raises(SystemExit, match="no tetris_hf/__init__.py"):
        loop_overhead.load_other_checkout(tmp_path)


def test_compiled_runs_are_timed_by_their_steps(loop_overhead, monkeypatch):
    # (torch.compile stands aside here: what is checked is that the runs pass tetris_compile=True and are timed)
    import tetris_hf.compiled as compiled

    compiled_models = []
    monkeypatch.setattr(compiled, "_COMPILED", __import__("weakref").WeakKeyDictionary())
    monkeypatch.setattr(compiled.torch, "compile",
                        lambda forward, **options: compiled_models.append(forward.__self__) or forward)
    target = tiny_llama(64, seed=77)
    draft = noisy_copy(target, 0.3, seed=78)
    input_ids, mask = left_pad(random_prompts(2, 64, seed=79))
    summary = loop_overhead.measure(target, draft, {"input_ids": input_ids, "attention_mask": mask}, 8, PAD,
                                    repeats=1, compiled=True)
    assert set(compiled_models) == {target, draft}
    assert summary["plain generate()"]["step"] is None
    for name in ("fixed k=2", "tetris k=2 e=2"):
        ours = summary[name + loop_overhead.COMPILED]
        assert ours["same"] and ours["step"] > 0 and summary[name]["step"] > 0
        assert ours["calls"] < summary[name]["calls"]  # the compiled step forwards bypass the timing hooks
