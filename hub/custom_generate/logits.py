# Exported from tetris_hf/logits/__init__.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""Target and draft distributions: logits processing at many positions, and lossless verification."""

from .logits_argmax import vocab_argmax
from .logits_processing import PositionwiseLogitsProcessor, is_prefix_free
from .logits_verification import residual_distribution, sample_tokens, verify, verify_greedy, verify_sampling

__all__ = ["PositionwiseLogitsProcessor", "is_prefix_free", "residual_distribution", "sample_tokens", "verify",
           "verify_greedy", "verify_sampling", "vocab_argmax"]
