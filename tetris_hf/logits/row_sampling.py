"""Each row's own temperature, top-k and top-p (a request stream's per-request sampling settings), applied as
transformers' temperature, top-k and top-p warpers are, in that order (:class:`RowSamplingWarper`). The draft's
distribution goes through the same warper, so verification stays lossless per request.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessor

KEEP_ALL = 0  # top_k that keeps every token


class RowSamplingWarper(LogitsProcessor):
    """Temperature, top-k and top-p per row, ``(num_rows,)`` each; :meth:`set_row` changes one row's.

    Args:
        num_rows: rows (lanes) of the batch.
        temperature, top_k, top_p: every row's values until set (``top_k`` 0 or ``None`` and ``top_p`` 1.0: off).
        device: where the values live.
    """

    def __init__(self, num_rows: int, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
                 device: torch.device | str = "cpu"):
        self.defaults = check_sampling(temperature, top_k, top_p)
        temperature, top_k, top_p = self.defaults
        self.temperature = torch.full((num_rows,), temperature, device=device)
        self.top_k = torch.full((num_rows,), top_k, dtype=torch.long, device=device)
        self.top_p = torch.full((num_rows,), top_p, device=device)
        self._host = [(temperature, top_k, top_p)] * num_rows  # the same, on the host: which filters any row uses

    def set_row(self, row: int, temperature: float | None = None, top_k: int | None = None,
                top_p: float | None = None) -> None:
        """Row ``row``'s settings; those not given take the defaults."""
        default_temperature, default_top_k, default_top_p = self.defaults
        temperature, top_k, top_p = check_sampling(default_temperature if temperature is None else temperature,
                                                   default_top_k if top_k is None else top_k,
                                                   default_top_p if top_p is None else top_p)
        self.temperature[row], self.top_k[row], self.top_p[row] = temperature, top_k, top_p
        self._host[row] = (temperature, top_k, top_p)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """transformers' interface: ``scores`` ``(B, V)`` of rows ``0 .. B - 1``."""
        rows = torch.arange(scores.shape[0], device=scores.device)
        return self.apply(rows, scores[:, None])[:, 0]

    def apply(self, rows: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` ``(B, L, V)`` of rows ``rows`` ``(B,)``: divided by each row's temperature, then everything
        below its ``k``-th best and outside its top-``p`` set at ``-inf``."""
        scores = scores / self.temperature[rows][:, None, None]
        if any(top_k != KEEP_ALL for _, top_k, _ in self._host):
            top_k = self.top_k[rows].clamp(max=scores.shape[-1])
            # top-k: what lies below the k-th best (ties kept, as transformers' threshold keeps them); k = 0 keeps all
            best_first = scores.sort(dim=-1, descending=True).values
            kth = best_first.gather(-1, (top_k - 1).clamp(min=0)[:, None, None].expand(-1, scores.shape[1], 1))
            scores = scores.masked_fill((scores < kth) & (top_k > 0)[:, None, None], float("-inf"))
        if all(top_p == 1.0 for _, _, top_p in self._host):
            return scores
        # top-p, as transformers: ascending sort, drop the tokens whose cumulative probability stays <= 1 - p, keep
        # the best one always
        sorted_scores, order = scores.sort(dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - self.top_p[rows])[:, None, None]
        drop[..., -1] = False
        return scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def check_sampling(temperature, top_k, top_p) -> tuple[float, int, float]:
    """Validated ``(temperature, top_k, top_p)``, ``top_k`` ``None`` as 0 (keep all); a ``ValueError`` names the bad
    one."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    top_k = KEEP_ALL if top_k is None else top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: keep every token), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return float(temperature), int(top_k), float(top_p)
