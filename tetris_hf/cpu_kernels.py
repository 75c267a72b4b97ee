"""oneDNN linear layers on CPU: the same weights, multiplied by oneDNN's kernels instead of MKL's ``sgemm``.

:func:`use_onednn_linears` switches a model's ``nn.Linear`` layers to :class:`OneDNNLinear` in place (the same
parameters, tied weights still tied, the same ``state_dict``); :func:`restore_linears` switches them back. Apply it to
every system a benchmark compares. ``torch.compile`` traces a switched model too: inside a compiled graph each product
is one opaque op (:func:`onednn_linear`), the graph fusing what lies between them. Measurements: docs/benchmarks.md,
"oneDNN linear layers on the CPU".
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .ops import define


def _onednn_product(input: torch.Tensor, weight: torch.Tensor, kernel_weight: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``(..., in) -> (..., out)``: oneDNN's product on ``kernel_weight`` (``weight`` reordered, or ``weight``), a
    single row on MKL's; :class:`OneDNNLinear`'s forward as one op that ``torch.compile`` calls without tracing into
    (its tracer fails on ``mkldnn._linear_pointwise``)."""
    if input.numel() == input.shape[-1]:  # one row
        return F.linear(input, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(input, kernel_weight, bias, "none", [], "")


onednn_linear = define("onednn_linear(Tensor input, Tensor weight, Tensor kernel_weight, Tensor? bias) -> Tensor",
                       _onednn_product,
                       lambda input, weight, kernel_weight, bias: input.new_empty(*input.shape[:-1], weight.shape[0]))


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is oneDNN's (``torch.ops.mkldnn._linear_pointwise``): ``(..., in) -> (...,
    out)``, as ``F.linear``. An fp32 weight is multiplied in oneDNN's blocked layout, a copy (as much memory again)
    reordered once and again whenever the weight changes; the weight stays the parameter. A single row goes to
    ``F.linear`` (MKL's kernel)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque op on the copy made before the call (compiled.py)
            packed = self.__dict__.get("_onednn_packed")
            return onednn_linear(input, self.weight, self.weight if packed is None else packed[1], self.bias)
        if input.numel() == input.shape[-1]:  # one row
            return F.linear(input, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(input, self._kernel_weight(), self.bias, "none", [], "")

    def _kernel_weight(self) -> torch.Tensor:
        """The reordered copy of an fp32 weight (made on first use and whenever the weight changed), else the weight."""
        weight = self.weight
        if weight.dtype != torch.float32 or (weight.requires_grad and torch.is_grad_enabled()):
            return weight
        key = (weight.data_ptr(), weight._version)
        packed = self.__dict__.get("_onednn_packed")
        if packed is None or packed[0] != key:
            with torch.no_grad():
                # (16: the rows oneDNN picks the layout for; a block of any other row count reads the same copy)
                packed = self.__dict__["_onednn_packed"] = (key, torch.ops.mkldnn._reorder_linear_weight(weight, 16))
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
    """``"onednn-packed"`` if some linear layer of ``model`` runs oneDNN's kernel (:func:`use_onednn_linears`), else
    ``"aten"``: what a measured cost profile depends on."""
    return "onednn-packed" if any(type(module) is OneDNNLinear for module in model.modules()) else "aten"


def restore_linears(model: nn.Module) -> int:
    """Switch :class:`OneDNNLinear` layers back to ``nn.Linear``; returns how many."""
    restored = 0
    for module in model.modules():
        if type(module) is OneDNNLinear:
            module.__dict__.pop("_onednn_packed", None)
            module.__class__ = nn.Linear
            restored += 1
    return restored
