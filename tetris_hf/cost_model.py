"""What one speculative step costs on this machine (:class:`StepCostModel`, interpolating a measured
:class:`CostProfile`: :func:`cost_model_for`, :func:`measure_profile`, :func:`load_profile`), and how likely a drafted
cell is to be accepted (:class:`AcceptanceCalibrator`); they feed the ``adaptive`` and ``dsd`` strategies. Design:
docs/design.md, "The cost model and the budget".
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch

from .cpu_kernels import linear_kernels

PROFILE_FORMAT = "tetris-hf-cost-profile"
PROFILE_VERSION = 1


# ---------------------------------------------------------------------------------------------------------------
# Profiles: measured forward times


@dataclass
class CostProfile:
    """Measured forward times in milliseconds, on a KV cache."""

    target: dict[tuple[int, int], float]  # {(rows, tokens): ms}, one target forward over rows x tokens new tokens
    draft: dict[int, float]  # {rows: ms}, one draft forward over rows x 1 token (one proposed token per row)
    meta: dict = field(default_factory=dict)  # free-form: models, device, dtype, where the numbers came from

    def __post_init__(self):
        if not self.target:
            raise ValueError("a cost profile needs at least one target timing")
        if not self.draft:
            raise ValueError("a cost profile needs at least one draft timing")
        for (rows, tokens), ms in self.target.items():
            if rows < 1 or tokens < 1 or not ms > 0:
                raise ValueError(f"bad target timing rows={rows} tokens={tokens} ms={ms}")
        for rows, ms in self.draft.items():
            if rows < 1 or not ms > 0:
                raise ValueError(f"bad draft timing rows={rows} ms={ms}")

    def covers(self, rows: int, tokens: int) -> bool:
        """Whether the measured grid reaches ``rows`` and ``tokens`` (no extrapolation needed)."""
        target_rows, target_tokens = max(r for r, _ in self.target), max(t for _, t in self.target)
        return target_rows >= rows and target_tokens >= tokens and max(self.draft) >= rows

    def merged(self, other: "CostProfile") -> "CostProfile":
        """This profile with ``other``'s cells added (``other`` wins where both have a cell)."""
        return CostProfile({**self.target, **other.target}, {**self.draft, **other.draft}, {**self.meta, **other.meta})

    def to_dict(self) -> dict:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "meta": self.meta,
            "target": [{"rows": r, "tokens": t, "ms": round(ms, 4)} for (r, t), ms in sorted(self.target.items())],
            "draft": [{"rows": r, "ms": round(ms, 4)} for r, ms in sorted(self.draft.items())],
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "CostProfile":
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a {PROFILE_FORMAT} (format={data.get('format')!r})")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{PROFILE_FORMAT} version {data.get('version')!r} is not supported "
                             f"(need {PROFILE_VERSION})")
        try:
            target = {(int(c["rows"]), int(c["tokens"])): float(c["ms"]) for c in data["target"]}
            draft = {int(c["rows"]): float(c["ms"]) for c in data["draft"]}
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed {PROFILE_FORMAT}: {error!r}") from error
        return cls(target, draft, dict(data.get("meta", {})))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON (atomically: a concurrent reader sees the old file or the new one)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        with os.fdopen(handle, "w") as out:
            json.dump(self.to_dict(), out, indent=1)
        os.replace(staging, path)
        return path


def _curve_rows(data) -> list[dict]:
    rows = data["rows"] if isinstance(data, Mapping) and "rows" in data else data
    if not isinstance(rows, list) or not all(isinstance(row, Mapping) for row in rows):
        raise ValueError("a curve file is a JSON list of {model|layers, B, L, ms} rows, or {'rows': [...]}")
    return rows


def _curve_id(row: Mapping) -> str:
    if "model" in row:
        return str(row["model"])
    if "layers" in row:
        return f"layers={row['layers']}"
    raise ValueError(f"curve row {dict(row)} names no model (a 'model' or 'layers' key)")


def curve_models(rows: list[dict]) -> dict[str, str]:
    """The models of a curve file's rows and their role guess: ``{id: "target" | "draft"}``.

    A model timed at more than one token per row (``L > 1``) is a target, one timed at ``L = 1`` only a draft.
    """
    roles: dict[str, str] = {}
    for row in rows:
        model = _curve_id(row)
        roles[model] = "target" if int(row["L"]) > 1 or roles.get(model) == "target" else "draft"
    return roles


def profile_from_curve(path: str | os.PathLike, target: str | None = None, draft: str | None = None) -> CostProfile:
    """A profile from a curve file of forward times: a list of rows like ``{"model": "target8b-bf16", "B": 32, "L": 4,
    "ms": 31.5}`` (or ``"layers": 30`` for the model, read as ``"layers=30"``), or ``{"rows": [...]}``.

    Args:
        path: the curve file.
        target: the model id to use as the target (default: the first one timed at ``L > 1``).
        draft: the model id to use as the draft (default: the first one timed at ``L = 1`` only).
    """
    path = Path(path)
    try:
        rows = _curve_rows(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read curve file {path}: {error}") from error
    roles = curve_models(rows)
    target = target or next((m for m, role in roles.items() if role == "target"), None)
    draft = draft or next((m for m, role in roles.items() if role == "draft"), None)
    for name, value in (("target", target), ("draft", draft)):
        if value is None or value not in roles:
            raise ValueError(f"curve {path.name}: no {name} model {value!r}; it has {sorted(roles)}")
    target_ms: dict[tuple[int, int], list[float]] = {}
    draft_ms: dict[int, list[float]] = {}
    for row in rows:
        model, rows_b, tokens, ms = _curve_id(row), int(row["B"]), int(row["L"]), float(row["ms"])
        if model == target:
            target_ms.setdefault((rows_b, tokens), []).append(ms)
        if model == draft and tokens == 1:
            draft_ms.setdefault(rows_b, []).append(ms)
    return CostProfile({cell: statistics.median(v) for cell, v in target_ms.items()},
                       {cell: statistics.median(v) for cell, v in draft_ms.items()},
                       {"source": f"curve {path.name}", "target": target, "draft": draft})


def load_profile(source: "str | os.PathLike | Mapping | CostProfile") -> CostProfile:
    """A profile from a :class:`CostProfile`, its dict form, a JSON file of either format (a saved profile or a curve
    file), or ``"CURVE.json:TARGET:DRAFT"`` to pick a curve file's models."""
    if isinstance(source, CostProfile):
        return source
    if isinstance(source, Mapping):
        return CostProfile.from_dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"a cost profile is a path, a dict or a CostProfile, got {type(source).__name__}")
    text = os.fspath(source)
    path, target, draft = Path(text), None, None
    if not path.is_file() and ":" in text:
        head, *names = text.split(":")
        path, target, draft = Path(head), (names + [None, None])[0] or None, (names + [None, None])[1] or None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read cost profile {text}: {error}") from error
    if isinstance(data, Mapping) and data.get("format") == PROFILE_FORMAT:
        return CostProfile.from_dict(data)
    return profile_from_curve(path, target, draft)


# ---------------------------------------------------------------------------------------------------------------
# The cost model: a monotone, piecewise-linear interpolation of a profile


def _isotonic(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight = blocks.pop()
            blocks[-1] = [(blocks[-1][0] * blocks[-1][1] + mean * weight) / (blocks[-1][1] + weight),
                          blocks[-1][1] + weight]
    return [mean for mean, weight in blocks for _ in range(int(weight))]


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through ``(xs, ys)`` (xs increasing); beyond the ends, the end segment's slope (never
    negative), or flat with one point."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    index = 1
    while index < len(xs) - 1 and x > xs[index]:
        index += 1
    x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
    slope = max((y1 - y0) / (x1 - x0), 0.0) if x > x1 else (y1 - y0) / (x1 - x0)
    return y0 + slope * (x - x0)


class StepCostModel:
    """Seconds of one speculative step: a monotone, piecewise-linear interpolation of a :class:`CostProfile`.

    Args:
        profile: the measurements.
        draft_scale, target_scale: multiply the profile's times (online corrections a strategy updates).
        step_overhead: seconds added to every step (what the loop spends outside the two forwards).
        packed: price a verification by the tokens it computes (every row's last token and the cells verified), not
            by a rectangle padded to the deepest row.
    """

    def __init__(self, profile: CostProfile, *, draft_scale: float = 1.0, target_scale: float = 1.0,
                 step_overhead: float = 0.0, packed: bool = False):
        self.profile = profile
        self.packed = packed
        self._packed_ms: dict[tuple[int, int], torch.Tensor] = {}  # verify_prices' tables, by rows and drafts
        self.draft_scale, self.target_scale, self.step_overhead = draft_scale, target_scale, step_overhead
        self.rows = sorted({r for r, _ in profile.target})
        self.tokens = sorted({t for _, t in profile.target})
        grid = []
        for rows in self.rows:
            have = sorted((t, ms) for (r, t), ms in profile.target.items() if r == rows)
            xs, ys = [t for t, _ in have], [ms for _, ms in have]
            grid.append(_isotonic([_interpolate(xs, ys, t) for t in self.tokens]))
        columns = [_isotonic([grid[i][j] for i in range(len(self.rows))]) for j in range(len(self.tokens))]
        grid = [[columns[j][i] for j in range(len(self.tokens))] for i in range(len(self.rows))]
        for i in range(len(self.rows)):  # running max keeps both directions monotone after the two fits
            for j in range(len(self.tokens)):
                grid[i][j] = max(grid[i][j], grid[i - 1][j] if i else 0.0, grid[i][j - 1] if j else 0.0)
        self._target_grid = grid
        self.draft_rows = sorted(profile.draft)
        self._draft_ms = _isotonic([profile.draft[r] for r in self.draft_rows])

    def draft_seconds(self, rows: int) -> float:
        """One draft forward over ``rows`` x 1 token: the cost of drafting one more token in every row."""
        return self.draft_scale * _interpolate(self.draft_rows, self._draft_ms, rows) / 1000.0

    def verify_seconds(self, rows: int, tokens: float) -> float:
        """One target forward over ``rows`` x ``tokens`` (``tokens = 1 + max verified drafts``; 1 = plain step)."""
        return self.target_scale * self._target_ms(rows, tokens) / 1000.0

    def _target_ms(self, rows: int, tokens: float) -> float:
        per_row = [_interpolate(self.tokens, line, tokens) for line in self._target_grid]
        return _interpolate(self.rows, per_row, rows)

    def verify_seconds_by_length(self, rows: int, max_drafts: int) -> torch.Tensor:
        """``(max_drafts + 1,)``: entry ``l`` is a padded verification forward where the longest row checks ``l``
        drafts."""
        return torch.tensor([self.verify_seconds(rows, l + 1) for l in range(max_drafts + 1)], dtype=torch.float64)

    def verify_prices(self, rows: int, max_drafts: int) -> torch.Tensor:
        """A verification's seconds as the goodput optimisers index them (:mod:`tetris_hf.goodput`): packed,
        ``(rows x max_drafts + 1,)`` by the cells verified over all rows; padded, ``(max_drafts + 1,)`` by the most
        one row verifies (:meth:`verify_seconds_by_length`)."""
        if not self.packed:
            return self.verify_seconds_by_length(rows, max_drafts)
        key = (rows, max_drafts)
        if key not in self._packed_ms:  # (asked for at every step: kept, the learnt scale applied after)
            self._packed_ms[key] = torch.tensor([self._target_ms(rows, 1 + cells / rows)
                                                 for cells in range(rows * max_drafts + 1)], dtype=torch.float64)
        return self.target_scale * self._packed_ms[key] / 1000.0

    def verify_step_seconds(self, rows: int, max_verified: int, total_verified: int) -> float:
        """One verification forward that checks ``total_verified`` cells over ``rows`` rows, at most ``max_verified``
        in one row: packed, ``rows + total_verified`` tokens; padded, ``rows x (1 + max_verified)``."""
        tokens = 1 + total_verified / rows if self.packed else max_verified + 1
        return self.verify_seconds(rows, tokens)

    def step_seconds(self, rows: int, num_drafted: int, max_verified: int, total_verified: int | None = None) -> float:
        """A whole step: ``num_drafted`` draft forwards, one verification (``total_verified`` cells, every row
        ``max_verified`` when not given), the per-step overhead."""
        total = rows * max_verified if total_verified is None else total_verified
        return num_drafted * self.draft_seconds(rows) + self.verify_step_seconds(rows, max_verified, total) + \
            self.step_overhead


# ---------------------------------------------------------------------------------------------------------------
# Measuring a profile on the real models


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _feature_inputs(model, input_ids: torch.Tensor) -> dict:
    """What a draft that reads features (an EAGLE head) takes besides tokens, to time it: zero features of its own
    width, as a drafted step reads them."""
    if getattr(model, "feature_kind", None) is None:
        return {}
    hidden = model.config.hidden_size
    return {"draft_features": torch.zeros(*input_ids.shape, hidden, dtype=model.dtype, device=input_ids.device)}


def _timed_forwards(model, rows: int, tokens_list: Sequence[int], context: int, repeats: int,
                    logits_to_keep: int = 0) -> dict[int, float]:
    """``{L: ms}``, the fastest of ``repeats`` forwards over ``rows`` x ``L`` new tokens on a ``context``-token KV
    cache, for each ``L`` in ``tokens_list``."""
    from transformers import DynamicCache

    device = _model_device(model)
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(rows)
    prompt = torch.randint(min(3, vocab - 1), vocab, (rows, context), generator=generator).to(device)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1,
              **_feature_inputs(model, prompt))
        results = {}
        for tokens in tokens_list:
            block = torch.randint(min(3, vocab - 1), vocab, (rows, tokens), generator=generator).to(device)
            mask = torch.ones(rows, context + tokens, dtype=torch.long, device=device)
            positions = torch.arange(context, context + tokens, device=device).expand(rows, tokens)
            times = []
            warm_up = not results  # the first forward over these rows is a warm-up
            for attempt in range(repeats + warm_up):
                _sync(device)
                start = time.perf_counter()
                out = model(input_ids=block, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=logits_to_keep, **_feature_inputs(model, block))
                out.logits.float().log_softmax(dim=-1)  # the loop turns every kept logit row into log-probs
                _sync(device)
                if attempt or not warm_up:
                    times.append((time.perf_counter() - start) * 1000.0)
                cache.crop(-tokens)  # back to the context-token cache
            results[tokens] = round(min(times), 4)
    return results


LOOKUP_DRAFT_MS = 0.01  # prompt lookup's draft "forward": a few tensor operations, near zero next to a forward


def measure_profile(model: torch.nn.Module, assistant_model: torch.nn.Module | None, *, rows: Sequence[int],
                    tokens: Sequence[int], context: int = 32, repeats: int = 2,
                    skip: CostProfile | None = None) -> CostProfile:
    """Time the target over ``rows`` x ``tokens`` and the draft over ``rows`` x 1 on real KV caches, the fastest of
    ``repeats`` after a warm-up (``assistant_model=None``: prompt lookup, priced :data:`LOOKUP_DRAFT_MS`); cells
    already in ``skip`` are not measured again."""
    target, draft = {}, {}
    for r in sorted(set(rows)):
        missing = [t for t in sorted(set(tokens)) if skip is None or (r, t) not in skip.target]
        if missing:
            target.update({(r, t): ms for t, ms in _timed_forwards(model, r, missing, context, repeats).items()})
        if skip is None or r not in skip.draft:
            draft[r] = (LOOKUP_DRAFT_MS if assistant_model is None
                        else _timed_forwards(assistant_model, r, [1], context, repeats, logits_to_keep=1)[1])
    if skip is not None:
        return skip.merged(CostProfile(target or dict(skip.target), draft or dict(skip.draft)))
    device = _model_device(model)
    meta = {
        "source": "measured",
        "target": _model_name(model),
        "draft": "prompt lookup" if assistant_model is None else _model_name(assistant_model),
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype),
        "threads": torch.get_num_threads(),
        "context": context,
    }
    return CostProfile(target, draft, meta)


def profile_grid(num_rows: int, max_tokens: int) -> tuple[list[int], list[int]]:
    """Rows ``{1, 4, 16, 64, ...} below num_rows, and num_rows``; tokens ``{1, 2, 4, 8, ...} below max_tokens, and
    max_tokens``: the grid :func:`cost_model_for` measures."""
    rows = [r for r in (1, 4, 16, 64, 256, 1024) if r < num_rows] + [num_rows]
    tokens = [t for t in (1, 2, 4, 8, 16, 32) if t < max_tokens] + [max_tokens]
    return rows, tokens


def _model_name(model) -> str:
    return str(getattr(model.config, "name_or_path", "") or type(model).__name__)


def _config_hash(model) -> str:
    return hashlib.sha1(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]


def profile_key(model: torch.nn.Module, assistant_model: torch.nn.Module | None) -> str:
    """What a measured profile depends on: both architectures (``None``: prompt lookup), device, dtype, torch version,
    CPU threads and the linear layers' kernels (:func:`~tetris_hf.cpu_kernels.linear_kernels`)."""
    parts = [
        _config_hash(model), "prompt-lookup" if assistant_model is None else _config_hash(assistant_model),
        str(_model_device(model)),
        str(next(model.parameters()).dtype), torch.__version__, str(torch.get_num_threads()),
    ]
    kernels = [linear_kernels(part) for part in (model, assistant_model) if part is not None]
    if any(kernel != "aten" for kernel in kernels):  # (keys of profiles measured before kernels were told apart stay)
        parts.append("linears:" + ",".join(kernels))
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    """tetris_hf's cache folder: ``$TETRIS_HF_CACHE`` or ``~/.cache/tetris_hf`` (cost profiles, converted models)."""
    root = os.environ.get("TETRIS_HF_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tetris_hf"


def profile_cache_dir() -> Path:
    """``$TETRIS_HF_CACHE/cost-profiles`` (default ``~/.cache/tetris_hf/cost-profiles``)."""
    return cache_dir() / "cost-profiles"


_MEMORY_CACHE: dict[str, CostProfile] = {}


def cost_model_for(model: torch.nn.Module, assistant_model: torch.nn.Module | None, *, num_rows: int, max_tokens: int,
                   source: "str | os.PathLike | Mapping | CostProfile | None" = None,
                   use_disk: bool = True, packed: bool = False) -> StepCostModel:
    """The cost model of this pair (``packed``: see :class:`StepCostModel`): from ``source`` when given, else measured
    once and cached in memory and (``use_disk``) under :func:`profile_cache_dir`; a cached profile short of
    ``num_rows`` or ``max_tokens`` is extended by measuring the missing cells."""
    if source is not None:
        return StepCostModel(load_profile(source), packed=packed)
    key = profile_key(model, assistant_model)
    profile = _MEMORY_CACHE.get(key)
    disk_path = profile_cache_dir() / f"{key}.json"
    if profile is None and use_disk and disk_path.is_file():
        try:
            profile = load_profile(disk_path)
        except (ValueError, TypeError):
            profile = None  # unreadable: measure again and overwrite it
    if profile is None or not profile.covers(num_rows, max_tokens):
        rows, tokens = profile_grid(num_rows, max_tokens)
        if profile is not None:
            rows = sorted(set(rows) | {r for r, _ in profile.target})
            tokens = sorted(set(tokens) | {t for _, t in profile.target})
        started = time.perf_counter()
        profile = measure_profile(model, assistant_model, rows=rows, tokens=tokens, skip=profile)
        profile.meta["seconds"] = round(profile.meta.get("seconds", 0.0) + time.perf_counter() - started, 3)
        if use_disk:
            try:
                profile.save(disk_path)
            except OSError:
                pass  # a read-only home: the memory cache still holds it
    _MEMORY_CACHE[key] = profile
    return StepCostModel(profile, packed=packed)


def clear_memory_cache() -> None:
    """Forget the profiles measured in this process (the disk cache stays)."""
    _MEMORY_CACHE.clear()


# ---------------------------------------------------------------------------------------------------------------
# Acceptance calibration


class AcceptanceCalibrator:
    """``P(cell accepted | the cells before it in its row were accepted)`` as a function of the cell's draft
    probability ``q``, learnt online: a Beta posterior per bin of ``q``, prior mean the bin's centre.

    Args:
        num_bins: equal bins of ``q`` on [0, 1].
        prior_strength: pseudo-observations per bin.
        memory: cells after which an observation's weight has decayed by ``e`` (``None``: never forget).
    """

    def __init__(self, num_bins: int = 10, prior_strength: float = 4.0, memory: float | None = 20000.0):
        if num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins}")
        self.num_bins = num_bins
        self.centres = (torch.arange(num_bins, dtype=torch.float64) + 0.5) / num_bins
        self.prior_accepted = prior_strength * self.centres
        self.prior_rejected = prior_strength * (1 - self.centres)
        self.accepted = torch.zeros(num_bins, dtype=torch.float64)
        self.rejected = torch.zeros(num_bins, dtype=torch.float64)
        self.memory = memory

    def bins(self, probs: torch.Tensor) -> torch.Tensor:
        """The bin of each draft probability in ``probs`` (any shape), long."""
        return (probs.double().clamp(0, 1) * self.num_bins).long().clamp(max=self.num_bins - 1)

    def means(self) -> torch.Tensor:
        """``(num_bins,)`` posterior mean acceptance per bin."""
        return (self.prior_accepted + self.accepted) / (
            self.prior_accepted + self.prior_rejected + self.accepted + self.rejected
        )

    def upper_bounds(self, optimism: float) -> torch.Tensor:
        """``(num_bins,)`` posterior mean plus ``optimism`` standard deviations per bin, at most 1."""
        alpha, beta = self.prior_accepted + self.accepted, self.prior_rejected + self.rejected
        total = alpha + beta
        spread = (alpha * beta / (total * total * (total + 1))).sqrt()
        return (alpha / total + optimism * spread).clamp(max=1.0)

    def predict(self, probs: torch.Tensor, optimism: float = 0.0) -> torch.Tensor:
        """Acceptance probability of cells with draft probabilities ``probs`` (any shape; float64 result),
        interpolated between bin centres; with ``optimism > 0``, its upper confidence bound (:meth:`upper_bounds`)."""
        means = self.upper_bounds(optimism) if optimism else self.means()
        position = (probs.double().clamp(0, 1) * self.num_bins - 0.5).clamp(0, self.num_bins - 1)
        low = position.floor().long()
        high = (low + 1).clamp(max=self.num_bins - 1)
        weight = position - low
        return means[low] * (1 - weight) + means[high] * weight

    def update_cells(self, probs: torch.Tensor, accepted: torch.Tensor) -> None:
        """Count observed cells: ``probs`` and ``accepted`` (bool) of the same shape, each a cell whose earlier cells
        were accepted."""
        probs, accepted = probs.flatten(), accepted.flatten().bool()
        if probs.numel() == 0:
            return
        if self.memory is not None:
            fade = math.exp(-probs.numel() / self.memory)
            self.accepted *= fade
            self.rejected *= fade
        bins = self.bins(probs)
        ones = torch.ones_like(bins, dtype=torch.float64)
        self.accepted.index_add_(0, bins[accepted], ones[accepted])
        self.rejected.index_add_(0, bins[~accepted], ones[~accepted])

    def update(self, token_log_probs: torch.Tensor, verify_lengths: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Learn from one verification step.

        Args:
            token_log_probs: ``(B, K)`` ``log q`` of each drafted cell.
            verify_lengths: ``(B,)`` cells each row verified.
            num_accepted: ``(B,)`` cells accepted before the first rejection: they count as accepted, the next
                verified one as rejected; later cells say nothing.
        """
        if token_log_probs.numel() == 0:
            return
        positions = torch.arange(token_log_probs.shape[1], device=token_log_probs.device)[None, :]
        accepted = positions < num_accepted[:, None]
        rejected = (positions == num_accepted[:, None]) & (num_accepted < verify_lengths)[:, None]
        seen = accepted | rejected
        self.update_cells(token_log_probs.exp()[seen].cpu(), accepted[seen].cpu())
