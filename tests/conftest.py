"""The suite runs ``tetris_compile=None`` eager (``$TETRIS_HF_COMPILE=0``): a first use would otherwise measure
compiled against eager steps for every tiny model it meets (tests/test_compile_choice.py tests that measurement and
the choice it makes, with the variable unset)."""

import os

os.environ.setdefault("TETRIS_HF_COMPILE", "0")
