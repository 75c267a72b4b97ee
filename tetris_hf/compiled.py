"""``tetris_compile=True``: the target's verify forward and the draft's one-token step through ``torch.compile``
(:func:`compiled_forward`; on CUDA as CUDA graphs, on the shapes of :mod:`tetris_hf.static_shapes`; on the CPU the
target's forwards on their eager shapes, :func:`eager_shapes_forward`), and what it refuses
(:func:`check_compilable`). Design and measurements: docs/gpu.md, "The compiled path".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .attention import AttentionLayout
from .cpu_kernels import refresh_kernel_weights
from .ops import define

_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, Callable]" = weakref.WeakKeyDictionary()
_ON_EAGER_SHAPES: "weakref.WeakKeyDictionary[torch.nn.Module, Callable]" = weakref.WeakKeyDictionary()


computed_once = define("computed_once(Tensor x) -> Tensor", lambda x: x.clone(), torch.empty_like)


class TrigOnce(CustomGraphPass):
    """An inductor pass (after autograd's) that makes each ``cos`` and ``sin`` a buffer of its own, computed once per
    forward: ``y = computed_once(cos(x))``, an op inductor does not see into, its result read by every consumer.
    Inductor's CPU backend inlines a pointwise producer into each consumer unless its code holds an op it counts as
    heavy (``exp``, ``log``, ``tanh``, not ``cos`` or ``sin``): a rotary embedding's table, computed once by the model,
    was recomputed in every layer's kernel for every query and key element (measured: docs/benchmarks.md, "Rotary
    tables computed once"). Only where they are computed moves: the values stay within a rounding of eager's, as a
    compiled kernel's already were."""

    TRIG = (torch.ops.aten.cos.default, torch.ops.aten.sin.default)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in self.TRIG or not node.users:
                continue
            with graph.inserting_after(node):
                once = graph.call_function(computed_once, (node,))
            once.meta.update(node.meta)
            node.replace_all_uses_with(once, delete_user_cb=lambda user: user is not once)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


CPU_OPTIONS = {"post_grad_custom_post_pass": TrigOnce()}  # inductor's options for a compiled forward on the CPU


def check_compilable(model: torch.nn.Module, role: str) -> None:
    """Refuse ``tetris_compile=True`` for a model it cannot serve, naming why and what to do instead."""
    if getattr(model, "is_quantized", False) or getattr(model.config, "quantization_config", None) is not None:
        raise ValueError(f"tetris_compile=True: the {role} is quantized ({type(model).__name__} with a "
                         "quantization_config); torch.compile does not trace its kernels. Use tetris_compile=False")
    placement = set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))
    offloaded = placement & {"cpu", "disk"}
    if offloaded and len(placement) > 1:
        raise ValueError(f"tetris_compile=True: the {role} is offloaded to {sorted(offloaded)} by accelerate, whose "
                         "hooks move weights during the forward. Use tetris_compile=False or place it on one device")


DYNAMIC = False  # static shapes: one specialised graph per shape (why: docs/gpu.md)
# on the CPU, a target's compiled forwards keep the eager shapes where they can (compiles_on_eager_shapes)
CPU_ON_EAGER_SHAPES = True


def compiles_on_eager_shapes(model: torch.nn.Module, packs: bool) -> bool:
    """Whether ``tetris_compile=True`` compiles ``model``'s forwards on the shapes as they come
    (:func:`eager_shapes_forward`: packed blocks, each layer's cache write and attention one opaque op) rather than on
    static shapes (:func:`compiled_forward`): on the CPU, where no CUDA graph needs static shapes and padding costs what
    a real token costs, for a model that reads packed (``packs``) on a plain sdpa layout (docs/gpu.md, "The compiled
    path")."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    return CPU_ON_EAGER_SHAPES and on_cpu and packs and AttentionLayout.of(model).plain_sdpa


def compiled_forward(model: torch.nn.Module) -> Callable:
    """``model.forward`` compiled for the loop's step forwards (one compilation per model, kept while it lives)."""
    if model not in _COMPILED:
        # every transformers forward shares one decorator code object, whose compiled variants (target, draft, batch
        # sizes) count against one dynamo cache: 8 by default, past which it silently runs eager
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        on_cuda = next(model.parameters()).is_cuda
        static = AttentionLayout.of(model).prepared  # (else the 2D mask: shapes as they come)
        compiled = torch.compile(model.forward, dynamic=DYNAMIC if static else True,
                                 **({"mode": "reduce-overhead"} if on_cuda else {"options": CPU_OPTIONS}))
        _COMPILED[model] = _refreshing_kernels(model, compiled)
    return _COMPILED[model]


def eager_shapes_forward(model: torch.nn.Module) -> Callable:
    """``model.forward`` compiled on dynamic shapes for the forwards of a target's cache whose attention layers run the
    slot op (:mod:`tetris_hf.slot_attention`: the cache's write and attention opaque, every block read packed), one
    compilation per model, kept while it lives."""
    if model not in _ON_EAGER_SHAPES:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        compiled = torch.compile(model.forward, dynamic=True, options=CPU_OPTIONS)

        def forward(*args, **kwargs):
            # sizes that happen to be equal stay apart (the block and the cache of a first read, say), and a size of
            # 1 is not a graph's constant (one row left, one token kept): else a graph per coincidence
            with torch.fx.experimental._config.patch(use_duck_shape=False, backed_size_oblivious=True):
                return compiled(*args, **kwargs)

        _ON_EAGER_SHAPES[model] = _refreshing_kernels(model, forward)
    return _ON_EAGER_SHAPES[model]


def _refreshing_kernels(model: torch.nn.Module, compiled: Callable) -> Callable:
    """``compiled``, refreshing the copies of the weights ``model``'s oneDNN layers multiply from before each call
    (made, or remade if a weight changed: a graph reads them as they are); ``compiled`` itself for a model without
    such layers."""
    refresh = refresh_kernel_weights(model)
    if refresh is None:
        return compiled

    def refreshed(*args, **kwargs):
        refresh()
        return compiled(*args, **kwargs)

    return refreshed
