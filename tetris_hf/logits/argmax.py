"""The index of each row's largest score over a vocabulary, as ``torch.argmax`` finds it, through NumPy's vectorised
``argmax`` for CPU float tensors (why: docs/development.md, "Why NumPy's argmax on the CPU").
"""

from __future__ import annotations

import torch

NUMPY_DTYPES = (torch.float32, torch.float64)  # what the loop's scores are (processed scores are float32)


def vocab_argmax(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(dim=-1)``: the first index of the maximum (NaN counts as the largest, as in torch).

    Args:
        scores: ``(..., V)``.

    Returns:
        ``(...)`` long indices in ``[0, V)``, on ``scores``' device.
    """
    if scores.is_cpu and scores.dtype in NUMPY_DTYPES and not scores.requires_grad:
        return torch.from_numpy(scores.numpy().argmax(axis=-1))
    return scores.argmax(dim=-1)
