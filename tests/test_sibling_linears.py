"""Sibling linear layers (a module's q/k/v or gate/up projections) multiplied in one call: the same outputs as each
layer alone, in eager and compiled forwards, and layers that turn out to read different inputs go back to their own
products."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from tetris_hf.cpu_kernels import (OneDNNLinear, SiblingLinears, onednn_available, panel_linear,
                                   panel_linear_parts, panel_weight, panels_available, refresh_kernel_weights,
                                   restore_linears, sibling_groups, use_onednn_linears)
from tiny_models import tiny_llama

pytestmark = pytest.mark.skipif(not (onednn_available() and panels_available()),
                                reason="needs oneDNN and the panel kernel (a C compiler)")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 40) | st.integers(230, 260), sizes=st.lists(st.integers(1, 100), min_size=1, max_size=4),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_parts_equal_each_weight_alone(rows, sizes, bias, seed):
    """Any part sizes (each part's last block ragged or whole), any row count."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(size, 24, generator=generator) for size in sizes]
    biases = [torch.randn(size, generator=generator) for size in sizes]
    x = torch.randn(rows, 24, generator=generator)
    outputs = panel_linear_parts(x, panel_weight(*weights), torch.cat(biases) if bias else None, tuple(sizes))
    assert [output.shape for output in outputs] == [(rows, size) for size in sizes]
    for output, weight, part in zip(outputs, weights, biases):
        assert output.is_contiguous()
        assert torch.equal(output, panel_linear(x, panel_weight(weight), part if bias else None, weight.shape[0]))


# (2 rows a call: stacked up to 16 rows, each layer alone past them)
@pytest.mark.parametrize("tokens", [1, 7, 40, 259])
def test_a_model_with_siblings_computes_what_it_does_without(tokens):
    grouped = tiny_llama(97, num_layers=2, seed=1)
    alone = copy.deepcopy(grouped)
    use_onednn_linears(grouped)
    use_onednn_linears(alone, siblings=False)
    groups = sibling_groups(grouped)
    assert len(groups) == 4 and not sibling_groups(alone)  # q/k/v and gate/up in each of 2 layers
    assert sorted(len(group.layers) for group in groups) == [2, 2, 3, 3]
    ids = torch.randint(3, 97, (2, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        assert torch.equal(grouped(ids).logits, alone(ids).logits)
    assert all(group.waiting is None and not group.apart for group in groups)  # nothing held after a forward
    assert all("_onednn_packed" not in layer.__dict__ for group in groups for layer in group.layers)  # one copy
    assert restore_linears(grouped) == 15 and not sibling_groups(grouped)


class CrossAttention(torch.nn.Module):
    """q from the decoder's states, k and v from the encoder's: siblings by name, not by input."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(32, 16) for _ in range(3))

    def forward(self, states, encoded, keys_too=True):
        query = self.q_proj(states)
        return (query, self.k_proj(encoded), self.v_proj(encoded)) if keys_too else (query,)


def linear(layer, x):
    return torch.nn.functional.linear(x, layer.weight, layer.bias)


def switched_attention(seed):
    """A one-layer tiny Llama's attention, its q/k/v grouped."""
    model = tiny_llama(97, num_layers=1, seed=seed)
    use_onednn_linears(model)
    return model.model.layers[0].self_attn


@pytest.mark.parametrize("keys_too", [True, False])  # (False: keys cached, the query's siblings never called)
def test_layers_reading_other_inputs_go_back_to_their_own_products(keys_too):
    torch.manual_seed(0)
    module = CrossAttention()
    use_onednn_linears(module)
    (group,) = sibling_groups(module)
    with torch.no_grad():
        for step in range(3):
            states, encoded = torch.randn(2, 3, 32), torch.randn(2, 5, 32)
            outputs = module(states, encoded, keys_too)
            for output, layer, x in zip(outputs, (module.q_proj, module.k_proj, module.v_proj),
                                        (states, encoded, encoded)):
                torch.testing.assert_close(output, linear(layer, x), atol=1e-5, rtol=1e-5)
    assert group.apart and group.waiting is None and group.packed is None


def test_a_round_cut_short_once_leaves_the_layers_together():
    attention = switched_attention(2)
    group = attention.q_proj.__dict__["_siblings"][0]
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        attention.q_proj(x)  # (a forward that raised after its query)
        assert group.waiting is not None
        y = torch.randn(1, 4, 32)
        outputs = [attention.q_proj(y), attention.k_proj(y), attention.v_proj(y)]
    assert not group.apart and group.waiting is None and group.unclaimed == 0
    for output, layer in zip(outputs, (attention.q_proj, attention.k_proj, attention.v_proj)):
        torch.testing.assert_close(output, linear(layer, y), atol=1e-5, rtol=1e-5)


def test_an_input_written_in_place_between_siblings_is_multiplied_again():
    attention = switched_attention(2)
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        attention.q_proj(x)
        x.mul_(2)  # (the kept outputs are of the old values: k must not take them)
        torch.testing.assert_close(attention.k_proj(x), linear(attention.k_proj, x), atol=1e-5, rtol=1e-5)


def test_a_changed_weight_is_read_anew():
    attention = switched_attention(3)
    x = torch.randn(1, 2, 32)
    with torch.no_grad():
        attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        attention.k_proj.weight.mul_(-1)
        outputs = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
    torch.testing.assert_close(outputs[1], linear(attention.k_proj, x), atol=1e-5, rtol=1e-5)


def test_a_compiled_forward_makes_one_call_per_group():
    torch._dynamo.reset()
    counters.clear()
    grouped = tiny_llama(97, num_layers=2, seed=4)
    alone = copy.deepcopy(grouped)
    use_onednn_linears(grouped)
    use_onednn_linears(alone, siblings=False)
    ids = torch.randint(3, 97, (3, 5), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            refresh_kernel_weights(grouped)()  # (as the package's compiled forwards do before each call)
            compiled, code = run_and_get_code(torch.compile(grouped, dynamic=True), ids)
            expected = alone(ids).logits
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled.logits, expected, atol=1e-5, rtol=1e-5)  # (inductor's own fusions)
    calls = [line for source in code for line in source.splitlines() if "tetris_hf.sibling_linears.default(" in line]
    assert len(calls) == 4
    assert not counters["graph_break"]
    assert all(group.waiting is None for group in sibling_groups(grouped))


def test_layers_that_cannot_share_a_call_stay_apart():
    module = CrossAttention()
    module.v_proj = torch.nn.Linear(24, 16)  # another input size
    use_onednn_linears(module)
    assert not sibling_groups(module)
    assert all(type(layer) is OneDNNLinear for layer in (module.q_proj, module.k_proj, module.v_proj))
    ragged = CrossAttention()
    ragged.q_proj = torch.nn.Linear(32, 20)  # (outputs not in whole blocks: each layer's blocks its own)
    use_onednn_linears(ragged)
    assert len(sibling_groups(ragged)) == 1
    shared = CrossAttention()
    shared.k_proj = shared.q_proj  # one layer twice
    use_onednn_linears(shared)
    assert not sibling_groups(shared)
    assert SiblingLinears([ragged.k_proj, ragged.v_proj]).everyone == 3
