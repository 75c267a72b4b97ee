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
       slots=st.integers(1, 70), dim=st.sampled_from([1, 8, 17, 32, 64, 128]), extra_slots=st.integers(0, 9),
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


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6), key_heads=st.integers(1, 3),
       groups=st.integers(1, 4), slots=st.integers(1, 50), dim=st.sampled_from([8, 17, 32, 64, 128]),
       first_rows=st.integers(0, 2), offsets=st.booleans(), mask_rows=st.booleans(), seed=st.integers(0, 2**16),
       density=st.floats(0, 1))
def test_packed_row_attention_equals_softmax_attention_on_the_unpacked_block(lengths, key_heads, groups, slots, dim,
                                                                             first_rows, offsets, mask_rows, seed,
                                                                             density):
    """A packed block's rows (some empty, after rows the call leaves out), each row's tokens from column 0 or from an
    offset column on: each token's output is its row's softmax attention at its column's mask row."""
    generator = torch.Generator().manual_seed(seed)
    width = max(max(lengths), 1)
    width = min(width + (2 if offsets else 0), cpu_attention.MAX_QUERIES // groups)
    lengths = [min(length, width) for length in lengths]
    heads, batch = key_heads * groups, len(lengths)
    starts = [int(torch.randint(0, width - length + 1, (), generator=generator)) if offsets else 0
              for length in lengths]
    before = torch.randint(0, 5, (first_rows,), generator=generator).tolist()  # tokens of rows left out
    ends = torch.tensor(before + lengths).cumsum(0)
    first_token = int(sum(before))
    columns = torch.tensor([0] * first_token + [start + index for start, length in zip(starts, lengths)
                                               for index in range(length)], dtype=torch.long)
    tokens = int(ends[-1])
    query = torch.randn(1, tokens + 2, heads, dim, generator=generator).transpose(1, 2)[:, :, :tokens]
    key, value = (torch.randn(batch, key_heads, slots + 3, dim, generator=generator)[:, :, :slots] for _ in range(2))
    mask = torch.rand(batch, 1, width if mask_rows else 1, slots, generator=generator) < density
    assert cpu_attention.packed_row_attention_applies(query, key, value, mask, width)
    output = cpu_attention.packed_row_attention(query[:, :, first_token:], key, value, mask, ends[first_rows:],
                                                columns[first_token:], first_token, width, dim ** -0.5)
    assert output.shape == (tokens - first_token, heads, dim)
    # the same tokens unpacked to their rows and columns, through the float64 reference
    unpacked = torch.zeros(batch, heads, width, dim)
    token = first_token
    for row, (start, length) in enumerate(zip(starts, lengths)):
        unpacked[row, :, start : start + length] = query[0, :, token : token + length]
        token += length
    expected = reference(unpacked, key, value, mask.expand(batch, 1, width, -1), dim ** -0.5)  # (B, L, H, D)
    token = 0
    for row, (start, length) in enumerate(zip(starts, lengths)):
        torch.testing.assert_close(output[token : token + length].double(), expected[row, start : start + length],
                                   atol=2e-5, rtol=1e-4)
        token += length


def test_a_packed_block_is_attended_where_it_lies_with_the_padded_blocks_attention(monkeypatch):
    """packed_attention on grouped sdpa hands a verify block to the packed kernel (no unpacking), with the attention
    of the unpacked path."""
    from tetris_hf import packing as packing_module
    from tetris_hf.packing import Packing, packed_attention

    module = torch.nn.Module()
    module.num_key_value_groups = 3
    generator = torch.Generator().manual_seed(3)
    packing = Packing.of(torch.tensor([4, 1, 3, 2]), 10, 4)
    query = torch.randn(1, 10, 9, 16, generator=generator).transpose(1, 2)
    key, value = torch.randn(4, 3, 40, 16, generator=generator), torch.randn(4, 3, 40, 16, generator=generator)
    mask = torch.rand(4, 1, 4, 40, generator=generator) < 0.6
    calls = []
    kernel = packing_module.packed_row_attention
    monkeypatch.setattr(packing_module, "packed_row_attention", lambda *args: calls.append(1) or kernel(*args))
    output, _ = packed_attention(grouped_sdpa_attention, module, query, key, value, mask, packing, scaling=0.25)
    assert calls == [1] and output.shape == (1, 10, 9, 16)
    monkeypatch.setattr(packing_module, "packed_row_attention_applies", lambda *args: False)
    unpacked, _ = packed_attention(grouped_sdpa_attention, module, query, key, value, mask, packing, scaling=0.25)
    assert calls == [1]
    torch.testing.assert_close(output, unpacked, atol=1e-5, rtol=1e-4)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=5), heads=st.integers(1, 3), start=st.integers(0, 6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_a_packed_write_puts_each_token_where_scatter_heads_does(lengths, heads, start, dtype, seed):
    """The kernel's cache write (Packing.write on the CPU) leaves the buffers as two scatter_heads calls do: each
    token's keys and values at its row and slot, every other slot untouched."""
    from tetris_hf.packing import Packing

    generator = torch.Generator().manual_seed(seed)
    width = max(max(lengths), 1)
    packing = Packing.of(torch.tensor(lengths), sum(lengths), width)
    tokens = sum(lengths)
    states = [torch.randn(1, tokens, heads, 8, generator=generator).to(dtype).transpose(1, 2) for _ in range(2)]
    buffers = [torch.randn(len(lengths) + 1, heads, start + width + 2, 8, generator=generator).to(dtype)
               for _ in range(2)]
    expected = [buffer.clone() for buffer in buffers]
    packing.scatter_heads(expected[0][: len(lengths)], states[0], start)
    packing.scatter_heads(expected[1][: len(lengths)], states[1], start)
    assert cpu_attention.write_packed_applies(buffers[0], states[0])
    packing.write(buffers[0][: len(lengths)], buffers[1][: len(lengths)], *states, start)
    assert torch.equal(buffers[0], expected[0]) and torch.equal(buffers[1], expected[1])


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
    assert "building the row_attention kernel failed" in run.stderr and "stays on sdpa" in run.stderr
    assert list(tmp_path.rglob("*.so")) == []


def example_lines(example: str, *arguments: str, marker: str) -> list[str]:
    """The lines holding ``marker`` that ``examples/<example>`` prints with ``arguments`` (it must exit cleanly)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "examples" / example), *arguments], capture_output=True,
                         text=True, cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr
    return [line for line in run.stdout.splitlines() if marker in line]


def test_the_kernel_alone_example_checks_and_times_this_trees_kernel_beside_another_commits():
    """examples/attention_kernel_alone.py on small shapes: each kernel's output checked against float64 attention
    (the script raises otherwise), this tree's and HEAD's kernels and the cold sum timed for each shape."""
    lines = example_lines("attention_kernel_alone.py", "--contexts", "40,70", "--queries", "1,6", "--rows", "3",
                          "--layers", "2", "--repeats", "1", "--against", "HEAD", marker="keys:")
    assert len(lines) == 4 and all("this tree" in line and "HEAD" in line and "cold sum" in line for line in lines)


def causal_mask(lengths, slots):
    """``(R, 1, W, S)`` bool: row ``r``'s ``j``-th token sees slots ``0..j`` (a row's own prompt, nothing before)."""
    width = max(max(lengths), 1)
    return torch.ones(width, slots, dtype=torch.bool).tril()[None, None].expand(len(lengths), 1, width, slots)


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(0, 90), min_size=1, max_size=5).filter(any), key_heads=st.integers(1, 3),
       groups=st.sampled_from([1, 2, 3, 5, 13]), dim=st.sampled_from([64, 128]), extra_slots=st.integers(0, 40),
       seed=st.integers(0, 2**16))
def test_prompt_attention_equals_causal_softmax_attention(lengths, key_heads, groups, dim, extra_slots, seed):
    """Rows of prompts packed one after another (some empty), each over its own first keys of a wider cache (read in
    place): each token's output is its row's causal softmax attention, whatever the heads' grouping (13 query heads
    a key-value head: more than a tile's 12) and the rows' lengths (tiles cut across positions)."""
    generator = torch.Generator().manual_seed(seed)
    heads, slots = key_heads * groups, max(lengths) + extra_slots
    buffer = torch.randn(2, len(lengths) + 1, key_heads, slots + 3, dim, generator=generator)
    key, value = buffer[0, : len(lengths), :, :slots], buffer[1, 1:, :, :slots]
    query = torch.randn(1, sum(lengths), heads, dim, generator=generator).transpose(1, 2)
    assert cpu_attention.prompt_attention_applies(query, key, value)
    output = cpu_attention.prompt_attention(query, key, value, lengths, 0.1)
    assert output.shape == (sum(lengths), heads, dim)
    width, token = max(lengths), 0
    rows = query.new_zeros(len(lengths), heads, width, dim)
    for row, length in enumerate(lengths):
        rows[row, :, :length] = query[0, :, token : token + length]
        token += length
    expected = reference(rows, key, value, causal_mask(lengths, slots), 0.1)  # (R, W, H, D)
    expected = torch.cat([expected[row, :length] for row, length in enumerate(lengths)])
    torch.testing.assert_close(output.double(), expected, atol=2e-5, rtol=1e-4)


def test_a_prompt_rows_attention_depends_on_its_row_alone():
    """A row's outputs are the same bit for bit read alone or beside others, longer or shorter, before or after it
    (a tile never mixes rows): what keeps a request's tokens independent of the batch it joined."""
    generator = torch.Generator().manual_seed(3)
    lengths = (37, 150, 5)
    key, value = (torch.randn(3, 3, 160, 64, generator=generator) for _ in range(2))
    query = torch.randn(1, 9, sum(lengths), 64, generator=generator)
    together = cpu_attention.prompt_attention(query, key, value, lengths)
    token = 0
    for row, length in enumerate(lengths):
        alone = cpu_attention.prompt_attention(query[:, :, token : token + length].contiguous(), key[row : row + 1],
                                               value[row : row + 1], (length,))
        assert torch.equal(alone, together[token : token + length])
        token += length


@pytest.mark.parametrize("lengths, slots, tokens", [((5, 4, 1), 9, 10), ((10, 4), 9, 14), ((5, 4), 9, 8),
                                                    ((5, -1), 9, 4)])
def test_prompt_attention_refuses_lengths_that_do_not_fit(lengths, slots, tokens):
    """More rows than the keys hold, a row longer than its slots, lengths that do not sum to the queries: a clear
    error, never a read past the tensors."""
    key = torch.randn(2, 3, slots, 64)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_attention.prompt_attention(torch.randn(1, 9, tokens, 64), key, key, lengths)


def test_prompt_rows_attention_takes_the_kernel_where_it_applies(monkeypatch):
    """Causal prompt rows go to the kernel (fp32, heads of 64 or 128 dimensions); masked rows, heads of 80
    dimensions, and ``TETRIS_HF_CPU_KERNELS=0`` stay on sdpa row by row; each within rounding of the other."""
    calls = []
    kernel = cpu_attention.prompt_attention
    monkeypatch.setattr(attention, "prompt_attention", lambda *args: calls.append(1) or kernel(*args))
    generator = torch.Generator().manual_seed(4)
    lengths = (20, 0, 33)
    for dim, expected_calls in ((64, 1), (80, 1)):
        key, value = (torch.randn(3, 2, 40, dim, generator=generator) for _ in range(2))
        query = torch.randn(1, 6, sum(lengths), dim, generator=generator)
        output = attention.prompt_rows_attention(query, key, value, lengths, None, 33)
        assert len(calls) == expected_calls
        monkeypatch.setenv("TETRIS_HF_CPU_KERNELS", "0")
        on_sdpa = attention.prompt_rows_attention(query, key, value, lengths, None, 33)
        monkeypatch.delenv("TETRIS_HF_CPU_KERNELS")
        assert len(calls) == expected_calls
        torch.testing.assert_close(output, on_sdpa, atol=2e-6, rtol=1e-5)
        if dim == 64:  # (the same rows under a mask: sdpa)
            masked = attention.prompt_rows_attention(query, key, value, lengths, causal_mask(lengths, 40), 33)
            assert len(calls) == 1
            torch.testing.assert_close(output, masked, atol=2e-6, rtol=1e-5)


def test_the_prompt_attention_example_checks_and_times_both_paths():
    """examples/prompt_attention_alone.py on small shapes: both paths checked against float64 attention (the script
    raises otherwise) and timed for each case."""
    lines = example_lines("prompt_attention_alone.py", "--lengths", "20,45", "--rows", "2", "--layers", "2",
                          "--repeats", "1", "--heads", "4", "--key-heads", "2", marker="tokens)")
    assert len(lines) == 2 and all("sdpa row by row" in line and "kernel /" in line for line in lines)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_stream_on_heads_of_64_reads_prompts_on_the_kernel_and_equals_the_target_alone(compiled, monkeypatch):
    """A stream of a model whose heads have 64 dimensions (the kernel's width; the other tiny models' heads are
    narrower) reads its prompts on prompt_attention, first reads and prompts riding in later steps, compiled steps too
    (the slot op calls it), and every request's greedy tokens equal the target's alone."""
    import tetris_hf.attention as attention_module
    from test_stream import check_exact, requests
    from tetris_hf.stream import RequestStream
    from tiny_models import tiny_llama

    calls = []
    kernel = cpu_attention.prompt_attention
    monkeypatch.setattr(attention_module, "prompt_attention",
                        lambda query, key, value, lengths, *args: calls.append(tuple(lengths)) or
                        kernel(query, key, value, lengths, *args))
    target = tiny_llama(seed=5, hidden_size=256)  # (4 heads of 64)
    stream = RequestStream(target, max_batch_size=3, eos_token_id=None, tetris_strategy="fixed",
                           prompt_lookup_num_tokens=3, tetris_compile=compiled)
    check_exact(target, stream, requests(target, 8, seed=11, max_prompt=60))
    assert any(len(lengths) > 1 for lengths in calls)  # a first read of several prompts
    assert len(calls) > target.config.num_hidden_layers  # and later reads, of prompts that joined
