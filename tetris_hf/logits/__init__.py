"""Target and draft distributions: logits processing at many positions, and lossless verification."""

from .argmax import vocab_argmax
from .processing import PositionwiseLogitsProcessor, is_prefix_free
from .verification import residual_distribution, sample_tokens, verify, verify_greedy, verify_sampling

__all__ = ["PositionwiseLogitsProcessor", "is_prefix_free", "residual_distribution", "sample_tokens", "verify",
           "verify_greedy", "verify_sampling", "vocab_argmax"]
