"""Optimal multi-draft acceptance (Hu et al., ICLR 2025, arXiv 2502.18779) and the verifiers it bounds.

Setting: target distribution ``p`` and draft distribution ``q`` over a vocabulary of ``V`` tokens, ``n`` drafts per
position. A lossless verifier couples the draft tuple ``X`` with its output ``Y ~ p``; its acceptance is
``P(Y in X)``. The best acceptance over all verifiers is

    alpha*(p, q, n) = 1 + min_H [ p(H) - Q(H^n) ] = min_H [ p(H) + P(some draft falls outside H) ],

and the minimising ``H`` is a prefix of the vocabulary sorted by ascending ``p/q`` (``q = 0`` tokens last), so the
bound is a sort plus ``V + 1`` evaluations of ``P(some draft outside H_k)``.

Contents, in order: the bound (:func:`optimal_acceptance`, :func:`greedy_acceptance`); the closed-form acceptance of
each verifier (:func:`single_draft_acceptance`, :func:`rrs_acceptance`, :func:`kseq_acceptance`); the verifiers as
samplers (:func:`verify_single`, :func:`verify_rrs`, :func:`verify_kseq`, :func:`verify_greedy_construction`), which
draw their own drafts and return ``(token, accepted)`` with ``accepted`` meaning "the output is one of the drafts".

Shapes: ``p`` and ``q`` are ``(..., V)``; closed forms return ``(...)`` float64; samplers take one position, ``(V,)``.
"""

from __future__ import annotations

import math
from itertools import combinations

import torch
from torch import Tensor

from ..logits.verification import residual_distribution

__all__ = [
    "optimal_acceptance",
    "greedy_acceptance",
    "single_draft_acceptance",
    "rrs_acceptance",
    "rrs_acceptance_method",
    "kseq_acceptance",
    "kseq_rho",
    "verify_single",
    "verify_rrs",
    "verify_kseq",
    "verify_greedy_construction",
]

_SUM_TOLERANCE = 1e-3  # how far from 1 an input distribution may sum before we refuse it (it is renormalised)
_SERIES_TOLERANCE = 1e-17  # truncation error of the light-token series in the without-replacement bound
_ENUMERATION_BUDGET = 2_000_000  # V**n above which RRS without replacement switches to Monte Carlo
_ROWS_ELEMENTS = 1 << 18  # rows * V processed at once by the without-replacement bound (memory cap)


# ----------------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------------


def _check_distribution(name: str, x: Tensor) -> Tensor:
    """A ``(..., V)`` probability tensor as float64, renormalised; ValueError naming ``name`` if it is not one."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of probabilities, got {type(x).__name__}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name} must have shape (..., V) with V >= 1, got {tuple(x.shape)}")
    x = x.detach().to(torch.float64)
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} has non-finite entries")
    if (x < 0).any():
        raise ValueError(f"{name} has negative probabilities (min {x.min().item():.3g})")
    total = x.sum(-1, keepdim=True)
    if ((total - 1).abs() > _SUM_TOLERANCE).any():
        worst = total.flatten()[(total - 1).abs().flatten().argmax()].item()
        raise ValueError(f"{name} must sum to 1 over its last dimension (a row sums to {worst:.6g})")
    return x / total


def _check_n(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1 (number of drafts), got {n!r}")
    return n


def _check_pair(p: Tensor, q: Tensor, n: int, *, distinct_drafts: bool) -> tuple[Tensor, Tensor, int]:
    """Validated float64 ``p, q`` of equal shape ``(..., V)`` and ``n``.

    ``distinct_drafts``: the drafts are ``n`` distinct tokens of q's support, so q needs at least ``n`` of them.
    """
    p, q, n = _check_distribution("p", p), _check_distribution("q", q), _check_n(n)
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape (..., V), got {tuple(p.shape)} and {tuple(q.shape)}")
    if distinct_drafts:
        support = int((q > 0).sum(-1).min())
        if support < n:
            raise ValueError(f"q must put mass on at least n={n} tokens for n distinct drafts (a row has {support})")
    return p, q, n


# ----------------------------------------------------------------------------------------------------------------
# The bound
# ----------------------------------------------------------------------------------------------------------------


def _prefix_order(p: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """``p`` and ``q`` ``(B, V)`` permuted into ascending ``p/q`` order, tokens with ``q = 0`` last."""
    ratio = torch.where(q > 0, p / q, torch.full_like(p, math.inf))
    order = ratio.argsort(dim=-1, stable=True)
    return p.gather(-1, order), q.gather(-1, order)


def _with_zero_first(x: Tensor) -> Tensor:
    """``(B, V)`` running sums -> ``(B, V + 1)`` with the empty prefix in front."""
    return torch.cat([x.new_zeros(x.shape[0], 1), x], dim=-1)


def _mass_outside_prefixes(q_sorted: Tensor) -> Tensor:
    """``c_k = q(S minus H_k)`` for ``k = 0..V``: ``(B, V + 1)``, summed from the small end (no cancellation)."""
    suffix = q_sorted.flip(-1).cumsum(-1).flip(-1)
    return torch.cat([suffix, suffix.new_zeros(suffix.shape[0], 1)], dim=-1)


def _iid_miss_probability(q_sorted: Tensor, n: int) -> Tensor:
    """``P(some of n i.i.d. drafts falls outside H_k) = 1 - q(H_k)^n`` for every prefix: ``(B, V) -> (B, V + 1)``.

    Written as ``c (1 + q(H) + ... + q(H)^(n-1))`` with ``c = 1 - q(H)`` summed directly: all terms positive.
    """
    inside = _with_zero_first(q_sorted.cumsum(-1))
    outside = _mass_outside_prefixes(q_sorted)
    powers = inside.unsqueeze(-1) ** torch.arange(n, dtype=q_sorted.dtype)
    return outside * powers.sum(-1)


def _stirling2(d_max: int, s_max: int) -> list[list[int]]:
    """Stirling numbers of the second kind ``S(d, s)`` for ``d <= d_max``, ``s <= s_max``."""
    table = [[0] * (s_max + 1) for _ in range(d_max + 1)]
    table[0][0] = 1
    for d in range(1, d_max + 1):
        for s in range(1, s_max + 1):
            table[d][s] = s * table[d - 1][s] + table[d - 1][s - 1]
    return table


def _series_mul(a: Tensor, b: Tensor) -> Tensor:
    """Product of power series in ``t`` truncated at the last degree; coefficients on dim 0: ``(D + 1, ...)``."""
    out = torch.zeros_like(a)
    width = a.shape[0]
    for u in range(width):
        out[u:] += a[u] * b[: width - u]
    return out


def _wor_miss_probability(q_sorted: Tensor, n: int, n_heavy: int | None = None) -> Tensor:
    """``P(some of n drafts drawn without replacement falls outside H_k)`` for every prefix ``H_k``.

    ``q_sorted``: ``(B, V)`` float64 summing to 1, in prefix order, with at least ``n`` positive entries per row.
    Returns ``(B, V + 1)``.

    Method (exact up to a series truncated below 1e-17 relative to each term). With exponential clocks (token x
    rings at rate q_x; the drafts are the first n to ring) and tau the first ring outside H,
    ``P(miss) = sum_{m<n} P(exactly m tokens of H ring before tau)``. Expanding, each term is
    ``c_H * sum_{S subset H, |S| = m} sum_{T subset S} (-1)^{m-|T|} / (1 - q(T))``: the inclusion-exclusion of the
    facts file, regrouped per subset ``S`` so that no large alternating binomial sums appear. Its cost is the number
    of subsets, so the vocabulary is split:
      * heavy tokens: the ``K`` largest q (``K = n - 1 + 64`` for n <= 4). Their subsets (|S| <= n-1) are enumerated,
        each added at the prefix where its last member enters, then accumulated along the prefix order;
      * light tokens: every other token has ``q < r / (K - n + 2)``, with ``r`` the mass outside the n-1 largest q.
        Their subsets enter through ``1 / (1 - q(T_heavy) - q(U_light))`` expanded as a power series in
        ``q(U) / (1 - q(T_heavy)) <= (n - 1) / (K - n + 2)``, whose coefficients are elementary symmetric
        polynomials of the light tokens in the prefix, obtained from running power sums by Newton's identities.
    Every quantity is scaled by ``r`` so that ``1 - q(T)`` for the dominant tokens is formed without cancellation.
    """
    batch, vocab = q_sorted.shape
    if n == 1:
        return _mass_outside_prefixes(q_sorted)
    top = n - 1
    extra = 64 if n <= 4 else 4 * (n - 1)
    heavy = min(vocab, n_heavy if n_heavy is not None else top + extra)
    if heavy < top:
        raise ValueError(f"n_heavy must be at least n - 1 = {top}, got {heavy}")

    h, h_pos = q_sorted.topk(heavy, dim=-1)  # (B, K) descending, positions in prefix order
    scale = q_sorted.scatter(-1, h_pos[:, :top], 0.0).sum(-1, keepdim=True)  # r: mass outside the n-1 largest q
    h = h / scale  # every mass below is in units of r
    light = q_sorted.scatter(-1, h_pos, 0.0) / scale  # (B, V): light tokens only

    largest_light = float(light.max())
    if largest_light > 0:
        ratio = top * largest_light
        if ratio >= 0.9:
            raise ValueError(f"n_heavy={heavy} leaves light tokens too heavy for the series (ratio {ratio:.3g})")
        degree = top + max(1, math.ceil(math.log(_SERIES_TOLERANCE) / math.log(ratio)))
    else:
        degree = 0
    width = degree + 1
    terms = sum(math.comb(heavy, i) * 2**i for i in range(n))
    if terms * width * batch > 5e8:
        raise ValueError(f"without replacement, n={n} on V={vocab} needs {terms:.3g} subset terms (n <= 4 is fast)")

    # Heavy part, (D + 1, B, V + 1) for each subset size i:
    #   Gamma_i[d, k] = sum_{S subset heavy, |S| = i, S in H_k} sum_{T subset S} (-1)^{i-|T|} rest(T)^-(d+1),
    # with rest(T) = (1 - q(T)) / r = 1 + (top tokens not in T) - (members of T beyond the top): no cancellation.
    gammas = []
    for size in range(n):
        subsets = list(combinations(range(heavy), size))
        members = torch.tensor(subsets, dtype=torch.long).reshape(len(subsets), size)  # (N, size)
        gamma = q_sorted.new_zeros(width, batch, len(subsets))
        for mask in range(1 << size):
            chosen = members[:, [bit for bit in range(size) if mask >> bit & 1]]  # (N, |T|)
            in_top = (chosen.unsqueeze(-1) == torch.arange(top)).any(1)  # (N, n-1)
            rest = 1.0 + (h[:, :top].unsqueeze(1) * ~in_top).sum(-1) - (h[:, chosen] * (chosen >= top)).sum(-1)
            sign = -1.0 if (size - bin(mask).count("1")) % 2 else 1.0
            gamma += sign * (1.0 / rest).expand(width, -1, -1).cumprod(0)  # rest^-(d+1), d = 0..D
        if size == 0:
            gammas.append(gamma.expand(width, batch, vocab + 1))
            continue
        enters = h_pos[:, members].amax(-1).expand(width, -1, -1)  # S lies in H_k from k = max position + 1 on
        binned = q_sorted.new_zeros(width, batch, vocab).scatter_add_(2, enters, gamma)
        gammas.append(torch.cat([binned.new_zeros(width, batch, 1), binned.cumsum(2)], dim=2))

    # Light part: W_j[d, k] = d! [t^d] e_j(exp(q_x t) - 1 : x light in H_k), from running power sums (Newton).
    powers = light.expand(width, -1, -1).cumprod(0)  # q^(d+1)
    power_sums = torch.cat([torch.zeros_like(powers[:1]), powers[:-1]])  # pi_d = sum q^d, d = 0..D (pi_0 unused)
    power_sums = torch.cat([power_sums.new_zeros(width, batch, 1), power_sums.cumsum(2)], dim=2)  # (D+1, B, V+1)
    stirling = _stirling2(degree, top)
    factorial = [math.factorial(d) for d in range(width)]
    elementary = [torch.zeros_like(power_sums)]
    elementary[0][0] = 1.0
    power_series = [None]  # P_s[d] = s! S(d, s) / d! * pi_d: power sums of (exp(q t) - 1)
    for s in range(1, n):
        coefficients = [math.factorial(s) * stirling[d][s] / factorial[d] for d in range(width)]
        power_series.append(power_sums * torch.tensor(coefficients, dtype=q_sorted.dtype).view(width, 1, 1))
    for j in range(1, n):
        total = sum((-1) ** (s - 1) * _series_mul(elementary[j - s], power_series[s]) for s in range(1, j + 1))
        elementary.append(total / j)
    factorials = torch.tensor(factorial, dtype=q_sorted.dtype).view(width, 1, 1)
    weights = [e * factorials for e in elementary]

    miss = sum((weights[j] * gammas[i]).sum(0) for i in range(n) for j in range(n - i))
    outside = _mass_outside_prefixes(q_sorted) / scale
    return (outside * miss).clamp(0.0, 1.0)


def optimal_acceptance(p: Tensor, q: Tensor, n: int, *, replacement: bool = True) -> Tensor:
    """The best acceptance ``alpha*(p, q, n)`` any lossless verifier can reach with ``n`` drafts from ``q``.

    ``replacement=True``: i.i.d. drafts; ``False``: drafts drawn sequentially without replacement (q renormalised
    over the tokens not yet drawn). Sorted-prefix subset form ``alpha* = min_k [p(H_k) + P(some draft outside H_k)]``.
    Exact in float64; without replacement through :func:`_wor_miss_probability` (series truncated below 1e-17).

    Args:
        p: ``(..., V)`` target probabilities.
        q: ``(..., V)`` draft probabilities (at least ``n`` positive entries when ``replacement=False``).
        n: number of drafts, ``>= 1``.
    Returns:
        ``(...)`` float64.
    """
    p, q, n = _check_pair(p, q, n, distinct_drafts=not replacement)
    batch_shape, vocab = p.shape[:-1], p.shape[-1]
    p, q = _prefix_order(p.reshape(-1, vocab), q.reshape(-1, vocab))
    inside_p = _with_zero_first(p.cumsum(-1))  # (B, V + 1)
    if replacement:
        miss = _iid_miss_probability(q, n)
    else:
        rows = max(1, _ROWS_ELEMENTS // vocab)
        miss = torch.cat([_wor_miss_probability(chunk, n) for chunk in q.split(rows)])
    return (inside_p + miss).amin(-1).clamp(0.0, 1.0).reshape(batch_shape)


def _greedy_drafts(q: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Greedy construction: fixed drafts ``T`` = the ``n - 1`` largest q (``(B, n-1)`` indices), and the law of the
    last draft, q restricted to the other tokens and renormalised (``(B, V)``)."""
    fixed = q.topk(n - 1, dim=-1).indices
    rest = q.scatter(-1, fixed, 0.0)
    return fixed, rest / rest.sum(-1, keepdim=True)


def greedy_acceptance(p: Tensor, q: Tensor, n: int) -> Tensor:
    """Optimal acceptance of the greedy draft construction, reached by :func:`verify_greedy_construction`.

    Drafts: the ``n - 1`` most likely tokens of q (``T``), plus one draft from ``q' = q`` restricted to ``S minus T``.
    ``alpha_greedy = p(T) + sum_{x not in T} min(p(x), q'(x))``.

    Args:
        p, q: ``(..., V)``; q needs at least ``n`` positive entries.
    Returns:
        ``(...)`` float64.
    """
    p, q, n = _check_pair(p, q, n, distinct_drafts=True)
    batch_shape, vocab = p.shape[:-1], p.shape[-1]
    p, q = p.reshape(-1, vocab), q.reshape(-1, vocab)
    fixed, last = _greedy_drafts(q, n)
    in_fixed = p.gather(-1, fixed).sum(-1)
    outside = torch.minimum(p.scatter(-1, fixed, 0.0), last).sum(-1)
    return (in_fixed + outside).clamp(0.0, 1.0).reshape(batch_shape)


# ----------------------------------------------------------------------------------------------------------------
# Closed-form acceptance of the verifiers
# ----------------------------------------------------------------------------------------------------------------


def single_draft_acceptance(p: Tensor, q: Tensor) -> Tensor:
    """Single-draft speculative sampling: ``sum_x min(p(x), q(x))``. ``(..., V) -> (...)`` float64."""
    p, q, _ = _check_pair(p, q, 1, distinct_drafts=False)
    return torch.minimum(p, q).sum(-1)


def _rrs_iid(p: Tensor, q: Tensor, n: int) -> Tensor:
    """RRS with i.i.d. drafts: ``1 - prod_i (1 - sum min(p_i, q))``, ``p_{i+1} = norm(max(p_i - q, 0))``."""
    target, missed = p, torch.ones(p.shape[:-1], dtype=p.dtype)
    for _ in range(n):
        target, rejected = residual_distribution(target, q)
        missed = missed * rejected
    return 1.0 - missed


def _rrs_wor_two(p: Tensor, q: Tensor) -> Tensor:
    """RRS without replacement, n = 2, exact for any V: ``(B, V) -> (B,)``.

    ``a_1 + sum_x max(q(x) - p(x), 0) f(1 / (1 - q(x)))`` where ``f(s) = sum_y min(p_2(y), s q(y))`` is piecewise
    linear in ``s`` (evaluated for all x at once by sorting ``p_2 / q``) and ``p_2 = norm(max(p - q, 0))``.
    """
    target2, rejected = residual_distribution(p, q)
    reject = (q - p).clamp(min=0.0)
    rest = q.sum(-1, keepdim=True) - q  # 1 - q(x); for the largest q summed directly instead
    largest = q.argmax(-1, keepdim=True)
    rest = rest.scatter(-1, largest, q.scatter(-1, largest, 0.0).sum(-1, keepdim=True))
    stretch = torch.where(rest > 0, 1.0 / rest, torch.zeros_like(rest))  # q_2 = q * stretch off the drawn token

    ratio = torch.where(q > 0, target2 / q, torch.full_like(q, math.inf))
    ratio, order = ratio.sort(-1)
    below = _with_zero_first(target2.gather(-1, order).cumsum(-1))  # p_2 over tokens with ratio <= s
    above = _mass_outside_prefixes(q.gather(-1, order))  # q over tokens with ratio > s
    count = torch.searchsorted(ratio.contiguous(), stretch.contiguous(), right=True)
    second = below.gather(-1, count) + stretch * above.gather(-1, count)
    return 1.0 - rejected + (reject * second).sum(-1)


def _without(proposal: Tensor, token: Tensor) -> Tensor:
    """``(N, V)`` draft laws with ``token`` ``(N,)`` removed and renormalised (the next draft without replacement)."""
    proposal = proposal.scatter(-1, token.unsqueeze(-1), 0.0)
    return proposal / proposal.sum(-1, keepdim=True)


def _sample_rows(weights: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row of ``(N, V)`` non-negative weights (positive sums), by inverse CDF: ``(N,)``."""
    cdf = weights.cumsum(-1)
    u = torch.rand(weights.shape[0], 1, dtype=weights.dtype, generator=generator) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=weights.shape[-1] - 1)


def _rrs_wor_walk(
    target: Tensor, proposal: Tensor, reach: Tensor, rows: Tensor, steps: int, out: Tensor,
    generator: torch.Generator | None = None, *, sample: bool = False,
) -> None:
    """Walk ``steps`` RRS steps without replacement from states ``(N, V)`` (current p_i and q_i), each reached with
    probability ``reach`` ``(N,)``, adding ``reach * sum min(p_i, q_i)`` at every step into ``out[rows]``.

    ``sample=False`` branches into every rejected draft (exact). ``sample=True`` follows one rejected draft per state,
    drawn from its conditional law ``max(q_i - p_i, 0) / (1 - a_i)`` (the Rao-Blackwellised Monte Carlo walk).
    """
    for step in range(steps):
        hit = torch.minimum(target, proposal).sum(-1)
        out.index_add_(0, rows, reach * hit)
        if step == steps - 1:
            return
        reject = (proposal - target).clamp(min=0.0)  # (N, V): probability of drawing x and rejecting it
        if sample:
            node = ((reject.sum(-1) > 0) & (reach > 0)).nonzero()[:, 0]
            token = _sample_rows(reject[node], generator)
            reach = reach[node] * (1.0 - hit[node])
        else:
            node, token = (reject * reach.unsqueeze(-1) > 0).nonzero(as_tuple=True)
            reach = reach[node] * reject[node, token]
        target = residual_distribution(target[node], proposal[node])[0]
        proposal = _without(proposal[node], token)
        rows = rows[node]


def _rrs_wor_monte_carlo(p: Tensor, q: Tensor, n: int, paths: int, generator: torch.Generator | None) -> Tensor:
    """Unbiased estimate of RRS-without-replacement acceptance, ``(B, V) -> (B,)``: the first step is exact and
    shared; ``paths`` walks per position continue from a first rejected draft drawn from its conditional law."""
    estimates = []
    for target, proposal in zip(p, q):
        hit = torch.minimum(target, proposal).sum()
        reject = (proposal - target).clamp(min=0.0)
        if reject.sum() <= 0:
            estimates.append(hit)
            continue
        first = torch.multinomial(reject, paths, replacement=True, generator=generator)
        second = residual_distribution(target, proposal)[0]
        later = torch.zeros(1, dtype=p.dtype)
        for chunk in first.split(32):  # (32, V) float64 states stay in cache
            size = chunk.shape[0]
            states = second.expand(size, -1), _without(proposal.expand(size, -1), chunk)
            ones, zeros = torch.ones(size, dtype=p.dtype), torch.zeros(size, dtype=torch.long)
            _rrs_wor_walk(*states, ones, zeros, n - 1, later, generator, sample=True)
        estimates.append(hit + (1.0 - hit) * later[0] / paths)
    return torch.stack(estimates)


def rrs_acceptance_method(vocab_size: int, n: int, *, replacement: bool = True) -> str:
    """``"exact"`` or ``"monte_carlo"``: how :func:`rrs_acceptance` with ``method="auto"`` computes this case."""
    if replacement or n <= 2 or vocab_size**n <= _ENUMERATION_BUDGET:
        return "exact"
    return "monte_carlo"


def rrs_acceptance(
    p: Tensor,
    q: Tensor,
    n: int,
    *,
    replacement: bool = True,
    method: str = "auto",
    num_samples: int = 256,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Acceptance of recursive rejection sampling (SpecInfer) with ``n`` drafts; the sampler is :func:`verify_rrs`.

    With replacement: exact closed form ``1 - prod_i (1 - sum min(p_i, q))``, ``p_{i+1} = norm(max(p_i - q, 0))``.
    Without replacement the acceptance depends on which drafts were drawn (each removal reshapes q):
      * n <= 2: exact for any V (closed form, sort + prefix sums);
      * n >= 3 and ``V**n <= 2e6``: exact, by enumerating every sequence of rejected drafts;
      * otherwise: unbiased Monte Carlo over ``num_samples`` sequences of rejected drafts per position, each adding
        the exact probability of accepting at every step it reaches (Rao-Blackwellised; standard error at most
        ``(1 - a_1) / (2 sqrt(num_samples))``, a_1 the first draft's acceptance). :func:`rrs_acceptance_method` says
        which one ``method="auto"`` picks.

    Args:
        p, q: ``(..., V)``.
        method: ``"auto"``, ``"exact"`` or ``"monte_carlo"`` (ignored with replacement or n <= 2).
        generator: for the Monte Carlo draws.
    Returns:
        ``(...)`` float64.
    """
    p, q, n = _check_pair(p, q, n, distinct_drafts=not replacement)
    if method not in ("auto", "exact", "monte_carlo"):
        raise ValueError(f"method must be 'auto', 'exact' or 'monte_carlo', got {method!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    batch_shape, vocab = p.shape[:-1], p.shape[-1]
    p, q = p.reshape(-1, vocab), q.reshape(-1, vocab)
    if replacement:
        result = _rrs_iid(p, q, n)
    elif n == 1:
        result = torch.minimum(p, q).sum(-1)
    elif n == 2:
        result = _rrs_wor_two(p, q)
    else:
        if method == "auto":
            method = rrs_acceptance_method(vocab, n, replacement=False)
        if method == "exact" and vocab**n > 50 * _ENUMERATION_BUDGET:
            raise ValueError(f"method='exact' without replacement would enumerate V**n = {vocab**n:.3g} cases")
        if method == "monte_carlo":
            result = _rrs_wor_monte_carlo(p, q, n, num_samples, generator)
        else:
            result = torch.zeros(p.shape[0], dtype=p.dtype)
            _rrs_wor_walk(p, q, torch.ones_like(result), torch.arange(p.shape[0]), n, result)
    return result.clamp(0.0, 1.0).reshape(batch_shape)


def kseq_rho(p: Tensor, q: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """K-SEQ's (SpecTr) scale: the smallest ``rho`` in ``[1, n]`` with ``rho * beta >= 1 - (1 - beta)^n``, where
    ``beta = sum min(q, p / rho)``; and that ``beta``. ``(..., V) -> (...), (...)``; bisection to float64 precision
    (``rho * beta`` grows and ``1 - (1 - beta)^n`` shrinks with rho, so the condition is monotone)."""
    p, q, n = _check_pair(p, q, n, distinct_drafts=False)
    return _kseq_rho(p, q, n)


def _kseq_rho(p: Tensor, q: Tensor, n: int) -> tuple[Tensor, Tensor]:
    def beta(rho: Tensor) -> Tensor:
        return torch.minimum(q, p / rho.unsqueeze(-1)).sum(-1)

    def feasible(rho: Tensor) -> Tensor:
        b = beta(rho)
        return rho * b >= 1.0 - (1.0 - b) ** n

    low = torch.ones(p.shape[:-1], dtype=p.dtype)
    high = torch.full_like(low, float(n))
    done = feasible(low)
    high = torch.where(done, low, high)
    for _ in range(64):
        middle = (low + high) / 2
        ok = feasible(middle)
        high, low = torch.where(ok, middle, high), torch.where(ok, low, middle)
    return high, beta(high)


def _kseq_residual(p: Tensor, q: Tensor, rho: Tensor, b: Tensor, n: int) -> Tensor:
    """Law of K-SEQ's output when every draft is rejected: ``(p - accept_mass * min(q, p/rho) / beta) / (1-beta)^n``."""
    first = torch.minimum(q, p / rho.unsqueeze(-1))
    accept = 1.0 - (1.0 - b) ** n
    scale = torch.where(b > 0, accept / torch.where(b > 0, b, torch.ones_like(b)), torch.zeros_like(b))
    residual = (p - scale.unsqueeze(-1) * first).clamp(min=0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / torch.where(mass > 0, mass, torch.ones_like(mass)), p)


def kseq_acceptance(p: Tensor, q: Tensor, n: int) -> Tensor:
    """Acceptance ``P(output in drafts)`` of K-SEQ (SpecTr) with ``n`` i.i.d. drafts; the sampler is
    :func:`verify_kseq`.

    A draft is accepted with probability ``1 - (1 - beta)^n`` (see :func:`kseq_rho`); when all are rejected the
    residual sample can still equal a rejected draft, which adds
    ``(1 - beta)^n * sum_y p_res(y) (1 - (1 - r(y))^n)`` with ``r = (q - min(q, p/rho)) / (1 - beta)`` the law of a
    rejected draft. ``(..., V) -> (...)`` float64. (The "accept step" alone, ``1 - (1 - beta)^n``, is what the facts
    file lists; it is lower by that last term.)
    """
    p, q, n = _check_pair(p, q, n, distinct_drafts=False)
    rho, b = _kseq_rho(p, q, n)
    all_rejected = (1.0 - b) ** n
    rejected_law = (q - torch.minimum(q, p / rho.unsqueeze(-1))).clamp(min=0.0)
    rejected_law = rejected_law / torch.where(b < 1, 1.0 - b, torch.ones_like(b)).unsqueeze(-1)
    residual = _kseq_residual(p, q, rho, b, n)
    again = (residual * (1.0 - (1.0 - rejected_law) ** n)).sum(-1)
    return (1.0 - all_rejected + all_rejected * again).clamp(0.0, 1.0)


# ----------------------------------------------------------------------------------------------------------------
# Verifiers as samplers: one position, (V,) tensors; each returns (token, accepted = token is one of the drafts)
# ----------------------------------------------------------------------------------------------------------------


def _check_position(p: Tensor, q: Tensor, n: int, *, distinct_drafts: bool) -> tuple[Tensor, Tensor, int]:
    p, q, n = _check_pair(p, q, n, distinct_drafts=distinct_drafts)
    if p.ndim != 1:
        raise ValueError(f"p and q must be one position, shape (V,), got {tuple(p.shape)}")
    return p, q, n


def _sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=generator))


def _draw_drafts(q: Tensor, n: int, replacement: bool, generator: torch.Generator | None) -> list[int]:
    """``n`` drafts from q: i.i.d., or one after another from q renormalised over the tokens not yet drawn."""
    if replacement:
        return torch.multinomial(q, n, replacement=True, generator=generator).tolist()
    drafts, remaining = [], q.clone()
    for _ in range(n):
        drafts.append(_sample(remaining, generator))
        remaining[drafts[-1]] = 0.0
    return drafts


def verify_single(p: Tensor, q: Tensor, n: int = 1, generator: torch.Generator | None = None) -> tuple[int, bool]:
    """Single-draft speculative sampling: draw ``x ~ q``, keep it with probability ``min(1, p(x)/q(x))``, else
    sample ``norm(max(p - q, 0))``. ``p, q``: ``(V,)``; ``n`` must be 1 (kept for a uniform signature)."""
    if n != 1:
        raise ValueError(f"n must be 1 for single-draft verification, got {n!r}")
    return verify_rrs(p, q, 1, generator)


def verify_rrs(
    p: Tensor, q: Tensor, n: int, generator: torch.Generator | None = None, *, replacement: bool = True
) -> tuple[int, bool]:
    """Recursive rejection sampling (SpecInfer) over ``n`` drafts it draws from q, i.i.d. or without replacement.

    ``p_1 = p``; draft ``x_i`` (from ``q_i``: q, or q without earlier drafts, renormalised) is accepted with
    probability ``min(1, p_i(x_i)/q_i(x_i))``; on rejection ``p_{i+1} = norm(max(p_i - q_i, 0))``; if every draft is
    rejected the output is sampled from ``p_{n+1}``. ``p, q``: ``(V,)``.
    """
    p, q, n = _check_position(p, q, n, distinct_drafts=not replacement)
    drafts = _draw_drafts(q, n, replacement, generator)
    target, proposal = p, q
    for index, x in enumerate(drafts):
        if not replacement and index > 0:
            proposal = proposal.clone()
            proposal[drafts[index - 1]] = 0.0
            proposal = proposal / proposal.sum()
        if _uniform(generator) * proposal[x] < target[x]:  # accept with probability min(1, target/proposal)
            return x, True
        target = residual_distribution(target, proposal)[0]
    return _sample(target, generator), False


def verify_kseq(p: Tensor, q: Tensor, n: int, generator: torch.Generator | None = None) -> tuple[int, bool]:
    """K-SEQ (SpecTr) over ``n`` i.i.d. drafts from q: the first draft accepted with probability
    ``min(1, p(x) / (rho q(x)))`` is the output (rho from :func:`kseq_rho`); if none is, the output is sampled from
    the residual law that keeps the output distributed as p. ``p, q``: ``(V,)``."""
    p, q, n = _check_position(p, q, n, distinct_drafts=False)
    rho, b = _kseq_rho(p, q, n)
    drafts = _draw_drafts(q, n, True, generator)
    for x in drafts:
        if _uniform(generator) * rho * q[x] < p[x]:
            return x, True
    token = _sample(_kseq_residual(p, q, rho, b, n), generator)
    return token, token in drafts


def verify_greedy_construction(
    p: Tensor, q: Tensor, n: int, generator: torch.Generator | None = None
) -> tuple[int, bool]:
    """Verifier of the greedy draft construction, reaching :func:`greedy_acceptance`.

    Drafts: the ``n - 1`` most likely tokens of q, and ``x_n ~ q'`` (q on the other tokens, renormalised). Keep
    ``x_n`` with probability ``min(1, p(x_n)/q'(x_n))``; else sample ``norm(max(p - q', 0))``, which is accepted
    when it lands on a fixed draft. ``p, q``: ``(V,)``.
    """
    p, q, n = _check_position(p, q, n, distinct_drafts=True)
    fixed, last_law = _greedy_drafts(q.unsqueeze(0), n)
    fixed, last_law = fixed[0].tolist(), last_law[0]
    x = _sample(last_law, generator)
    if _uniform(generator) * last_law[x] < p[x]:
        return x, True
    token = _sample(residual_distribution(p, last_law)[0], generator)
    return token, token in fixed
