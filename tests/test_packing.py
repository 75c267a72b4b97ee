"""Packed verify forwards: the target computes only each row's last token and the drafts selected for it, and the
output stays the target's own."""

import pytest
import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf import decoding
from tetris_hf.packed_probe import packs_exactly
from tetris_hf.packing import Packing
from test_architectures import FULL_ATTENTION, SLIDING_WINDOW, tiny
from test_greedy_exactness import generate_checked, pick_eos, target_alone
from tiny_models import PAD, left_pad, random_prompts, target_and_draft


def test_a_packing_lists_each_real_token_by_row_and_column():
    packing = Packing.of(torch.tensor([3, 1, 2]), 6, 3)
    assert packing.rows.tolist() == [0, 0, 0, 1, 2, 2]
    assert packing.columns.tolist() == [0, 1, 2, 0, 0, 1]
    block = torch.arange(9).view(3, 3)
    assert packing.pack(block).tolist() == [0, 1, 2, 3, 6, 7]
    assert packing.unpack(packing.pack(block)).tolist() == [[0, 1, 2], [3, 0, 0], [6, 7, 0]]


@pytest.mark.parametrize("family,packs", [("llama", True), ("gemma2", True), ("gpt_oss", True),
                                          ("falcon", False), ("bloom", False), ("gptj", False)])
def test_the_probe_packs_families_whose_attention_goes_through_the_interface(family, packs):
    """Falcon computes attention inline, GPT-J in its own method, BLOOM takes ALiBi from the 2D mask: padded."""
    model_type, overrides = {**FULL_ATTENTION, **SLIDING_WINDOW}[family]
    assert packs_exactly(tiny(model_type, 2, seed=0, overrides=overrides)) == packs


class TokenCounter:
    """Tokens each call of the target's forward read, via a forward pre-hook."""

    def __init__(self, model):
        self.per_call: list[int] = []
        self.handle = model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.per_call.append(input_ids.numel())


def computed_and_selected(pack: bool, monkeypatch) -> tuple[int, int, torch.Tensor]:
    """A TETRIS call on rows that verify unevenly: tokens the target's forwards read after the prompt, tokens
    selected (verified drafts + one per active row and step, from ``tetris_stats``), and the output."""
    monkeypatch.setattr(decoding, "packs_exactly", lambda model: pack)
    target, draft = target_and_draft(64, seed=3, draft_kind="noisy", noise=0.5)
    input_ids, mask = left_pad(random_prompts(8, 64, seed=4))
    counter = TokenCounter(target)
    with torch.no_grad():
        out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                              max_new_tokens=24, num_assistant_tokens=3, tetris_extra_tokens=3, tetris_budget=20,
                              return_dict_in_generate=True, pad_token_id=PAD)
    counter.handle.remove()
    stats = out.tetris_stats
    rows_per_step = [sum(row >= 0 for row in step) for step in stats.verified_per_step]
    selected = stats.verified_tokens + sum(rows_per_step[1:])
    assert selected == stats.selected_tokens
    computed = sum(counter.per_call[1:])  # after the prompt's read
    assert computed == stats.target_tokens
    return computed, selected, out.sequences


def test_packed_steps_compute_only_the_selected_tokens(monkeypatch):
    computed, selected, packed_out = computed_and_selected(True, monkeypatch)
    assert computed <= 1.05 * selected, (computed, selected)
    padded, _, padded_out = computed_and_selected(False, monkeypatch)
    assert padded > 1.05 * selected  # uneven rows: the padded rectangle fails the bound the packed path meets
    assert torch.equal(packed_out, padded_out)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("strategy,batch", [("tetris", 1), ("tetris", 3), ("fixed", 8), ("adaptive", 8), ("dsd", 3)])
def test_greedy_rows_equal_the_target_alone_on_both_paths(pack, strategy, batch, monkeypatch):
    """Left padding, an EOS some rows meet early, a partial budget: every row is the target's own greedy text."""
    monkeypatch.setattr(decoding, "packs_exactly", lambda model: pack)
    target, draft = target_and_draft(64, seed=5, draft_kind="noisy", noise=0.4)
    prompts = random_prompts(batch, 64, seed=6)
    input_ids, mask = left_pad(prompts)
    eos = pick_eos(target, prompts)
    with torch.no_grad():
        generate_checked(target, draft, input_ids, mask, target_alone(target, prompts, eos), eos,
                         tetris_strategy=strategy, num_assistant_tokens=2, tetris_extra_tokens=2,
                         tetris_budget=2 * batch + 1)
