"""``adaptive`` in a request stream, step by step, beside ``fixed``: each run's throughput, the steps as one string
(``0`` a plain step, ``K`` a drafting one, ``p`` a probe), tokens a row-step and step time for the drafting and the
plain steps apart, and what the pair's memory holds at the end (guard, probe interval, realized gain, probe price).
The strategies (``--strategies``; ``plain``: the same stream with speculation off) alternate, ``--rounds`` times
each, so that the second ``adaptive`` starts from what the first learnt, as a long-lived stream would.

    python examples/adaptive_stream_trace.py --prompts humaneval-edit --draft lookup

``--first-steps N`` also prints each run's first ``N`` steps row by row: cells verified and accepted.
"""

from __future__ import annotations

import argparse
import time

from tetris_hf.stream import RequestStream
from tetris_hf.tools.models import load_target
from tetris_hf.tools.stream_bench import stream_prompts

DRAFTS = {"lookup": "prompt_lookup_num_tokens", "suffix": "tetris_suffix_num_tokens"}


def serve(target, prompts, eos, pad, strategy: str, draft: str, args) -> tuple[list, float, int, object]:
    """Every prompt through one stream; ``(steps, seconds, tokens, the stream's loop core)``, each step
    ``(K, probe, rows, tokens emitted, seconds, cells verified a row, cells accepted a row, StepSeconds)``."""
    steps, cores = [], []

    def on_step(record, loop):
        steps.append((record.num_drafted, record.probe, record.rows.numel(), int(record.emitted.sum()),
                      sum(record.seconds), record.verify_lengths.tolist(), record.num_accepted.tolist(),
                      record.seconds))
        cores[:] = [loop.core]

    # ("plain": speculation off, as stream-bench's stream-plain: the drafter never drafts)
    settings = {"tetris_budget": 0} if strategy == "plain" else {"tetris_strategy": strategy}
    stream = RequestStream(target, max_batch_size=args.max_batch_size, max_new_tokens=args.max_new_tokens,
                           do_sample=False, eos_token_id=sorted(eos), pad_token_id=pad, tetris_step_callback=on_step,
                           tetris_extra_tokens=2, **{DRAFTS[draft]: args.k}, **settings)
    start = time.perf_counter()
    for prompt in prompts:
        stream.add(prompt)
    try:
        outputs = list(stream.run())
    finally:
        stream.close()
    return steps, time.perf_counter() - start, sum(len(output.generated_tokens) for output in outputs), cores[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="humaneval-edit")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--draft", choices=tuple(DRAFTS), default="lookup")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--strategies", default="fixed,adaptive", help="in turn each round; plain: speculation off")
    parser.add_argument("--first-steps", type=int, default=0, metavar="N")
    args = parser.parse_args()
    target, tokenizer = load_target()
    prompts, note, eos, pad = stream_prompts(target, tokenizer, args.prompts, args.num_prompts, 512)
    print(f"{len(prompts)} requests ({note}), {args.draft} k = {args.k}, {args.max_batch_size} rows", flush=True)
    for _ in range(args.rounds):
        for strategy in args.strategies.split(","):
            steps, seconds, tokens, core = serve(target, prompts, eos, pad, strategy, args.draft, args)
            print(f"== {strategy}: {tokens / seconds:.1f} tok/s, {len(steps)} steps, {seconds:.1f} s")
            print("".join("p" if probe else str(k) for k, probe, *_ in steps))
            for number, (k, probe, *_, verified, accepted, _) in enumerate(steps[:args.first_steps]):
                print(f"  step {number} ({'probe' if probe else f'K = {k}'}): verified {verified}, accepted {accepted}")
            for label, group in (("drafting", [s for s in steps if s[0] > 0]), ("plain", [s for s in steps if not s[0]])):
                if group:
                    rows, emitted, busy = (sum(s[i] for s in group) for i in (2, 3, 4))
                    phases = ", ".join(f"{name} {1000 * sum(s[-1][i] for s in group) / len(group):.1f}"
                                       for i, name in enumerate(group[0][-1]._fields))
                    print(f"  {label}: {len(group)} steps, {emitted / rows:.2f} tokens a row-step, "
                          f"{1000 * busy / len(group):.1f} ms a step ({phases}), {rows / len(group):.1f} rows")
            memory = getattr(core.strategy, "memory", None)
            if memory is not None:
                print(f"  memory: guarded {memory.guarded}, probe interval {memory.probe_interval}, realized "
                      f"{[round(gain.factor(4.0), 3) for gain in memory.realized.values()]}, probe cost "
                      f"{memory.probe_cost}", flush=True)


if __name__ == "__main__":
    main()
