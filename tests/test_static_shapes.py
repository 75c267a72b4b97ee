"""``tetris_compile=True`` feeds the compiled step forwards a few static shapes, however long the call: the KV width is
the cache's fixed capacity, blocks are powers of two where CUDA graphs are recorded (else their exact widths, at most
k + e + 1 of them), and the batch is padded to a few buckets as rows finish. CUDA graphs record one graph per shape,
so this bounds them. The shape tests run both block policies on the CPU and replace ``torch.compile`` by a recorder
around the eager forward (fast, and the static shapes are then checked for exactness without compiling); one test
compiles for real (inductor on the CPU) and counts graphs."""

import weakref

import pytest
import torch
from torch._dynamo.utils import counters

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
import tetris_hf.compiled as compiled
import tetris_hf.static_shapes as static_shapes
from tetris_hf.static_shapes import batch_bucket, batch_buckets, bucket, static_capacity
from tetris_hf.kv import SlotCache
from test_greedy_exactness import assert_rows_equal
from test_prompt_lookup import repetitive_prompts
from tiny_models import EOS, PAD, left_pad, random_prompts, sharpen, target_and_draft, tiny_llama

BATCH, DRAFTED, EXTRA = 16, 3, 2  # TETRIS drafts K = 5 cells per row: target blocks of 1, 2, 4 or 8 tokens
SHORT, LONG = 48, 160


@pytest.fixture(autouse=True)
def static_shapes_on_the_cpu(monkeypatch):
    """This module tests the static-shape path (CUDA's, and the CPU's for models that cannot read packed): pinned on
    the CPU too, where ``tetris_compile=True`` otherwise keeps eager shapes (tests/test_compile_eager_shapes.py)."""
    monkeypatch.setattr(compiled, "CPU_ON_EAGER_SHAPES", False)


def shape_of(value):
    if isinstance(value, dict):  # hybrid models: a mask per layer type
        return tuple(sorted((kind, tuple(mask.shape)) for kind, mask in value.items()))
    return None if value is None else tuple(value.shape)


class ShapeRecorder:
    """Stands in for ``torch.compile``: the "compiled" forward is the eager one, recording every distinct
    ``(input_ids, attention_mask, position_ids)`` shape it is called with, per model, and checking that every query,
    dummy rows' included, sees some key."""

    def __init__(self):
        self.shapes: dict[torch.nn.Module, set] = {}

    def __call__(self, forward, **options):
        seen = self.shapes.setdefault(forward.__self__, set())

        def recorded(**inputs):
            seen.add(tuple(shape_of(inputs.get(name)) for name in ("input_ids", "attention_mask", "position_ids")))
            masks = inputs["attention_mask"]
            for mask in masks.values() if isinstance(masks, dict) else [masks]:
                # (sdpa kernels may give NaN for a query that sees nothing; this CPU one gives zeros)
                visible = mask if mask.dtype == torch.bool else mask == 0
                assert visible.any(dim=-1).all(), "a query (of a real or a dummy row) sees no key"
            outputs = forward(**inputs)
            assert torch.isfinite(outputs.logits).all()
            return outputs

        return recorded

    def of(self, model) -> set:
        return self.shapes.get(model, set())

    def reset(self) -> None:
        for seen in self.shapes.values():  # (the compiled forwards are kept per model: their sets too)
            seen.clear()


@pytest.fixture
def recorder(monkeypatch):
    recorder = ShapeRecorder()
    monkeypatch.setattr(compiled, "_COMPILED", weakref.WeakKeyDictionary())  # compile afresh, through the recorder
    monkeypatch.setattr(compiled.torch, "compile", recorder)
    return recorder


@pytest.fixture(params=["cuda graphs", "cpu"])
def block_widths(request, monkeypatch):
    """The widths a target block of up to ``n`` tokens may take, per policy: powers of two where graphs are recorded
    (the CUDA policy, played on the CPU), else exact."""
    graphs = request.param == "cuda graphs"
    monkeypatch.setattr(static_shapes, "records_graphs", lambda device: graphs)
    return lambda n: {bucket(length) if graphs else length for length in range(1, n + 1)}


def alone(target, prompts, eos, new_tokens):
    """Each row generated on its own, unpadded: the reference."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                              eos_token_id=eos, pad_token_id=PAD)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def compiled_call(target, prompts, references, new_tokens, **options):
    """A greedy compiled call, asserted equal to the target alone row by row."""
    input_ids, mask = left_pad(prompts)
    out = target.generate(input_ids, attention_mask=mask, custom_generate="tetris", do_sample=False,
                          max_new_tokens=new_tokens, eos_token_id=EOS, pad_token_id=PAD, tetris_compile=True,
                          return_dict_in_generate=True, **options)
    assert_rows_equal(out.sequences, input_ids, mask, [reference[:new_tokens] for reference in references])
    return out.tetris_stats


def assert_static(shapes: set, widths: set, batch_size: int) -> None:
    """Every shape is (padded batch, block width) with one KV width, the cache's fixed capacity."""
    batches = set(batch_buckets(batch_size))
    kv_widths = {mask[-1] for _, mask, _ in shapes}
    assert len(kv_widths) == 1, f"the KV width changed within the call: {sorted(kv_widths)}"
    for input_ids, mask, positions in shapes:
        batch, width = input_ids
        assert batch in batches and width in widths, (input_ids, batches, widths)
        assert mask == (batch, 1, width, *kv_widths) and positions == input_ids


def test_buckets():
    assert [batch_bucket(rows, 16) for rows in range(1, 17)] == [4] * 4 + [16] * 12
    assert batch_buckets(16) == [16, 4] and batch_buckets(64) == [64, 16, 4] and batch_buckets(40) == [40, 16, 4]
    assert batch_buckets(3) == [3] and batch_buckets(1) == [1]
    assert [static_capacity(slots) for slots in (1, 256, 257, 600)] == [256, 256, 512, 768]


def test_static_steps_compute_what_eager_steps_compute():
    """The same verified blocks, roll-backs, repacks and retired rows through an eager cache and a static one (whose
    step forward is the eager model on static shapes): the same logits at every real token, the same keys in every
    real slot, and buffers that never move."""
    model = tiny_llama(32, num_layers=2, seed=5, hidden_size=16)
    generator = torch.Generator().manual_seed(0)
    prompts = random_prompts(6, 32, seed=5)
    input_ids, mask = left_pad(prompts)
    recorder = ShapeRecorder()
    eager = SlotCache(6, torch.device("cpu"), max_holes=3, capacity=40)
    static = SlotCache(6, torch.device("cpu"), max_holes=3, capacity=40)
    static.step_forward = recorder(model.forward)
    assert static.capacity == 256 and eager.capacity == 40
    with torch.no_grad():
        for slots in (eager, static):
            slots.forward(model, input_ids, mask, logits_to_keep=1)  # the prompt read: eager in both
        buffers = [layer.static_keys.data_ptr() for layer in static.cache.layers]
        repacked = False
        for step in range(14):
            rows = eager.next_positions.shape[0]
            width = (1, 2, 4)[step % 3]
            block = torch.randint(3, 32, (rows, width), generator=generator)
            real = torch.randint(1, width + 1, (rows,), generator=generator)
            logits = [slots.forward(model, block, None, step=True, real_lengths=real) for slots in (eager, static)]
            for row, length in enumerate(real.tolist()):
                torch.testing.assert_close(logits[1][row, :length], logits[0][row, :length])
            keep = torch.minimum(torch.randint(1, width + 1, (rows,), generator=generator), real)
            written = eager.pointer
            for slots in (eager, static):
                slots.keep_prefix(slots.pointer - width, keep)
                slots.compact(int(slots.next_positions.max()))
            repacked = repacked or eager.pointer < written
            if step % 4 == 3 and rows > 1:  # row 0 finishes: the last row takes its place
                for slots in (eager, static):
                    slots.fill_rows(torch.tensor([0]), torch.tensor([rows - 1]), rows - 1)
            assert static.pointer == eager.pointer and torch.equal(static.slot_mask[:, :40], eager.slot_mask)
        real_slots = eager.slot_mask[:, : eager.pointer]
        for ours, theirs in zip(static.cache.layers, eager.cache.layers):
            assert ours.keys.shape[0] == theirs.keys.shape[0] == 3  # active rows (of 6 in the buffers)
            for tensor, reference in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                written = tensor[:, :, : eager.pointer].transpose(1, 2)[real_slots]
                torch.testing.assert_close(written, reference[:, :, : eager.pointer].transpose(1, 2)[real_slots])
    assert [layer.static_keys.data_ptr() for layer in static.cache.layers] == buffers and static.capacity == 256
    batches = {shape[0][0] for shape in recorder.of(model)}
    assert batches == {6, 4}, batches  # 6 and 5 rows run as 6, then 4 and 3 as 4
    assert repacked  # (max_holes 3: the repacking paths ran)


def test_a_static_cache_that_must_grow_moves_its_buffers_and_stays_exact():
    """Growth is what sizing avoids (a new KV width: new graphs), but it stays correct: the buffers are reallocated,
    marked static again, and the step computes what an eager cache computes."""
    model = tiny_llama(32, num_layers=1, seed=6, hidden_size=16)
    recorder = ShapeRecorder()
    eager, static = (SlotCache(2, torch.device("cpu"), capacity=8) for _ in range(2))
    static.step_forward = recorder(model.forward)
    prompt = torch.randint(3, 32, (2, 254), generator=torch.Generator().manual_seed(1))
    block = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        for slots in (eager, static):
            slots.forward(model, prompt, torch.ones_like(prompt), logits_to_keep=1)
        buffer = static.cache.layers[0].static_keys.data_ptr()
        logits = [slots.forward(model, block, None, step=True, real_lengths=torch.tensor([4, 2]))
                  for slots in (eager, static)]
    assert static.capacity == 512 and static.cache.layers[0].static_keys.shape[2] == 512
    assert static.cache.layers[0].static_keys.data_ptr() != buffer
    assert {shape[1] for shape in recorder.of(model)} == {(2, 1, 4, 512)}
    torch.testing.assert_close(logits[1][0], logits[0][0])
    torch.testing.assert_close(logits[1][1, :2], logits[0][1, :2])


def test_draft_and_target_see_a_few_shapes_however_long_the_call(recorder, block_widths):
    """B = 16, rows stopping at their EOS from 4 to 160 tokens. Before static shapes the target's compiled forward
    saw 32 shapes in 48 tokens and 104 in 160, the draft's 150 and 367. Now at most 8 (CUDA: 4 block widths x 2 batch
    buckets), or 12 on the CPU (6 exact widths x 2)."""
    target, draft = target_and_draft(64, seed=7, draft_kind="noisy", noise=0.3)
    prompts = random_prompts(BATCH, 64, seed=7)
    references = alone(target, prompts, EOS, LONG)
    lengths = sorted(map(len, references))
    assert lengths[0] < 8 and lengths[BATCH // 2] < SHORT < lengths[-1] == LONG, lengths  # rows stop all along
    counts = {}
    for new_tokens in (SHORT, LONG):
        recorder.reset()
        compiled_call(target, prompts, references, new_tokens, assistant_model=draft, num_assistant_tokens=DRAFTED,
                      tetris_extra_tokens=EXTRA)
        target_shapes, draft_shapes = recorder.of(target), recorder.of(draft)
        widths = block_widths(DRAFTED + EXTRA + 1)
        assert_static(target_shapes, widths, BATCH)
        assert_static(draft_shapes, {1, 2}, BATCH)  # the pending block (target token, and a last draft), then 1
        assert len(target_shapes) <= len(widths) * len(batch_buckets(BATCH)) and len(draft_shapes) <= 4
        assert len(widths) == (4 if static_shapes.records_graphs(None) else 6)
        counts[new_tokens] = len(target_shapes), len(draft_shapes)
    # the same here; which widths a call needs varies a little with its rows, never past the bound
    assert counts[SHORT] == counts[LONG], counts


def test_prompt_lookup_target_sees_a_few_shapes_however_long_the_call(recorder, block_widths):
    """Prompt lookup has no draft model: only the target is compiled. Before static shapes it saw 28 shapes in 48
    tokens and 32 in 160."""
    target = sharpen(tiny_llama(vocab_size=24, num_layers=2, seed=3), 6.0)
    prompts = repetitive_prompts(BATCH, 24, seed=3)
    references = alone(target, prompts, EOS, LONG)
    assert sorted(map(len, references))[-1] > SHORT  # the long call runs longer
    counts = []
    for new_tokens in (SHORT, LONG):
        recorder.reset()
        stats = compiled_call(target, prompts, references, new_tokens, prompt_lookup_num_tokens=DRAFTED)
        assert stats.accepted_tokens > 0
        assert list(recorder.shapes) == [target]  # nothing else compiled
        widths = block_widths(DRAFTED + 2 + 1)  # (e = 2 by default)
        assert_static(recorder.of(target), widths, BATCH)
        counts.append(len(recorder.of(target)))
    # bounded whatever the length (which shapes a call meets depends on where its rows stop: the short call may meet
    # one the long one does not)
    assert max(counts) <= len(widths) * len(batch_buckets(BATCH)), counts


def test_real_compile_builds_a_bounded_set_of_graphs_and_no_more_for_longer_calls(monkeypatch):
    """Inductor on the CPU (dynamic=False: a graph per shape), prompt lookup (the target alone is compiled). B = 4 is
    one batch bucket and K = 1 gives blocks of 1 or 2 tokens: at most 2 graphs, and a call twice as long compiles
    none."""
    monkeypatch.setattr(compiled, "_COMPILED", weakref.WeakKeyDictionary())
    target = sharpen(tiny_llama(24, num_layers=1, seed=3, hidden_size=16), 6.0)
    prompts = repetitive_prompts(4, 24, seed=4)
    references = alone(target, prompts, EOS, 32)
    graphs = []
    for new_tokens in (16, 32):
        counters.clear()
        compiled_call(target, prompts, references, new_tokens, prompt_lookup_num_tokens=1, tetris_extra_tokens=0)
        graphs.append(counters["stats"]["unique_graphs"])
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert 0 < graphs[0] <= 2 and graphs[1] == 0, graphs


def test_static_steps_read_each_key_value_head_in_place(recorder, monkeypatch):
    """A static step on an sdpa model with grouped heads (the tiny Llama: 4 query heads, 2 key-value heads) passes
    SDPA ``enable_gqa`` instead of expanding the cache's whole capacity to every head (what transformers does with a
    mask); the rows still equal the target alone, and the model's attention setting is back to sdpa after."""
    flags = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        flags.append(kwargs.get("enable_gqa", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    target, draft = target_and_draft(64, seed=9, draft_kind="noisy", noise=0.3)
    assert target.config._attn_implementation == "sdpa" and target.config.num_key_value_heads < 4
    prompts = random_prompts(4, 64, seed=9)
    references = alone(target, prompts, EOS, 12)
    flags.clear()
    compiled_call(target, prompts, references, 12, assistant_model=draft, num_assistant_tokens=2)
    assert True in flags and False in flags  # static steps in place; the eager prompt reads as transformers does
    assert target.config._attn_implementation == draft.config._attn_implementation == "sdpa"
