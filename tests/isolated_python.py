"""Run Python in a subprocess that cannot import this checkout's ``tetris_hf``, as a user without the package would.

The subprocess runs in isolated mode (``python -I``: no ``PYTHONPATH``, no user site-packages, neither the script's
nor the working directory on ``sys.path``) from a temporary working directory. ``tetris_hf`` is installed in the
virtual environment as an *editable* package, whose import hook would still find the checkout, so :data:`PREAMBLE`
removes that hook and any ``sys.path`` entry holding a ``tetris_hf`` folder before the script runs, then asserts that
``importlib.util.find_spec("tetris_hf") is None``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PREAMBLE = textwrap.dedent('''
    import importlib.util
    import os
    import sys

    def _from_editable_install(hook):
        return getattr(hook, "__module__", "").startswith("__editable__")

    sys.meta_path[:] = [finder for finder in sys.meta_path if not _from_editable_install(finder)]
    sys.path_hooks[:] = [hook for hook in sys.path_hooks if not _from_editable_install(hook)]
    sys.path[:] = [entry for entry in sys.path if not os.path.isdir(os.path.join(entry or ".", "tetris_hf"))]
    sys.path_importer_cache.clear()
    assert "tetris_hf" not in sys.modules
    assert importlib.util.find_spec("tetris_hf") is None, "tetris_hf is still importable"
''')

RESULT_MARK = "RESULT-JSON:"


def run_isolated(script: str, workdir: Path, timeout: float = 600) -> dict:
    """Run ``script`` (after :data:`PREAMBLE`) in ``workdir``; returns what it passed to ``report(dict)``.

    The script gets a ``report(obj)`` function that prints ``obj`` as JSON for the caller. Hugging Face caches go to
    ``workdir`` and the Hub is offline. Fails (AssertionError with stderr) when the subprocess exits non-zero.
    """
    reporter = f"import json as _json\ndef report(obj):\n    print({RESULT_MARK!r} + _json.dumps(obj), flush=True)\n"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(workdir / "hf-modules"),
        "TETRIS_HF_CACHE": str(workdir / "tetris-cache"),
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    env.pop("PYTHONPATH", None)
    result = subprocess.run([sys.executable, "-I", "-c", PREAMBLE + reporter + script], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"isolated subprocess failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_MARK)]
    assert lines, f"the isolated script reported nothing:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return json.loads(lines[-1][len(RESULT_MARK):])
