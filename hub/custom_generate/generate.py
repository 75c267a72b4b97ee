"""TETRIS batched speculative decoding as a transformers ``custom_generate`` repository.

``model.generate(inputs, assistant_model=draft, custom_generate="<this repo>", trust_remote_code=True)`` runs
:func:`tetris_hf.generate`; the package (``pip install tetris-hf``) holds the implementation, so this folder and the
package can never drift apart.
"""

from tetris_hf.generation import generate

__all__ = ["generate"]
