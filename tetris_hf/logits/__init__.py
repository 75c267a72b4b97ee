"""Target and draft distributions: logits processing at many positions, and lossless verification."""

from .processing import is_prefix_free, process_logits
from .verification import residual_distribution, verify_greedy, verify_sampling

__all__ = ["is_prefix_free", "process_logits", "residual_distribution", "verify_greedy", "verify_sampling"]
