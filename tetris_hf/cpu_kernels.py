"""Faster linear layers on the CPU: the same weights, multiplied by our panel kernel (a few rows) or oneDNN's (many)
instead of MKL's ``sgemm``.

:func:`use_onednn_linears` switches a model's ``nn.Linear`` layers to :class:`OneDNNLinear` in place (the same
parameters, tied weights still tied, the same ``state_dict``); :func:`restore_linears` switches them back. Apply it to
every system a benchmark compares. An fp32 layer keeps a copy of its weight in panels (:func:`panel_weight`) and
multiplies up to :data:`PANEL_ROWS` rows with :func:`panel_linear` (the C kernel of
:mod:`tetris_hf.panel_linear_source`, built at first use), more with oneDNN on the weight itself; where no kernel can
be built (no C compiler), or ``TETRIS_HF_CPU_KERNELS=0`` (read at each call: a copy is remade when it changes), and for
bf16, the copy is oneDNN's reordered weight. ``torch.compile`` traces a switched model too: inside a compiled graph
each product is one opaque op (:func:`onednn_linear`), the graph fusing what lies between them. Measurements:
docs/benchmarks.md, "oneDNN linear layers on the CPU" and "A linear kernel for few rows".
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .kernel_build import built, switched_on
from .ops import define
from .panel_linear_source import SOURCE

PANEL_ROWS = 256  # rows (tokens) a product multiplies on the panels at most; more: oneDNN (docs/benchmarks.md)
LANES = 16  # outputs a panel holds (the C source's LANES)


@functools.cache
def _library() -> Optional[ctypes.CDLL]:
    """The built panel kernel, its ``panel_linear`` typed; ``None`` where it cannot be built."""
    library = built("panel_linear", SOURCE, "linear layers stay on oneDNN's kernel")
    if library is None:
        return None
    loaded = ctypes.CDLL(str(library))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    loaded.panel_linear.argtypes = [pointer, size, size, pointer, size, size, pointer, pointer, size, ctypes.c_int]
    loaded.panel_linear.restype = None
    return loaded


def panels_available() -> bool:
    """Whether :func:`panel_linear` runs here: not switched off (``TETRIS_HF_CPU_KERNELS=0``) and the kernel built."""
    return switched_on() and _library() is not None


def panel_weight(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight ``(N, K)`` in the panel kernel's layout: ``(ceil(N / 16), K, 16)``, panel ``p`` row ``k`` holding
    ``weight[16 p .. 16 p + 15, k]`` (zeros past ``N``)."""
    outputs, inputs = weight.shape
    count = -(-outputs // LANES)
    padded = weight if outputs == count * LANES else F.pad(weight, (0, 0, 0, count * LANES - outputs))
    return padded.reshape(count, LANES, inputs).transpose(1, 2).contiguous()


def panel_linear(input: torch.Tensor, panels: torch.Tensor, bias: Optional[torch.Tensor],
                 out_features: int) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` on ``panels = panel_weight(weight)``: ``input`` ``(..., K)`` fp32 -> ``(...,
    out_features)``. Every output is the same sum, in the same order, whatever the rows beside it."""
    rows = input.reshape(-1, input.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    output = rows.new_empty(rows.shape[0], out_features)
    if rows.shape[0]:
        bias = None if bias is None else bias.contiguous()
        _library().panel_linear(rows.data_ptr(), rows.shape[0], rows.stride(0), panels.data_ptr(), out_features,
                                rows.shape[1], None if bias is None else bias.data_ptr(), output.data_ptr(),
                                out_features, torch.get_num_threads())
    return output.view(*input.shape[:-1], out_features)


def _onednn_product(input: torch.Tensor, weight: torch.Tensor, kernel_weight: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``(..., in) -> (..., out)``: on panels (``kernel_weight`` 3D, :func:`panel_weight`) the panel kernel up to
    :data:`PANEL_ROWS` rows, oneDNN's product on ``weight`` past them; else oneDNN's product on ``kernel_weight``
    (``weight`` reordered, or ``weight``), a single row on MKL's. :class:`OneDNNLinear`'s forward as one op that
    ``torch.compile`` calls without tracing into (its tracer fails on ``mkldnn._linear_pointwise``)."""
    if kernel_weight.dim() == 3:
        if input.numel() <= PANEL_ROWS * input.shape[-1] and input.dtype == torch.float32:
            return panel_linear(input, kernel_weight, bias, weight.shape[0])
        return torch.ops.mkldnn._linear_pointwise(input, weight, bias, "none", [], "")
    if input.numel() == input.shape[-1]:  # one row
        return F.linear(input, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(input, kernel_weight, bias, "none", [], "")


onednn_linear = define("onednn_linear(Tensor input, Tensor weight, Tensor kernel_weight, Tensor? bias) -> Tensor",
                       _onednn_product,
                       lambda input, weight, kernel_weight, bias: input.new_empty(*input.shape[:-1], weight.shape[0]))


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` multiplied by faster CPU kernels: ``(..., in) -> (..., out)``, as ``F.linear``. An fp32
    weight is multiplied from a copy (as much memory again) made once and again whenever the weight changes: in
    panels for our kernel (up to :data:`PANEL_ROWS` rows; more rows: oneDNN on the weight), or, where that kernel
    cannot run, in oneDNN's blocked layout (a single row then on ``F.linear``, MKL's kernel). The weight stays the
    parameter."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque op on the copy made before the call (compiled.py)
            packed = self.__dict__.get("_onednn_packed")
            return onednn_linear(input, self.weight, self.weight if packed is None else packed[1], self.bias)
        return _onednn_product(input, self.weight, self._kernel_weight(), self.bias)

    def _kernel_weight(self) -> torch.Tensor:
        """The copy of an fp32 weight the kernels read (made on first use and whenever the weight changed, or the
        kernel to read it): panels (:func:`panel_weight`) where the panel kernel runs, else oneDNN's reordered weight;
        the weight itself for other dtypes or where a gradient is wanted."""
        weight = self.weight
        if weight.dtype != torch.float32 or (weight.requires_grad and torch.is_grad_enabled()):
            return weight
        panels = panels_available() and (self.bias is None or self.bias.dtype == torch.float32)
        key = (weight.data_ptr(), weight._version, panels)
        packed = self.__dict__.get("_onednn_packed")
        if packed is None or packed[0] != key:
            with torch.no_grad():
                # (oneDNN's 16: the rows it picks the layout for; a block of any other row count reads the same copy)
                copy = panel_weight(weight) if panels else torch.ops.mkldnn._reorder_linear_weight(weight, 16)
                packed = self.__dict__["_onednn_packed"] = (key, copy)
        return packed[1]


def onednn_available() -> bool:
    """Whether this PyTorch build runs oneDNN's linear kernel on the CPU."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def use_onednn_linears(model: nn.Module) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` (fp32 or bf16 weights, on the CPU) to :class:`OneDNNLinear`, in
    place; returns how many were switched. Layers of other classes (quantized, LoRA, ...) stay as they are.

    Raises:
        ValueError: the model has no layer on the CPU to switch, or this build has no oneDNN.
    """
    if not onednn_available():
        raise ValueError("this PyTorch build has no oneDNN (torch.backends.mkldnn.is_available() is False): "
                         "use the model as it is")
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and \
                module.weight.dtype in (torch.float32, torch.bfloat16):
            module.__class__ = OneDNNLinear
            switched += 1
    if switched == 0:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer with fp32 or bf16 weights on the CPU to "
                         f"switch to oneDNN")
    return switched


def linear_kernels(model: nn.Module) -> str:
    """``"panels"`` if some linear layer of ``model`` is switched (:func:`use_onednn_linears`) and the panel kernel
    runs, ``"onednn-packed"`` if switched and it does not, else ``"aten"``: what a measured cost profile depends on."""
    if not any(type(module) is OneDNNLinear for module in model.modules()):
        return "aten"
    return "panels" if panels_available() else "onednn-packed"


def restore_linears(model: nn.Module) -> int:
    """Switch :class:`OneDNNLinear` layers back to ``nn.Linear``; returns how many."""
    restored = 0
    for module in model.modules():
        if type(module) is OneDNNLinear:
            module.__dict__.pop("_onednn_packed", None)
            module.__class__ = nn.Linear
            restored += 1
    return restored
