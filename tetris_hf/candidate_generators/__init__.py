"""The draft side of batched speculative decoding: the batched proposer and reduced-vocabulary draft heads."""

from .batched_draft import BatchedDraftCandidateGenerator

__all__ = ["BatchedDraftCandidateGenerator"]
