"""The loop reads the device at most twice per steady-state step (on a GPU every read stalls the step).

Reads are counted as in the issue that set the bound: every call of ``Tensor.item/__int__/__bool__/__float__/
__index__/tolist/cpu`` during a ``generate()`` call, between two step callbacks. Plain ``generate()`` does about two
per step (its stopping check and transformers' mask check); the loop's are the block length (with the caches' fill
levels) and, when a row may have stopped, how many did.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tiny_models import left_pad, noisy_copy, random_prompts, tiny_llama

_spec = importlib.util.spec_from_file_location(
    "host_reads", Path(__file__).resolve().parents[1] / "examples" / "host_reads.py")
host_reads = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_reads)  # the counter gpu_check.py uses too


def reads_per_step(**generate_kwargs) -> list[int]:
    """Host reads made during each step of a TETRIS call on tiny models (B = 8, 40 new tokens)."""
    target = tiny_llama(64, num_layers=2, seed=0)
    draft = noisy_copy(target, 0.3)
    input_ids, mask = left_pad(random_prompts(8, 64, seed=1))
    with host_reads.HostReads() as reads:
        target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                        max_new_tokens=40, tetris_step_callback=reads.step_done, **generate_kwargs)
    return reads.per_step


@pytest.mark.parametrize("strategy", ["tetris", "fixed"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_steady_state_step_reads_the_device_at_most_twice(strategy, do_sample):
    per_step = reads_per_step(tetris_strategy=strategy, do_sample=do_sample)
    steady = per_step[2:-1]  # after the prompt step and the first drafting step, before the last
    assert len(steady) >= 5
    assert max(steady) <= 2, per_step


# The prefix-reading processors transformers ships run batched on the device (tetris_hf/logits/batched_processors.py).
PREFIX_READERS = dict(repetition_penalty=1.3, min_new_tokens=30, no_repeat_ngram_size=3, bad_words_ids=[[5], [7, 8]])


@pytest.mark.parametrize("do_sample", [False, True])
def test_prefix_reading_processors_add_no_read_to_a_step(do_sample):
    per_step = reads_per_step(do_sample=do_sample, **PREFIX_READERS)
    steady = per_step[2:-1]
    assert len(steady) >= 5
    assert max(steady) <= 2, per_step


def test_a_custom_prefix_reading_processor_runs_per_row_and_its_reads_are_counted():
    """Teeth: a processor with no batched form runs per row and position, on the host."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class LastTokenBonus(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores + torch.nn.functional.one_hot(input_ids[:, -1], scores.shape[-1])

    per_step = reads_per_step(logits_processor=LogitsProcessorList([LastTokenBonus()]), **PREFIX_READERS)
    assert max(per_step[2:-1]) > 2


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_plain_step_reads_the_device_only_for_stopping(do_sample):
    """A step that drafts nothing (``tetris_budget=0``, and ``adaptive`` when drafting does not pay) sends each row's
    last token: no block length to read, only whether a row stopped (this call has an EOS token)."""
    per_step = reads_per_step(tetris_budget=0, do_sample=do_sample, eos_token_id=63)
    steady = per_step[1:-1]
    assert len(steady) >= 5
    assert max(steady) <= 1, per_step


def test_reads_are_counted():
    """The counter sees the reads a custom stopping criterion makes (token by token, on the host)."""
    from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

    class NeverStops(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    per_step = reads_per_step(stopping_criteria=StoppingCriteriaList([NeverStops()]))
    assert max(per_step[2:-1]) > 2


def count_strategy_transfers(monkeypatch, reads) -> None:
    """Count each transfer the cost-aware strategies make (``strategies._to_host``, their one read a step) in
    ``reads``; their arithmetic on the host copies is not a device read."""
    from tetris_hf import strategies

    to_host = getattr(strategies._to_host, "__wrapped__", strategies._to_host)

    def transfer(tensors):
        reads.count += 1
        return to_host(tensors)

    transfer.__wrapped__ = to_host
    monkeypatch.setattr(strategies, "_to_host", transfer)


def test_cost_aware_strategies_read_the_device_once_per_step_besides_the_loop(monkeypatch):
    """``adaptive`` and ``dsd`` move what they learn and select on to the host in one transfer per step
    (``strategies._to_host``, counted here); their arithmetic on those host copies is not a device read."""
    from tetris_hf.cost_model import CostProfile

    rows, tokens = (1, 4, 16, 64), (1, 2, 4, 8)
    free_verification = CostProfile({(r, t): 10.0 for r in rows for t in tokens}, {r: 1e-3 for r in rows})
    for strategy in ("adaptive", "dsd"):
        target = tiny_llama(64, num_layers=2, seed=0)
        draft = noisy_copy(target, 0.3)
        input_ids, mask = left_pad(random_prompts(8, 64, seed=1))
        with host_reads.HostReads(host_files=("strategies.py", "goodput.py", "cost_model.py")) as reads:
            count_strategy_transfers(monkeypatch, reads)
            target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                            max_new_tokens=40, tetris_step_callback=reads.step_done, tetris_strategy=strategy,
                            tetris_cost_profile=free_verification)
        steady = reads.per_step[3:-1]  # after the prompt step, the first probe and the first plan on it
        assert len(steady) >= 5
        assert max(steady) <= 3, (strategy, reads.per_step)
