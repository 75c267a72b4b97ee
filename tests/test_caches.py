"""After any step, both caches give the logits a fresh, unpadded, uncached forward gives; and they stay bounded."""

import copy

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

from tetris_hf.decoding import BatchedSpeculativeLoop
from tetris_hf.options import TetrisOptions
from tetris_hf.step_strategy import DraftPlan
from tetris_hf.strategies import FixedWindow
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, tiny_llama


def make_loop(target, draft, prompts, max_new_tokens, **options):
    input_ids, mask = left_pad(prompts)
    max_length = input_ids.shape[1] + max_new_tokens
    config = GenerationConfig(do_sample=False, max_length=max_length, pad_token_id=PAD)
    stopping = StoppingCriteriaList([MaxLengthCriteria(max_length)])
    loop = BatchedSpeculativeLoop(target, draft, input_ids, mask, LogitsProcessorList(), stopping, config,
                                  TetrisOptions(**options))
    return loop, mask.shape[1] - mask.sum(dim=1)  # left padding per original row


def next_logits_from_cache(slots, model, tokens, mask):
    """Feed the tokens the cache has not read yet into a copy of it; logits at each row's last position."""
    return copy.deepcopy(slots).forward(model, tokens, mask)[:, -1]


def next_logits_fresh(model, tokens):
    return model(torch.tensor([tokens])).logits[0, -1]


def assert_caches_match_fresh(loop, target, draft, padding) -> None:
    """Both caches of a running loop give, for every active row, the next-token logits of a fresh forward over the
    row's unpadded tokens (``padding``: each original row's left padding)."""
    rows = loop.batch.rows.tolist()
    last = loop.batch.sequences[torch.arange(len(rows)), loop.batch.lengths - 1][:, None]
    target_next = next_logits_from_cache(loop.target_slots, target, last, torch.ones_like(last))
    drafter = loop.drafter
    draft_next = next_logits_from_cache(drafter.slots, draft, drafter.pending_tokens, drafter.pending_mask)
    for index, row in enumerate(rows):
        text = loop.batch.sequences[index, int(padding[row]) : int(loop.batch.lengths[index])].tolist()
        torch.testing.assert_close(target_next[index], next_logits_fresh(target, text), atol=1e-4, rtol=0)
        torch.testing.assert_close(draft_next[index], next_logits_fresh(draft, text), atol=1e-4, rtol=0)


@pytest.mark.parametrize("strategy,extra", [("tetris", 2), ("fixed", 0), ("tetris", 0)])
def test_caches_match_fresh_forward_after_every_step(strategy, extra):
    target = tiny_llama(97, num_layers=2, seed=31)
    draft = noisy_copy(target, 0.5, seed=32)
    prompts = random_prompts(5, 97, seed=33, max_length=12)
    loop, padding = make_loop(target, draft, prompts, 40, tetris_strategy=strategy, tetris_extra_tokens=extra,
                              num_assistant_tokens=3, tetris_max_holes=4)
    steps_checked = 0
    with torch.no_grad():
        while not loop.done:
            loop.step()
            if loop.done:
                break
            assert_caches_match_fresh(loop, target, draft, padding)
            steps_checked += 1
    assert steps_checked >= 5
    assert loop.stats.accepted_tokens > 0


def test_cache_length_stays_bounded_over_500_steps():
    target = tiny_llama(64, num_layers=1, seed=41, hidden_size=16)
    draft = tiny_llama(64, num_layers=1, seed=42, hidden_size=16)  # mostly rejected: many holes
    prompts = random_prompts(4, 64, seed=43, max_length=10)
    max_holes = 8
    loop, _ = make_loop(target, draft, prompts, 700, num_assistant_tokens=3, tetris_extra_tokens=2,
                        tetris_max_holes=max_holes)
    # The loop repacks from a fill level it read before the step's forwards (no read of its own), so a cache may
    # hold one block (K + 1 slots) beyond max_holes until the next step repacks it.
    allowed = max_holes + (3 + 2) + 1
    steps, worst_waste = 0, 0
    with torch.no_grad():
        while not loop.done and steps < 500:
            loop.step()
            steps += 1
            for slots in (loop.target_slots, loop.drafter.slots):
                waste = slots.length - int(slots.live_lengths().max())
                worst_waste = max(worst_waste, waste)
                assert waste <= allowed, f"step {steps}: {waste} wasted slots"
                assert slots.capacity == loop.target_slots.capacity  # allocated once: never grew
    assert steps == 500
    assert loop.stats.verified_tokens > loop.stats.accepted_tokens  # holes were made, and removed
    assert worst_waste > 0


class DraftsEveryThirdStep(FixedWindow):
    """Decodes plainly two steps out of three, so the draft keeps falling behind and catching up."""

    def __init__(self, options):
        super().__init__(options)
        self.calls = 0

    def plan(self, num_rows: int) -> DraftPlan:
        self.calls += 1
        return super().plan(num_rows) if self.calls % 3 == 0 else DraftPlan(0, 0)


def test_draft_cache_catches_up_after_plain_steps():
    target = tiny_llama(97, num_layers=2, seed=51)
    draft = noisy_copy(target, 0.3, seed=52)
    prompts = random_prompts(4, 97, seed=53, max_length=12)
    loop, padding = make_loop(target, draft, prompts, 30, num_assistant_tokens=2, tetris_max_holes=4)
    loop.core.strategy = DraftsEveryThirdStep(TetrisOptions(num_assistant_tokens=2))
    pending_widths = []
    with torch.no_grad():
        while not loop.done:
            loop.step()
            if loop.done:
                break
            drafter = loop.drafter
            pending_widths.append(drafter.pending_tokens.shape[1])
            draft_next = next_logits_from_cache(drafter.slots, draft, drafter.pending_tokens, drafter.pending_mask)
            for index, row in enumerate(loop.batch.rows.tolist()):
                text = loop.batch.sequences[index, int(padding[row]) : int(loop.batch.lengths[index])].tolist()
                torch.testing.assert_close(draft_next[index], next_logits_fresh(draft, text), atol=1e-4, rtol=0)
    assert max(pending_widths) > 12  # the prompt and two plain steps waited, unread, before the first draft
    assert loop.stats.accepted_tokens > 0


def test_steps_that_draft_nothing_cost_what_plain_generate_costs():
    """``tetris_budget=0``: the draft never runs, and the target runs once per new token, as in ``generate()``."""
    target = tiny_llama(97, num_layers=2, seed=61)
    draft = noisy_copy(target, 0.3, seed=62)
    input_ids, mask = left_pad(random_prompts(3, 97, seed=63, max_length=9))
    calls = {"target": 0, "draft": 0}
    hooks = [model.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
             for name, model in (("target", target), ("draft", draft))]
    try:
        plain = target.generate(input_ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=PAD)
        plain_calls = calls["target"]
        calls["target"] = 0
        out = target.generate(input_ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=PAD,
                              assistant_model=draft, custom_generate="tetris", tetris_budget=0)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(out, plain)
    assert plain_calls == 7 and calls == {"target": 7, "draft": 0}


def test_windowed_model_cache_stays_bounded_over_500_steps_and_exact():
    """Every layer of this Mistral attends through an 8-token window: slots older than every window are dropped, so
    the cache never holds more than the window, the holes allowed and a block or two, however long the call."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(61)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                           max_position_embeddings=4096, pad_token_id=PAD, eos_token_id=None, bos_token_id=None,
                           tie_word_embeddings=False)
    target = MistralForCausalLM(config).eval()
    draft = noisy_copy(target, 0.6, seed=62)  # agrees now and then: accepted drafts and holes
    prompts = random_prompts(3, 64, seed=63, min_length=4, max_length=12)
    max_holes, block = 4, 2 + 1
    loop, padding = make_loop(target, draft, prompts, 1500, num_assistant_tokens=1, tetris_extra_tokens=1,
                              tetris_max_holes=max_holes)
    bound = 8 + max_holes + 2 * block  # window + holes + the block being written and the one not yet repacked
    steps = 0
    with torch.no_grad():
        while not loop.done and steps < 500:
            loop.step()
            steps += 1
            for slots in (loop.target_slots, loop.drafter.slots):
                assert slots.length <= bound, f"step {steps}: {slots.length} slots"
                assert slots.capacity <= 12 + bound  # allocated for the window, not for 1500 tokens
    assert steps == 500 and loop.stats.verified_tokens > loop.stats.accepted_tokens > 0
    for row, tokens in enumerate(loop.partial_outputs()):  # exact: 60 windows past the start
        tokens = tokens[int(padding[row]):]
        reference = target.generate(torch.tensor([prompts[row]]), max_new_tokens=len(tokens) - len(prompts[row]),
                                    do_sample=False, pad_token_id=PAD)[0].tolist()
        assert tokens == reference, f"row {row}"


def test_a_calls_caches_are_freed_when_it_returns_without_waiting_for_the_garbage_collector():
    """Nothing keeps a finished call's KV buffers alive: no reference cycle (which only the cyclic collector frees,
    whenever it runs, and which grew the process by a call's caches per call)."""
    import gc
    import weakref

    target = tiny_llama(64, num_layers=2, seed=0)
    draft = noisy_copy(target, 0.3)
    input_ids, mask = left_pad(random_prompts(4, 64, seed=1))
    buffers = []

    def keep_weak_references(record, loop):
        if not buffers:
            for slots in (loop.target_slots, loop.drafter.slots):
                buffers.extend(weakref.ref(layer.keys) for layer in slots.cache.layers if layer.is_initialized)
            buffers.append(weakref.ref(loop.target_slots))

    gc.disable()
    try:
        with torch.no_grad():
            target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                            max_new_tokens=8, tetris_step_callback=keep_weak_references)
        assert len(buffers) > 2 and all(reference() is None for reference in buffers)
    finally:
        gc.enable()
