"""Reading the prompts against the whole run, vLLM's CPU engine and our stream, on the same prompt set: how much of a
side by side's time is prompt reads, on each side, under the allocator this process runs under.

    export TETRIS_HF_VLLM_PYTHON=/work/vllm-venv/bin/python     # scripts/setup_vllm.sh makes it
    OMP_NUM_THREADS=2 python examples/prompts_vs_vllm.py --prompts sharegpt
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 OMP_NUM_THREADS=2 \\
        python examples/prompts_vs_vllm.py --prompts sharegpt        # both sides under tcmalloc

Every system serves the set's ``--num-prompts`` requests (greedy, fp32, the target's end tokens, at most ``--rows``
rows, oneDNN linears on our side as on vLLM's) ``--repeats`` times: once with one new token each (the prompts' read
and the first token) and once with ``--max-new-tokens``; the difference is what the decode and verify steps cost.
vLLM runs in its own venv (``--vllm-python`` or ``$TETRIS_HF_VLLM_PYTHON``) and inherits this process's
``LD_PRELOAD``; absent, the run says so and goes on. Measurements: docs/benchmarks.md, "Page faults: the allocator
under both engines".
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import tetris_hf  # noqa: F401
from tetris_hf import use_onednn_linears
from tetris_hf.tools import stream_bench
from tetris_hf.tools.allocator import allocator_note, loaded_allocator
from tetris_hf.tools.models import load_target

SYSTEMS = ("vllm", "stream-plain", "stream-plain-compiled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval-edit", help="a prompt set of tetris-hf stream-bench")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default="vllm,stream-plain-compiled", help="comma list of " + ", ".join(SYSTEMS))
    parser.add_argument("--vllm-python", default=None, help="default $TETRIS_HF_VLLM_PYTHON")
    args = parser.parse_args()
    systems = [name for name in args.systems.split(",") if name]
    if set(systems) - set(SYSTEMS):
        parser.error(f"unknown --systems {sorted(set(systems) - set(SYSTEMS))}: choose from {', '.join(SYSTEMS)}")
    target, tokenizer = load_target(None)
    use_onednn_linears(target)
    prompts, note, eos, pad = stream_bench.stream_prompts(target, tokenizer, args.prompts, args.num_prompts,
                                                          args.max_prompt_tokens)
    print(f"{len(prompts)} prompts ({args.prompts}), {sum(map(len, prompts))} tokens, {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} each; {torch.get_num_threads()} threads\n{allocator_note(loaded_allocator())}",
          flush=True)
    with contextlib.ExitStack() as stack:
        for name in systems:
            if name == "vllm":
                from tetris_hf.tools.vllm_system import VLLMEngine, VLLMUnavailable, find_vllm, model_folder

                try:
                    python, version = find_vllm(args.vllm_python)
                except VLLMUnavailable as error:
                    print(f"vllm: not run ({error})", flush=True)
                    continue
                engine = stack.enter_context(VLLMEngine(
                    python, model_folder(None), max_num_seqs=args.rows,
                    max_model_len=args.max_prompt_tokens + args.max_new_tokens + 8, threads=torch.get_num_threads(),
                    speculative=None, log_path=f"/tmp/prompts-vs-vllm-{version}.log"))
                engine.start()
                print(f"vllm {version}: started in {engine.startup_seconds:.1f} s, "
                      f"{engine.ready.get('allocator', '?')} (not counted)", flush=True)
                run = lambda new: float(engine.generate(prompts, new, sorted(eos))["seconds"])  # noqa: E731
            else:
                options = dict(tetris_budget=0, prompt_lookup_num_tokens=4, max_matching_ngram_size=3,
                               tetris_compile=name.endswith("-compiled"))
                run = lambda new, options=options: stream_bench.run_stream(  # noqa: E731
                    name, target, prompts, new, args.rows, eos, pad, **options).seconds
            with torch.no_grad():
                run(2)
                run(args.max_new_tokens)  # (a warm-up: a compiled stream compiles here)
                for _ in range(args.repeats):
                    alone, whole = run(1), run(args.max_new_tokens)
                    print(f"{name}: prompts alone {alone:.2f} s, whole {whole:.2f} s (steps {whole - alone:.2f} s)",
                          flush=True)


if __name__ == "__main__":
    main()
