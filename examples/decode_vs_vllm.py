"""A decode step alone, vLLM's CPU engine against our stream, at one context length: what the side by side mixes with
prompt reads and admissions, taken apart.

    export TETRIS_HF_VLLM_PYTHON=/work/vllm-venv/bin/python     # scripts/setup_vllm.sh makes it
    OMP_NUM_THREADS=2 python examples/decode_vs_vllm.py --context 128 --new-tokens 64 \\
        --systems vllm,stream-plain,stream-plain-compiled

Every system serves the same ``--rows`` prompts of ``--context`` random tokens (greedy, fp32, no end token, so every
row decodes ``--new-tokens``), oneDNN linears on our side as on vLLM's. A decode step's time is a run with
``--new-tokens + 1`` new tokens less a run with 1 (the prompts' read and the first token), over ``--new-tokens``;
the second run alone is the prompts' read. Each system runs ``--repeats`` such pairs after a warm-up (a compiled
stream's first full run compiles, untimed). vLLM runs in its own venv (``--vllm-python`` or
``$TETRIS_HF_VLLM_PYTHON``); absent, the run says so and goes on. Measurements: docs/benchmarks.md, "Decode steps
against vLLM's at equal contexts".
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf import use_onednn_linears
from tetris_hf.tools import stream_bench
from tetris_hf.tools.models import load_target

SYSTEMS = ("vllm", "stream-plain", "stream-plain-compiled")


def vllm_runner(args, prompts, stack: contextlib.ExitStack):
    """A function ``(new_tokens) -> seconds`` on a started engine (stopped when ``stack`` closes)."""
    from tetris_hf.tools.vllm_system import VLLMEngine, find_vllm, model_folder

    python, version = find_vllm(args.vllm_python)
    engine = stack.enter_context(VLLMEngine(python, model_folder(None), max_num_seqs=args.rows,
                                            max_model_len=args.context + args.new_tokens + 8,
                                            threads=torch.get_num_threads(), speculative=None,
                                            log_path=f"/tmp/decode-vs-vllm-{version}.log"))
    engine.start()
    print(f"vLLM {version}: engine started in {engine.startup_seconds:.1f} s (not counted)", flush=True)
    return lambda new: float(engine.generate(prompts, new, [])["seconds"])


def stream_runner(name: str, target, prompts):
    """A function ``(new_tokens) -> seconds``: our request stream without speculation, eager or compiled."""
    options = dict(tetris_budget=0, prompt_lookup_num_tokens=4, max_matching_ngram_size=3,
                   tetris_compile=name.endswith("-compiled"))
    return lambda new: stream_bench.run_stream(name, target, prompts, new, len(prompts), set(), 0, **options).seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens a row")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps timed")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of " + ", ".join(SYSTEMS))
    parser.add_argument("--vllm-python", default=None, help="default $TETRIS_HF_VLLM_PYTHON")
    args = parser.parse_args()
    target, _ = load_target(None)
    use_onednn_linears(target)
    generator = torch.Generator().manual_seed(0)
    vocabulary = target.get_input_embeddings().weight.shape[0]
    prompts = [torch.randint(100, vocabulary, (args.context,), generator=generator).tolist() for _ in range(args.rows)]
    print(f"{args.rows} rows of {args.context} prompt tokens, {args.new_tokens} decode steps, "
          f"{torch.get_num_threads()} threads", flush=True)
    for name in args.systems.split(","):
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system {name!r}; one of {', '.join(SYSTEMS)}")
        with contextlib.ExitStack() as stack, torch.no_grad():
            if name == "vllm":
                from tetris_hf.tools.vllm_system import VLLMUnavailable

                try:
                    run = vllm_runner(args, prompts, stack)
                except VLLMUnavailable as error:
                    print(f"{error}; going on with the other systems", flush=True)
                    continue
            else:
                run = stream_runner(name, target, prompts)
            run(2)  # warm-up: first-call costs
            if name.endswith("-compiled"):
                started = time.perf_counter()
                run(args.new_tokens + 1)
                print(f"{name}: compile run {time.perf_counter() - started:.1f} s (not counted)", flush=True)
            for _ in range(args.repeats):
                whole, prompts_only = run(args.new_tokens + 1), run(1)
                print(f"{name}: {1000 * (whole - prompts_only) / args.new_tokens:.1f} ms a decode step; prompts read "
                      f"in {prompts_only:.2f} s", flush=True)


if __name__ == "__main__":
    main()
