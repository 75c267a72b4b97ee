"""Which occurrence should prompt lookup copy from: the loop's rule (``best``: the most tokens to copy, then the
longest match with the row's end, then the latest), the latest earlier occurrence of the row's last n-gram, or the
earliest (transformers' one-row lookup)? Measured on the target's own greedy continuations.

For each prompt the target generates ``--max-new-tokens`` tokens greedily (plain ``generate()``, the offline default
target unless ``--target``). Lookup is then replayed on those outputs: at each step it drafts ``k`` tokens from the
row's prompt and output so far, the drafts matching the target's continuation are accepted, and the row advances by
them plus one target token, exactly as greedy verification would. Printed per prompt set and ``k``: tokens per
row-step (emitted per target forward) and the share of steps that drafted anything, for each rule.

    python examples/lookup_occurrence.py --prompts humaneval-edit,sharegpt-summarize,sharegpt --num-prompts 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tetris_hf.candidate_generators.prompt_lookup import OCCURRENCES, lookup_drafts


def replay_lookup(sequences: torch.Tensor, starts: torch.Tensor, prompt_ends: torch.Tensor, ends: torch.Tensor,
                  num_tokens: int, ngram_sizes: range, occurrence: str = "best") -> dict:
    """Greedy lookup replayed on known continuations, all rows at once.

    Args:
        sequences: ``(B, T)`` left-padded prompt + the target's greedy continuation per row.
        starts, prompt_ends, ends: ``(B,)`` first real column, first generated column, end of the continuation.
        num_tokens: ``k``.
        ngram_sizes, occurrence: as :func:`~tetris_hf.candidate_generators.prompt_lookup.lookup_drafts`.

    Returns:
        ``{"steps": row-steps, "tokens": tokens emitted, "drafting_steps": row-steps with a match,
        "accepted": drafts accepted}``.
    """
    lengths = prompt_ends.clone()
    totals = dict(steps=0, tokens=0, drafting_steps=0, accepted=0)
    columns = torch.arange(num_tokens)
    while True:
        active = lengths < ends
        if not bool(active.any()):
            return totals
        drafts, counts, _ = lookup_drafts(sequences, starts, lengths, num_tokens, ngram_sizes,
                                          occurrence=occurrence)
        truth = sequences.gather(1, (lengths[:, None] + columns).clamp(max=sequences.shape[1] - 1))
        room = (ends - lengths - 1).clamp(min=0)  # the last token is always the target's
        usable = torch.minimum(counts, room)
        matches = (drafts == truth) & (columns[None, :] < usable[:, None])
        accepted = matches.long().cumprod(dim=1).sum(dim=1)
        emitted = torch.where(active, accepted + 1, 0)
        totals["steps"] += int(active.sum())
        totals["tokens"] += int(emitted.sum())
        totals["drafting_steps"] += int((active & (usable > 0)).sum())
        totals["accepted"] += int(torch.where(active, accepted, 0).sum())
        lengths = lengths + emitted


def greedy_continuations(target, tokenizer, prompts, max_new_tokens: int, batch_size: int):
    """``(sequences, starts, prompt_ends, ends)`` of the target's greedy outputs, batch by batch, left-padded."""
    from tetris_hf.tools.data import render_prompts

    rows = []
    for first in range(0, len(prompts), batch_size):
        texts = render_prompts(prompts[first : first + batch_size], tokenizer)
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = target.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)
        width = batch["input_ids"].shape[1]
        for row, mask in zip(out, batch["attention_mask"]):
            generated = row[width:].tolist()
            if tokenizer.eos_token_id in generated:
                generated = generated[: generated.index(tokenizer.eos_token_id) + 1]
            rows.append(row[width - int(mask.sum()) : width].tolist() + generated)
            rows[-1] = (rows[-1], int(mask.sum()))
    longest = max(len(tokens) for tokens, _ in rows)
    sequences = torch.full((len(rows), longest), tokenizer.pad_token_id, dtype=torch.long)
    starts, prompt_ends, ends = [], [], []
    for index, (tokens, prompt_length) in enumerate(rows):
        sequences[index, longest - len(tokens):] = torch.tensor(tokens)
        starts.append(longest - len(tokens))
        prompt_ends.append(longest - len(tokens) + prompt_length)
        ends.append(longest)
    return sequences, torch.tensor(starts), torch.tensor(prompt_ends), torch.tensor(ends)


def main(argv=None) -> int:
    from tetris_hf.tools.data import load_prompts
    from tetris_hf.tools.models import load_default_pair

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="humaneval-edit,sharegpt-summarize,sharegpt")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--skip", type=int, default=0, help="leave out each set's first this-many prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-tokens", default="2,4,8", help="k values, comma-separated")
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--min-ngram", type=int, default=1)
    parser.add_argument("--target", default=None)
    parser.add_argument("--output", default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    target, _, tokenizer, _ = load_default_pair(args.target)
    tokenizer.padding_side = "left"
    sizes = range(args.min_ngram, args.max_ngram + 1)
    results = []
    print(f"{'prompts':20s} {'k':>3s} {'occurrence':>10s} {'tokens/step':>12s} {'drafting':>9s} {'accepted/draft step':>20s}")
    for name in args.prompts.split(","):
        prompts = list(load_prompts(name, limit=args.skip + args.num_prompts))[args.skip :]
        data = greedy_continuations(target, tokenizer, list(prompts), args.max_new_tokens, args.batch_size)
        for k in (int(value) for value in args.num_tokens.split(",")):
            for occurrence in OCCURRENCES:
                totals = replay_lookup(*data, k, sizes, occurrence)
                row = dict(prompts=name, k=k, occurrence=occurrence,
                           tokens_per_step=totals["tokens"] / totals["steps"],
                           drafting_share=totals["drafting_steps"] / totals["steps"],
                           accepted_per_drafting_step=totals["accepted"] / max(totals["drafting_steps"], 1))
                results.append(row)
                print(f"{name:20s} {k:3d} {row['occurrence']:>10s} {row['tokens_per_step']:12.3f} "
                      f"{row['drafting_share']:9.3f} {row['accepted_per_drafting_step']:20.3f}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
