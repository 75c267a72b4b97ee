# Exported from tetris_hf/candidate_generators/__init__.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""The draft side of batched speculative decoding: the batched proposer and reduced-vocabulary draft heads, EAGLE
heads, prompt lookup, and :func:`build_drafter`, which picks one for a call."""

from .candidate_generators_batched_draft import BatchedDraftCandidateGenerator
from .candidate_generators_build import build_drafter

__all__ = ["BatchedDraftCandidateGenerator", "build_drafter"]
