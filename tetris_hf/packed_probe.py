"""Whether a model reads packed blocks exactly (:func:`packs_exactly`): a short block read both ways on the model
itself, packed and padded, once per model. Design: docs/design.md, "Packed steps".
"""

from __future__ import annotations

import weakref

import torch

from .attention import AttentionLayout
from .kv import SlotCache

_answers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> bool

PROMPT = [[1, 2], [3, 4]]
BLOCK, REAL_LENGTHS = [[5, 6, 7], [8, 1, 1]], [3, 1]  # row 1: one real token, then filler


def packs_exactly(model: torch.nn.Module) -> bool:
    """``model`` reads packed blocks (``(1, N)``, :mod:`tetris_hf.packing`) with the logits of a padded read: checked
    once on a probe of two rows (a 2-token prompt each, then blocks of 3 and 1 real tokens), to ``1e-4`` of the logits'
    scale in fp32 and ``5e-2`` in half precision; any error in the packed read is a no."""
    if model in _answers:
        return _answers[model]
    layout = AttentionLayout.of(model)
    answer = layout.prepared and _probe(model)
    _answers[model] = answer
    return answer


class _Unhooked:
    """``model`` called through its ``forward`` (accelerate's placement wrapper included), so that hooks the user put on
    the model itself do not see the probe; attributes as the model's."""

    def __init__(self, model: torch.nn.Module):
        self._model = model

    def __call__(self, **kwargs):
        return self._model.forward(**kwargs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


@torch.no_grad()
def _probe(model: torch.nn.Module) -> bool:
    device = model.get_input_embeddings().weight.device
    prompt, block = torch.tensor(PROMPT, device=device), torch.tensor(BLOCK, device=device)
    real_lengths = torch.tensor(REAL_LENGTHS, device=device)
    # an EAGLE head reads features too: it is called with features made from its tokens (the same in both reads)
    probe_forward = getattr(model, "probe_forward", None)
    num_ids = 1 + max(max(row) for row in PROMPT + BLOCK)
    forward = probe_forward(num_ids) if callable(probe_forward) else _Unhooked(model)
    logits = []
    for pack in (False, True):
        cache = SlotCache(2, device, capacity=8)
        cache.pack = pack
        cache.forward(forward, prompt, None)
        try:
            logits.append(cache.forward(forward, block, None, step=True, real_lengths=real_lengths,
                                        num_real=int(sum(REAL_LENGTHS))))
        except (RuntimeError, ValueError, IndexError):  # e.g. attention computed inline on mismatched shapes
            return False
    real = torch.arange(block.shape[1], device=device)[None, :] < real_lengths[:, None]
    padded, packed = (part.float()[real] for part in logits)
    finite = padded.isfinite()  # (a head's reduced vocabulary: -inf outside it)
    scale = padded[finite].abs().max().clamp(min=1.0)
    tolerance = (1e-4 if model.dtype == torch.float32 else 5e-2) * scale
    return torch.equal(finite, packed.isfinite()) and bool((padded[finite] - packed[finite]).abs().max() <= tolerance)
