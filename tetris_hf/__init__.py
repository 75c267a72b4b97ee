"""tetris-hf: batched speculative decoding with TETRIS draft-token selection for transformers.

After ``import tetris_hf``::

    target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris")
    tetris_hf.generate_batch(target, [ids_a, ids_b, ...], assistant_model=draft, max_new_tokens=64)  # a stream
"""

from .candidate_generators.eagle import EagleDraft
from .cpu_kernels import restore_linears, use_onednn_linears
from .continuous import SpeculativeBatchingManager, generate_batch, init_continuous_batching
from .generation import generate, register
from .outputs import TetrisGenerateOutput, TetrisStats
from .options import TetrisOptions
from .pair_memory import load_pair_memory, save_pair_memory

__version__ = "0.1.0"
__all__ = ["EagleDraft", "SpeculativeBatchingManager", "TetrisGenerateOutput", "TetrisOptions", "TetrisStats",
           "generate", "generate_batch", "init_continuous_batching", "load_pair_memory", "register",
           "restore_linears", "save_pair_memory", "use_onednn_linears"]

register()
