"""The package's C kernels, built at first use with the system's C compiler and kept: :func:`built` compiles a
kernel's source into a shared library under :func:`cache_directory`, named by a hash of the source, the compiler, its
flags and the CPU (a build on one CPU is not reused on another), and reuses it from then on. The kernels themselves
(their sources, their ``ctypes`` signatures) live with the modules that call them: :mod:`tetris_hf.cpu_attention`,
:mod:`tetris_hf.cpu_kernels`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
ENVIRONMENT = "TETRIS_HF_CPU_KERNELS"  # "0": no C kernel runs (see switched_on)


def switched_on() -> bool:
    """Whether the C kernels may run: :data:`ENVIRONMENT` is not ``"0"`` (each caller says when it reads it)."""
    return os.environ.get(ENVIRONMENT, "1") != "0"


def cache_directory() -> Path:
    """Where built kernels are kept: ``$TETRIS_HF_CACHE`` or ``~/.cache/tetris_hf``, under ``kernels/``."""
    root = os.environ.get("TETRIS_HF_CACHE") or Path.home() / ".cache" / "tetris_hf"
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for them: a build on one CPU is not reused on another)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def compiler() -> list[str] | None:
    """The C compiler's command: ``$CC`` (split as a shell would), else ``gcc`` or ``cc`` on the path; ``None``
    where none is found."""
    command = shlex.split(os.environ.get("CC", "")) or [shutil.which("gcc") or shutil.which("cc")]
    return None if command[0] is None else command


def build(source: str, library: Path, command: list[str]) -> None:
    """Compile the C ``source`` with ``command`` (:func:`compiler`) and :data:`FLAGS` into the shared library
    ``library``, written whole or not at all (built beside it, then renamed: concurrent builds are safe). Raises
    ``OSError`` or ``subprocess.SubprocessError`` (its ``stderr`` the compiler's) where the build fails."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        target, code = Path(scratch) / library.name, Path(scratch) / f"{library.stem}.c"
        code.write_bytes(source.encode())
        subprocess.run([*command, *FLAGS, "-o", str(target), str(code)], check=True, capture_output=True, timeout=120)
        os.replace(target, library)


def built(name: str, source: str, fallback: str) -> Path | None:
    """The shared library of the kernel ``name`` built from ``source`` (built now unless a matching build is kept);
    ``None``, with a warning that ends with ``fallback`` (what runs instead), where no compiler is found or the
    build fails."""
    command = compiler()
    if command is None:
        logger.warning("tetris_hf: no C compiler found (gcc or $CC); %s", fallback)
        return None
    parts = [source.encode(), " ".join(command).encode(), " ".join(FLAGS).encode(), _cpu_flags().encode(),
             platform.machine().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    library = cache_directory() / f"{name}-{key}.so"
    if not library.exists():
        try:
            build(source, library, command)
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", b"") or b""
            logger.warning("tetris_hf: building the %s kernel failed (%s%s); %s", name, error,
                           f": {detail.decode(errors='replace')[:500]}" if detail else "", fallback)
            return None
    return library
