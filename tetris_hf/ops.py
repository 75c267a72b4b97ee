"""The package's own operators (``torch.ops.tetris_hf.*``), which ``torch.compile`` calls without tracing into:
:func:`define` registers one once per process, its kernel a Python function behind the dispatcher's fast path (a few
microseconds a call; ``torch.library.custom_op``'s wrappers cost about 30, too much for an op called 211 times a step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARY = torch.library.Library("tetris_hf", "FRAGMENT")  # (kept alive: registrations die with their library)


def define(schema: str, kernel: Callable, shape: Callable) -> Callable:
    """Register ``tetris_hf::<schema>`` (e.g. ``"scale(Tensor x, float factor) -> Tensor"``; ``Tensor(a!)`` marks an
    argument the kernel writes) with ``kernel`` for every device and ``shape`` as its fake (the output's shape,
    for tracing); returns the operator. A second copy of this package in the process (a Hub folder's) finds it
    defined and takes it as it is: the same code."""
    name = schema[: schema.index("(")]
    if not hasattr(torch.ops.tetris_hf, name):
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"tetris_hf::{name}", shape, lib=_LIBRARY)
    return getattr(torch.ops.tetris_hf, name).default
