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
