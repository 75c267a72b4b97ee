"""bitsandbytes 4-bit (nf4) / 8-bit targets: :func:`quantization_config` gives a ``BitsAndBytesConfig`` checked to run
here (bitsandbytes installed, new enough, one tiny quantized matmul on the device), or a clear error up front instead of
a failure deep inside ``from_pretrained``.
"""

from __future__ import annotations

import importlib.metadata

import torch
from packaging import version
from transformers import BitsAndBytesConfig

MIN_BITSANDBYTES = "0.46.1"  # what transformers 5.23's bitsandbytes quantizers require
INSTALL_HINT = "pip install bitsandbytes==0.50.2 (its wheel has CPU and CUDA backends)"


class QuantizationUnavailableError(RuntimeError):
    """bitsandbytes is missing, too old, or cannot run on the requested device; the message says which."""


def _bitsandbytes(mode: str):
    """Import bitsandbytes or raise :class:`QuantizationUnavailableError` naming the fix."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise QuantizationUnavailableError(f"{mode} quantization needs bitsandbytes, which is not installed ({error}): "
                                           f"{INSTALL_HINT}") from error
    installed = getattr(bitsandbytes, "__version__", None) or importlib.metadata.version("bitsandbytes")
    if version.parse(installed) < version.parse(MIN_BITSANDBYTES):
        raise QuantizationUnavailableError(f"{mode} quantization needs bitsandbytes>={MIN_BITSANDBYTES}, found "
                                           f"{installed}: {INSTALL_HINT}")
    return bitsandbytes


def check_backend(load_in_4bit: bool, device: str | torch.device) -> None:
    """Run one tiny quantized linear layer on ``device``; raise :class:`QuantizationUnavailableError` if it fails."""
    mode = "4-bit (nf4)" if load_in_4bit else "8-bit (LLM.int8)"
    bitsandbytes = _bitsandbytes(mode)
    device = torch.device(device)
    try:
        weight = torch.randn(64, 64)
        if load_in_4bit:
            layer = bitsandbytes.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
            layer.weight = bitsandbytes.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            inputs = torch.randn(2, 64, device=device)
        else:
            layer = bitsandbytes.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
            layer.weight = bitsandbytes.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            inputs = torch.randn(2, 64, device=device, dtype=torch.float16)
        with torch.no_grad():
            output = layer.to(device)(inputs)
        if output.shape != (2, 64) or not bool(torch.isfinite(output).all()):
            raise RuntimeError(f"a {mode} test layer returned {tuple(output.shape)} / non-finite values")
    except Exception as error:  # the backend's own errors are many and unrelated; report them as one
        raise QuantizationUnavailableError(f"bitsandbytes {bitsandbytes.__version__} cannot run {mode} layers on "
                                           f"{device.type} ({type(error).__name__}: {error}). Load the target without "
                                           "quantization, or use a machine and bitsandbytes build with a backend for "
                                           f"{device.type}: {INSTALL_HINT}") from error


def quantization_config(load_in_4bit: bool = False, load_in_8bit: bool = False, *,
                        compute_dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None) -> BitsAndBytesConfig | None:
    """The ``quantization_config`` for ``from_pretrained`` of a 4-bit (nf4) or 8-bit target, checked to run here.

    Args:
        load_in_4bit: nf4 weights (``bnb_4bit_compute_dtype=compute_dtype``).
        load_in_8bit: LLM.int8 weights.
        compute_dtype: 4-bit matmul dtype; default bfloat16 on CUDA, float32 elsewhere.
        device: where the model will run (default ``cuda`` when available, else ``cpu``); the backend is tried there.

    Returns:
        ``None`` when neither flag is set, else a ``BitsAndBytesConfig``.

    Raises:
        ValueError: both flags set.
        QuantizationUnavailableError: bitsandbytes missing, older than 0.46.1, or failing on ``device``.
    """
    if load_in_4bit and load_in_8bit:
        raise ValueError("choose one of load_in_4bit and load_in_8bit, not both")
    if not (load_in_4bit or load_in_8bit):
        return None
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    check_backend(load_in_4bit, device)
    if load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)
