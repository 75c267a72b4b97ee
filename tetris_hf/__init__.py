"""tetris-hf: batched speculative decoding with TETRIS draft-token selection for transformers.

After ``import tetris_hf``::

    target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris")
"""

from .candidate_generators.eagle import EagleDraft
from .generation import generate, register
from .outputs import TetrisGenerateOutput, TetrisStats
from .options import TetrisOptions

__version__ = "0.1.0"
__all__ = ["EagleDraft", "TetrisGenerateOutput", "TetrisOptions", "TetrisStats", "generate", "register"]

register()
