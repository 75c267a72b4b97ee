# Exported from tetris_hf/logits/argmax.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""The index of each row's largest score over a vocabulary, as ``torch.argmax`` finds it, cheaper on the CPU.

torch's CPU ``argmax`` is not vectorised, and the loop takes several vocabulary-wide argmaxes a step (each greedy
draft token, every verified position). NumPy's ``argmax`` is vectorised and follows the same rules (the first maximum;
NaN counts as the largest), so CPU float tensors go through it on a zero-copy view (the measured difference is in
``docs/development.md``). Other devices and dtypes NumPy lacks (bfloat16) take ``torch.argmax``.
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
