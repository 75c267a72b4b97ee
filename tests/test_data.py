"""Prompt sets: truncated ShareGPT recovery, the shipped MT-bench / HumanEval sets, the grounded sets built from them
(humaneval-edit, sharegpt-summarize: measurement side of the split only), user JSONL files."""

from __future__ import annotations

import gzip
import json
import logging

import pytest

from tetris_hf.tools.data import (
    HUMANEVAL_EDITS,
    HUMANEVAL_FILE,
    SHAREGPT_FILE,
    SHAREGPT_RESERVED_TAIL,
    SHAREGPT_WRAPPERS,
    Prompt,
    is_long_prose,
    load_humaneval,
    load_humaneval_edit,
    load_jsonl,
    load_mtbench,
    load_prompts,
    load_sharegpt,
    load_sharegpt_summarize,
    package_file,
    render_prompts,
    scan_json_array,
    sharegpt_fitting_chats,
)


def sharegpt_records() -> list[dict]:
    return [
        {"id": "a", "conversations": [{"from": "human", "value": "Héllo ✓ there"}, {"from": "gpt", "value": "Hi!"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "I speak first"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Ünïcode prompt"}, {"from": "gpt", "value": "ok"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "   "}]},
        {"id": "e", "conversations": [{"from": "human", "value": "fifth"}, {"from": "gpt", "value": "é" * 50}]},
        {"id": "f", "conversations": [{"from": "human", "value": "sixth"}]},
    ]


def write_sharegpt(path, records) -> list[int]:
    """Write records as an indented JSON array (as the real file is); return each record's starting byte offset."""
    parts, starts, offset = [], [], 0
    head = "[\n  "
    parts.append(head)
    offset += len(head.encode())
    for i, record in enumerate(records):
        starts.append(offset)
        text = json.dumps(record, indent=2, ensure_ascii=False) + ("" if i == len(records) - 1 else ",\n  ")
        parts.append(text)
        offset += len(text.encode())
    parts.append("\n]")
    path.write_bytes("".join(parts).encode())
    return starts


def test_truncated_copy_recovers_complete_records_and_reports_break_point(tmp_path, caplog):
    full = tmp_path / "full.json"
    starts = write_sharegpt(full, sharegpt_records())
    cut = starts[4] + 40  # inside record "e", after multi-byte characters earlier in the file
    truncated = tmp_path / "truncated.json"
    truncated.write_bytes(full.read_bytes()[:cut])
    with pytest.raises(json.JSONDecodeError):
        json.loads(truncated.read_text())

    with caplog.at_level(logging.WARNING, logger="tetris_hf.tools.data"):
        prompts = load_sharegpt(truncated)

    assert prompts.recovered == 4  # a, b, c, d decoded completely
    assert prompts.broke_off_at == starts[4]
    assert prompts.size == cut
    # only complete conversations whose first turn is a (non-empty) human turn
    assert [p.id for p in prompts] == ["sharegpt/a", "sharegpt/c"]
    assert prompts[0].messages == ({"role": "user", "content": "Héllo ✓ there"},)
    assert "recovered 4 complete records" in prompts.note and f"{starts[4]:,}" in prompts.note
    assert prompts.note in caplog.text


def test_the_fitting_side_is_the_last_reserved_chats_in_file_order(tmp_path, monkeypatch):
    import tetris_hf.tools.data as data

    path = tmp_path / "chats.json"
    write_sharegpt(path, sharegpt_records())
    everything = [chat.id for chat in data.load_sharegpt_chats(path)]
    assert len(everything) >= 2
    monkeypatch.setattr(data, "SHAREGPT_RESERVED_TAIL", 1)
    tail, note = sharegpt_fitting_chats(path)
    assert [chat.id for chat in tail] == everything[-1:] and "the last 1 human-first chats" in note
    monkeypatch.setattr(data, "SHAREGPT_RESERVED_TAIL", 1000)  # a smaller file: all of it
    assert [chat.id for chat in sharegpt_fitting_chats(path)[0]] == everything


def test_complete_file_reports_no_break(tmp_path):
    full = tmp_path / "full.json"
    write_sharegpt(full, sharegpt_records())
    prompts = load_sharegpt(full)
    assert prompts.recovered == 6 and prompts.broke_off_at is None
    assert [p.id for p in prompts] == ["sharegpt/a", "sharegpt/c", "sharegpt/e", "sharegpt/f"]
    assert len(load_sharegpt(full, limit=3)) == 3


@pytest.mark.parametrize("content", ["", "[", "[\n  ", '[\n  {"id": "a", "conversa'])
def test_file_cut_before_first_record_is_a_clear_error(tmp_path, content):
    path = tmp_path / "cut.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="no complete record|not a JSON array"):
        load_sharegpt(path)


def test_not_an_array_is_a_clear_error(tmp_path):
    path = tmp_path / "object.json"
    path.write_text('{"id": "a"}')
    with pytest.raises(ValueError, match="not a JSON array"):
        load_sharegpt(path)


def test_truncated_head_of_shipped_file_matches_independent_decode(tmp_path):
    """A 300 kB head of the real ShareGPT file: what the loader recovers is exactly what json.loads reads up to the
    reported break point."""
    shipped = package_file(*SHAREGPT_FILE)
    with shipped.open("rb") as f:
        head = f.read(300_000)
    copy = tmp_path / "head.json"
    copy.write_bytes(head)
    scan = scan_json_array(copy, keep=lambda record: record)
    assert scan.size == 300_000 and scan.broke_off_at < 300_000
    prefix = head[: scan.broke_off_at].decode().rstrip().rstrip(",") + "]"
    assert json.loads(prefix) == scan.kept
    assert scan.decoded == len(scan.kept) > 10


def test_shipped_sharegpt_recovers_known_counts():
    prompts = load_sharegpt()
    assert prompts.size == 125_509_632
    assert prompts.recovered == 17_671
    assert prompts.broke_off_at == 125_506_645
    assert len(prompts) == 11_139  # first turn human (or "user") and not empty
    assert all(p.is_chat and p.messages[0]["content"].strip() for p in prompts)


def test_mtbench_has_80_first_turn_questions_with_categories():
    prompts = load_mtbench()
    assert len(prompts) == 80
    assert all(p.is_chat and len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in prompts)
    categories = [p.category for p in prompts]
    assert sorted(set(categories)) == [
        "coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem", "writing"
    ]
    assert all(categories.count(c) == 10 for c in set(categories))
    assert prompts[0].id == "mtbench/81" and prompts[0].messages[0]["content"].startswith("Compose an engaging")


def test_humaneval_has_164_raw_code_prompts():
    prompts = load_humaneval()
    assert len(prompts) == 164
    assert [p.id for p in prompts] == [f"HumanEval/{i}" for i in range(164)]
    assert not any(p.is_chat for p in prompts)
    assert all("def " in p.text for p in prompts)


def test_user_jsonl_prompt_messages_and_raw(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        {"prompt": "Say hi", "category": "greeting"},
        {},  # replaced below by a blank line
        {"messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Why?"}], "id": "q2"},
        {"prompt": "def f(x):", "raw": True},
        {"prompt": "Name it", "answer_start": '{"name": "'},
    ]
    text = "\n".join("" if not obj else json.dumps(obj) for obj in lines) + "\n"
    path.write_text(text)
    prompts = load_prompts(str(path))
    assert len(prompts) == 4
    assert prompts[0].messages == ({"role": "user", "content": "Say hi"},) and prompts[0].category == "greeting"
    assert prompts[1].id == "q2" and len(prompts[1].messages) == 2
    assert prompts[2].text == "def f(x):" and not prompts[2].is_chat
    assert prompts[0].answer_start == "" and prompts[3].answer_start == '{"name": "'
    assert len(load_jsonl(path, limit=1)) == 1


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_jsonl_names_the_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"empty\.jsonl holds no prompts"):
        load_jsonl(path)


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "unterminated\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: not valid JSON"):
        load_jsonl(path)


@pytest.mark.parametrize(
    "line", ['{"text": "wrong field"}', '{"prompt": ""}', '{"messages": []}', '{"messages": [{"role": "user"}]}', "[1]",
             '{"prompt": "x", "answer_start": 3}', '{"prompt": "x", "raw": true, "answer_start": "{"}']
)
def test_jsonl_missing_field_names_file_and_line(tmp_path, line):
    path = tmp_path / "fields.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"fields\.jsonl, line 2"):
        load_jsonl(path)


def test_missing_jsonl_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"))


def test_missing_data_package_says_what_to_install():
    with pytest.raises(FileNotFoundError, match=r"pip install no-such-set==1\.0"):
        package_file("no_such_package_for_tetris_tests", "data.json", "no-such-set==1.0")


def test_unknown_prompt_set_lists_the_choices():
    with pytest.raises(ValueError, match="sharegpt, mtbench, humaneval, humaneval-edit, sharegpt-summarize"):
        load_prompts("arena")


def test_bad_limit():
    with pytest.raises(ValueError, match="limit"):
        load_mtbench(limit=0)


class TemplateTokenizer:
    """Just enough of a tokenizer for render_prompts: a chat template."""

    chat_template = "<chat>"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class PlainTokenizer:
    chat_template = None


def test_render_chats_through_template_and_raw_as_is():
    prompts = [
        Prompt(id="1", messages=({"role": "user", "content": "hi"},)),
        Prompt(id="2", text="def f():"),
        "plain string",
    ]
    assert render_prompts(prompts, TemplateTokenizer()) == ["<user>hi<assistant>", "def f():", "plain string"]
    assert render_prompts(prompts, PlainTokenizer()) == ["hi", "def f():", "plain string"]


def test_an_answer_start_follows_the_generation_prompt():
    prompt = Prompt(id="1", messages=({"role": "user", "content": "name?"},), answer_start='{"name": "')
    assert render_prompts([prompt], TemplateTokenizer()) == ['<user>name?<assistant>{"name": "']
    assert render_prompts([prompt], PlainTokenizer()) == ['name?\n{"name": "']
    assert Prompt(id="2", messages=prompt.messages).answer_start == ""


def test_render_mtbench_with_smollm2_chat_template():
    from tetris_hf.tools.models import load_target

    _, tokenizer = load_target()  # ~20 s the first time (GGUF conversion), then cached
    prompts = load_mtbench(limit=2)
    rendered = render_prompts(prompts, tokenizer)
    assert rendered[0].startswith("<|im_start|>system\n") and rendered[0].endswith("<|im_start|>assistant\n")
    assert prompts[0].messages[0]["content"] in rendered[0]


def test_to_dataset_keeps_every_record():
    prompts = load_humaneval(limit=3)
    dataset = prompts.to_dataset()
    assert len(dataset) == 3 and dataset[0]["kind"] == "raw" and dataset[0]["text"] == prompts[0].text
    chats = load_mtbench(limit=2).to_dataset()
    assert chats[1]["messages"] == [{"role": "user", "content": load_mtbench(limit=2)[1].messages[0]["content"]}]


# ---------------------------------------------------------------------------------------------------------------
# Grounded sets


def test_extraction_asks_for_one_json_object_per_humaneval_signature():
    from tetris_hf.tools.data import EXTRACTION_ANSWER_START, EXTRACTION_INSTRUCTION

    prompts = load_prompts("extraction")
    records = [json.loads(line) for line in gzip.open(package_file(*HUMANEVAL_FILE), "rt")]
    assert len(prompts) == 164 and prompts.name == "extraction"
    assert len(load_prompts("extraction", limit=16)) == 16
    for prompt, record in zip(prompts, records):
        assert prompt.id == f"{record['task_id']}/extraction" and prompt.category == "extraction"
        assert prompt.is_chat and len(prompt.messages) == 1 and prompt.messages[0]["role"] == "user"
        content = prompt.messages[0]["content"]
        assert content == f"{EXTRACTION_INSTRUCTION}\n\n```python\n{record['prompt'].strip(chr(10)).rstrip()}\n```"
        assert "canonical_solution" not in content and record["canonical_solution"].strip() not in content
        assert prompt.answer_start == EXTRACTION_ANSWER_START == '{\n  "name": "'
    assert all(key in EXTRACTION_INSTRUCTION for key in ('"name"', '"arguments"', '"return_type"', '"summary"'))


def test_humaneval_edit_asks_to_edit_each_whole_canonical_function():
    prompts = load_prompts("humaneval-edit")
    records = [json.loads(line) for line in gzip.open(package_file(*HUMANEVAL_FILE), "rt")]
    assert len(prompts) == 164 and prompts.name == "humaneval-edit"
    tags = [tag for tag, _ in HUMANEVAL_EDITS]
    for index, (prompt, record) in enumerate(zip(prompts, records)):
        tag, instruction = HUMANEVAL_EDITS[index % len(HUMANEVAL_EDITS)]
        assert prompt.id == f"{record['task_id']}/{tag}" and prompt.category == tag
        assert prompt.is_chat and len(prompt.messages) == 1 and prompt.messages[0]["role"] == "user"
        whole_function = (record["prompt"] + record["canonical_solution"]).strip("\n")
        content = prompt.messages[0]["content"]
        assert content == f"{instruction}\n\n```python\n{whole_function.rstrip()}\n```"
        assert instruction.endswith("Return the whole function.")
    assert [p.category for p in prompts[:7]] == tags + tags[:2]
    assert len(load_humaneval_edit(limit=5)) == 5


def test_humaneval_edit_is_deterministic():
    assert list(load_humaneval_edit()) == list(load_humaneval_edit())


def test_truncated_humaneval_file_is_a_clear_error(tmp_path):
    shipped = package_file(*HUMANEVAL_FILE).read_bytes()
    cut = tmp_path / "HumanEval.jsonl.gz"
    cut.write_bytes(shipped[: len(shipped) // 2])
    with pytest.raises(ValueError, match=r"HumanEval\.jsonl\.gz is truncated or not gzip.*pip install --force"):
        load_humaneval_edit(cut)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_humaneval_edit(tmp_path / "missing.jsonl.gz")


def test_humaneval_record_without_solution_names_file_and_line(tmp_path):
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"task_id": "T/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n"}) + "\n")
        f.write(json.dumps({"task_id": "T/1", "prompt": "def g():\n"}) + "\n")
    with pytest.raises(ValueError, match=r"he\.jsonl\.gz, line 2: .*'canonical_solution'"):
        load_humaneval_edit(path)


PROSE = "The committee met on Tuesday to discuss the budget, and everyone agreed it was too small. "  # 88 characters


@pytest.mark.parametrize("text,kept", [
    ((PROSE * 9)[:699], False),  # too short
    ((PROSE * 9)[:700], True),
    ((PROSE * 11)[:950], True),
    ((PROSE * 11)[:951], False),  # too long
    ("def f(x):\n    return {k: v for k, v in x.items() if v > 0}  # [1, 2]\n" * 12, False),  # code
    ("\u4f60\u597d\uff0c" * 300, False),  # another script
])
def test_long_prose_rule(text, kept):
    assert is_long_prose(text) is kept


def _chat(record_id: str, text: str) -> dict:
    return {"id": record_id, "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]}


def test_summarize_skips_the_reserved_tail_and_wraps_in_turn(tmp_path):
    long_text = (PROSE * 9)[:800]
    records = [_chat("a", long_text), _chat("b", "short"), _chat("c", long_text), _chat("d", long_text),
               _chat("e", long_text)]
    path = tmp_path / "chats.json"
    write_sharegpt(path, records)
    prompts = load_sharegpt_summarize(path, reserved=2)  # d and e are reserved for fitting
    assert [p.id for p in prompts] == ["sharegpt/a/summarize", "sharegpt/c/concise"]
    (_, summarize), (_, concise) = SHAREGPT_WRAPPERS
    assert prompts[0].messages == ({"role": "user", "content": f"{summarize}\n\nText:\n{long_text}"},)
    assert prompts[1].messages[0]["content"] == f"{concise}\n\nText:\n{long_text}"
    assert "before the 2 reserved" in prompts.note
    with pytest.raises(ValueError, match="all within the last 5, which are reserved"):
        load_sharegpt_summarize(path, reserved=5)


def test_sharegpt_summarize_comes_only_from_the_measurement_side():
    """The shipped set: 217 long prose first turns, none among the last 2,000 human-first chats (reserved for
    fitting, e.g. the bench's token tables), in file order."""
    prompts = load_prompts("sharegpt-summarize")
    first_turns = load_sharegpt()
    measured = {p.id: p.messages[0]["content"] for p in first_turns[: len(first_turns) - SHAREGPT_RESERVED_TAIL]}
    reserved = {p.id for p in first_turns[len(first_turns) - SHAREGPT_RESERVED_TAIL:]}
    assert len(prompts) == 217 and prompts.name == "sharegpt-summarize"
    source_ids = [p.id.rsplit("/", 1)[0] for p in prompts]
    assert not set(source_ids) & reserved
    assert all(source in measured for source in source_ids)
    order = list(measured)
    assert [order.index(s) for s in source_ids] == sorted(order.index(s) for s in source_ids)
    for index, prompt in enumerate(prompts):
        tag, instruction = SHAREGPT_WRAPPERS[index % len(SHAREGPT_WRAPPERS)]
        text = measured[source_ids[index]]
        assert prompt.category == tag and prompt.id.endswith(f"/{tag}") and is_long_prose(text)
        assert prompt.messages == ({"role": "user", "content": f"{instruction}\n\nText:\n{text}"},)
    assert list(load_sharegpt_summarize(limit=3)) == list(prompts[:3])  # deterministic


def test_humaneval_edit_renders_through_smollm2_chat_template():
    from tetris_hf.tools.models import load_target

    _, tokenizer = load_target()
    prompts = load_humaneval_edit(limit=2)
    rendered = render_prompts(prompts, tokenizer)
    assert rendered[1].startswith("<|im_start|>system\n") and rendered[1].endswith("<|im_start|>assistant\n")
    assert f"<|im_start|>user\n{prompts[1].messages[0]['content']}<|im_end|>" in rendered[1]


def test_mixed_interleaves_chat_code_edits_and_summaries():
    from tetris_hf.tools.data import MIXED_PARTS, load_prompts

    mixed = load_prompts("mixed", limit=7)
    assert [prompt.category for prompt in mixed] == list(MIXED_PARTS) * 2 + [MIXED_PARTS[0]]
    parts = {name: load_prompts(name, limit=3) for name in MIXED_PARTS}
    assert mixed[1].id == parts["humaneval-edit"][0].id and mixed[5].id == parts["sharegpt-summarize"][1].id
    assert all(name in mixed.note for name in MIXED_PARTS)
