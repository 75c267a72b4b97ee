"""Draft proposers (transformers ``CandidateGenerator`` subclasses) for batched speculative decoding."""

from .batched_draft import BatchedDraftCandidateGenerator

__all__ = ["BatchedDraftCandidateGenerator"]
