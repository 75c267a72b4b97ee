"""The CPU's row-walking attention kernel (tetris_hf/cpu_attention.py): the same attention as sdpa's over every row's
visible keys, whatever the shapes, strides and masks; taken only where it applies; and a stream on it equal to the
target alone."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tetris_hf import attention, cpu_attention
from tetris_hf.attention import grouped_sdpa_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler to build the CPU kernel")


def reference(query, key, value, mask, scale):
    """Softmax attention in float64, ``(B, L, H, D)``; zeros for a query that sees no key."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).double(), value.repeat_interleave(groups, 1).double()
    scores = query.double() @ key.transpose(-1, -2) * scale
    scores = scores.masked_fill(~mask[..., : key.shape[2]], float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    return (weights @ value).transpose(1, 2)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 5), key_heads=st.integers(1, 3), groups=st.integers(1, 4), length=st.integers(1, 8),
       slots=st.integers(1, 70), dim=st.sampled_from([1, 8, 17, 64]), extra_slots=st.integers(0, 9),
       mask_batch=st.booleans(), mask_rows=st.booleans(), seed=st.integers(0, 2**16), density=st.floats(0, 1))
def test_row_attention_equals_softmax_attention(batch, key_heads, groups, length, slots, dim, extra_slots, mask_batch,
                                                mask_rows, seed, density):
    length = min(length, cpu_attention.MAX_QUERIES // groups)
    generator = torch.Generator().manual_seed(seed)
    heads = key_heads * groups
    # keys and values: views of wider buffers (a cache's, read in place); queries transposed from (B, L, H, D)
    buffer = torch.randn(2, batch + 1, key_heads, slots + extra_slots, dim, generator=generator)
    key, value = buffer[0, :batch, :, :slots], buffer[1, 1:, :, :slots]
    query = torch.randn(batch, length, heads, dim, generator=generator).transpose(1, 2)
    mask = torch.rand(batch if mask_batch else 1, 1, length if mask_rows else 1, slots + extra_slots,
                      generator=generator) < density
    scale = dim ** -0.5
    assert cpu_attention.row_attention_applies(query, key, value, mask)
    output = cpu_attention.row_attention(query, key, value, mask, scale)
    expected = reference(query, key, value, mask.expand(batch, 1, length, -1), scale)
    assert output.shape == (batch, length, heads, dim)
    torch.testing.assert_close(output.double(), expected, atol=2e-5, rtol=1e-4)


def test_a_key_it_may_not_see_changes_nothing():
    """Keys and values under a false mask are never read: NaN there leaves the output as it was."""
    query, key, value = torch.randn(3, 6, 2, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    mask = torch.rand(3, 1, 2, 40, generator=torch.Generator().manual_seed(0)) < 0.5
    before = cpu_attention.row_attention(query, key, value, mask)
    hidden = ~mask.any(dim=2)[..., None]  # (B, 1, S, 1): slots no query of the row sees
    key.masked_fill_(hidden, float("nan"))
    value.masked_fill_(hidden, float("nan"))
    assert torch.equal(cpu_attention.row_attention(query, key, value, mask), before)


def test_it_applies_only_where_it_can():
    applies = cpu_attention.row_attention_applies
    query, key, value = torch.randn(2, 6, 3, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    mask = torch.ones(2, 1, 3, 10, dtype=torch.bool)
    assert applies(query, key, value, mask)
    assert not applies(query.half(), key.half(), value.half(), mask)  # fp32 only
    assert not applies(query, key, value, mask.float())  # an additive mask
    assert not applies(query, key, value, None)
    long = torch.randn(2, 6, cpu_attention.MAX_QUERIES, 8)  # 3 query heads a key-value head x 32: sdpa's
    assert not applies(long, key, value, torch.ones(2, 1, cpu_attention.MAX_QUERIES, 10, dtype=torch.bool))
    assert not applies(query, key, value, torch.ones(3, 1, 3, 10, dtype=torch.bool))  # 3 mask rows for 2
    assert not applies(query.requires_grad_(), key, value, mask)  # no backward


def test_grouped_sdpa_runs_the_kernel_where_it_applies(monkeypatch):
    """The loop's CPU sdpa attention (grouped_sdpa_attention) goes to the kernel for a masked block of a few queries,
    and with the kernel switched off to sdpa, with the same attention."""
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    query, key, value = torch.randn(4, 6, 2, 16), torch.randn(4, 2, 30, 16), torch.randn(4, 2, 30, 16)
    mask = torch.rand(4, 1, 2, 30, generator=torch.Generator().manual_seed(1)) < 0.7
    mask[..., -1] = True
    calls = []
    monkeypatch.setattr(attention, "row_attention", lambda *args: calls.append(1) or cpu_attention.row_attention(*args))
    output, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    assert calls == [1]
    monkeypatch.setattr(attention, "row_attention_applies", lambda *args: False)
    on_sdpa, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    assert calls == [1]
    torch.testing.assert_close(output, on_sdpa, atol=1e-5, rtol=1e-4)


def test_without_a_compiler_attention_stays_on_sdpa_with_a_warning(tmp_path):
    """A machine whose C compiler fails (here ``CC=false``, an empty kernel cache): one warning naming the fallback,
    the kernel unavailable, and the loop's attention the same as sdpa's."""
    import os
    import subprocess
    import sys

    script = """
import torch
from types import SimpleNamespace
from tetris_hf import cpu_attention
from tetris_hf.attention import grouped_sdpa_attention
query, key, value = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
output, _ = grouped_sdpa_attention(SimpleNamespace(num_key_value_groups=3), query, key, value, mask)
expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
print(cpu_attention.available(), torch.allclose(output, expected.transpose(1, 2), atol=1e-6))
"""
    environment = {**os.environ, "CC": "false", "TETRIS_HF_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True"]
    assert "building the CPU attention kernel failed" in run.stderr and "stays on sdpa" in run.stderr
    assert list(tmp_path.rglob("*.so")) == []
