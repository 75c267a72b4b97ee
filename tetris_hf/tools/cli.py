"""The ``tetris-hf`` command line: one sub-command per module.

Each sub-command lives in its own module, which defines ``add_arguments(parser)`` and ``main(args) -> int``.
User mistakes raise :class:`UsageError`; they are printed as one line and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> (module, one-line help)
COMMANDS = {
    "bench": ("tetris_hf.tools.bench", "throughput, acceptance and VSR of TETRIS vs the baselines on real prompts"),
    "distill": ("tetris_hf.tools.distill", "train a small same-tokenizer draft for a target by KL distillation"),
    "distill-whisper": ("tetris_hf.tools.distill_whisper", "train a 2-layer distil-whisper style draft for "
                        "whisper-base on its own transcripts of synthesized speech"),
    "speech-bench": ("tetris_hf.tools.speech_bench", "Whisper on synthesized speech: plain generate(), transformers' "
                     "assisted generation and TETRIS at several batch sizes; exactness, WER, acceptance"),
    "train-eagle": ("tetris_hf.tools.train_eagle", "train an EAGLE-3 draft head for a target, with training-time test"),
    "stream-bench": ("tetris_hf.tools.stream_bench", "a stream of requests: continuous batching with TETRIS vs "
                     "transformers' generate_batch and static chunks"),
    "simulate": ("tetris_hf.tools.simulate", "replay recorded acceptance traces under a cost curve"),
    "bound": ("tetris_hf.tools.bound", "optimal multi-draft acceptance vs verifiers on real distributions"),
    # one module, two commands: its main reads args.command
    "export-hub": ("tetris_hf.tools.hub_export", "write the strategy as a Hub custom_generate repository into DIR"),
    "export-space": ("tetris_hf.tools.hub_export", "write the Space demo (examples/space/ and its strategy/) into DIR"),
}


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


# Helpers the sub-commands share -------------------------------------------------------------------------------


def number_list(kind: type = int, minimum: float | None = None):
    """argparse type: a comma-separated list of ``kind`` values, each ``>= minimum`` when given."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected at least one {kind.__name__}, got {text!r}")
        if minimum is not None and min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected values >= {minimum}, got {text!r}")
        return values

    return parse


def resolve_device(name: str | None):
    """``--device``: ``auto``/``None`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    import torch

    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown --device {name!r}: use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name} asked for, but this machine has no CUDA device: use --device cpu")
    return device


def load_pair(target: str | None, draft: str | None, device, quantization_config=None):
    """``--target``/``--draft``: :func:`tetris_hf.tools.models.load_default_pair`, with a missing model or a draft of
    another vocabulary as a one-line :class:`UsageError`."""
    from .models import ModelNotFoundError, load_default_pair

    try:
        return load_default_pair(target, draft, device=device, quantization_config=quantization_config)
    except (ModelNotFoundError, ValueError) as error:
        raise UsageError(str(error)) from None


def add_kernel_argument(parser: argparse.ArgumentParser) -> None:
    """``--onednn-linears``: every model of the run on oneDNN's linear kernels (:mod:`tetris_hf.cpu_kernels`)."""
    parser.add_argument("--onednn-linears", action="store_true",
                        help="switch the target's and the draft's linear layers to faster CPU kernels (ours for "
                             "fp32, oneDNN's for bf16; every system of the run uses them): see tetris_hf.cpu_kernels")


def apply_kernels(args, *models) -> str:
    """The models on the faster CPU linear kernels (:mod:`tetris_hf.cpu_kernels`) where ``args.onednn_linears`` asks; a
    line saying which kernels run."""
    if not getattr(args, "onednn_linears", False):
        return "linear layers: PyTorch's own (MKL on CPU)"
    from tetris_hf.cpu_kernels import panels_available, use_onednn_linears

    try:
        switched = sum(use_onednn_linears(model) for model in models if model is not None)
    except ValueError as error:
        raise UsageError(f"--onednn-linears: {error}") from None
    kernels = "our panel kernel (fp32), oneDNN (bf16)" if panels_available() else "oneDNN"
    return f"linear layers: {kernels} ({switched} switched, every system)"


def load_prompt_set(name: str):
    """``--prompts``: a prompt set by name or path (see :func:`tetris_hf.tools.data.load_prompts`), checked before any
    model loads."""
    from .data import load_prompts

    try:
        return load_prompts(name)
    except (ValueError, FileNotFoundError) as error:
        raise UsageError(str(error)) from None


def training_chats(path: str | None, seed: int, side: str = "fitting") -> tuple[list, str]:
    """``--data`` for the training commands: the ShareGPT chats to fit to, shuffled with ``seed``, and a one-line note
    on where they came from. ``side`` ``"fitting"``: the fitting side of the split
    (:func:`tetris_hf.tools.data.sharegpt_fitting_chats`, which no prompt set for measurement reads); ``"all"``: every
    human-first chat. A missing, broken or empty file is a one-line :class:`UsageError`."""
    import random

    from .data import load_sharegpt_chats, sharegpt_fitting_chats

    try:
        if side == "fitting":
            chats, note = sharegpt_fitting_chats(path)
        else:
            everything = load_sharegpt_chats(path)
            chats, note = list(everything), f"{everything.note}; every human-first chat (--data-side all)"
    except (ValueError, FileNotFoundError) as error:
        raise UsageError(str(error)) from None
    if not chats:
        raise UsageError(f"{path or 'the ShareGPT file'} holds no chat that starts with a human turn: nothing to "
                         "train on")
    random.Random(seed).shuffle(chats)
    return chats, f"{note}, shuffled with seed {seed}"


def prompt_texts(prompt_set, limit: int, tokenizer, max_prompt_tokens: int | None = None) -> tuple[list[str], str]:
    """The first ``limit`` non-empty prompts of the set (of at most ``max_prompt_tokens`` tokens), rendered for
    ``tokenizer`` (chats through its chat template); and a one-line note on where they came from."""
    from .data import render_prompts

    texts, skipped = [], 0
    for prompt in prompt_set:
        if len(texts) == limit:
            break
        text = render_prompts([prompt], tokenizer)[0]
        if not text.strip():
            continue
        if max_prompt_tokens is not None and len(tokenizer(text, add_special_tokens=False)["input_ids"]) > max_prompt_tokens:
            skipped += 1
            continue
        texts.append(text)
    if not texts:
        longest = f" of at most {max_prompt_tokens} tokens" if max_prompt_tokens is not None else ""
        raise UsageError(f"prompt set {prompt_set.name!r} holds no non-empty prompt{longest}")
    note = prompt_set.note + (f"; skipped {skipped} prompts longer than {max_prompt_tokens} tokens" if skipped else "")
    return texts, note


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tetris-hf", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:  # sub-command not shipped in this build
                continue
            raise
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub)
        sub.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Progress lines reach a log as they are printed, not when a block buffer fills (a redirected long run).
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    try:
        return int(args._main(args) or 0)
    except UsageError as error:
        print(f"tetris-hf {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run as `python -m tetris_hf.tools.cli`: call the imported module's main, so that sub-commands raising
    # tetris_hf.tools.cli.UsageError meet the same class here (this file is a second module named __main__).
    from tetris_hf.tools.cli import main as package_main

    sys.exit(package_main())
