"""Write the Hub ``custom_generate`` repository of tetris_hf: the generation strategy's own modules, flattened.

    tetris-hf export-hub /tmp/tetris          # then: hf upload USER/tetris /tmp/tetris .
    tetris-hf export-space /tmp/tetris-live   # the Space (examples/space/ and its strategy/ copy of the folder)
                                              # then: hf upload USER/tetris-live /tmp/tetris-live . --repo-type space

Neither folder is kept in git: both are generated (``python -m tetris_hf.tools.hub_export DIR`` is ``export-hub``).

transformers loads ``custom_generate/generate.py`` with ``get_cached_module_file``: it copies the modules that file
imports relatively (``from .kv import SlotCache``), recursively, but only flat files of the same folder, and checks
that every other import is installed. So the export is the import closure of :mod:`tetris_hf.generation` inside the
package, and of :mod:`tetris_hf.continuous` (the request stream: :data:`ENTRIES`), found by reading every import
statement, also those inside functions, each module written as one flat file
(``logits/processing.py`` -> ``logits_processing.py``, a package's ``__init__.py`` -> ``logits.py``) whose imports
of the package are rewritten as relative imports of those files. The tools (:data:`TOOLS`: command-line programs,
model loading, data sets, benchmarks) are never exported: a library module that imports one is an error, to be
fixed in the package. Also written: ``custom_generate/generate.py`` (re-exports ``generate``, and ``generate_batch`` and
``init_continuous_batching``),
``custom_generate/requirements.txt`` (the distributions the exported modules import, at least the installed
versions) and ``README.md`` (the model card: ``custom_generate`` tag, what ``trust_remote_code`` runs, the
arguments from :class:`TetrisOptions`'s fields and docstring, the output fields from :class:`TetrisStats`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.metadata
import inspect
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path

from packaging.version import Version

from .. import __version__
from ..outputs import TetrisStats
from ..options import TetrisOptions
from .cli import UsageError

DISTRIBUTION = "tetris-hf"
PACKAGE = "tetris_hf"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
# The Space's app in a checkout (not in the wheel); export-space copies its files and adds strategy/.
SPACE_DIR = PACKAGE_DIR.parent / "examples" / "space"
SPACE_SUFFIXES = frozenset({".py", ".md", ".txt", ".json", ".png"})
# The roots of the export: the generation strategy (what transformers calls) and the request stream (importable from
# the folder as a package, e.g. by the Space).
ENTRIES = ("tetris_hf.generation", "tetris_hf.continuous")
# The package's tools around the strategy (programs, model and data loading, measurement) and everything under them,
# never exported: the strategy must not depend on them.
TOOLS = frozenset({f"{PACKAGE}.tools"})

GENERATE_PY = '''"""TETRIS batched speculative decoding as a transformers ``custom_generate`` repository.

``model.generate(inputs, assistant_model=draft, custom_generate="<this repo>", trust_remote_code=True)`` runs
:func:`generation.generate`. The modules of this folder are tetris_hf's generation strategy and its request stream
(``generate_batch`` and ``init_continuous_batching``: rows that join a live batch as others finish), exported by
``tetris-hf export-hub``: edit the tetris_hf package and export again, not these copies.
"""

from .continuous import generate_batch, init_continuous_batching
from .generation import generate

__all__ = ["generate", "generate_batch", "init_continuous_batching"]
'''


class ExportError(Exception):
    """The package cannot be exported as it is; the message says which module and what to change."""


@dataclasses.dataclass(frozen=True)
class LibraryModule:
    """One module of the strategy: ``name`` (``tetris_hf.logits.processing``), its source file and its flat name."""

    name: str
    path: Path

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    @property
    def relative_path(self) -> str:
        return self.path.relative_to(PACKAGE_DIR).as_posix()

    @property
    def flat(self) -> str:
        """The exported file's stem: the dotted path inside the package joined by ``_``."""
        return self.name.removeprefix(PACKAGE + ".").replace(".", "_")

    @property
    def summary(self) -> str:
        """The first line of the module's docstring."""
        doc = ast.get_docstring(ast.parse(self.path.read_text(encoding="utf-8"))) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""


def module_path(name: str) -> Path | None:
    """The source file of package module ``name`` (``__init__.py`` for a subpackage), or ``None``."""
    parts = name.split(".")[1:]
    base = PACKAGE_DIR.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if parts and path.is_file():
            return path
    return None


def _imported_module(module: LibraryModule, node: ast.ImportFrom) -> str | None:
    """The package module a ``from ... import`` statement reads, or ``None`` when it reads another distribution."""
    if node.level == 0:
        if node.module != PACKAGE and not (node.module or "").startswith(PACKAGE + "."):
            return None
        return node.module
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    if node.level - 1 >= len(package):
        raise ExportError(f"tetris_hf/{module.relative_path}:{node.lineno}: relative import beyond the package")
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def package_imports(module: LibraryModule) -> list[tuple[ast.ImportFrom, str]]:
    """Every import of another package module in ``module`` (anywhere: top level, functions, branches), with the
    module it names. Raises :class:`ExportError` for forms a flat folder cannot express."""
    tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
    found = []
    for node in ast.walk(tree):
        where = f"tetris_hf/{module.relative_path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    raise ExportError(f"{where}: `import {alias.name}` cannot be exported; write "
                                      "`from .module import name`")
        elif isinstance(node, ast.ImportFrom):
            target = _imported_module(module, node)
            if target is None:
                continue
            if target == PACKAGE:
                raise ExportError(f"{where}: imports from the package's __init__; import from the module that "
                                  "defines the name (`from .module import name`)")
            for alias in node.names:
                if module_path(f"{target}.{alias.name}") is not None:
                    raise ExportError(f"{where}: imports the module {target}.{alias.name} as a name; write "
                                      f"`from .{alias.name} import ...` instead")
            if module_path(target) is None:
                raise ExportError(f"{where}: {target} is not a module of the package")
            found.append((node, target))
    return found


def library_closure(entries: tuple[str, ...] = ENTRIES) -> list[LibraryModule]:
    """The package modules ``entries`` need, themselves included, in the order first reached (breadth first).

    Raises :class:`ExportError` when one of them imports a tool (:data:`TOOLS`), naming the chain of imports.
    """
    reached_from: dict[str, str | None] = {entry: None for entry in entries}
    order = list(entries)
    for name in order:  # grows while it is walked
        module = LibraryModule(name, module_path(name))
        for _, target in package_imports(module):
            if target in reached_from:
                continue
            reached_from[target] = name
            if target in TOOLS or any(target.startswith(tool + ".") for tool in TOOLS):
                chain = [target]
                while reached_from[chain[-1]] is not None:
                    chain.append(reached_from[chain[-1]])
                raise ExportError(
                    f"the generation strategy imports the tool module {target} ({' <- '.join(chain)}): the Hub "
                    "folder may hold only library modules. Move what it needs into the library (or import it "
                    "lazily from a tool), then export again."
                )
            order.append(target)
    modules = [LibraryModule(name, module_path(name)) for name in order]
    flats: dict[str, str] = {}
    for module in modules:
        if module.flat in flats or module.flat == "generate":
            raise ExportError(f"{module.name} and {flats.get(module.flat, 'the entry point')} would both be exported "
                              f"as {module.flat}.py: rename one")
        flats[module.flat] = module.name
    return modules


_IMPORT_HEAD = re.compile(r"from\s+[\w.]+\s+import\b")


def flat_source(module: LibraryModule) -> str:
    """``module``'s source with every import of the package rewritten as ``from .<flat name> import ...``."""
    lines = module.path.read_text(encoding="utf-8").splitlines(keepends=True)
    for node, target in package_imports(module):
        line = lines[node.lineno - 1]
        column = len(line.encode("utf-8")[: node.col_offset].decode("utf-8"))  # col_offset counts bytes
        head = _IMPORT_HEAD.match(line, column)
        if head is None:
            raise ExportError(f"tetris_hf/{module.relative_path}:{node.lineno}: write `from X import` on one line")
        flat = LibraryModule(target, module_path(target)).flat
        lines[node.lineno - 1] = line[:column] + f"from .{flat} import" + line[head.end():]
    note = (f"# Exported from tetris_hf/{module.relative_path} by `tetris-hf export-hub`: edit the package, not this "
            "copy.\n")
    return note + "".join(lines)


def third_party_imports(sources: list[str]) -> list[str]:
    """Top-level names of the modules ``sources`` import from outside the standard library (relative ones aside)."""
    names = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return sorted(name for name in names if name not in sys.stdlib_module_names and name != "__future__")


def requirements_for(import_names: list[str]) -> list[str]:
    """``distribution>=installed version`` for each imported top-level name, e.g. ``torch>=2.13.0``."""
    distributions = importlib.metadata.packages_distributions()
    lines = []
    for name in import_names:
        if name == PACKAGE or name not in distributions:
            raise ExportError(f"the exported modules import {name!r}, which no installed distribution provides")
        for distribution in distributions[name]:
            lines.append(f"{distribution}>={installed_version(distribution)}")
    return sorted(set(lines))


def installed_version(distribution: str = DISTRIBUTION) -> str:
    """An installed distribution's version without a local part (``2.13.0+cpu`` -> ``2.13.0``); tetris-hf's own
    falls back to the package's ``__version__`` when it runs from a source tree."""
    try:
        return Version(importlib.metadata.version(distribution)).base_version
    except importlib.metadata.PackageNotFoundError:
        if distribution != DISTRIBUTION:
            raise
        return __version__


def _docstring_args(cls) -> dict[str, str]:
    """``{name: description}`` from the ``Args:`` section of a Google-style docstring (``a, b: text`` names both)."""
    doc = inspect.getdoc(cls) or ""
    section = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    described: dict[str, str] = {}
    current: list[str] = []
    for line in section.splitlines():
        match = re.match(r"^    (\w+(?:, \w+)*): (.*)$", line)
        if match:
            current = match.group(1).split(", ")
            for name in current:
                described[name] = match.group(2).strip()
        elif line.startswith("        ") and current:
            for name in current:
                described[name] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break  # the next section
    return described


def _markdown(text: str) -> str:
    """Sphinx roles (``:class:`~a.b.C``` -> ```C```) and RST literals (double backticks) as Markdown code spans."""
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _default_text(field: dataclasses.Field) -> str:
    default = field.default
    if default is None:
        return "`None`"
    return f'`"{default}"`' if isinstance(default, str) else f"`{default}`"


def options_table() -> str:
    """The Markdown table of tetris_hf's ``generate()`` arguments, one row per :class:`TetrisOptions` field."""
    described = _docstring_args(TetrisOptions)
    rows = ["| argument | default | meaning |", "|---|---|---|"]
    for field in dataclasses.fields(TetrisOptions):
        meaning = _markdown(described.get(field.name, "")).replace("|", "\\|")
        rows.append(f"| `{field.name}` | {_default_text(field)} | {meaning} |")
    return "\n".join(rows)


def stats_fields() -> str:
    """The names of :class:`TetrisStats`'s fields and properties, as a Markdown list item body."""
    names = [field.name for field in dataclasses.fields(TetrisStats)]
    names += [name for name, value in vars(TetrisStats).items() if isinstance(value, property)]
    return ", ".join(f"`{name}`" for name in names)


def files_table(modules: list[LibraryModule]) -> str:
    """The Markdown table of the exported files, each with the first line of its docstring."""
    rows = ["| file | exported from | what it does |", "|---|---|---|"]
    for module in sorted(modules, key=lambda module: module.flat):
        summary = _markdown(module.summary).replace("|", "\\|")
        rows.append(f"| `custom_generate/{module.flat}.py` | `tetris_hf/{module.relative_path}` | {summary} |")
    return "\n".join(rows)


def model_card(version: str, modules: list[LibraryModule], requirements: list[str]) -> str:
    """The repository's README.md."""
    stats_doc = " ".join(line.strip() for line in (inspect.getdoc(TetrisStats) or "").splitlines()[2:] if line.strip())
    stats = textwrap.fill(
        f"(a `TetrisStats`: {stats_fields()}). {_markdown(stats_doc)}", width=116, initial_indent="  ",
        subsequent_indent="  ", break_on_hyphens=False,
    )
    return f"""---
library_name: transformers
tags:
- custom_generate
- speculative-decoding
- tetris
license: apache-2.0
---

# TETRIS batched speculative decoding (`custom_generate`)

Batched speculative decoding with **TETRIS** draft-token selection (Wu et al., ACL 2025, arXiv 2502.15197) for any
decoder-only `transformers` model. transformers' own assisted generation refuses batch size > 1; this strategy runs
left-padded batches of any size, greedy or sampling. Each step every active row drafts `k + e` tokens with a small
draft model; the `C` drafted cells of the whole batch with the highest cumulative draft probability are verified by
the target in one forward pass; every row keeps its accepted prefix plus one target token. Greedy output equals the
target alone, token for token; sampled output has the target's distribution.

This repository holds no weights, only code: `custom_generate/` is tetris-hf {version}'s generation strategy,
exported by `tetris-hf export-hub` as flat modules (nothing else to install: its requirements are
{", ".join(f"`{line}`" for line in requirements)}).

## What `trust_remote_code=True` runs

transformers copies `custom_generate/generate.py` and the modules it imports relatively into its modules cache and
imports them; `generate.py` only re-exports `generate` from `generation.py` (which transformers calls) and
`generate_batch` and `init_continuous_batching` from `continuous.py` (the request stream). Importing them defines
classes and functions and patches nothing of transformers; besides the Python standard library they import only the
requirements above. Running
`tetris_strategy="adaptive"` or `"dsd"` without `tetris_cost_profile` times a few forwards of your models and caches
the result as JSON under `$TETRIS_HF_CACHE/cost-profiles` (default `~/.cache/tetris_hf`).

{files_table(modules)}

## Example

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-1.7B-Instruct", padding_side="left")
target = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-1.7B-Instruct")
draft = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")

batch = tokenizer(["The capital of France is", "def fibonacci(n):"], return_tensors="pt", padding=True)
out = target.generate(
    **batch,
    assistant_model=draft,
    custom_generate="<this repo id or a local copy of it>",
    trust_remote_code=True,
    max_new_tokens=64,
    do_sample=False,
    num_assistant_tokens=4,
    tetris_extra_tokens=2,
    return_dict_in_generate=True,
)
print(tokenizer.batch_decode(out.sequences, skip_special_tokens=True))
print(out.tetris_stats.verification_success_rate)
```

With the tetris-hf package installed, `import tetris_hf` makes `custom_generate="tetris"` do the same without
`trust_remote_code`. It also works through `pipeline("text-generation", model=target, tokenizer=tokenizer,
assistant_model=draft, custom_generate="tetris", batch_size=8)`.

## Arguments

Everything plain `generate()` accepts for greedy and sampling decoding, plus `assistant_model` (required: a causal
LM with the target's vocabulary) and:

{options_table()}

Refused with a `ValueError` naming the problem: no `assistant_model`, a draft with another vocabulary, an unknown
`tetris_strategy`, right-padded rows, beam search, static caches, `output_scores`/`output_logits`, greedy with
`num_return_sequences > 1`, a streamer with more than one row.

## Outputs

- default: a `(batch, prompt + new)` `torch.LongTensor`, as `generate()` returns; rows that stop early are
  right-padded with the pad token.
- `return_dict_in_generate=True`: a `TetrisGenerateOutput` with `.sequences` (the same tensor) and `.tetris_stats`
{stats}
"""


def export(directory: str | Path) -> list[Path]:
    """Write the Hub folder into ``directory`` (created if needed); returns the files written.

    Python files left in ``custom_generate/`` by an earlier export that this one does not write are removed, so a
    module that left the library leaves the folder too.
    """
    modules = library_closure()
    sources = {module.flat: flat_source(module) for module in modules}
    requirements = requirements_for(third_party_imports(list(sources.values())))
    root = Path(directory)
    code = root / "custom_generate"
    code.mkdir(parents=True, exist_ok=True)
    files = {
        code / "generate.py": GENERATE_PY,
        **{code / f"{flat}.py": source for flat, source in sources.items()},
        code / "requirements.txt": "".join(f"{line}\n" for line in requirements),
        root / "README.md": model_card(installed_version(), modules, requirements),
    }
    for stale in set(code.glob("*.py")) - set(files):
        stale.unlink()
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    return list(files)


def space_files(source: Path = SPACE_DIR) -> list[Path]:
    """The Space's own files: those at the top of ``source`` (app, its modules, README with the Space's front matter,
    requirements, presets, screenshots); not ``strategy/``, which is exported."""
    return sorted(path for path in source.iterdir() if path.is_file() and path.suffix in SPACE_SUFFIXES)


def export_space(directory: str | Path, source: Path = SPACE_DIR) -> list[Path]:
    """Write the Space into ``directory`` (created if needed): the files of ``source`` (a checkout's examples/space/)
    and the Hub folder as ``strategy/``, where the app loads it from; returns the files written. ``directory`` may
    be ``source`` itself: then only ``strategy/`` is written (what ``python examples/space/app.py`` needs)."""
    if not source.is_dir():
        raise ExportError(f"{source} is absent: export-space copies the Space from a tetris-hf checkout "
                          "(git clone the repository and run it there)")
    root = Path(directory)
    root.mkdir(exist_ok=True)
    written = []
    for path in space_files(source):
        copy = root / path.name
        if not (copy.exists() and copy.samefile(path)):
            shutil.copyfile(path, copy)
        written.append(copy)
    return written + export(root / "strategy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``tetris-hf export-hub DIR`` and ``tetris-hf export-space DIR`` (both commands share this module)."""
    parser.add_argument("directory", help="the folder to write (created if absent; its parent must exist)")


def _writable_folder(directory: str) -> Path:
    """``directory`` as a folder the export can write, or a :class:`UsageError` saying why not."""
    path = Path(directory)
    parent = path.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{path}: its parent {parent} is not an existing folder; create it first")
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} is a file, not a folder")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise UsageError(f"{path}: no permission to write there")
    return path


def main(args) -> int:
    """Write the folder ``args.command`` names (``export-hub``: the Hub repository, ``export-space``: the Space);
    print each file written. A package the export refuses (:class:`ExportError`) is exit status 1."""
    directory = _writable_folder(args.directory)
    write = {"export-hub": export, "export-space": export_space}[args.command]
    try:
        written = write(directory)
    except ExportError as error:
        print(f"tetris-hf {args.command}: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        raise UsageError(f"cannot write {error.filename or directory}: {error.strerror or error}") from None
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    # `python -m tetris_hf.tools.hub_export DIR` is `tetris-hf export-hub DIR`
    from tetris_hf.tools.cli import main as cli_main

    sys.exit(cli_main(["export-hub", *sys.argv[1:]]))
