"""SlotCache bookkeeping on hand-built blocks: where each forward writes, which slots become holes, how repacking moves
slots and their keys/values, and the exact attention masks. Tokens are single letters in the comments; ``.`` a hole,
``_`` left padding (filler)."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from tetris_hf.attention import FULL, SLIDING, AttentionLayout, position_masks
from tetris_hf.kv import SlotCache, slots_needed
from tiny_models import tiny_llama

HEADS, HEAD_DIM, LAYERS = 2, 3, 2
FULL_SDPA = AttentionLayout({FULL: None}, False, "sdpa", True)


class RecordingModel:
    """Stands in for a causal LM: writes keys = token id (+ 100 * layer) and values = -keys into every layer of the
    cache, records the mask and positions it was given, and predicts token + 1 after every token."""

    dtype = torch.float32
    vocab_size = 64

    def __init__(self):
        self.config = LlamaConfig(vocab_size=self.vocab_size, attn_implementation="sdpa")  # full attention, sdpa
        self.calls = []

    def __call__(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep=0):
        self.calls.append({"attention_mask": attention_mask, "position_ids": position_ids.clone()})
        batch, block = input_ids.shape
        for layer in range(LAYERS):
            keys = (input_ids.float() + 100 * layer)[:, None, :, None].expand(batch, HEADS, block, HEAD_DIM)
            past_key_values.update(keys.contiguous(), -keys, layer)
        kept = logits_to_keep or block
        logits = torch.nn.functional.one_hot((input_ids[:, -kept:] + 1) % self.vocab_size, self.vocab_size).float()
        return type("Output", (), {"logits": logits})()


def new_cache(batch_size, layout=FULL_SDPA, **kwargs):
    slots = SlotCache(batch_size, torch.device("cpu"), **kwargs)
    slots.layout = layout
    return slots


def feed(slots, model, tokens, mask):
    slots.forward(model, torch.tensor(tokens), torch.tensor(mask))


def drop_slots(slots, start, keep):
    """Turn slots ``start + keep[i]`` onwards of row ``i`` into holes, filler counted: a left-padded block's rolled
    back tail (how these tests make holes, and the reference for ``keep_prefix``).

    E.g. block mask [[0 1 1 1], [1 1 1 1]] (row 0 left-padded) with keep [2, 3] -> [[0 1 . .], [1 1 1 .]];
    next_positions drops by the real slots removed, [2, 1]."""
    block = slots.slot_mask[:, start : slots.pointer]  # a view: changed in place
    dropped = (torch.arange(block.shape[1]) >= keep[:, None]) & block
    slots.next_positions = slots.next_positions - dropped.sum(dim=1)
    block.masked_fill_(dropped, False)


def cached_tokens(slots, layer=0):
    """``(B, pointer)`` the token each slot's key holds (-1 where the slot is a hole)."""
    keys = slots.cache.layers[layer].keys[:, 0, : slots.pointer, 0].long() - 100 * layer
    return keys.masked_fill(slots.slot_mask[:, : slots.pointer] == 0, -1)


A, B, C, D, E, X, PAD = 10, 11, 12, 13, 14, 15, 0


def test_forward_writes_every_row_at_the_shared_pointer_and_numbers_real_tokens():
    model, slots = RecordingModel(), new_cache(2, capacity=16)
    feed(slots, model, [[PAD, PAD, A, B], [C, D, E, X]], [[0, 0, 1, 1], [1, 1, 1, 1]])
    # Left filler takes the position of the row's first real token ([_ _ a b] -> 0 0 0 1).
    assert slots.pointer == 4 and slots.next_positions.tolist() == [2, 4]
    assert slots.slot_mask[:, :4].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert slots.slot_positions[:, :4].tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert model.calls[0]["position_ids"].tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    # Second block at slots 4..6: row 0 [c _ _] (right filler: the last real position), row 1 [_ a b].
    feed(slots, model, [[C, PAD, PAD], [PAD, A, B]], [[1, 0, 0], [0, 1, 1]])
    assert slots.pointer == 7 and slots.next_positions.tolist() == [3, 6]
    assert slots.slot_mask[:, :7].tolist() == [[0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 1, 1]]
    assert slots.slot_positions[:, 4:7].tolist() == [[2, 2, 2], [4, 4, 5]]
    assert model.calls[1]["position_ids"].tolist() == [[2, 2, 2], [4, 4, 5]]
    assert cached_tokens(slots).tolist() == [[-1, -1, A, B, C, -1, -1], [C, D, E, X, -1, A, B]]
    assert torch.equal(slots.cache.layers[1].values[:, :, :7], -slots.cache.layers[1].keys[:, :, :7])
    # The mask the model got: query i sees real keys at positions <= its own.
    assert model.calls[1]["attention_mask"].shape == (2, 1, 3, 7)
    assert model.calls[1]["attention_mask"][0, 0, 0].tolist() == [False, False, True, True, True, False, False]


@pytest.mark.parametrize("layout", [
    FULL_SDPA,  # one real token: its mask is its row's real slots (no positions compared)
    AttentionLayout({SLIDING: 3}, False, "sdpa", True),
    AttentionLayout({FULL: None, SLIDING: 3}, True, "sdpa", True),
    AttentionLayout({FULL: None}, False, "eager", True),
], ids=["sdpa", "window", "hybrid", "eager"])
@pytest.mark.parametrize("block", [1, 2])
def test_a_block_of_real_tokens_passed_without_a_mask_is_cached_as_with_a_mask_of_ones(layout, block):
    def run(mask):
        model, slots = RecordingModel(), new_cache(2, layout=layout, capacity=16)
        feed(slots, model, [[PAD, A, B, C, D], [A, B, C, D, E]], [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
        drop_slots(slots, 0, torch.tensor([3, 5]))  # [_ a b . .]: row 0 now has holes
        tokens = torch.tensor([[X] * block, [E] * block])
        slots.forward(model, tokens, mask if mask is None else torch.ones_like(tokens))
        return model.calls[-1], slots

    (without, slots), (with_ones, reference) = run(None), run("ones")
    assert torch.equal(without["position_ids"], with_ones["position_ids"])
    assert without["position_ids"].tolist() == [[2 + j for j in range(block)], [5 + j for j in range(block)]]
    masks, expected = without["attention_mask"], with_ones["attention_mask"]
    if isinstance(expected, dict):
        assert set(masks) == set(expected) and all(torch.equal(masks[kind], expected[kind]) for kind in expected)
    else:
        assert masks.dtype == expected.dtype and torch.equal(masks, expected)
    for name in ("slot_mask", "slot_positions", "next_positions"):
        assert torch.equal(getattr(slots, name), getattr(reference, name)), name
    assert cached_tokens(slots).tolist() == cached_tokens(reference).tolist()


@pytest.mark.parametrize("layout", [
    FULL_SDPA,  # cached real slots, then causality within the block (no positions compared)
    AttentionLayout({SLIDING: 3}, False, "sdpa", True),
    AttentionLayout({FULL: None, SLIDING: 3}, True, "sdpa", True),
    AttentionLayout({FULL: None}, False, "eager", True),
    AttentionLayout({FULL: None}, False, "flash_attention_2", False),
], ids=["sdpa", "window", "hybrid", "eager", "2d"])
@pytest.mark.parametrize("real", [[1, 3], [4, 1], [4, 4]])
def test_a_verified_block_passed_as_a_real_prefix_is_seen_as_with_its_mask(layout, real):
    # A verified block: each row's last token and its verified drafts, then filler. What a real token sees, where it
    # sits and what is cached must not depend on passing real_lengths in place of the mask; nor must rolling it back
    # by keep_prefix in place of dropping the block's tail.
    def run(prefix):
        model, slots = RecordingModel(), new_cache(2, layout=layout, capacity=16)
        feed(slots, model, [[PAD, A, B, C, D], [A, B, C, D, E]], [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
        drop_slots(slots, 0, torch.tensor([3, 5]))  # [_ a b . .]: row 0 now has holes
        mask = torch.arange(4)[None, :] < torch.tensor(real)[:, None]
        block = torch.tensor([[X, A, B, C], [E, D, C, B]])
        if prefix:
            slots.forward(model, block, None, real_lengths=torch.tensor(real))
        else:
            slots.forward(model, block, mask)
        rolled_back = []
        for keep in (torch.zeros(2, dtype=torch.long), (torch.tensor(real) - 2).clamp(min=0), torch.tensor(real)):
            after = copy.deepcopy(slots)
            if prefix:
                after.keep_prefix(5, keep)
            else:
                drop_slots(after, 5, keep)
            rolled_back.append(after)
        return model.calls[-1], slots, mask, rolled_back

    (fast, slots, mask, kept), (generic, reference, _, dropped) = run(True), run(False)
    for after_keep, after_drop in zip(kept, dropped):
        for name in ("slot_mask", "next_positions"):
            assert torch.equal(getattr(after_keep, name), getattr(after_drop, name)), name
    assert torch.equal(fast["position_ids"][mask], generic["position_ids"][mask])
    masks, expected = fast["attention_mask"], generic["attention_mask"]
    if not isinstance(expected, dict):
        masks, expected = {FULL: masks}, {FULL: expected}
    for kind in expected:
        if expected[kind].dim() == 2:  # 2D masks of real slots
            assert torch.equal(masks[kind], expected[kind])
        else:  # (B, 1, L, S): the real queries' rows
            assert masks[kind].dtype == expected[kind].dtype
            assert torch.equal(masks[kind][:, 0][mask], expected[kind][:, 0][mask])
    assert torch.equal(slots.slot_mask, reference.slot_mask) and torch.equal(slots.next_positions,
                                                                             reference.next_positions)
    assert torch.equal(slots.slot_positions[slots.slot_mask], reference.slot_positions[reference.slot_mask])


def rows_with_a_hole(**kwargs):
    """Rows ``[a b . c | _ _ d e]``: x was drafted into slot 2 of row 0 and dropped."""
    model, slots = RecordingModel(), new_cache(2, **kwargs)
    feed(slots, model, [[A, B], [PAD, PAD]], [[1, 1], [0, 0]])
    feed(slots, model, [[X], [D]], [[1], [1]])
    drop_slots(slots, 2, torch.tensor([0, 1]))
    feed(slots, model, [[C], [E]], [[1], [1]])
    assert cached_tokens(slots).tolist() == [[A, B, -1, C], [-1, -1, D, E]]
    assert slots.slot_positions[:, :4].tolist() == [[0, 1, 2, 2], [0, 0, 0, 1]]
    return model, slots


def test_compact_moves_real_slots_past_the_width_into_the_first_holes_with_their_keys_and_values():
    model, slots = rows_with_a_hole(capacity=16, max_holes=0)
    slots.compact(3)  # the loop read that no row holds more than 3 real slots
    # [a b . c | _ _ d e] -> [a b c | e . d]: what lies past the width fills the first holes; the rest stays put
    assert slots.pointer == 3
    assert slots.slot_mask[:, :5].tolist() == [[1, 1, 1, 0, 0], [1, 0, 1, 0, 0]]
    assert slots.slot_positions[0, :3].tolist() == [0, 1, 2]
    assert slots.slot_positions[1, [0, 2]].tolist() == [1, 0]
    assert slots.next_positions.tolist() == [3, 2]
    for layer in range(LAYERS):
        assert cached_tokens(slots, layer).tolist() == [[A, B, C], [E, -1, D]]
        keys, values = slots.cache.layers[layer].keys, slots.cache.layers[layer].values
        real = slots.slot_mask[:, :3]
        assert torch.equal(values[:, :, :3][real[:, None].expand(-1, HEADS, -1)],
                           -keys[:, :, :3][real[:, None].expand(-1, HEADS, -1)])
    # The next block is written right after the width.
    feed(slots, model, [[D], [A]], [[1], [1]])
    assert slots.pointer == 4 and slots.slot_positions[:, 3].tolist() == [3, 2]
    assert cached_tokens(slots).tolist() == [[A, B, C, D], [E, -1, D, A]]


def test_compact_without_a_tighter_bound_keeps_the_width_and_moves_nothing():
    _, slots = rows_with_a_hole(capacity=16, max_holes=0)
    before = cached_tokens(slots).tolist()
    copied = compact_counting_reads(slots, force=True)  # width = the pointer (4): nothing lies past it
    assert slots.pointer == 4
    assert slots.slot_mask[:, :4].tolist() == [[1, 1, 0, 1], [0, 0, 1, 1]]
    assert cached_tokens(slots).tolist() == before
    assert copied == [0] * (2 * LAYERS)


def test_compact_waits_until_holes_exceed_max_holes():
    _, slots = rows_with_a_hole(capacity=16, max_holes=1)
    before = (slots.slot_mask.clone(), slots.slot_positions.clone(), slots.cache.layers[0].keys.clone())
    slots.compact(3)  # 4 slots, at most 3 real: 1 hole, allowed
    assert slots.pointer == 4
    assert torch.equal(slots.slot_mask, before[0]) and torch.equal(slots.slot_positions, before[1])
    assert torch.equal(slots.cache.layers[0].keys, before[2])


def compact_counting_reads(slots, *args, **kwargs) -> list[int]:
    """``slots.compact(*args, **kwargs)``; the number of slots each ``index_select`` it ran read (one per tensor)."""
    copied = []
    select = torch.Tensor.index_select

    def counting(tensor, dim, index):
        copied.append(index.numel())
        return select(tensor, dim, index)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "index_select", counting)
        slots.compact(*args, **kwargs)
    return copied


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_compact_keeps_each_rows_real_tokens_and_moves_only_those_past_the_width(data):
    """Random blocks (any filler pattern) and rolled-back tails, then a repack to a random bound: every row holds the
    same real tokens at the same positions, keys and values with them, all before the width; a real slot before the
    width stays where it was; those past it fill the row's first holes, in order; only they are copied."""
    rows = data.draw(st.integers(1, 4))
    model, slots = RecordingModel(), new_cache(rows, capacity=64, max_holes=0)
    for _ in range(data.draw(st.integers(1, 5))):
        width = data.draw(st.integers(1, 5))
        tokens = data.draw(st.lists(st.lists(st.integers(1, 60), min_size=width, max_size=width), min_size=rows,
                                    max_size=rows))
        mask = data.draw(st.lists(st.lists(st.integers(0, 1), min_size=width, max_size=width), min_size=rows,
                                  max_size=rows))
        start = slots.pointer
        feed(slots, model, tokens, mask)
        if data.draw(st.booleans()):  # a rolled-back tail: holes in the middle of rows
            drop_slots(slots, start, torch.tensor(data.draw(st.lists(st.integers(0, width), min_size=rows,
                                                                     max_size=rows))))
    pointer = slots.pointer
    held = [[(int(p), t) for p, t, real in zip(slots.slot_positions[row, :pointer], cached_tokens(slots)[row].tolist(),
                                             slots.slot_mask[row, :pointer]) if real] for row in range(rows)]
    places = [torch.nonzero(row).flatten().tolist() for row in slots.slot_mask[:, :pointer]]
    most = max(len(row) for row in places)
    bound = data.draw(st.integers(most, pointer))
    tokens_before = cached_tokens(slots).clone()
    copied = compact_counting_reads(slots, bound, force=True)
    width = slots.pointer
    assert width == bound
    tokens_after = cached_tokens(slots)
    for row in range(rows):
        real = slots.slot_mask[row, :width]
        after = sorted((int(p), t) for p, t, r in zip(slots.slot_positions[row, :width], tokens_after[row].tolist(),
                                                      real) if r)
        assert after == sorted(held[row])
        stay = [place for place in places[row] if place < width]
        assert tokens_after[row, stay].tolist() == tokens_before[row, stay].tolist()
        moved = [place for place in places[row] if place >= width]
        holes = [slot for slot in range(width) if slot not in stay][: len(moved)]
        assert tokens_after[row, holes].tolist() == tokens_before[row, moved].tolist()
        assert not slots.slot_mask[row, width:].any()
        for layer in range(LAYERS):
            keys, values = slots.cache.layers[layer].keys, slots.cache.layers[layer].values
            assert torch.equal(values[row, :, :width][:, real], -keys[row, :, :width][:, real])
    # only real slots past the width were read (each head's), for each layer's keys and values
    moved = sum(sum(1 for place in row if place >= width) for row in places)
    assert copied == [moved * HEADS] * (2 * LAYERS)


def test_a_repack_copies_only_the_slots_that_move():
    """A stream's repack after a prompt joined: the decoding rows' real slots lie before the width; only the joining
    row's slots past it move (here 1 slot of row 1, on each layer's keys and values, each head)."""
    model, slots = RecordingModel(), new_cache(2, capacity=16, max_holes=0)
    feed(slots, model, [[A, B, C], [PAD, PAD, PAD]], [[1, 1, 1], [0, 0, 0]])  # row 1 joins later
    feed(slots, model, [[D, PAD], [A, B]], [[1, 0], [1, 1]])  # row 0 decodes one token, row 1 reads its prompt
    assert cached_tokens(slots).tolist() == [[A, B, C, D, -1], [-1, -1, -1, A, B]]
    copied = compact_counting_reads(slots, 4)  # no row holds more than 4 real slots: [a b c d | b . . a]
    assert cached_tokens(slots).tolist() == [[A, B, C, D], [B, -1, -1, A]]
    assert slots.slot_positions[1, [0, 3]].tolist() == [1, 0]
    assert copied == [1 * HEADS] * (2 * LAYERS)


def test_compact_on_a_windowed_model_drops_slots_out_of_every_window():
    layout = AttentionLayout({SLIDING: 3}, False, "sdpa", True)
    model, slots = RecordingModel(), new_cache(2, layout=layout, capacity=16, max_holes=0)
    feed(slots, model, [[A, B, C, D], [PAD, PAD, A, B]], [[1, 1, 1, 1], [0, 0, 1, 1]])
    # The next queries sit at positions 4 and 2; with a window of 3 they see positions 2 and 0 onwards:
    # [a b c d | _ _ a b] -> [. . c d | _ _ a b], then repacked to the window's width: [d . c | b . a].
    slots.compact()
    assert slots.pointer == 3
    assert slots.slot_mask[:, :4].tolist() == [[1, 0, 1, 0], [1, 0, 1, 0]]
    assert slots.slot_positions[:, [0, 2]].tolist() == [[3, 2], [1, 0]]
    assert cached_tokens(slots).tolist() == [[D, -1, C], [B, -1, A]]
    assert slots.next_positions.tolist() == [4, 2]


def test_fill_rows_moves_rows_from_the_end_into_finished_rows_places_in_place():
    model, slots = RecordingModel(), new_cache(4, capacity=8)
    feed(slots, model, [[A, B], [PAD, C], [D, E], [PAD, X]], [[1, 1], [0, 1], [1, 1], [0, 1]])
    drop_slots(slots, 0, torch.tensor([2, 2, 1, 2]))
    buffers = [layer.keys.data_ptr() for layer in slots.cache.layers]
    # rows 1 and 2 finished: row 3 takes row 1's place, 2 rows remain
    rows = slots.fill_rows(torch.tensor([1]), torch.tensor([3]), 2)
    assert rows.tolist() == [0, 3]
    assert slots.slot_mask[:, :2].tolist() == [[1, 1], [0, 1]]
    assert slots.next_positions.tolist() == [2, 1]
    assert cached_tokens(slots).tolist() == [[A, B], [-1, X]]
    for layer, buffer in zip(slots.cache.layers, buffers):
        assert layer.keys.shape[0] == 2 and layer.values.shape[0] == 2
        assert layer.keys.data_ptr() == buffer  # the same buffer: nothing reallocated
        assert torch.equal(layer.values[:, :, :2], -layer.keys[:, :, :2])
    # and the rows go on: the next block is written after their slots
    feed(slots, model, [[C], [D]], [[1], [1]])
    assert cached_tokens(slots).tolist() == [[A, B, C], [-1, X, D]]
    assert slots.slot_positions[:, 2].tolist() == [2, 1]


def test_fill_rows_pairs_that_name_the_same_row_move_nothing():
    model, slots = RecordingModel(), new_cache(3, capacity=8)
    feed(slots, model, [[A, B], [C, D], [E, X]], [[1, 1], [1, 1], [1, 1]])
    rows = slots.fill_rows(torch.tensor([0, 1]), torch.tensor([2, 1]), 2)  # row 2 into row 0; row 1 stays
    assert rows.tolist() == [2, 1]
    assert cached_tokens(slots).tolist() == [[E, X], [C, D]]


def test_a_full_buffer_repacks_then_grows():
    model, slots = RecordingModel(), new_cache(1, capacity=4, max_holes=100)
    feed(slots, model, [[A, B, C]], [[1, 1, 1]])
    drop_slots(slots, 1, torch.tensor([0]))  # [a . .]
    slots.compact(1)  # the bound the loop read; 2 holes are allowed, so nothing moves yet
    feed(slots, model, [[D, E]], [[1, 1]])  # does not fit: repacked to [a] first, then written
    assert slots.capacity == 4 and slots.pointer == 3
    assert cached_tokens(slots).tolist() == [[A, D, E]]
    feed(slots, model, [[X, X]], [[1, 1]])  # no hole left: the buffers double
    assert slots.capacity == 8 and slots.pointer == 5
    assert cached_tokens(slots).tolist() == [[A, D, E, X, X]]
    assert slots.slot_positions[0, :5].tolist() == [0, 1, 2, 3, 4]


# position_masks on one row ``[_ _ a b . c]``: positions 0 0 0 1 2 2 (the hole held a dropped token at 2), queries
# at positions 2 (c itself) and 3 (the next token).
KEY_POSITIONS = torch.tensor([[0, 0, 0, 1, 2, 2]])
KEY_VALID = torch.tensor([[False, False, True, True, False, True]])
QUERIES = torch.tensor([[2, 3]])
SEES_ALL = [[0, 0, 1, 1, 0, 1], [0, 0, 1, 1, 0, 1]]
SEES_WINDOW_2 = [[0, 0, 0, 1, 0, 1], [0, 0, 0, 0, 0, 1]]  # position 2 sees 1..2, position 3 sees 2..3


def as_bool(rows):
    return torch.tensor(rows, dtype=torch.bool)[None, None]


@pytest.mark.parametrize("window,expected", [
    (None, SEES_ALL),
    (3, [[0, 0, 1, 1, 0, 1], [0, 0, 0, 1, 0, 1]]),
    (2, SEES_WINDOW_2),
    (1, [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0]]),
])
def test_position_masks_see_real_keys_not_after_the_query_within_the_window(window, expected):
    layout = AttentionLayout({FULL if window is None else SLIDING: window}, False, "sdpa", True)
    mask = position_masks(layout, KEY_POSITIONS, KEY_VALID, QUERIES, torch.float32)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, as_bool(expected))


def test_position_masks_for_hybrid_models_are_keyed_by_layer_type():
    layout = AttentionLayout({FULL: None, SLIDING: 2}, True, "sdpa", True)
    masks = position_masks(layout, KEY_POSITIONS, KEY_VALID, QUERIES, torch.float32)
    assert set(masks) == {FULL, SLIDING}
    assert torch.equal(masks[FULL], as_bool(SEES_ALL))
    assert torch.equal(masks[SLIDING], as_bool(SEES_WINDOW_2))


def test_position_masks_for_eager_attention_are_additive():
    layout = AttentionLayout({SLIDING: 2}, False, "eager", True)
    mask = position_masks(layout, KEY_POSITIONS, KEY_VALID, QUERIES, torch.float16)
    blocked = torch.finfo(torch.float16).min
    expected = torch.tensor(SEES_WINDOW_2, dtype=torch.float16).mul(-blocked).add(blocked)  # 1 -> 0, 0 -> min
    assert mask.dtype == torch.float16
    assert torch.equal(mask, expected[None, None])


@pytest.mark.parametrize("windows,prompt,max_length,expected", [
    ({FULL: None}, 5, 100, 100 + 11),  # every token up to max_length, plus 2 blocks of 4 and 3 holes
    ({FULL: None, SLIDING: 8}, 5, 100, 100 + 11),  # one full layer: unbounded
    ({SLIDING: 8}, 5, 100, 8 + 11),  # the window outlives the prompt
    ({SLIDING: 8}, 20, 100, 20 + 11),  # the prompt is read whole before anything expires
    ({SLIDING: 8}, 5, 6, 6 + 11),  # the call ends inside the window
], ids=["full", "hybrid", "window outlives prompt", "prompt outlives window", "call ends inside window"])
def test_slots_needed(windows, prompt, max_length, expected):
    layout = AttentionLayout(windows, len(windows) > 1, "sdpa", True)
    assert slots_needed(layout, prompt, max_length, block=4, max_holes=3) == expected


def test_repacking_changes_nothing_a_real_model_computes():
    model = tiny_llama(32, num_layers=2, seed=5, hidden_size=16)
    slots = SlotCache(2, torch.device("cpu"), max_holes=0, capacity=16)
    with torch.no_grad():
        slots.forward(model, torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        slots.forward(model, torch.tensor([[11, 12], [13, 14]]), torch.tensor([[1, 1], [1, 1]]))
        drop_slots(slots, 4, torch.tensor([1, 0]))  # [_ _ a b c .] and [a b c d . .]
        with_holes = copy.deepcopy(slots).forward(model, torch.tensor([[15], [16]]), torch.ones(2, 1, dtype=torch.long))
        slots.compact(4)
        # c (position 2) fills row 0's first hole: its slots no longer in position order, the same computation
        assert slots.pointer == 4 and slots.slot_mask[:, :4].tolist() == [[1, 0, 1, 1], [1, 1, 1, 1]]
        repacked = slots.forward(model, torch.tensor([[15], [16]]), torch.ones(2, 1, dtype=torch.long))
        fresh = [model(torch.tensor([text])).logits[0, -1] for text in ([5, 6, 11, 15], [7, 8, 9, 10, 16])]
    torch.testing.assert_close(repacked, with_holes, atol=1e-5, rtol=0)
    torch.testing.assert_close(repacked[:, -1], torch.stack(fresh), atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout, unmasked", [
    (FULL_SDPA, True),  # plain causality: sdpa's own (a mask would make transformers expand every key-value head)
    (AttentionLayout({SLIDING: 3}, False, "sdpa", True), False),
    (AttentionLayout({FULL: None, SLIDING: 3}, True, "sdpa", True), False),
    (AttentionLayout({FULL: None}, False, "eager", True), False),
], ids=["sdpa", "window", "hybrid", "eager"])
def test_only_a_first_block_of_real_tokens_on_plain_sdpa_goes_without_a_mask(layout, unmasked):
    model, slots = RecordingModel(), new_cache(2, layout=layout, capacity=16)
    slots.forward(model, torch.tensor([[A, B, C], [C, D, E]]), None)
    assert (model.calls[-1]["attention_mask"] is None) == unmasked
    slots.forward(model, torch.tensor([[X, A], [E, B]]), None)  # a later block of two: causality needs a mask
    assert model.calls[-1]["attention_mask"] is not None
    padded, slots = RecordingModel(), new_cache(2, layout=layout, capacity=16)
    feed(slots, padded, [[PAD, A, B], [C, D, E]], [[0, 1, 1], [1, 1, 1]])
    assert padded.calls[-1]["attention_mask"] is not None
    counted, slots = RecordingModel(), new_cache(2, layout=layout, capacity=16)  # a mask of ones, its sum counted
    slots.forward(counted, torch.tensor([[A, B], [C, D]]), torch.ones(2, 2, dtype=torch.long), num_real=4)
    assert (counted.calls[-1]["attention_mask"] is None) == unmasked


def test_a_first_block_read_without_a_mask_computes_what_the_model_alone_does():
    model = tiny_llama(32, num_layers=2, seed=5, hidden_size=16)
    prompts = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    with torch.no_grad():
        slots = SlotCache(2, torch.device("cpu"), capacity=16)
        first = slots.forward(model, prompts, None)
        assert slots.layout.plain_sdpa
        after = slots.forward(model, torch.tensor([[11], [12]]), None)
        alone = model(torch.cat([prompts, torch.tensor([[11], [12]])], dim=1)).logits
    torch.testing.assert_close(first, alone[:, :4], atol=1e-5, rtol=0)
    torch.testing.assert_close(after[:, -1], alone[:, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout, unmasked", [(FULL_SDPA, True), (AttentionLayout({FULL: None}, False, "eager", True),
                                                                   False)], ids=["sdpa", "eager"])
def test_one_token_after_slots_all_real_goes_without_a_mask_until_a_hole_may_exist(layout, unmasked):
    model, slots = RecordingModel(), new_cache(2, layout=layout, capacity=16)
    slots.forward(model, torch.tensor([[A, B, C], [C, D, E]]), None)
    slots.forward(model, torch.tensor([[X], [E]]), torch.ones(2, 1, dtype=torch.long), num_real=2)  # a plain step
    assert (model.calls[-1]["attention_mask"] is None) == unmasked
    start = slots.pointer
    slots.forward(model, torch.tensor([[A, B], [C, D]]), None, real_lengths=torch.tensor([2, 2]), num_real=4)
    slots.keep_prefix(start, torch.tensor([2, 1]))  # a rejected draft: a hole in row 1
    slots.forward(model, torch.tensor([[X], [E]]), None)
    assert model.calls[-1]["attention_mask"] is not None  # the hole must stay unseen
    for hole in ("padded", "joined"):
        model, slots = RecordingModel(), new_cache(2, layout=layout, capacity=16)
        if hole == "padded":
            feed(slots, model, [[PAD, A, B], [C, D, E]], [[0, 1, 1], [1, 1, 1]])
        else:
            slots.forward(model, torch.tensor([[A, B, C], [C, D, E]]), None)
            slots.add_rows(1)
            slots.forward(model, torch.tensor([[X], [E], [A]]), None)
        slots.forward(model, torch.tensor([[X], [E]] + ([[B]] if hole == "joined" else [])), None)
        assert model.calls[-1]["attention_mask"] is not None, hole


def test_plain_decoding_steps_compute_bit_for_bit_what_transformers_own_steps_do():
    """One real token after slots all real goes to sdpa unmasked, as transformers' own decoding step does: the same
    kernel on the same numbers, so the logits are equal to the last bit (a mask of ones took another kernel)."""
    model = tiny_llama(97, num_layers=3, seed=7)
    prompt, tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]), [13, 14, 15, 16, 17, 18]
    with torch.no_grad():
        past = model(prompt, use_cache=True).past_key_values
        transformers_steps = []
        for token in tokens:
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            transformers_steps.append(out.logits[0, -1])
        slots = SlotCache(1, torch.device("cpu"), capacity=64)
        slots.forward(model, prompt, None)
        ours = [slots.forward(model, torch.tensor([[token]]), None)[0, -1] for token in tokens]
    assert slots.dense
    assert torch.equal(torch.stack(ours), torch.stack(transformers_steps))
