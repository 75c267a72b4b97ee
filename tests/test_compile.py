"""``tetris_compile=True``: the compiled step forwards give the same tokens, and what cannot compile is refused."""

import pytest
import torch
from torch._dynamo.utils import counters

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
import tetris_hf.compiled as compiled
from tetris_hf.compiled import check_compilable, compiled_forward
from tetris_hf.cpu_kernels import onednn_available, use_onednn_linears
from tetris_hf.static_shapes import block_width, bucket
from test_greedy_exactness import generate_checked, pick_eos, target_alone
from test_sampling_distribution import VOCAB, chi_square_p_value, exact_joint, sampled_joint
from tiny_models import left_pad, random_prompts, sharpen, target_and_draft, tiny_llama

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this PyTorch build")


def test_blocks_are_padded_to_powers_of_two_only_where_cuda_graphs_are_recorded():
    assert [bucket(length) for length in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [block_width(length, True, cuda) for length in (1, 3, 5)] == [1, 4, 8]
    assert [block_width(length, True, cpu) for length in (1, 3, 5)] == [1, 3, 5]  # inductor: a graph per width
    assert [block_width(length, False, cuda) for length in (1, 3, 5)] == [1, 3, 5]  # eager


def test_compiled_greedy_rows_equal_target_alone(monkeypatch):
    """A graph per shape (static shapes, dynamic=False) serves every step: rows retire, blocks change length, caches
    fill, and the shapes stay among the batch buckets x block widths. (The static path, CUDA's, pinned on the CPU: its
    eager-shape path is tests/test_compile_eager_shapes.py's.)"""
    monkeypatch.setattr(compiled, "CPU_ON_EAGER_SHAPES", False)
    target, draft = target_and_draft(64, seed=7, draft_kind="noisy", noise=0.3)
    prompts = random_prompts(4, 64, seed=7)
    eos = pick_eos(target, prompts)
    references = target_alone(target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    counters.clear()
    for options in (dict(tetris_strategy="tetris", tetris_extra_tokens=2, tetris_budget=5),
                    dict(tetris_strategy="fixed", num_assistant_tokens=2),
                    dict(tetris_budget=0)):  # plain steps: the last token alone, no mask built from positions
        stats = generate_checked(target, draft, input_ids, mask, references, eos, tetris_compile=True, **options)
        assert (stats.verified_tokens > 0) == (options.get("tetris_budget") != 0)
    # the step forwards really ran compiled, and a handful of graphs (not one per step) served them all: 4 rows are one
    # batch bucket, the target's blocks take their exact widths on the CPU (the few each call needs), the draft's 1 or
    # 2 (one KV width: every call's capacity rounds up to 256)
    assert 0 < counters["stats"]["unique_graphs"] <= 4 + 2, dict(counters["stats"])


def test_compiled_sampling_follows_the_target_distribution():
    """Chi-square of the first 3 sampled tokens against the exact target law, compiled, with a partial budget."""
    target = sharpen(tiny_llama(VOCAB, num_layers=2, seed=21, hidden_size=16), 12)
    draft = sharpen(tiny_llama(VOCAB, num_layers=1, seed=22, hidden_size=16), 12)
    counts, stats = sampled_joint(target, draft, 1.0, 1.0, "tetris", tetris_compile=True, tetris_budget=6000)
    assert 0 < stats.accepted_tokens < stats.verified_tokens
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0)) > 1e-3


def test_compile_is_refused_for_quantized_and_offloaded_models():
    target, _ = target_and_draft(32, seed=0, draft_kind="same")
    target.hf_device_map = {"model.layers.0": "cpu", "model.layers.1": "disk"}
    with pytest.raises(ValueError, match="offloaded"):
        check_compilable(target, "target")
    del target.hf_device_map
    target.config.quantization_config = {"load_in_4bit": True}
    with pytest.raises(ValueError, match="quantized"):
        check_compilable(target, "target")


@needs_onednn
def test_compiled_greedy_rows_equal_target_alone_on_onednn_linears():
    """Linears switched to oneDNN compile as one opaque op each (the tracer cannot see into oneDNN's): the graphs hold
    them, and the tokens are the target's alone on the same kernels; a weight changed between calls is read anew."""
    target, draft = target_and_draft(64, seed=11, draft_kind="noisy", noise=0.3)
    use_onednn_linears(target)
    use_onednn_linears(draft)
    prompts = random_prompts(4, 64, seed=11)
    eos = pick_eos(target, prompts)
    input_ids, mask = left_pad(prompts)
    counters.clear()
    options = dict(tetris_strategy="tetris", tetris_extra_tokens=2, tetris_budget=5, tetris_compile=True)
    stats = generate_checked(target, draft, input_ids, mask, target_alone(target, prompts, eos), eos, **options)
    assert stats.verified_tokens > 0 and counters["stats"]["unique_graphs"] > 0
    assert not any("onednn" in str(key) or "mkldnn" in str(key) for key in counters["graph_break"]), \
        dict(counters["graph_break"])


@needs_onednn
def test_a_compiled_forward_reads_a_changed_onednn_weight_anew():
    model = tiny_llama(64, num_layers=1, seed=3)
    use_onednn_linears(model)
    input_ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(3))
    forward = compiled_forward(model)
    with torch.no_grad():
        model(input_ids=input_ids)  # an eager call first: the reordered copies exist before the graph reads them
        before = forward(input_ids=input_ids).logits
        model.lm_head.weight.mul_(-2.0)  # in place: the same tensor, a new version
        after = forward(input_ids=input_ids).logits
        torch.testing.assert_close(after, model(input_ids=input_ids).logits)
    torch.testing.assert_close(after, -2.0 * before)


def test_a_compiled_forward_reads_weights_set_anew_and_grouped_weights_changed_in_place():
    """The forward's check of the kernels' copies (cpu_kernels.refresh_kernel_weights) sees a weight replaced by a
    new parameter and a grouped (q/k/v) weight changed in place, as the model's own eager forward reads them."""
    model = tiny_llama(64, num_layers=1, seed=3)
    use_onednn_linears(model)
    input_ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(3))
    forward = compiled_forward(model)
    with torch.no_grad():
        model(input_ids=input_ids)
        before = forward(input_ids=input_ids).logits
        model.lm_head.weight = torch.nn.Parameter(-2.0 * model.lm_head.weight)  # a new tensor
        torch.testing.assert_close(forward(input_ids=input_ids).logits, -2.0 * before)
        model.model.layers[0].self_attn.k_proj.weight.mul_(0.5)  # a grouped layer's, in place
        changed = forward(input_ids=input_ids).logits
        assert not torch.allclose(changed, -2.0 * before)
        torch.testing.assert_close(changed, model(input_ids=input_ids).logits)


def test_compile_option_must_be_a_bool():
    with pytest.raises(TypeError, match="tetris_compile"):
        tetris_hf.TetrisOptions(tetris_compile="yes")
