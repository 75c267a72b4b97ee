"""TETRIS batched speculative decoding as a transformers ``custom_generate`` repository.

``model.generate(inputs, assistant_model=draft, custom_generate="<this repo>", trust_remote_code=True)`` runs
:func:`generation.generate`. The modules of this folder are tetris_hf's generation strategy and its request stream
(``generate_batch`` and ``init_continuous_batching``: rows that join a live batch as others finish), exported by
``python -m tetris_hf.tools.hub_export``: edit the tetris_hf package and export again, not these copies.
"""

from .continuous import generate_batch, init_continuous_batching
from .generation import generate

__all__ = ["generate", "generate_batch", "init_continuous_batching"]
