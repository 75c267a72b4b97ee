"""The docs hold to the code: every ``TetrisOptions`` field has a row in the README's options table (and every row is a
field), every README code block marked runnable runs, every relative link in README.md and docs/*.md reaches a file
of the repository (and a heading of it, when the link names one), the README stays within 250 lines, and
``generate()``'s docstring names every option.

Each check is a pure function of a document's text (links also look at the files they point to), so the tests plant
a drift in a copy of the README (an option row removed, a link or an anchor broken, a runnable block that fails) and
expect the check to report it.
"""

from __future__ import annotations

import dataclasses
import re
import traceback
from pathlib import Path

import pytest

from tetris_hf import TetrisOptions
from tetris_hf.generation import generate

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
OPTION_NAMES = tuple(field.name for field in dataclasses.fields(TetrisOptions))
OPTIONS_HEADER = "option"  # the first header cell of the README's options table
RUNNABLE = "<!-- runnable -->"  # on the line right before a ```python block that the suite runs
MAX_README_LINES = 250

CELL_SEPARATOR = re.compile(r"(?<!\\)\|")  # GitHub tables: a pipe inside a cell is written \|
SEPARATOR_ROW = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?$")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # https:, mailto:, ...


# ---------------------------------------------------------------------------------------------------------------
# The checks: pure functions of text


def table_cells(line: str) -> list[str]:
    """The cells of one Markdown table row, stripped (``[]`` for a line that is not a table row)."""
    line = line.strip()
    if not line.startswith("|"):
        return []
    return [cell.strip() for cell in CELL_SEPARATOR.split(line.strip("|"))]


def table_rows(text: str, first_header: str) -> list[list[str]]:
    """The body rows of the first table whose header row starts with the cell ``first_header``."""
    lines = text.splitlines()
    for index, line in enumerate(lines[:-1]):
        cells = table_cells(line)
        if cells and cells[0] == first_header and SEPARATOR_ROW.match(lines[index + 1].strip()):
            rows = []
            for body in lines[index + 2 :]:
                cells = table_cells(body)
                if not cells:
                    break
                rows.append(cells)
            return rows
    return []


def documented_options(text: str) -> list[str]:
    """The option names in the first column of the options table, backticks removed."""
    return [cells[0].strip("`") for cells in table_rows(text, OPTIONS_HEADER)]


def missing_options(text: str, names=OPTION_NAMES) -> list[str]:
    """Options without a row of their own in the options table."""
    documented = set(documented_options(text))
    return [name for name in names if name not in documented]


def unknown_options(text: str, names=OPTION_NAMES) -> list[str]:
    """Rows of the options table that name no option (a renamed or removed one)."""
    return [name for name in documented_options(text) if name not in names]


def prose_lines(text: str):
    """``(line number, line)`` outside fenced code blocks, inline code spans removed."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, CODE_SPAN.sub("", line)


def links(text: str) -> list[tuple[int, str]]:
    """``(line number, target)`` of every Markdown link and image outside code."""
    return [(number, match.group(1)) for number, line in prose_lines(text) for match in LINK.finditer(line)]


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text (lower case, punctuation dropped, spaces to hyphens,
    ``-1``, ``-2``... for repeats)."""
    anchors: set[str] = set()
    for _, line in prose_lines(text.replace("`", "")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        anchor = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        candidate, repeat = anchor, 0
        while candidate in anchors:
            repeat += 1
            candidate = f"{anchor}-{repeat}"
        anchors.add(candidate)
    return anchors


def broken_links(text: str, source: Path, root: Path = ROOT) -> list[str]:
    """Relative links of ``text`` (the document at ``source``) that reach no file inside ``root``, or no heading of
    the Markdown file they name; external links are not followed."""
    broken = []
    for number, target in links(text):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.is_relative_to(root.resolve()) or not resolved.exists():
            broken.append(f"line {number}: {target} (no such file)")
            continue
        if anchor and resolved.suffix == ".md":
            headings = text if resolved == source else resolved.read_text(encoding="utf-8")
            if anchor not in heading_anchors(headings):
                broken.append(f"line {number}: {target} (no such heading)")
    return broken


def marker_errors(text: str) -> list[str]:
    """Runnable markers not followed by a ```python block (a marker that marks nothing runs nothing)."""
    lines = text.splitlines()
    return [f"line {index + 1}" for index, line in enumerate(lines)
            if line.strip() == RUNNABLE and (index + 1 == len(lines) or lines[index + 1].strip() != "```python")]


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number of its first line, code)`` of every ```python block right after a runnable marker."""
    lines = text.splitlines()
    blocks = []
    for index, line in enumerate(lines[:-1]):
        if line.strip() != RUNNABLE or lines[index + 1].strip() != "```python":
            continue
        body = []
        for code in lines[index + 2 :]:
            if code.strip() == "```":
                break
            body.append(code)
        blocks.append((index + 3, "\n".join(body) + "\n"))
    return blocks


def run_blocks(text: str, name: str = "README.md") -> int:
    """Run the runnable blocks in order in one namespace (later blocks may use what earlier ones defined), compiled so
    that a traceback names the document and its own line numbers. Returns how many ran."""
    namespace = {"__name__": "__readme__"}
    blocks = runnable_blocks(text)
    for first_line, code in blocks:
        exec(compile("\n" * (first_line - 1) + code, name, "exec"), namespace)
    return len(blocks)


# ---------------------------------------------------------------------------------------------------------------
# The docs as they are


def test_every_option_has_a_row_in_the_readme_options_table():
    text = README.read_text(encoding="utf-8")
    assert documented_options(text), "no table headed `| option |` in README.md"
    assert missing_options(text) == []
    assert unknown_options(text) == []


def test_readme_runnable_blocks_run():
    text = README.read_text(encoding="utf-8")
    assert marker_errors(text) == []
    assert run_blocks(text) >= 1


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_relative_links_resolve(document):
    assert broken_links(document.read_text(encoding="utf-8"), document) == []


def test_readme_fits_in_250_lines():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= MAX_README_LINES


def test_generate_docstring_names_every_option():
    assert [name for name in OPTION_NAMES if f"``{name}``" not in generate.__doc__] == []


# ---------------------------------------------------------------------------------------------------------------
# Planted drift: each check reports it


def without_row(text: str, name: str) -> str:
    lines = text.splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith(f"| `{name}` |")]
    assert len(kept) == len(lines) - 1, f"expected exactly one table row for {name}"
    return "".join(kept)


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_an_option_row_removed_is_reported_even_where_prose_still_names_it(name):
    text = without_row(README.read_text(encoding="utf-8"), name)
    assert missing_options(text) == [name]
    assert missing_options(text + f"\nThe `{name}` option is described in prose only.\n") == [name]


def test_a_row_for_an_option_that_does_not_exist_is_reported():
    text = README.read_text(encoding="utf-8").replace("| `tetris_max_holes` |", "| `tetris_max_gaps` |", 1)
    assert unknown_options(text) == ["tetris_max_gaps"]
    assert missing_options(text) == ["tetris_max_holes"]


def test_a_broken_file_link_is_reported():
    text = README.read_text(encoding="utf-8")
    assert "](docs/design.md)" in text
    broken = broken_links(text.replace("](docs/design.md)", "](docs/desing.md)", 1), README)
    assert len(broken) == 1 and "docs/desing.md (no such file)" in broken[0]


def test_a_broken_heading_link_is_reported():
    planted = README.read_text(encoding="utf-8") + "\nSee [the limits](#limits) and [the bounds](#bounds).\n"
    broken = broken_links(planted, README)
    assert broken == [f"line {len(planted.splitlines())}: #bounds (no such heading)"]


def test_links_outside_the_repository_or_inside_code_are_not_taken_as_files():
    text = "[up](../outside.md) `[code](missing.md)`\n```\n[fenced](missing.md)\n```\n[web](https://example.org/x)\n"
    assert broken_links(text, README) == ["line 1: ../outside.md (no such file)"]


def test_a_failing_runnable_block_is_reported_with_its_line():
    text = f"intro\n{RUNNABLE}\n```python\nvalue = 1\n```\n\n{RUNNABLE}\n```python\nassert value == 2\n```\n"
    with pytest.raises(AssertionError) as error:
        run_blocks(text)
    frame = traceback.extract_tb(error.tb)[-1]
    assert (frame.filename, frame.lineno) == ("README.md", 9)


def test_a_marker_that_marks_no_python_block_is_reported():
    assert marker_errors(f"{RUNNABLE}\n```bash\nls\n```\n") == ["line 1"]
    assert runnable_blocks(f"{RUNNABLE}\n```bash\nls\n```\n") == []
