"""The panel linear kernel (tetris_hf/panel_linear_source.py, called by tetris_hf/cpu_kernels.py): what ``F.linear``
computes, for any shape; a row's outputs the same whatever rows share its call; switched fp32 layers reading it at
every row count, and oneDNN where it is switched off."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tetris_hf import cpu_kernels
from tetris_hf.cpu_kernels import panel_linear, panel_weight, panels_available, use_onednn_linears

pytestmark = pytest.mark.skipif(not panels_available(), reason="no C compiler to build the panel kernel")


@settings(max_examples=80, deadline=None)
@given(outputs=st.integers(1, 80), inputs=st.integers(1, 70), rows=st.integers(0, 40) | st.integers(230, 500),
       lead=st.integers(1, 3), with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_panels_compute_what_linear_computes(outputs, inputs, rows, lead, with_bias, seed):
    """Any output count (a last block part empty, one block or several), any input count, 0 to 40 rows (one tile up
    to 12, tiles of equal heights past) or 230 to 500 (spans of 240 rows, the last one short), leading dimensions
    kept, with and without a bias."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(outputs, inputs, generator=generator)
    bias = torch.randn(outputs, generator=generator) if with_bias else None
    x = torch.randn(lead, rows, inputs, generator=generator)
    y = panel_linear(x, panel_weight(weight), bias, outputs)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert y.shape == expected.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, atol=1e-4 * inputs ** 0.5, rtol=1e-4)


@settings(max_examples=30, deadline=None)
@given(outputs=st.integers(1, 70), rows=st.lists(st.integers(1, 60) | st.integers(230, 300), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(outputs, rows, seed):
    """Bitwise: the first ``n`` rows of a call give what they give alone, whatever tiles and spans the call cuts."""
    generator = torch.Generator().manual_seed(seed)
    weight, x = torch.randn(outputs, 48, generator=generator), torch.randn(max(rows), 48, generator=generator)
    panels = panel_weight(weight)
    whole = panel_linear(x, panels, None, outputs)
    for count in rows:
        assert torch.equal(panel_linear(x[:count], panels, None, outputs), whole[:count])


def test_the_panel_layout_is_blocks_of_thirty_two_outputs_zero_past_the_last():
    weight = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    panels = panel_weight(weight)
    assert panels.shape == (2, 3, 32)
    assert torch.equal(panels[0], weight[:32].T) and torch.equal(panels[1, :, :8], weight[32:].T)
    assert not panels[1, :, 8:].any()
    stacked = panel_weight(weight[:20], weight)  # (each weight's blocks its own: 1 + 2)
    assert stacked.shape == (3, 3, 32) and torch.equal(stacked[1:], panels)
    assert torch.equal(stacked[0, :, :20], weight[:20].T) and not stacked[0, :, 20:].any()


def test_a_switched_layer_reads_panels_at_every_row_count(monkeypatch):
    layer = torch.nn.Linear(40, 24)
    use_onednn_linears(layer)
    calls = []
    monkeypatch.setattr(cpu_kernels, "panel_linear", lambda *args: calls.append(args[0].shape) or panel_linear(*args))
    with torch.no_grad():
        for rows in (1, 16, 257, 3000):
            x = torch.randn(rows, 40)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert layer._kernel_weight().shape == (1, 40, 32)
    assert calls == [(1, 40), (16, 40), (257, 40), (3000, 40)]
    assert cpu_kernels.linear_kernels(layer) == "panels"


def test_switched_off_the_copy_is_onednns_and_the_layer_says_so(tmp_path):
    """``TETRIS_HF_CPU_KERNELS=0`` (and, the same path, no compiler): oneDNN's reordered copy, no panel kernel built."""
    script = """
import torch
from tetris_hf import cpu_kernels
layer = torch.nn.Linear(40, 24)
cpu_kernels.use_onednn_linears(layer)
x = torch.randn(5, 40)
with torch.no_grad():
    same = torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
    print(cpu_kernels.linear_kernels(layer), layer._kernel_weight().dim(), same)
"""
    environment = {**os.environ, "TETRIS_HF_CPU_KERNELS": "0", "TETRIS_HF_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["onednn-packed", "2", "True"]
    assert list(tmp_path.rglob("*.so")) == []


def test_the_kernel_alone_example_checks_and_times_each_kernel():
    """examples/panel_linear_alone.py on small shapes: each kernel's output checked against float64 (the script
    exits otherwise), each timed for each shape and row count."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "panel_linear_alone.py"
    run = subprocess.run([sys.executable, str(script), "--rows", "3,20", "--shapes", "40x24,17x8", "--layers", "2",
                          "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if "rows:" in line]
    assert len(lines) == 4
    assert all(all(name in line for name in ("panels", "oneDNN reordered", "oneDNN on the weight")) for line in lines)
