"""Decode and verify attention on the CPU, each row over its own keys: :func:`row_attention`, a small C kernel
(:mod:`tetris_hf.row_attention_source`) compiled at first use with the system's C compiler and called through
``ctypes``.

A step's attention reads the cache's written prefix, which every row shares: the CPU's sdpa kernel reads all of it for
every row, masked, so a row holding 80 real tokens beside one holding 450 reads 450 keys (docs/benchmarks.md,
"Attention over long contexts"). The kernel reads only the slots a row's mask lets it see, each key-value head once for
its group of query heads (what vLLM's CPU engine reads over its paged cache). fp32 on the CPU only; where no compiler
is found, or ``TETRIS_HF_CPU_KERNELS=0``, attention stays on sdpa. Measurements: docs/benchmarks.md, "Each row over
its own keys".
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .ops import define
from .row_attention_source import SOURCE

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
MAX_QUERIES = 32  # queries a key-value head (query heads x block length) this kernel takes; longer blocks: sdpa
ENVIRONMENT = "TETRIS_HF_CPU_KERNELS"  # "0": attention stays on sdpa (read at every call, before any build)


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


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, loaded (built first if no matching build is cached); ``None`` where it cannot be."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("gcc") or shutil.which("cc")]
    if compiler[0] is None:
        logger.warning("tetris_hf: no C compiler found (gcc or $CC); CPU attention stays on sdpa")
        return None
    source = SOURCE.encode()
    parts = [source, " ".join(compiler).encode(), " ".join(FLAGS).encode(), _cpu_flags().encode(),
             platform.machine().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    built = cache_directory() / f"row_attention-{key}.so"
    if not built.exists():
        try:
            built.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=built.parent) as scratch:  # (then renamed: concurrent builds are safe)
                target, code = Path(scratch) / built.name, Path(scratch) / "row_attention.c"
                code.write_bytes(source)
                subprocess.run([*compiler, *FLAGS, "-o", str(target), str(code)], check=True, capture_output=True,
                               timeout=120)
                os.replace(target, built)
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", b"") or b""
            logger.warning("tetris_hf: building the CPU attention kernel failed (%s%s); attention stays on sdpa",
                           error, f": {detail.decode(errors='replace')[:500]}" if detail else "")
            return None
    library = ctypes.CDLL(str(built))
    function = library.row_attention
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, size, size, size, pointer, size, size, size, pointer, size, size, size,
                         pointer, size, size, size, pointer, size, size, size, size, size, size, ctypes.c_float,
                         ctypes.c_int]
    function.restype = None
    return library


def available() -> bool:
    """Whether :func:`row_attention` runs here (building the kernel at the first call)."""
    return _library() is not None


def row_attention_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None) -> bool:
    """Whether :func:`row_attention` takes these tensors: fp32 on the CPU, a 4D bool mask, at most
    :data:`MAX_QUERIES` queries a key-value head, the last dimension contiguous, no gradient wanted (the kernel has
    no backward), and the kernel built."""
    return (query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32
            and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
            and attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1
            and attention_mask.shape[0] in (1, query.shape[0]) and attention_mask.shape[2] in (1, query.shape[2])
            and attention_mask.shape[3] >= key.shape[2]
            and query.shape[1] % key.shape[1] == 0
            and query.shape[1] // key.shape[1] * query.shape[2] <= MAX_QUERIES
            and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
            and not (torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value)))
            and not torch.compiler.is_compiling() and os.environ.get(ENVIRONMENT, "1") != "0" and available())


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                  scaling: float | None = None) -> torch.Tensor:
    """Softmax attention of each row's queries over the keys its mask lets them see, read row by row (the operator
    ``tetris_hf::row_attention``: a profile names it among the attention ops).

    Args:
        query: ``(B, H, L, D)``.
        key, value: ``(B, H_kv, S, D)`` (views of a cache's buffers read in place), ``H`` a multiple of ``H_kv``;
            query head ``i`` reads key-value head ``i // (H // H_kv)``.
        attention_mask: ``(B or 1, 1, L or 1, S)`` bool, True = attend.
        scaling: the softmax scale (``None``: ``D ** -0.5``).

    Returns:
        ``(B, L, H, D)``; zeros for a query that sees no key.
    """
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return _row_attention_op(query, key, value, attention_mask[..., : key.shape[2]], float(scale))


def _row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """:func:`row_attention`'s kernel: the C function on the tensors' memory (``attention_mask`` ``S`` slots wide)."""
    batch, heads, length, dim = query.shape
    key_heads, slots = key.shape[1], key.shape[2]
    mask = attention_mask.view(torch.uint8)
    output = query.new_empty(batch, length, heads, dim)
    _library().row_attention(
        query.data_ptr(), *query.stride()[:3], key.data_ptr(), *key.stride()[:3], value.data_ptr(), *value.stride()[:3],
        mask.data_ptr(), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2) if mask.shape[2] > 1 else 0,
        mask.stride(3), output.data_ptr(), batch, heads, key_heads, length, slots, dim, scale, torch.get_num_threads())
    return output


_row_attention_op = define("row_attention(Tensor query, Tensor key, Tensor value, Tensor attention_mask, float scale) "
                           "-> Tensor", _row_attention,
                           lambda query, *_: query.new_empty(query.shape[0], query.shape[2], query.shape[1],
                                                             query.shape[3]))
