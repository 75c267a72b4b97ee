"""Which memory allocator this process runs under, and where tcmalloc is: benchmarks report it beside their numbers.

On the CPU a forward allocates its activations anew each time; glibc's ``malloc`` serves blocks over 32 MB (a long
prompt's MLP activations: 6,239 tokens x 1,536 x 4 bytes = 38 MB) from fresh pages and returns them at ``free``, so
every such forward pays the page faults again (on this project's CPUs about 1 GB/s: a 6,240-row product 1.3-1.4x its
time under tcmalloc). tcmalloc keeps freed memory for the next block. vLLM recommends it for its CPU engine; a process
gets it from ``LD_PRELOAD`` only (set before the process starts), and a vLLM worker started by
:mod:`tetris_hf.tools.vllm_system` inherits this process's, so both sides of a benchmark run under the same allocator
(the worker, which runs without tetris_hf, imports this file as its sibling: it needs the standard library only).
Measurements: docs/benchmarks.md, "Page faults: the allocator under both engines".
"""

from __future__ import annotations

import os
from pathlib import Path

# (Debian and Ubuntu: apt install libtcmalloc-minimal4)
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_FOLDERS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                   "/usr/local/lib")


def loaded_allocator(maps: str | Path = "/proc/self/maps") -> str:
    """``"tcmalloc"``, ``"jemalloc"`` or ``"glibc malloc"``: the allocator whose library ``maps`` (a process's memory
    map, this process's by default) shows loaded; ``"unknown"`` where the map cannot be read (not Linux)."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return "unknown"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in text:
            return name
    return "glibc malloc"


def find_tcmalloc(folders: tuple[str, ...] = LIBRARY_FOLDERS) -> Path | None:
    """The first tcmalloc library found in ``folders`` (:data:`TCMALLOC_NAMES`, the minimal one first), else None."""
    for folder in folders:
        for name in TCMALLOC_NAMES:
            path = Path(folder) / name
            if path.is_file():
                return path
    return None


def allocator_note(loaded: str) -> str:
    """A line for a benchmark's log: ``loaded`` (:func:`loaded_allocator`), the allocator both engines run under, and,
    under glibc's, how to preload tcmalloc (or install it)."""
    if loaded != "glibc malloc":
        preload = os.environ.get("LD_PRELOAD", "")
        return f"memory allocator: {loaded} (LD_PRELOAD={preload or '?'}; a vLLM worker inherits it)"
    path = find_tcmalloc()
    how = f"LD_PRELOAD={path}" if path else "apt install libtcmalloc-minimal4, then LD_PRELOAD its library"
    return (f"memory allocator: glibc malloc (a vLLM worker inherits it); tcmalloc, which vLLM recommends on the CPU, "
            f"reads long prompts faster in both engines: {how}")
