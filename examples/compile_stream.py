"""What compiling costs a request stream (``tetris_compile=True`` in ``tetris_hf.generate_batch``'s stream): the first
run compiles, a second runs warm, next to the eager stream on the same requests.

    python examples/compile_stream.py                          # random tiny Llama pair (seconds)
    python examples/compile_stream.py --pair default --requests 32 --max-batch-size 8 --new-tokens 32

Prints, per strategy: the eager stream's seconds, the compiled stream's first run (seconds, of which torch.compile's;
the CPU seconds it took, the C++ compiler's included, as wall seconds are inflated on a shared machine), the graphs
dynamo compiled in it per call, its warm run, and how many outputs equal the eager stream's. A fresh process and
``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` (or a new ``TORCHINDUCTOR_CACHE_DIR``) measure a cold compile (inductor
otherwise reuses the kernels of an earlier process with the same shapes). :func:`measure` is what
``examples/gpu_check.py`` runs too.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

import tetris_hf  # noqa: F401


def cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (inductor compiles C++ kernels in subprocesses)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


def measure(target, draft, requests: list[list[int]], eos: set[int], pad: int, max_batch_size: int,
            new_tokens: int, strategy: str, k: int, extra: int) -> dict:
    """The eager stream, then the compiled stream twice (compiling, warm), greedy, on ``requests``: seconds, compile
    seconds, graphs compiled, and the compiled outputs equal to the eager ones."""
    from torch._dynamo.utils import counters

    from tetris_hf.tools.stream_bench import run_stream

    options = dict(assistant_model=draft, num_assistant_tokens=k, tetris_extra_tokens=extra)
    options.update({"tetris_budget": 0} if strategy == "plain" else {"tetris_strategy": strategy})
    with torch.no_grad():
        eager = run_stream("eager", target, requests, new_tokens, max_batch_size, eos, pad, **options)
        graphs, compiling, cpu = counters["stats"]["unique_graphs"], compile_seconds(), cpu_seconds()
        first = run_stream("compiled, first", target, requests, new_tokens, max_batch_size, eos, pad,
                           tetris_compile=True, **options)
        graphs, compiling = counters["stats"]["unique_graphs"] - graphs, compile_seconds() - compiling
        cpu = cpu_seconds() - cpu
        warm = run_stream("compiled, warm", target, requests, new_tokens, max_batch_size, eos, pad,
                          tetris_compile=True, **options)
    return {"strategy": strategy, "max_batch_size": max_batch_size, "requests": len(requests),
            "eager_s": round(eager.seconds, 2), "first_s": round(first.seconds, 2), "first_cpu_s": round(cpu, 2),
            "compile_s": round(compiling, 2),
            "graphs": graphs, "warm_s": round(warm.seconds, 2),
            "equal": sum(a == b for a, b in zip(warm.tokens, eager.tokens)) + sum(
                a == b for a, b in zip(first.tokens, eager.tokens)), "outputs": 2 * len(requests)}


def tiny_pair(seed: int = 0):
    """A random 4-layer Llama (width 64, vocabulary 256) and a 1-layer draft of its first layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(config).eval()
    draft_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
    draft = LlamaForCausalLM(draft_config).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    return target, draft


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=("tiny", "default"), default="tiny",
                        help="tiny: random Llamas; default: the offline default pair (SmolLM2-135M + its draft)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--strategies", nargs="+", default=["tetris", "fixed"])
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--extra", type=int, default=2)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    if args.pair == "tiny":
        target, draft = tiny_pair()
        vocab, eos, pad = 256, {3}, 0
    else:
        from tetris_hf.tools.models import load_default_pair

        target, draft, tokenizer, _ = load_default_pair()
        vocab, eos, pad = target.config.vocab_size, {tokenizer.eos_token_id}, tokenizer.pad_token_id or 0
    requests = [torch.randint(4, vocab, (int(length),), generator=generator).tolist()
                for length in torch.randint(8, 65, (args.requests,), generator=generator)]
    print(f"{args.pair} pair, {args.requests} requests of 8-64 tokens, {args.new_tokens} new tokens, "
          f"max_batch_size {args.max_batch_size}, k = {args.k}, e = {args.extra}, {torch.get_num_threads()} threads")
    print("| strategy | eager s | compiled first s (CPU s) | of which compiling s | graphs | compiled warm s | "
          "= eager |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for strategy in args.strategies:
        started = time.perf_counter()
        row = measure(target, draft, requests, eos, pad, args.max_batch_size, args.new_tokens, strategy, args.k,
                      args.extra)
        print(f"| {strategy} | {row['eager_s']} | {row['first_s']} ({row['first_cpu_s']}) | {row['compile_s']} | "
              f"{row['graphs']} | {row['warm_s']} | {row['equal']}/{row['outputs']} |  "
              f"({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
