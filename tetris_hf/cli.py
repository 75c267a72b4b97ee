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
    "bench": ("tetris_hf.bench", "throughput, acceptance and VSR of TETRIS vs the baselines on real prompts"),
    "distill": ("tetris_hf.distill", "train a small same-tokenizer draft for a target by KL distillation"),
    "simulate": ("tetris_hf.simulate", "replay recorded acceptance traces under a cost curve"),
    "bound": ("tetris_hf.bound", "optimal multi-draft acceptance vs verifiers on real distributions"),
}


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


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
    try:
        return int(args._main(args) or 0)
    except UsageError as error:
        print(f"tetris-hf {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run as `python -m tetris_hf.cli`: call the imported module's main, so that sub-commands raising
    # tetris_hf.cli.UsageError meet the same class here (this file is a second module named __main__).
    from tetris_hf.cli import main as package_main

    sys.exit(package_main())
