"""Packed verify forwards: the target computes only each row's last token and the drafts selected for it, and the
output stays the target's own."""

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf import attention, loop_core
from tetris_hf.attention import grouped_sdpa_attention, queries_read, real_prefix_mask
from tetris_hf.cost_model import CostProfile, StepCostModel
from tetris_hf.goodput import best_budget
from tetris_hf.packed_probe import packs_exactly
from tetris_hf.packing import Packing, packed_attention
from test_architectures import FULL_ATTENTION, SLIDING_WINDOW, tiny
from test_greedy_exactness import NEW_TOKENS, generate_checked, pick_eos, target_alone
from tiny_models import PAD, left_pad, random_prompts, target_and_draft, tiny_llama


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
    monkeypatch.setattr(loop_core, "packs_exactly", lambda model: pack)
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
    monkeypatch.setattr(loop_core, "packs_exactly", lambda model: pack)
    target, draft = target_and_draft(64, seed=5, draft_kind="noisy", noise=0.4)
    prompts = random_prompts(batch, 64, seed=6)
    input_ids, mask = left_pad(prompts)
    eos = pick_eos(target, prompts)
    with torch.no_grad():
        generate_checked(target, draft, input_ids, mask, target_alone(target, prompts, eos), eos,
                         tetris_strategy=strategy, num_assistant_tokens=2, tetris_extra_tokens=2,
                         tetris_budget=2 * batch + 1)


def linear_cost(packed: bool) -> StepCostModel:
    """A target forward over ``r x t`` tokens costs ``10 + r t`` ms; a draft forward 1 ms."""
    rows, tokens = (1, 4, 16), (1, 2, 4, 8)
    return StepCostModel(CostProfile({(r, t): 10.0 + r * t for r in rows for t in tokens}, {r: 1.0 for r in rows}),
                         packed=packed)


def test_packed_prices_charge_the_tokens_computed_not_the_deepest_row():
    packed, padded = linear_cost(True), linear_cost(False)
    # 4 rows verifying [3, 1, 1, 1] drafts: packed 4 + 6 = 10 tokens, padded 4 x (1 + 3) = 16
    assert packed.verify_step_seconds(4, 3, 6) == pytest.approx((10 + 10) / 1000)
    assert padded.verify_step_seconds(4, 3, 6) == pytest.approx((10 + 16) / 1000)
    assert packed.verify_prices(4, 2).tolist() == pytest.approx([(10 + 4 + c) / 1000 for c in range(9)])
    assert padded.verify_prices(4, 2).tolist() == pytest.approx([(10 + 4 * (1 + l)) / 1000 for l in range(3)])
    assert packed.step_seconds(4, 2, 3, 6) == pytest.approx(2 / 1000 + (10 + 10) / 1000)


@pytest.mark.parametrize("seed", range(5))
def test_packed_best_budget_is_the_brute_force_best(seed):
    """Every budget ``c`` priced by its own cells, checked against ranking the cells by hand."""
    generator = torch.Generator().manual_seed(seed)
    rows, cells = 4, 3
    survival = torch.rand(rows, cells, generator=generator).cumprod(dim=1)
    max_lengths = torch.randint(0, cells + 1, (rows,), generator=generator)
    cost = linear_cost(True)
    prices = cost.verify_prices(rows, cells)
    choice = best_budget(survival, max_lengths, 0.002, prices, packed=True)
    candidates = sorted(((float(survival[r, j]), -r, -j) for r in range(rows) for j in range(cells)
                         if j < max_lengths[r]), reverse=True)
    rates = [(rows + sum(value for value, _, _ in candidates[:c])) / (0.002 + float(prices[c]))
             for c in range(len(candidates) + 1)]
    assert int(choice.budget) == max(range(len(rates)), key=lambda c: (rates[c], -c))


def test_adaptive_prices_packed_steps_when_the_loop_packs(monkeypatch):
    seen = []
    real = loop_core.make_strategy

    def spy(*args, **kwargs):
        seen.append(kwargs.get("packed"))
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_core, "make_strategy", spy)
    target, draft = target_and_draft(64, seed=5, draft_kind="noisy", noise=0.4)
    input_ids, mask = left_pad(random_prompts(2, 64, seed=6))
    for pack in (True, False):
        target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                        max_new_tokens=4, tetris_strategy="adaptive", tetris_pack=pack, pad_token_id=PAD,
                        tetris_cost_profile=linear_cost(False).profile)
    assert seen == [True, False]


def test_sampled_calls_with_a_partial_budget_run_packed():
    """The sampling tests (tests/test_sampling_distribution.py: chi-square with partial budgets and their negative
    controls) run on this path: a sampled partial-budget call computes only what it selects, where the padded block
    computes more."""
    target, draft = target_and_draft(64, seed=3, draft_kind="noisy", noise=0.5)
    input_ids, mask = left_pad(random_prompts(6, 64, seed=4))
    ratios = {}
    for pack in (True, False):
        torch.manual_seed(0)
        with torch.no_grad():
            stats = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                                    do_sample=True, max_new_tokens=16, num_assistant_tokens=2, tetris_extra_tokens=2,
                                    tetris_budget=5, tetris_pack=pack, return_dict_in_generate=True,
                                    pad_token_id=PAD).tetris_stats
        assert stats.verified_tokens > 0
        ratios[pack] = stats.computed_per_selected
    assert ratios[True] == 1.0 < ratios[False]


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_a_split_block_reads_like_one_block(family):
    """Decoding rows and a joining prompt in one forward, attended apart at their own widths (a request stream's
    verification with a prompt riding in it): the first rows' logits and every row's cached keys and values, position
    by position, equal the unsplit packed forward's, for full, windowed and sink attention; the prompt lies in its row's
    first slots (on plain sdpa layouts: the others' block widens them by its own width only)."""
    import tetris_hf.packing as packing_module
    from tetris_hf.kv import SlotCache
    from tetris_hf.packing import BlockSplit

    model_type, overrides = {**FULL_ATTENTION, **SLIDING_WINDOW}[family]
    model = tiny(model_type, 2, seed=3, overrides=overrides)
    prompts = torch.randint(4, 60, (2, 6))
    block = torch.tensor([[7, 8, PAD, PAD, PAD], [9, PAD, PAD, PAD, PAD], [11, 12, 13, 14, 15]])
    real_lengths = torch.tensor([2, 1, 5])
    caches, logits = [], []
    for split in (BlockSplit(2, 2, 3), None):
        cache = SlotCache(2, torch.device("cpu"), capacity=64)
        cache.pack = True
        with torch.no_grad():
            cache.forward(model, prompts, None)  # two rows decoding, six tokens cached each
            cache.add_rows(1)  # a row joins: its prompt rides in the next block
            logits.append(cache.forward(model, block, None, real_lengths=real_lengths, num_real=8, split=split))
        caches.append(cache)
    split_logits, whole_logits = logits
    assert split_logits.shape == (3, 2, model.config.vocab_size)  # the joining row's last token's in its column 0
    real = torch.tensor([[True, True], [True, False]])
    torch.testing.assert_close(split_logits[:2][real], whole_logits[:2, :2][real])
    torch.testing.assert_close(split_logits[2, 0], whole_logits[2, 4])
    assert not split_logits[2, 1].any()
    split_cache, whole_cache = caches
    assert split_cache.layout.plain_sdpa == (family == "llama")
    if split_cache.layout.plain_sdpa:
        assert split_cache.slot_mask[2].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
        assert split_cache.pointer == 6 + 2 < whole_cache.pointer == 6 + 5
    for row in range(3):  # each row's real slots in position order
        slots = [split_cache.slot_mask[row].nonzero().flatten(), whole_cache.slot_mask[row].nonzero().flatten()]
        slots = [index[cache.slot_positions[row, index].argsort()] for index, cache in zip(slots, caches)]
        assert split_cache.slot_positions[row, slots[0]].tolist() == whole_cache.slot_positions[row, slots[1]].tolist()
        for split_layer, whole_layer in zip(split_cache._layers(), whole_cache._layers()):
            torch.testing.assert_close(split_layer.keys[row, :, slots[0]], whole_layer.keys[row, :, slots[1]])
            torch.testing.assert_close(split_layer.values[row, :, slots[0]], whole_layer.values[row, :, slots[1]])


def test_a_split_block_without_filler_is_read_whole():
    """Every row as long as the joining prompt: nothing to pack; the first rows' logits come out all the same."""
    from tetris_hf.kv import SlotCache
    from tetris_hf.packing import BlockSplit

    model_type, overrides = FULL_ATTENTION["llama"]
    model = tiny(model_type, 2, seed=4, overrides=overrides)
    block, logits = torch.randint(4, 60, (3, 3)), []
    for split in (BlockSplit(2, 3, 6), None):
        cache = SlotCache(2, torch.device("cpu"), capacity=32)
        cache.pack = True
        with torch.no_grad():
            cache.forward(model, block[:2], None)
            cache.add_rows(1)
            logits.append(cache.forward(model, block, None, real_lengths=torch.tensor([3, 3, 3]), num_real=9,
                                        split=split))
    assert logits[0].shape == (3, 3, model.config.vocab_size)
    torch.testing.assert_close(logits[0][:2], logits[1][:2])
    torch.testing.assert_close(logits[0][2, 0], logits[1][2, 2])


def test_a_call_routes_attention_through_the_loop_and_restores_it_storing_nothing_on_transformers():
    """The packing travels as a forward argument to one attention function registered once; the models are routed
    to it for the call only, and nothing is kept on the transformers module (several copies of the package share
    nothing through it)."""
    import transformers

    from tetris_hf.routing import is_routed

    target, draft = target_and_draft(97, seed=3, draft_kind="noisy")
    seen = []
    prompts = random_prompts(3, 97, seed=4)
    input_ids, mask = left_pad(prompts)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                          max_new_tokens=NEW_TOKENS, tetris_strategy="tetris", pad_token_id=PAD, eos_token_id=None,
                          tetris_step_callback=lambda record, loop: seen.append((is_routed(target), is_routed(draft))))
    assert seen and all(routed == (True, True) for routed in seen)
    assert target.config._attn_implementation == draft.config._attn_implementation == "sdpa"
    assert not is_routed(target) and not is_routed(draft)
    assert not [name for name in vars(transformers) if "tetris" in name.lower()]
    generated = [row[input_ids.shape[1]:].tolist() for row in out]
    assert generated == target_alone(target, prompts, None)


def test_two_open_streams_on_one_target_stay_routed_until_the_last_closes():
    """Two streams over one target, open at once: closing the first leaves the second on the loop's attention (its
    packed and compiled forwards need it; before, the first's close restored sdpa under the second), and closing the
    second restores the target's own. A model on an implementation the loop does not route stays as it is."""
    from tetris_hf.routing import is_routed, routed_attention
    from tetris_hf.stream import RequestStream

    target = tiny_llama(seed=0)
    first, second = (RequestStream(target, max_batch_size=2, eos_token_id=None, prompt_lookup_num_tokens=2)
                     for _ in range(2))
    assert is_routed(target)
    first.close()
    assert is_routed(target)
    prompts = random_prompts(3, target.config.vocab_size, seed=8)
    for prompt in prompts:
        second.add(prompt, max_new_tokens=NEW_TOKENS)
    outputs = {output.request_id: list(output.generated_tokens) for output in second.run()}
    assert [outputs[key] for key in sorted(outputs)] == target_alone(target, prompts, None)
    assert is_routed(target)
    second.close()
    assert not is_routed(target) and target.config._attn_implementation == "sdpa"
    target.config._attn_implementation = "flex_attention"  # (not routed: left as it is, before and after)
    with routed_attention(target), routed_attention(target):
        assert target.config._attn_implementation == "flex_attention"
    assert target.config._attn_implementation == "flex_attention"


def test_no_module_of_the_package_puts_a_hook_on_a_model():
    """What a drafter reads of the target arrives in the verdict (the verify forward's hidden states), never through
    a hook; a counter of transformers' steps is a stopping criterion."""
    from pathlib import Path

    package = Path(tetris_hf.__file__).parent
    hooked = [str(path.relative_to(package)) for path in package.rglob("*.py")
              if "register_forward_hook" in path.read_text() or "register_forward_pre_hook" in path.read_text()]
    assert hooked == []


@pytest.mark.parametrize("family, own_block", [("llama", True), ("mistral_window", False)])
def test_joining_prompts_attend_to_their_own_block_causally_and_read_as_the_model_alone(family, own_block, monkeypatch):
    """Rows that just joined read their prompts (real tokens first, nothing real before them in their rows): on a plain
    sdpa layout they attend causally to their own block's slots, unmasked, not over the whole cache under a mask; a
    windowed model keeps its mask. Either way each prompt's last logits and its cached keys are the model's alone."""
    import tetris_hf.packing as packing_module
    from tetris_hf.kv import SlotCache
    from tetris_hf.packing import BlockSplit

    model_type, overrides = {**FULL_ATTENTION, **SLIDING_WINDOW}[family]
    model = tiny(model_type, 2, seed=7, overrides=overrides)
    history = torch.randint(4, 60, (2, 9))
    joining = [[21, 22, 23, 24, 25], [31, 32, 33]]
    block = torch.tensor([[7, PAD, PAD, PAD, PAD], [9, PAD, PAD, PAD, PAD], joining[0], joining[1] + [PAD, PAD]])
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.shape[0], key.shape[-2], attn_mask is None, kwargs.get("is_causal", False)))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    cache = SlotCache(2, torch.device("cpu"), capacity=64)
    cache.pack = True
    with torch.no_grad():
        cache.forward(model, history, None)
        cache.add_rows(2)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        monkeypatch.setattr(attention, "row_attention_applies", lambda *args: False)  # (decoding rows on sdpa)
        monkeypatch.setattr(packing_module, "packed_row_attention_applies", lambda *args: False)
        logits = cache.forward(model, block, None, real_lengths=torch.tensor([1, 1, 5, 3]), num_real=10,
                               split=BlockSplit(2, 1, 2))
        monkeypatch.undo()
        alone = [model(torch.tensor([prompt])).logits[0, -1] for prompt in joining]
    for row, expected in zip((2, 3), alone):
        torch.testing.assert_close(logits[row, 0], expected, atol=1e-5, rtol=0)
    # per layer: the decoding rows' group (1 query each, over the whole cache, masked: on plain sdpa the prompts lie
    # in their own rows' first slots, so the decoding rows' block widens the cache by its one column only), then the
    # joining rows'
    decoding, joining_rows = calls[0::2], calls[1::2]
    assert len(joining_rows) == 2 and all(call[1:3] == (9 + (1 if own_block else 5), False) for call in decoding)
    expected = (5, True, True) if own_block else (9 + 5, False, False)
    assert all(call[1:] == expected for call in joining_rows), joining_rows
    assert cache.new_from is None  # the rows hold their prompts now: a later block attends under the mask


@functools.cache
def long_rows_read_alone_bitwise() -> bool:
    """Whether this machine's sdpa kernel gives a causal row of 129 queries read alone (queries and keys cut as
    :func:`~tetris_hf.attention.prompt_rows_attention` cuts them) the sums of a padded block of 256, bit for bit: yes
    on the Intel CPUs measured, no on an AMD EPYC (Zen 4), whose products over a row's keys round by their count."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 3, 256, 64, generator=generator) for _ in range(3))
    padded = F.scaled_dot_product_attention(query, key, value, is_causal=True)[:, :, :129]
    read = queries_read(129, 256)
    keys = -(-read // attention.KEY_MULTIPLE) * attention.KEY_MULTIPLE
    alone = F.scaled_dot_product_attention(query[:, :, :read], key[:, :, :keys], value[:, :, :keys], is_causal=True)
    return torch.equal(alone[:, :, :129], padded)


def assert_same_sums(padded: torch.Tensor, apart: torch.Tensor) -> None:
    """Bit for bit where this machine's sdpa kernel gives it (:func:`long_rows_read_alone_bitwise`), else within
    fp32 rounding (what the loop's exactness rests on there: tests/test_greedy_exactness.py)."""
    if long_rows_read_alone_bitwise():
        assert torch.equal(padded, apart)
    else:
        torch.testing.assert_close(apart, padded, atol=1e-6, rtol=1e-5)


def padded_and_row_by_row(lengths: list[int], width: int, cached: int, decoding_rows: int, seed: int):
    """One layer's attention over a packed prompt block, ``lengths`` tokens in each prompt row after
    ``decoding_rows`` rows with none, SmolLM2's heads (9 query heads on 3 key-value heads): as the padded block and
    row by row. ``cached``: slots before the block (0: the rows just joined and attend causally, unmasked; else a
    mask over cached slots and the block)."""
    generator = torch.Generator().manual_seed(seed)
    rows = decoding_rows + len(lengths)
    real_lengths = torch.tensor([0] * decoding_rows + lengths)
    num_tokens = sum(lengths)
    packing = Packing.of(real_lengths, num_tokens, width, first_row=decoding_rows,
                         new_from=decoding_rows if cached == 0 else None, prompt_lengths=tuple(lengths))
    query = torch.randn(1, 9, num_tokens, 64, generator=generator)
    key, value = (torch.randn(rows, 3, cached + width + 3, 64, generator=generator)[:, :, : cached + width]
                  for _ in range(2))  # (views of a longer buffer, as a cache's)
    mask = None
    if cached:
        real = torch.rand(rows, cached, generator=generator) < 0.7
        mask = real_prefix_mask(real[:, None, None], torch.ones(width, width, dtype=torch.bool).tril())
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    return [packed_attention(grouped_sdpa_attention, module, query, key, value, mask, packing, prompt_rows=apart,
                             scaling=0.125)[0][0] for apart in (False, True)]


@pytest.mark.parametrize("cached", [0, 40, 300], ids=["joined", "masked-40", "masked-300"])
@pytest.mark.parametrize("width", [16, 37, 150, 256, 600])
def test_prompt_rows_read_alone_compute_the_padded_blocks_sums_bitwise(width, cached):
    """Each prompt row at its own length (rows with no token left out, causal keys cut) gives the padded block's
    outputs on the CPU's sdpa (bit for bit where its kernel gives it: :func:`assert_same_sums`): lengths that end a
    block of 1 or 2 queries (33, 34), the longest rows, a row of one token, an empty row."""
    lengths = [1, 2, 0, 33, 34, 17, width - 2, width - 1, width, width // 2 + 1, 65, 97]
    lengths = [min(length, width) for length in lengths]
    padded, apart = padded_and_row_by_row(lengths, width, cached, decoding_rows=3, seed=width + cached)
    assert padded.shape == apart.shape == (sum(lengths), 9, 64)
    assert_same_sums(padded, apart)


@pytest.mark.parametrize("seed", range(6))
def test_random_prompt_rows_read_alone_equal_the_padded_block(seed):
    generator = torch.Generator().manual_seed(seed)
    width = int(torch.randint(16, 520, (), generator=generator))
    lengths = torch.randint(0, width + 1, (int(torch.randint(1, 17, (), generator=generator)),),
                            generator=generator).tolist()
    padded, apart = padded_and_row_by_row(lengths, width, [0, 64][seed % 2], decoding_rows=seed % 3, seed=seed)
    assert_same_sums(padded, apart)


def test_a_row_read_alone_ends_no_block_of_queries_the_padded_block_did_not():
    assert [queries_read(length, 256) for length in (1, 2, 3, 4, 32, 33, 34, 35, 36, 40, 65, 252, 253, 256)] == [
        4, 4, 4, 4, 32, 36, 36, 36, 36, 40, 68, 252, 256, 256]
    assert queries_read(20, 21) == 21 and queries_read(1, 16) == 4


def test_the_small_blocks_that_round_differently_here_are_the_ones_small_block_names():
    """On this machine's sdpa kernel, the queries whose last block rounds otherwise than in a longer block are those
    ending a block of at most ``SMALL_BLOCK`` (the kernel's choice differs by CPU: what the row-by-row prompt read
    and the folded heads rely on)."""
    from tetris_hf.attention import QUERY_BLOCK, SMALL_BLOCK

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(4, 9, 2 * QUERY_BLOCK + 8, 64, generator=generator)
    key, value = (torch.randn(4, 9, 300, 64, generator=generator) for _ in range(2))
    mask = torch.ones(4, 1, query.shape[2], 300, dtype=torch.bool)
    whole = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.125)
    differ = [length for length in range(1, query.shape[2])
              if not torch.equal(F.scaled_dot_product_attention(query[:, :, :length], key, value,
                                                                attn_mask=mask[:, :, :length], scale=0.125),
                                 whole[:, :, :length])]
    assert all(1 <= length % QUERY_BLOCK <= SMALL_BLOCK for length in differ), differ


def test_a_stream_reads_joining_prompts_row_by_row_and_stays_exact(monkeypatch):
    """Prompts of 2 to 70 tokens joining at the start and mid-stream, read in chunks of 24 and riding in
    verification forwards: each prompt row is attended alone (at its own length) and every row equals the target
    alone."""
    import tetris_hf.packing as packing
    from test_stream import check_exact, requests
    from tetris_hf.stream import RequestStream
    from tiny_models import tiny_llama

    target = tiny_llama(seed=0)
    seen = []
    row_by_row = packing.prompt_rows_attention

    def spy(query, key, value, lengths, *args, **kwargs):
        seen.append(tuple(lengths))
        return row_by_row(query, key, value, lengths, *args, **kwargs)

    monkeypatch.setattr(packing, "prompt_rows_attention", spy)
    stream = RequestStream(target, max_batch_size=4, prefill_chunk=24, eos_token_id=None, tetris_strategy="fixed",
                           prompt_lookup_num_tokens=3)
    check_exact(target, stream, requests(target, 10, seed=8, max_prompt=70))
    assert any(len(lengths) > 1 for lengths in seen)  # several prompt rows in one block
    assert any(0 in lengths for lengths in seen)  # a later chunk: the rows whose prompts ended, left out


@pytest.mark.parametrize("length", [1, 2, 3, 5, 10, 11])
@pytest.mark.parametrize("mask_rows", ["per-query", "shared"])
def test_folded_query_heads_give_the_grouped_sums_bitwise(length, mask_rows, monkeypatch):
    """A masked block's query heads folded onto their key-value head (3 or more queries a head, at most 32 a
    key-value head) give ``enable_gqa``'s outputs bit for bit; 1, 2 and 11 queries (33 a head) are not folded. (On
    sdpa: where the row-walking kernel is not built, tetris_hf/cpu_attention.py.)"""
    monkeypatch.setattr(attention, "row_attention_applies", lambda *args: False)

    generator = torch.Generator().manual_seed(length)
    keys = 300 + length
    query = torch.randn(16, length, 9, 64, generator=generator).transpose(1, 2)  # (as the layer hands it)
    key, value = (torch.randn(16, 3, keys + 5, 64, generator=generator)[:, :, :keys] for _ in range(2))
    mask = torch.rand(16, 1, length if mask_rows == "per-query" else 1, keys, generator=generator) < 0.7
    mask[..., 0] = True
    module = SimpleNamespace(num_key_value_groups=3)
    folds = attention.fold_queries(query, 3, mask)
    assert folds == (attention.SMALL_BLOCK < length <= 10)
    outputs = []
    for most in (0, attention.FOLDED_QUERIES):  # (0: never folded)
        monkeypatch.setattr(attention, "FOLDED_QUERIES", most)
        outputs.append(grouped_sdpa_attention(module, query, key, value, mask, scaling=0.125)[0])
    assert outputs[0].shape == (16, length, 9, 64)
    assert torch.equal(outputs[0], outputs[1])
