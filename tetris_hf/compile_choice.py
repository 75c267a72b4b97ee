"""``tetris_compile=None``, the default: a call starts eager and compiles its target's forwards once its eager steps
have taken long enough for compiled steps to pay the compile back, where a measurement on this machine says compiled
steps are faster (:func:`compile_later`, :class:`CompileLater`). The measurement (:func:`measure_compiled_steps`)
times the same decoding steps eager and compiled, interleaved, on the model itself; it runs once per model, dtype,
device, threads, torch version and linear kernels, when a call first gets that far, and is cached in memory and under
:func:`choice_cache_dir`. Design and measurements: docs/gpu.md, "The compiled path".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .compiled import check_compilable, compiles_on_eager_shapes, eager_shapes_forward
from .cost_model import cache_dir, profile_key
from .kv import SlotCache
from .options import TetrisOptions
from .packed_probe import packs_exactly
from .routing import routed_attention
from .timing import compiled_graphs

logger = logging.getLogger(__name__)

ENVIRONMENT = "TETRIS_HF_COMPILE"  # "0": tetris_compile=None means eager in this process (the test suite sets it)
PAYS_BELOW = 0.95  # compiled steps are chosen when they take at most this share of eager steps' time
ROWS, CONTEXT, WIDTHS, STEPS = 8, 128, (1, 4), 6  # the measured steps: rows, tokens cached, tokens a row, timed each
VERSION = 1  # of the measurement: a cached choice of another version is measured again
# eager steps' seconds after which a call that may compile, with no choice measured for its model, measures (and
# compiles where it pays): about what a 135M model's compile (about 60 s on 2 CPU cores) over its saving (about 8%) is
UNMEASURED_PAYBACK_SECONDS = 600.0

_CHOICES: dict[str, "CompileChoice"] = {}


@dataclass(frozen=True)
class CompileChoice:
    """Whether ``tetris_compile=None`` compiles a target's forwards, and why.

    Attributes:
        compile: compile them.
        why: a sentence saying why (what was measured, or what rules compiling out).
        compiled_over_eager: compiled steps' time over eager steps' (``None``: not measured).
        compile_seconds: the first compiled forwards' time, the compiler's (``None``: not measured).
        measured: the measurement's numbers as :func:`measure_compiled_steps` returns them (empty: not measured).
    """

    compile: bool
    why: str
    compiled_over_eager: float | None = None
    compile_seconds: float | None = None
    measured: dict = dataclasses.field(default_factory=dict)


def choice_cache_dir() -> Path:
    """``$TETRIS_HF_CACHE/compile-choices`` (default ``~/.cache/tetris_hf/compile-choices``)."""
    return cache_dir() / "compile-choices"


@dataclass
class CompileLater:
    """``tetris_compile=None`` in a call whose target may compile: the call runs eager and compiles once its eager
    steps have taken :attr:`payback_seconds`, the time after which compiled steps would have saved what the compile
    costs (a ski rental: a call that ends sooner never compiles and is eager's own; one that ends right after the
    compile took at most ``1 + saving`` times eager's time, 1.06x with the 2-core CPU's 0.9365x; a longer one gains
    the saving on every later step). With no choice measured yet for the model, the call measures when due
    (:func:`measure_compiled_steps`, whose compile then serves the call) after :data:`UNMEASURED_PAYBACK_SECONDS`.

    Attributes:
        model: the target.
        payback_seconds: eager steps' seconds after which the call compiles (or measures).
        choice: the cached choice (one that compiles), or ``None``: measure when due.
        eager_seconds: eager steps' seconds so far (:meth:`count`).
    """

    model: torch.nn.Module
    payback_seconds: float
    choice: CompileChoice | None = None
    eager_seconds: float = 0.0

    def count(self, seconds: float) -> bool:
        """Add an eager step's (or prompt read's) ``seconds``; whether the call should compile now."""
        self.eager_seconds += seconds
        return self.eager_seconds >= self.payback_seconds

    def decide(self) -> bool:
        """Due: whether to compile now, measuring first where no choice was cached (said in a warning either way)."""
        choice = self.choice or compile_choice(self.model, None, TetrisOptions())
        if choice.compile:
            logger.warning("tetris_compile=None: %.0f s of eager steps, compiling %s's forwards now (%s); "
                           "tetris_compile=False never compiles, True compiles at once.", self.eager_seconds,
                           type(self.model).__name__, choice.why)
        return choice.compile


def compile_later(model: torch.nn.Module, assistant_model: torch.nn.Module | None,
                  options: TetrisOptions) -> CompileLater | None:
    """For ``tetris_compile=None``: a :class:`CompileLater` where the call may compile its target's forwards later;
    ``None`` where it runs eager throughout: a call ruled out (:func:`_ruled_out`), a model whose cached choice is not
    to compile, or ``tetris_compile`` given (``True`` or ``False``). Measures nothing."""
    if options.tetris_compile is not None or _ruled_out(model, assistant_model, options) is not None:
        return None
    choice = cached_choice(model)
    if choice is None:
        return CompileLater(model, UNMEASURED_PAYBACK_SECONDS)
    if not choice.compile:
        return None
    return CompileLater(model, payback_seconds(choice), choice)


def payback_seconds(choice: CompileChoice) -> float:
    """Eager steps' seconds after which compiled steps would have saved ``choice``'s compile: its compile seconds over
    the share of a step's time compiling saves."""
    return choice.compile_seconds / max(1.0 - choice.compiled_over_eager, 1e-3)


def cached_choice(model: torch.nn.Module) -> CompileChoice | None:
    """The choice measured for ``model`` on this machine (in memory, else on disk), or ``None``."""
    return _cached(_choice_key(model))


def _cached(key: str) -> CompileChoice | None:
    """The choice cached under ``key`` (in memory, else on disk), or ``None``."""
    choice = _CHOICES.get(key) or _read(choice_cache_dir() / f"{key}.json")
    if choice is not None:
        _CHOICES[key] = choice
    return choice


def _choice_key(model: torch.nn.Module) -> str:
    """What a choice is cached under: what it was measured for, as a cost profile is (the model, device, dtype,
    threads, torch, linear kernels)."""
    return "compile-" + profile_key(model, None)


def compile_choice(model: torch.nn.Module, assistant_model: torch.nn.Module | None,
                   options: TetrisOptions) -> CompileChoice:
    """Whether ``tetris_compile=None`` compiles ``model``'s forwards in a call with ``assistant_model`` and
    ``options``: never where the call or the model rules it out (:func:`_ruled_out`); elsewhere as measured on this
    machine, once (cached in memory and on disk; the first call measures, which includes the compile that call's
    steps then use)."""
    reason = _ruled_out(model, assistant_model, options)
    if reason is not None:
        return CompileChoice(False, reason)
    key = _choice_key(model)
    choice = _cached(key)
    if choice is None:
        choice = _CHOICES[key] = _measure_and_choose(model)
        _write(choice_cache_dir() / f"{key}.json", choice)
    return choice


def _ruled_out(model: torch.nn.Module, assistant_model: torch.nn.Module | None,
               options: TetrisOptions) -> str | None:
    """Why ``tetris_compile=None`` stays eager without measuring, or ``None`` when it measures."""
    if os.environ.get(ENVIRONMENT, "").strip() == "0":
        return f"${ENVIRONMENT}=0"
    if assistant_model is not None:
        return "a draft model's or head's compiled steps are not measured: tetris_compile=True compiles both"
    if not options.tetris_pack:
        return "unpacked blocks compile on static shapes only (tetris_compile=True)"
    try:
        check_compilable(model, "target")
    except ValueError as error:
        return str(error)
    if not compiles_on_eager_shapes(model, packs_exactly(model)):
        return ("only a CPU target that reads packed blocks on sdpa compiles on its eager shapes; elsewhere "
                "tetris_compile=True compiles on static shapes")
    return None


def _measure_and_choose(model: torch.nn.Module) -> CompileChoice:
    """Measure (:func:`measure_compiled_steps`, saying so before and after: it compiles) and choose."""
    logger.warning("tetris_compile=None: timing %s's steps compiled against eager on this machine, once (cached under "
                   "%s); the compile takes a while (about a minute for a 135M model on 2 CPU cores). "
                   "tetris_compile=True or False skips it.", type(model).__name__, choice_cache_dir())
    try:
        measured = measure_compiled_steps(model)
    except Exception as error:  # (a compiler missing or failing: eager, and said why)
        logger.warning("tetris_compile=None: compiling failed, staying eager: %s: %s", type(error).__name__, error)
        return CompileChoice(False, f"compiling failed: {type(error).__name__}: {error}"[:500])
    ratio = round(measured["compiled_seconds"] / measured["eager_seconds"], 4)  # (as cached and said: one number)
    pays = ratio <= PAYS_BELOW
    why = (f"compiled steps took {ratio:.4f}x eager's ({'at most' if pays else 'above'} {PAYS_BELOW}) on {ROWS} rows "
           f"of 1 and 4 tokens over {CONTEXT} cached; the compile {measured['compile_seconds']:.0f} s")
    logger.warning("tetris_compile=None: %s: %s", why, "compiling" if pays else "staying eager")
    return CompileChoice(pays, why, compiled_over_eager=ratio, compile_seconds=measured["compile_seconds"],
                         measured=measured)


@torch.no_grad()
def measure_compiled_steps(model: torch.nn.Module, rows: int = ROWS, context: int = CONTEXT,
                           widths: tuple[int, ...] = WIDTHS, steps: int = STEPS) -> dict:
    """Time ``model``'s decoding steps eager and compiled on its eager shapes: two caches read the same ``(rows,
    context)`` random prompt, then take the same steps of ``widths`` tokens a row, ``steps`` timed each after one
    untimed, the eager and the compiled step in turn (so that a noisy machine slows both alike).

    Returns:
        ``{"eager_seconds", "compiled_seconds"}`` summed over the timed steps, ``"compile_seconds"`` (the compiled
        cache's untimed forwards, the compiler's time), ``"graphs"`` compiled, and the sizes measured.
    """
    device = model.get_input_embeddings().weight.device
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(vocab, (rows, context), generator=generator).to(device)
    blocks = [torch.randint(vocab, (rows, width), generator=generator).to(device) for width in widths]
    capacity = context + (steps + 1) * sum(widths)
    caches = {}
    for compiled in (False, True):
        cache = SlotCache(rows, device, capacity=capacity)
        cache.pack = True
        if compiled:
            cache.eager_shapes_forward = eager_shapes_forward(model)
        caches[compiled] = cache
    seconds = {False: 0.0, True: 0.0}
    graphs, compile_seconds = compiled_graphs(), 0.0
    with routed_attention(model):
        for compiled, cache in caches.items():
            started = time.perf_counter()
            cache.forward(model, prompt, None, discard_logits=True)
            compile_seconds += (time.perf_counter() - started) if compiled else 0.0
        for block in blocks:
            width = block.shape[1]
            real_lengths = torch.full((rows,), width, device=device)
            for step in range(steps + 1):
                for compiled, cache in caches.items():
                    started = time.perf_counter()
                    cache.forward(model, block, None, step=True, real_lengths=real_lengths, num_real=rows * width)
                    elapsed = time.perf_counter() - started
                    if step:
                        seconds[compiled] += elapsed
                    elif compiled:
                        compile_seconds += elapsed
    return {"eager_seconds": round(seconds[False], 6), "compiled_seconds": round(seconds[True], 6),
            "compile_seconds": round(compile_seconds, 3), "graphs": compiled_graphs() - graphs, "rows": rows,
            "context": context, "widths": list(widths), "steps": steps, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "version": VERSION}


def _read(path: Path) -> CompileChoice | None:
    """The choice cached at ``path``, or ``None`` (absent, unreadable, or of another measurement version)."""
    try:
        data = json.loads(path.read_text())
        choice = CompileChoice(**data)
    except (OSError, ValueError, TypeError):
        return None
    return choice if choice.measured.get("version") == VERSION else None


def _write(path: Path, choice: CompileChoice) -> None:
    """Cache a measured ``choice`` at ``path`` (one not measured, a failed compile, is kept in memory only)."""
    if not choice.measured:  # (so that a compiler installed later is tried again)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(choice), indent=1))
    except OSError:
        pass  # a read-only home: the memory cache still holds it


def clear_memory_cache() -> None:
    """Forget the choices made in this process (the disk cache stays)."""
    _CHOICES.clear()
