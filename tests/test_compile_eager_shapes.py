"""``tetris_compile=True`` on the CPU: the target's forwards compiled on the shapes as they come (dynamic shapes,
packed blocks, each layer's cache write and attention one opaque op, ``tetris_hf::slot_attention``). Every row equals
the target alone, in ``generate()`` and in a stream where rows join (their prompts read in the steps' forwards) and
leave; sampling follows the target's law; a few graphs serve every shape; models it cannot serve take the static path.
"""

import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
import tetris_hf.compiled as compiled_module
from tetris_hf.compiled import compiles_on_eager_shapes, eager_shapes_forward
from tetris_hf.cpu_kernels import use_onednn_linears
from tetris_hf.stream import RequestStream
from test_compile import needs_onednn
from test_compile_stream import fresh_dynamo  # noqa: F401  (a fixture)
from test_greedy_exactness import generate_checked, pick_eos, target_alone
from test_sampling_distribution import VOCAB, chi_square_p_value, exact_joint, sampled_joint
from test_stream import check_exact, requests
from tiny_models import left_pad, noisy_copy, random_prompts, sharpen, target_and_draft, tiny_llama

LOOKUP = dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=2)
# graphs a call may compile: one serves every forward of the target (sizes of 1 not specialised, the cache's capacity
# not a constant); a draft model's one-token steps compile on the static path
GRAPHS = 3


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


# (fixed chains and plain steps: test_compiled_generate_on_eager_shapes_rows_equal_target_alone and the oneDNN test)
@pytest.mark.parametrize("options", [dict(tetris_strategy="tetris", tetris_extra_tokens=1, **LOOKUP),
                                     dict(tetris_strategy="tetris", num_assistant_tokens=2, draft="model")],
                         ids=["tetris-lookup", "tetris-draft-model"])
def test_compiled_stream_on_eager_shapes_rows_equal_target_alone(options, fresh_dynamo):
    """12 requests through 4 rows (prompts of 1-40 tokens, read 7 tokens a forward or riding in the steps' forwards,
    every third stopping at an end token): each equals the target alone; the target's cache packs and is not static;
    a few graphs serve the whole stream."""
    target = tiny_llama(seed=0)
    options = dict(options)
    if options.pop("draft", None):
        options["assistant_model"] = noisy_copy(target, 0.3)
    stream = RequestStream(target, max_batch_size=4, prefill_chunk=7, eos_token_id=None, tetris_compile=True,
                           **options)
    slots = stream.loop.core.target_slots
    assert slots.eager_shapes_forward is not None and not slots.static and slots.packs
    check_exact(target, stream, requests(target, 12, seed=70))
    assert 0 < compiled_graphs() <= GRAPHS, dict(counters["stats"])


def test_compiled_stream_on_eager_shapes_compiles_once_however_plans_and_the_cache_change(fresh_dynamo):
    """``adaptive`` with prompt lookup (plans of every draft width, probes, plain steps with prompts riding, one row
    left at the end) over prompts long enough that the cache doubles: one graph serves the whole first call, every row
    exact, and the same call again compiles nothing."""
    target = tiny_llama(seed=0)
    settings = [(prompt, max_new * 16, eos) for prompt, max_new, eos in requests(target, 8, seed=72, max_prompt=200)]
    for call in range(2):
        stream = RequestStream(target, max_batch_size=4, prefill_chunk=64, eos_token_id=None, tetris_compile=True,
                               tetris_strategy="adaptive", **LOOKUP)
        slots = stream.loop.core.target_slots
        first_capacity = slots.capacity
        check_exact(target, stream, settings)
        assert slots.capacity >= 4 * first_capacity  # (grown twice or more)
        assert compiled_graphs() == 1, (call, dict(counters["stats"]))


@pytest.mark.parametrize("drafts", ["suffix trees", "draft model trees"])
def test_draft_trees_compile_on_eager_shapes_and_stay_exact(fresh_dynamo, drafts):
    """Trees of width 2 (suffix drafts alone, or a draft model's, whose growth stays eager): every row equals the
    target alone, the target's tree forwards (ancestor masks, positions by depth) run its one graph."""
    target, draft = target_and_draft(64, seed=2, draft_kind="noisy", noise=0.4)
    prompts = [prompt + prompt[: len(prompt) // 2] for prompt in random_prompts(6, 64, seed=2)]  # (suffixes to copy)
    eos = pick_eos(target, prompts)
    references = target_alone(target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    options = (dict(tetris_suffix_num_tokens=4, tetris_suffix_min_prob=0.0) if drafts == "suffix trees" else
               dict(num_assistant_tokens=3))
    stats = generate_checked(target, draft if drafts == "draft model trees" else None, input_ids, mask, references,
                             eos, tetris_compile=True, tetris_tree_width=2, **options)
    assert stats.accepted_tokens > 0
    assert compiled_graphs() == 1, dict(counters["stats"])


def test_trees_on_a_target_that_would_compile_on_static_shapes_are_refused(monkeypatch):
    monkeypatch.setattr(compiled_module, "CPU_ON_EAGER_SHAPES", False)
    target, draft = target_and_draft(64, seed=2, draft_kind="noisy", noise=0.4)
    input_ids, mask = left_pad(random_prompts(2, 64, seed=2))
    with pytest.raises(ValueError, match="tetris_tree_width.*tetris_compile"):
        target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                        max_new_tokens=4, pad_token_id=0, tetris_tree_width=2, tetris_compile=True)


def test_compiled_generate_on_eager_shapes_rows_equal_target_alone(fresh_dynamo):
    """Left-padded rows of their own lengths, a draft model, TETRIS and fixed chains and plain steps: every row equals
    the target alone."""
    target, draft = target_and_draft(64, seed=7, draft_kind="noisy", noise=0.3)
    prompts = random_prompts(4, 64, seed=7)
    eos = pick_eos(target, prompts)
    references = target_alone(target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    for options in (dict(tetris_strategy="tetris", tetris_extra_tokens=2, tetris_budget=5),
                    dict(tetris_strategy="fixed", num_assistant_tokens=2), dict(tetris_budget=0)):
        stats = generate_checked(target, draft, input_ids, mask, references, eos, tetris_compile=True, **options)
        assert (stats.verified_tokens > 0) == (options.get("tetris_budget") != 0)
    assert 0 < compiled_graphs() <= GRAPHS, dict(counters["stats"])


def test_compiled_sampling_on_eager_shapes_follows_the_target_distribution(fresh_dynamo):
    """Chi-square of the first 3 sampled tokens against the exact target law, compiled on eager shapes."""
    target = sharpen(tiny_llama(VOCAB, num_layers=2, seed=21, hidden_size=16), 12)
    draft = sharpen(tiny_llama(VOCAB, num_layers=1, seed=22, hidden_size=16), 12)
    assert compiles_on_eager_shapes(target, packs=True)
    counts, stats = sampled_joint(target, draft, 1.0, 1.0, "tetris", tetris_compile=True, tetris_budget=6000)
    assert 0 < stats.accepted_tokens < stats.verified_tokens and compiled_graphs() > 0
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0)) > 1e-3


@needs_onednn
def test_compiled_stream_on_eager_shapes_with_onednn_linears(fresh_dynamo):
    """The linears as oneDNN's opaque op inside the graph, the attention as ours: rows exact, no graph break at
    either."""
    target = tiny_llama(seed=0)
    use_onednn_linears(target)
    stream = RequestStream(target, max_batch_size=3, prefill_chunk=9, eos_token_id=None, tetris_compile=True,
                           tetris_strategy="fixed", **LOOKUP)
    check_exact(target, stream, requests(target, 6, seed=71))
    assert compiled_graphs() > 0
    assert not any(name in str(key) for key in counters["graph_break"] for name in ("onednn", "mkldnn", "slot")), \
        dict(counters["graph_break"])


def test_models_that_cannot_read_packed_take_the_static_path():
    """Without packed reads (``tetris_pack=False``) the compiled step keeps static shapes, as on CUDA."""
    target = tiny_llama(seed=0)
    assert compiles_on_eager_shapes(target, packs=True) and not compiles_on_eager_shapes(target, packs=False)
    stream = RequestStream(target, max_batch_size=2, eos_token_id=None, tetris_compile=True, tetris_pack=False,
                           **LOOKUP)
    slots = stream.loop.core.target_slots
    assert slots.eager_shapes_forward is None and slots.static


def _kernels_computing(code: str, function: str) -> int:
    """How many of inductor's C++ kernels in ``code`` call ``function`` (``"cos("``, say)."""
    return sum(function in kernel for kernel in re.split(r"cpp_fused_\w+ = async_compile", code))


def test_rotary_tables_are_computed_once_per_forward_not_in_every_layer(fresh_dynamo):
    """A compiled forward on the CPU computes the rotary embedding's cos and sin in one kernel, its result a buffer
    every layer reads (:class:`~tetris_hf.compiled.TrigOnce`); compiled without the pass (the negative control),
    inductor recomputes them inside the layers' kernels. Logits within a rounding of eager's either way."""
    model = tiny_llama(seed=0, num_layers=4)
    input_ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(input_ids=input_ids).logits
        once, codes = run_and_get_code(eager_shapes_forward(model), input_ids=input_ids)
        torch._dynamo.reset()
        inlined, inlined_codes = run_and_get_code(torch.compile(model.forward, dynamic=True), input_ids=input_ids)
    code, inlined_code = "\n".join(codes), "\n".join(inlined_codes)
    assert _kernels_computing(code, "cos(") == _kernels_computing(code, "sin(") == 1
    assert _kernels_computing(inlined_code, "cos(") > 1 and _kernels_computing(inlined_code, "sin(") > 1
    torch.testing.assert_close(once.logits, eager, rtol=0, atol=1e-5)
    torch.testing.assert_close(inlined.logits, eager, rtol=0, atol=1e-5)


def test_a_forward_works_out_its_attention_once_not_in_every_layer(fresh_dynamo, monkeypatch):
    """A compiled forward's slot attention works out the block's packing and its kernels' calls at its first layer
    and every later layer reuses them (:func:`tetris_hf.slot_attention._plan`): one plan a forward, the kernels' calls
    run in every layer of the forwards they serve, rows exact. Negative control: with no plan kept, every layer works
    its own out."""
    import tetris_hf.slot_attention as slot_module

    num_layers = 4
    target = tiny_llama(seed=0, num_layers=num_layers)
    seen = {"forwards": [], "plans": 0, "layer_calls": 0}
    plan, kernel_groups, layer_calls = slot_module._plan, slot_module.kernel_groups, slot_module.LayerCalls.__call__

    def counting_plan(*args):
        host = args[9]
        if not any(host is other for other in seen["forwards"]):
            seen["forwards"].append(host)  # (kept: no id reused)
        return plan(*args)

    def counting_groups(*args):
        seen["plans"] += 1
        return kernel_groups(*args)

    def counting_calls(self, *args):
        seen["layer_calls"] += 1
        return layer_calls(self, *args)

    monkeypatch.setattr(slot_module, "_plan", counting_plan)
    monkeypatch.setattr(slot_module, "kernel_groups", counting_groups)
    monkeypatch.setattr(slot_module.LayerCalls, "__call__", counting_calls)
    for keep_plans in (True, False):
        if not keep_plans:
            monkeypatch.setattr(slot_module, "_PLANS", _NoPlansKept())
        seen.update(forwards=[], plans=0, layer_calls=0)
        stream = RequestStream(target, max_batch_size=3, prefill_chunk=16, eos_token_id=None, tetris_compile=True,
                               tetris_strategy="fixed", **LOOKUP)
        check_exact(target, stream, requests(target, 6, seed=73))
        stream.close()
        forwards = len(seen["forwards"])
        assert forwards > 10 and seen["layer_calls"] > 0 and seen["layer_calls"] % num_layers == 0
        assert seen["plans"] == (forwards if keep_plans else forwards * num_layers), (seen["plans"], forwards)


class _NoPlansKept(dict):
    """A plan store that keeps nothing (the negative control above)."""

    def get(self, key, default=None):
        return default

    def __setitem__(self, key, value):
        pass
