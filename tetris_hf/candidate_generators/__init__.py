"""The draft side of batched speculative decoding: the batched proposer and reduced-vocabulary draft heads, EAGLE
heads, prompt lookup, and :func:`build_drafter`, which picks one for a call."""

from .batched_draft import BatchedDraftCandidateGenerator
from .build import build_drafter

__all__ = ["BatchedDraftCandidateGenerator", "build_drafter"]
