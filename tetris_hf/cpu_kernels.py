"""Faster linear layers on the CPU: the same weights, multiplied by our panel kernel (fp32) or oneDNN's instead of
MKL's ``sgemm``.

:func:`use_onednn_linears` switches a model's ``nn.Linear`` layers to :class:`OneDNNLinear` in place (the same
parameters, tied weights still tied, the same ``state_dict``); :func:`restore_linears` switches them back. Apply it to
every system a benchmark compares. An fp32 layer keeps a copy of its weight in panels (:func:`panel_weight`) and
multiplies any number of rows with :func:`panel_linear` (the C kernel of :mod:`tetris_hf.panel_linear_source`, built at
first use): a row's outputs are the same whether it is read in a prompt of 3,000 tokens or in a decode step of one.
Where no kernel can be built (no C compiler), or ``TETRIS_HF_CPU_KERNELS=0`` (read at each call: a copy is remade when
it changes), and for bf16, the copy is oneDNN's reordered weight. ``torch.compile`` traces a switched model too: inside
a compiled graph each product is one opaque op (:func:`onednn_linear`), the graph fusing what lies between them. A
module's layers that read one input (its q/k/v, its gate/up) multiply in one call (:class:`SiblingLinears`).
Measurements: docs/benchmarks.md, "oneDNN linear layers on the CPU", "A linear kernel for few rows", "Sibling
projections in one call, and what did not pay" and "One linear kernel for every row count".
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .kernel_build import built, switched_on
from .ops import define
from .panel_linear_source import SOURCE

STACKED_ROWS = 16  # rows SiblingLinears multiply in one call at most; more: each layer alone (docs/benchmarks.md)
WIDTH = 32  # outputs a block of panels holds (the C source's WIDTH)


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
    loaded.panel_linear_parts.argtypes = [pointer, size, size, pointer, size, pointer, ctypes.c_int, pointer, pointer,
                                          pointer, ctypes.c_int]
    loaded.panel_linear_parts.restype = None
    return loaded


def panels_available() -> bool:
    """Whether :func:`panel_linear` runs here: not switched off (``TETRIS_HF_CPU_KERNELS=0``) and the kernel built."""
    return switched_on() and _library() is not None


def panel_weight(*weights: torch.Tensor) -> torch.Tensor:
    """fp32 weights ``(N_i, K)`` in the panel kernel's layout, one after another: each ``(ceil(N_i / 32), K, 32)``,
    block ``p`` row ``k`` holding ``weight[32 p .. 32 p + 31, k]`` (zeros past ``N_i``)."""
    blocks = []
    for weight in weights:
        outputs, inputs = weight.shape
        count = -(-outputs // WIDTH)
        padded = weight if outputs == count * WIDTH else F.pad(weight, (0, 0, 0, count * WIDTH - outputs))
        blocks.append(padded.reshape(count, WIDTH, inputs).transpose(1, 2))
    return torch.cat(blocks)  # (a new, contiguous tensor, one weight or several)


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


def panel_linear_parts(input: torch.Tensor, panels: torch.Tensor, bias: Optional[torch.Tensor],
                       sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """:func:`panel_linear` of several weights at once (``panels = panel_weight(*weights)``, ``weights[i]`` ``sizes[i]``
    outputs), each part's outputs in a tensor of its own: ``input`` ``(..., K)`` fp32 -> ``[(..., sizes[0]), (...,
    sizes[1]), ...]``. Each output the same sum as :func:`panel_linear`'s of that part's weight alone."""
    rows = input.reshape(-1, input.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    outputs = [rows.new_empty(rows.shape[0], size) for size in sizes]
    if rows.shape[0]:
        bias = None if bias is None else bias.contiguous()
        count = len(sizes)
        first = (ctypes.c_int64 * (count + 1))(*itertools.accumulate(sizes, initial=0))
        places = (ctypes.c_void_p * count)(*(output.data_ptr() for output in outputs))
        strides = (ctypes.c_int64 * count)(*sizes)
        _library().panel_linear_parts(rows.data_ptr(), rows.shape[0], rows.stride(0), panels.data_ptr(), rows.shape[1],
                                      None if bias is None else bias.data_ptr(), count, first, places, strides,
                                      torch.get_num_threads())
    return [output.view(*input.shape[:-1], size) for output, size in zip(outputs, sizes)]


def _onednn_product(input: torch.Tensor, weight: torch.Tensor, kernel_weight: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``(..., in) -> (..., out)``: on panels (``kernel_weight`` 3D, :func:`panel_weight`) the panel kernel, every row
    count (an input of another dtype: oneDNN's product on ``weight``); else oneDNN's product on ``kernel_weight``
    (``weight`` reordered, or ``weight``), a single row on MKL's. :class:`OneDNNLinear`'s forward as one op that
    ``torch.compile`` calls without tracing into (its tracer fails on ``mkldnn._linear_pointwise``)."""
    if kernel_weight.dim() == 3:
        if input.dtype == torch.float32:
            return panel_linear(input, kernel_weight, bias, weight.shape[0])
        return torch.ops.mkldnn._linear_pointwise(input, weight, bias, "none", [], "")
    if input.numel() == input.shape[-1]:  # one row
        return F.linear(input, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(input, kernel_weight, bias, "none", [], "")


onednn_linear = define("onednn_linear(Tensor input, Tensor weight, Tensor kernel_weight, Tensor? bias) -> Tensor",
                       _onednn_product,
                       lambda input, weight, kernel_weight, bias: input.new_empty(*input.shape[:-1], weight.shape[0]))


def _sibling_products(input: torch.Tensor, weights: list[torch.Tensor], panels: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """The products of layers that read one input, ``(..., K)`` -> ``[(..., N_0), (..., N_1), ...]``: up to
    :data:`STACKED_ROWS` rows one call of the panel kernel on ``panels`` (:func:`panel_weight` of the stacked
    ``weights``; ``bias`` the stacked biases or ``None``); more, each layer's own :func:`_onednn_product` (its panels
    a slice of the stacked ones). :class:`SiblingLinears`' product as one op that ``torch.compile`` calls as it is."""
    sizes = [weight.shape[0] for weight in weights]
    if input.numel() <= STACKED_ROWS * input.shape[-1]:
        return panel_linear_parts(input, panels, bias, tuple(sizes))
    biases = [None] * len(weights) if bias is None else bias.split(sizes)
    firsts = itertools.accumulate((-(-size // WIDTH) for size in sizes), initial=0)
    return [_onednn_product(input, weight, panels[first:], part)
            for weight, first, part in zip(weights, firsts, biases)]


sibling_linears = define("sibling_linears(Tensor input, Tensor[] weights, Tensor panels, Tensor? bias) -> Tensor[]",
                         _sibling_products,
                         lambda input, weights, panels, bias: [input.new_empty(*input.shape[:-1], weight.shape[0])
                                                               for weight in weights])

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # a module's linear layers that read one input


class SiblingLinears:
    """A module's :class:`OneDNNLinear` layers that read one input (an attention's query, key and value projections,
    an MLP's gate and up), multiplied in one call (:func:`sibling_linears`): up to :data:`STACKED_ROWS` rows the panel
    kernel over their stacked weights (a copy in place of each layer's own), each layer's outputs in a tensor of its
    own, every output the same sum as the layer's own product. The model's code still calls each layer: the first to
    be called multiplies for all of them and keeps the others' outputs, with the input, until each takes its own
    (:meth:`output`); they hold memory only between those calls. Layers seen reading different inputs (a
    cross-attention's keys read the encoder's states: a layer called on another input than the one its output waits
    for, or two rounds in a row whose outputs a layer never took) multiply alone from then on (:attr:`apart`). A
    decode step makes 90 fewer products in SmolLM2-135M; past :data:`STACKED_ROWS` rows each layer multiplies alone
    inside the op (stacked there, whole runs lost 3%). Measurements: docs/benchmarks.md, "Sibling projections in one
    call, and what did not pay".

    Args:
        layers: the layers, in the order their outputs are stacked; the same input size, fp32 weights on the CPU,
            all with a bias or none.
    """

    def __init__(self, layers: list[OneDNNLinear]):
        self.layers = tuple(layers)
        self.everyone = (1 << len(layers)) - 1  # a bit per layer
        self.waiting: tuple | None = None  # (input, its version, outputs, bits of the layers yet to take theirs)
        self.apart = False
        self.unclaimed = 0  # rounds in a row ended with some layer's output not taken
        self.packed: tuple | None = None  # (weights' key, stacked panels, stacked bias): kernel_weights()

    def kernel_weights(self) -> bool:
        """Make the stacked copy the call reads (again if a weight changed, dropped where the panel kernel does not
        run); whether the layers multiply together."""
        layers = self.layers
        if self.apart or not panels_available() or (any(layer.weight.requires_grad for layer in layers) and
                                                      torch.is_grad_enabled()):
            self.packed = None
            return False
        key = tuple((layer.weight.data_ptr(), layer.weight._version) +
                    (() if layer.bias is None else (layer.bias.data_ptr(), layer.bias._version)) for layer in layers)
        if self.packed is None or self.packed[0] != key:
            with torch.no_grad():
                bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
                self.packed = (key, panel_weight(*(layer.weight for layer in layers)), bias)
        return True

    def output(self, index: int, input: torch.Tensor) -> torch.Tensor | None:
        """Layer ``index``'s product of ``input`` ``(..., K)``, from the group's call (made now if no output waits for
        it); ``None`` where it multiplies alone (the layers apart, or a compiled forward traced without the copy)."""
        if self.apart or input.dtype != torch.float32 or input.device.type != "cpu":
            return None
        compiling = torch.compiler.is_compiling()
        version = 0 if compiling else input._version  # (a traced graph's tensors are not written in place)
        bit = 1 << index
        waiting = self.waiting
        if waiting is not None and waiting[0] is input and waiting[1] == version and waiting[3] & bit:
            outputs, left = waiting[2], waiting[3] & ~bit
        else:
            if waiting is not None:  # a round some layer did not take its output of
                self.unclaimed += 1
                if waiting[3] & bit or self.unclaimed > 1:  # (this layer's output waits for another input)
                    self.waiting, self.apart, self.packed = None, True, None
                    return None
                self.waiting = None
            if not (self.packed is not None if compiling else self.kernel_weights()):
                return None
            _, panels, bias = self.packed
            outputs = tuple(sibling_linears(input, [layer.weight for layer in self.layers], panels, bias))
            left = self.everyone & ~bit
        if left:
            self.waiting = (input, version, outputs, left)
        else:
            self.waiting = None
            if self.unclaimed:
                self.unclaimed = 0
        return outputs[index]


def group_siblings(model: nn.Module) -> int:
    """Make each module's :data:`SIBLINGS` (its :class:`OneDNNLinear` layers reading one input) a
    :class:`SiblingLinears`; returns how many groups. Layers that cannot share a call stay apart (other input sizes,
    dtypes or devices, a bias on some only, a shared weight)."""
    groups = 0
    for module in model.modules():
        for names in SIBLINGS:
            layers = [getattr(module, name, None) for name in names]
            if not all(type(layer) is OneDNNLinear and "_siblings" not in layer.__dict__ for layer in layers):
                continue
            first = layers[0]
            if any(layer.in_features != first.in_features or layer.weight.dtype != torch.float32 or
                   layer.weight.device.type != "cpu" or (layer.bias is None) != (first.bias is None)
                   for layer in layers) or len({layer.weight.data_ptr() for layer in layers}) < len(layers):
                continue
            group = SiblingLinears(layers)
            for index, layer in enumerate(layers):
                layer.__dict__["_siblings"] = (group, index)
                layer.__dict__.pop("_onednn_packed", None)
            groups += 1
    return groups


def sibling_groups(model: nn.Module) -> list[SiblingLinears]:
    """``model``'s :class:`SiblingLinears`, each once."""
    return list({id(siblings[0]): siblings[0] for siblings in (module.__dict__.get("_siblings")
                                                               for module in model.modules()) if siblings}.values())


def refresh_kernel_weights(model: nn.Module) -> Callable[[], None] | None:
    """A function that makes (or remakes, where a weight changed) the copies ``model``'s switched layers multiply
    from, as a compiled forward reads them (it cannot make them itself); ``None`` for a model without such layers."""
    switched = [module for module in model.modules() if type(module) is OneDNNLinear]
    if not switched:
        return None
    groups = sibling_groups(model)
    alone = [module for module in switched if "_siblings" not in module.__dict__]
    made_for = [None]  # what the copies were last made (or found current) for: weights_state()
    holders = [module._parameters for module in switched]  # (a weight set anew lands in its module's dict)

    def weights_state() -> tuple:
        """Every switched layer's weight and bias (memory and version), the groups apart, whether the panel kernel
        runs and a gradient is wanted: the copies stay current while it does not change (a forward's check, a
        fraction of going through every layer's)."""
        parameters = [(held["weight"], held["bias"]) for held in holders]  # (the modules' own dicts: fast)
        return (panels_available(), torch.is_grad_enabled(), [group.apart for group in groups],
                [(weight.data_ptr(), weight._version, None if bias is None else (bias.data_ptr(), bias._version))
                 for weight, bias in parameters])

    def refresh() -> None:
        state = weights_state()
        if state == made_for[0]:
            return
        for group in groups:
            if not group.kernel_weights():  # (apart, or no panel kernel: each layer its own copy)
                for layer in group.layers:
                    layer._kernel_weight()
        for module in alone:
            module._kernel_weight()
        made_for[0] = state

    return refresh


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` multiplied by faster CPU kernels: ``(..., in) -> (..., out)``, as ``F.linear``. An fp32
    weight is multiplied from a copy (as much memory again) made once and again whenever the weight changes: in panels
    for our kernel (every row count), or, where that kernel cannot run, in oneDNN's blocked layout (a single row then
    on ``F.linear``, MKL's kernel). The weight stays the parameter."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        siblings = self.__dict__.get("_siblings")
        if siblings is not None:  # (one call for this layer and those reading the same input: SiblingLinears)
            output = siblings[0].output(siblings[1], input)
            if output is not None:
                return output
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


def use_onednn_linears(model: nn.Module, siblings: bool = True) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` (fp32 or bf16 weights, on the CPU) to :class:`OneDNNLinear`, in
    place; returns how many were switched. Layers of other classes (quantized, LoRA, ...) stay as they are.
    ``siblings``: a module's layers that read one input (:data:`SIBLINGS`) multiply in one call
    (:class:`SiblingLinears`; ``False``: each alone).

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
    if siblings:
        group_siblings(model)
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
            module.__dict__.pop("_siblings", None)
            module.__class__ = nn.Linear
            restored += 1
    return restored
