"""Packed draft forwards: a draft model's catch-ups and an EAGLE head's re-reads of accepted tokens read only the real
tokens of their left-padded blocks, and propose what the padded reads propose."""

import itertools

import pytest
import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf import loop_core
from tetris_hf.candidate_generators import batched_draft, build
from tetris_hf.candidate_generators.batched_draft import pending_read, split_pending_read
from tetris_hf.kv import SlotCache
from tetris_hf.packing import Packing
from tetris_hf.step_strategy import DraftPlan
from test_eagle_loop import load_pair, prompts_for
from test_greedy_exactness import NEW_TOKENS, assert_rows_equal, pick_eos, target_alone
from test_packing import TokenCounter
from tiny_models import PAD, left_pad, random_prompts, target_and_draft, tiny_llama


def test_a_left_padded_packing_lists_each_rows_last_tokens():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 0]])
    packing = Packing.of_left_padded(mask, 6)
    assert packing.rows.tolist() == [0, 0, 1, 1, 1, 2]
    assert packing.columns.tolist() == [1, 2, 0, 1, 2, 2]
    assert packing.ends.tolist() == [2, 5, 6, 6]
    block = torch.arange(12).view(4, 3)
    assert packing.pack(block).tolist() == [1, 2, 3, 4, 5, 8]
    assert packing.unpack(packing.pack(block)).tolist() == [[0, 1, 2], [3, 4, 5], [0, 0, 8], [0, 0, 0]]


@pytest.mark.parametrize("mask", [[[0, 1], [1, 1], [0, 1]], [[1]], [[0, 0, 1], [0, 1, 1]]])
def test_the_pending_read_carries_the_widest_row_and_the_real_tokens(mask):
    mask = torch.tensor(mask)
    columns = mask.shape[1]
    read = int(pending_read(mask))
    assert split_pending_read(read, columns) == (int(mask.sum(dim=1).max()), int(mask.sum()))
    assert split_pending_read(columns, columns) == (columns, None)  # a plain width: no count


@torch.no_grad()
def read_block(pack: bool, model, prompt: torch.Tensor, prompt_mask: torch.Tensor, block: torch.Tensor,
               block_mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """A draft's cache reading a left-padded prompt but its last column (its first forward), then a left-padded
    block with logits for its last column: those logits, and the tokens each forward computed."""
    slots = SlotCache(prompt.shape[0], prompt.device, capacity=32)
    slots.pack = pack
    slots.prefill(model, prompt, prompt_mask, int(prompt_mask.sum()))
    computed = [slots.tokens_read]
    slots.forward(model, prompt[:, -1:], None, step=True)
    logits = slots.forward(model, block, block_mask, logits_to_keep=1, step=True, num_real=int(block_mask.sum()))
    return logits, computed + [slots.tokens_read]


def test_a_packed_left_padded_block_gives_the_padded_logits_and_computes_its_real_tokens():
    model = tiny_llama(64, num_layers=2, seed=0)
    prompt, prompt_mask = left_pad([[5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15]])
    block, block_mask = left_pad([[20, 21, 22], [23], [24, 25], [26]])
    packed, packed_computed = read_block(True, model, prompt, prompt_mask, block, block_mask)
    padded, padded_computed = read_block(False, model, prompt, prompt_mask, block, block_mask)
    assert packed.shape == padded.shape == (4, 1, 64)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    assert packed_computed == [3 + 0 + 1 + 3, 7]  # the prompt's real tokens but each row's last; the block's real ones
    assert padded_computed == [4 * 3, 4 * 3]


def packed_draft_forwards(monkeypatch, target) -> list[int]:
    """Tokens of each packed forward a drafter's cache runs (not the target's), appended as they run."""
    computed = []
    real = SlotCache._packed_run

    def spy(self, forward, input_ids, attention_mask, position_ids, packing, *args):
        if forward is not target:
            computed.append(packing.num_tokens)
        return real(self, forward, input_ids, attention_mask, position_ids, packing, *args)

    monkeypatch.setattr(SlotCache, "_packed_run", spy)
    return computed


def recorded_proposals(monkeypatch) -> list:
    """Every non-empty proposal's tokens and confidences (``None`` where nothing asked for them), as proposed."""
    proposals = []
    real = batched_draft.BatchedDraftCandidateGenerator.propose

    def recording(self, sequences, lengths, num_tokens, rows=None, confidences=True, **options):
        proposal = real(self, sequences, lengths, num_tokens, rows, confidences, **options)
        if num_tokens:
            log_probs = None if proposal.log_probs is None else proposal.log_probs.clone()
            proposals.append((proposal.tokens.clone(), log_probs))
        return proposal

    monkeypatch.setattr(batched_draft.BatchedDraftCandidateGenerator, "propose", recording)
    return proposals


def plain_steps_between_drafting_steps(monkeypatch) -> None:
    """The call's strategy drafts one step in three and decodes plainly in between, so the draft falls behind and
    catches up (as ``adaptive`` does when drafting does not pay, here on a fixed schedule)."""
    real = loop_core.make_strategy

    def making(*args, **kwargs):
        strategy = real(*args, **kwargs)
        plan, steps = strategy.plan, itertools.count(1)
        strategy.plan = lambda num_rows: plan(num_rows) if next(steps) % 3 == 0 else DraftPlan(0, 0)
        return strategy

    monkeypatch.setattr(loop_core, "make_strategy", making)


def draft_run(monkeypatch, pack: bool, target, draft, prompts: list[list[int]], eos: int | None, plain_steps: bool,
              **options):
    """A greedy TETRIS call with the draft's packing on or off (the target's as it is), plain steps between drafting
    ones or not: its output, the proposals, and the tokens of the draft's packed forwards."""
    monkeypatch.setattr(build, "packs_exactly", lambda model: pack)
    if plain_steps:
        plain_steps_between_drafting_steps(monkeypatch)
    proposals = recorded_proposals(monkeypatch)
    packed = packed_draft_forwards(monkeypatch, target)
    input_ids, mask = left_pad(prompts)
    with torch.no_grad():
        out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                              do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD,
                              return_dict_in_generate=True, **options)
    monkeypatch.undo()
    return out, proposals, packed


def assert_packed_proposes_as_padded(monkeypatch, target, draft, prompts, eos, references, plain_steps=False,
                                     **options):
    """Packed and padded draft reads give the same greedy rows (the target's alone, where ``references`` are given)
    and the same proposals; the packed call did read packed. Returns the packed forwards' tokens."""
    packed_out, packed_proposals, packed = draft_run(monkeypatch, True, target, draft, prompts, eos, plain_steps,
                                                     **options)
    padded_out, padded_proposals, unpacked = draft_run(monkeypatch, False, target, draft, prompts, eos, plain_steps,
                                                       **options)
    assert packed and not unpacked
    assert torch.equal(packed_out.sequences, padded_out.sequences)
    if references is not None:
        input_ids, mask = left_pad(prompts)
        assert_rows_equal(packed_out.sequences, input_ids, mask, references)
    assert len(packed_proposals) == len(padded_proposals)
    for (tokens, log_probs), (padded_tokens, padded_log_probs) in zip(packed_proposals, padded_proposals):
        assert torch.equal(tokens, padded_tokens)
        if log_probs is not None:
            torch.testing.assert_close(log_probs, padded_log_probs, atol=1e-4, rtol=1e-4)
    return packed


# (batch, noise of the draft: how often rows accept, whether rows stop at an EOS: the loop then reads the pending count)
DRAFT_CASES = [(1, 0.3, True), (3, 0.2, True), (3, 0.5, False), (8, 0.4, True), (8, 0.6, False)]


@pytest.mark.parametrize("batch,noise,stops", DRAFT_CASES)
@pytest.mark.parametrize("plain_steps", [False, True], ids=["drafting", "plain-steps"])
@pytest.mark.parametrize("fixed", [False, True], ids=["tetris", "fixed-k2"])
def test_greedy_rows_equal_the_target_alone_with_a_packed_draft_model(monkeypatch, batch, noise, stops, plain_steps,
                                                                      fixed):
    """Left-padded prompts of different lengths, drafts of different acceptance, plain steps whose tokens the draft
    catches up on, rows that accept every draft (fixed ``k = 2``: the last draft then waits beside the target's token
    in some rows only): packed or padded, the draft proposes the same and the rows are the target's own."""
    target, draft = target_and_draft(64, seed=batch, draft_kind="noisy", noise=noise)
    prompts = random_prompts(batch, 64, seed=batch + 10, min_length=1, max_length=12)
    eos = pick_eos(target, prompts) if stops else None
    references = target_alone(target, prompts, eos) if stops else None
    options = dict(tetris_strategy="fixed", num_assistant_tokens=2) if fixed else \
        dict(num_assistant_tokens=3, tetris_extra_tokens=2, tetris_budget=2 * batch + 1)
    assert_packed_proposes_as_padded(monkeypatch, target, draft, prompts, eos, references, plain_steps, **options)


@pytest.mark.parametrize("family,head_format,batch", [
    ("llama", "eagle1", 1), ("llama", "eagle3", 3), ("qwen2", "eagle3-full-vocab", 8), ("qwen3", "eagle3", 8),
])
@pytest.mark.parametrize("budget", [None, 3])
def test_greedy_rows_equal_the_target_alone_with_a_packed_eagle_head(tmp_path, monkeypatch, family, head_format,
                                                                     batch, budget):
    """The head re-reads each row's accepted tokens (as many as it accepted) with the target's features: packed or
    padded, it proposes the same and the rows are the target's own."""
    target, head = load_pair(tmp_path, family, head_format)
    with torch.no_grad():  # peaked, so that rows accept drafts, and unevenly
        target.lm_head.weight.mul_(3.0)
    prompts = prompts_for(batch, seed=batch)
    eos = pick_eos(target, prompts)
    options = {} if budget is None else {"tetris_budget": budget}
    assert_packed_proposes_as_padded(monkeypatch, target, head, prompts, eos, target_alone(target, prompts, eos),
                                     num_assistant_tokens=3, **options)


def test_the_draft_model_computes_only_the_real_tokens_of_its_catch_up(monkeypatch):
    """The draft's first forward reads the left-padded prompts (the target's first token opens its first proposal):
    the real tokens only, where padded it reads every row to the longest prompt."""
    monkeypatch.setattr(build, "packs_exactly", lambda model: True)
    target, draft = target_and_draft(64, seed=5, draft_kind="noisy", noise=0.4)
    prompts = random_prompts(8, 64, seed=6, min_length=1, max_length=16)
    input_ids, mask = left_pad(prompts)
    counter = TokenCounter(draft)
    with torch.no_grad():
        target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                        max_new_tokens=4, eos_token_id=None, pad_token_id=PAD)
    counter.handle.remove()
    real = sum(len(prompt) for prompt in prompts)
    assert real < input_ids.numel()  # the prompts' lengths differ
    assert counter.per_call[0] == real
