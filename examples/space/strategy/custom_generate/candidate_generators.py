# Exported from tetris_hf/candidate_generators/__init__.py by `python -m tetris_hf.hub_export`: edit the package, not this copy.
"""Draft proposers (transformers ``CandidateGenerator`` subclasses) for batched speculative decoding."""

from .candidate_generators_batched_draft import BatchedDraftCandidateGenerator

__all__ = ["BatchedDraftCandidateGenerator"]
