"""The Space's shared request stream (examples/space/shared_stream.py), without a browser: one stream per pair for
every caller, requests from separate threads in the same batch and each equal to the target alone (greedy), a
visitor who goes away frees its row, and the board's HTML says who is in the batch.

The stream is the Space's strategy copy's (examples/space/strategy/, not kept in git), which :func:`strategy_copy`
exports from the package first (``tetris-hf export-space examples/space``)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "space"))

import shared_stream  # noqa: E402
from shared_stream import SharedStream, render_output, render_stream_board  # noqa: E402
from tetris_hf.tools.hub_export import SPACE_DIR, export_space  # noqa: E402
from tetris_runs import encode_prompts  # noqa: E402
from tiny_models import noisy_copy, sharpen, tiny_llama  # noqa: E402
from tiny_tokenizer import tiny_tokenizer  # noqa: E402

PROMPTS = ["the quick brown fox", "hello how are you today ?"]


@pytest.fixture(scope="module", autouse=True)
def strategy_copy():
    """The Space's strategy/ (not kept in git), written from the package as `tetris-hf export-space examples/space`
    does in a checkout, before any run loads it."""
    export_space(SPACE_DIR)


@pytest.fixture(scope="module")
def pair():
    target = sharpen(tiny_llama(vocab_size=64, seed=0), 6.0)
    return target, noisy_copy(target, 0.15), tiny_tokenizer()


def prompt_ids(tokenizer, text: str) -> list[int]:
    return encode_prompts(tokenizer, [text], "cpu")["input_ids"][0].tolist()


def alone(target, ids: list[int], max_new_tokens: int) -> list[int]:
    """The target by itself, greedy, on one prompt: its new tokens."""
    prompt = torch.tensor([ids])
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                          do_sample=False)
    return out[0, len(ids):].tolist()


def submit_together(stream: SharedStream, tokenizer, prompts: list[str], max_new_tokens: int) -> dict:
    """Each prompt sent from its own thread at the same moment, as separate visitors; their entries' snapshots."""
    ready = threading.Barrier(len(prompts))
    seen: dict[str, list] = {}

    def visit(visitor: str, text: str) -> None:
        ids = prompt_ids(tokenizer, text)
        ready.wait()
        seen[visitor] = list(stream.submit(ids, max_new_tokens, visitor, text, every=0.0))

    threads = [threading.Thread(target=visit, args=(f"visitor {i + 1}", text)) for i, text in enumerate(prompts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return seen


def test_requests_from_two_threads_share_the_batch_and_equal_the_target_alone(pair):
    target, draft, tokenizer = pair
    stream = shared_stream.shared_stream(target, draft)
    try:
        assert shared_stream.shared_stream(target, draft) is stream and stream.running  # one stream, started once
        seen = submit_together(stream, tokenizer, PROMPTS, 64)
        for (visitor, snapshots), text in zip(sorted(seen.items()), PROMPTS):
            last = snapshots[-1]
            assert last.state == "done" and last.visitor == visitor
            assert last.tokens == alone(target, prompt_ids(tokenizer, text), 64)
            assert last.most_rows == 2  # it shared a step with the other visitor's request
            assert last.time_to_first_token > 0 and last.tokens_per_second > 0
            for partial in snapshots[:-1]:  # each a prefix of the final output
                assert partial.tokens == last.tokens[: len(partial.tokens)]
        board = stream.board()
        assert board.most_rows == 2 and board.served >= 2 and board.in_batch == []
        assert 2 in board.rows_per_step and board.steps >= len(board.rows_per_step)
        page = render_stream_board(board, "visitor 1", lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        assert 'data-most-rows="2"' in page and page.count('class="stream-row done') >= 2
        assert page.count(" (you)") == 1 and "visitor 2" in page
        output = render_output(seen["visitor 1"][-1], lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        assert 'data-state="done"' in output and "▌" not in output
        # the batch's total speed, from its own steps: every token its steps emitted over their decoding time
        tokens = sum(len(snapshots[-1].tokens) for snapshots in seen.values())
        assert 0 < board.busy_tokens <= tokens and board.busy_seconds > 0 and board.busy_steps < board.steps
        assert f"Whole batch: <b>{board.tokens_per_second:.1f} tok/s</b> in all" in page
        assert f"acceptance {board.acceptance:.2f}" in page and 0 <= board.acceptance <= 1
        assert "Rows in the batch at each of its last" in page and "compare with the first tab" in page
    finally:  # (the Space keeps it for its life; a test process should not)
        stream.stop()


def test_a_visitor_who_goes_away_frees_its_row(pair):
    target, draft, tokenizer = pair
    stream = SharedStream(target, draft, max_rows=1)
    stream.start()
    try:
        leaving = stream.submit(prompt_ids(tokenizer, PROMPTS[0]), 256, "visitor 1", every=0.0)
        first = next(leaving)
        assert first.state in ("waiting", "decoding")
        leaving.close()  # the page went away: the request is cancelled, its row freed for the next one
        [*_, last] = stream.submit(prompt_ids(tokenizer, PROMPTS[1]), 8, "visitor 2")
        assert last.state == "done" and last.tokens == alone(target, prompt_ids(tokenizer, PROMPTS[1]), 8)
        board = stream.board()
        assert [(entry.visitor, entry.state) for entry in board.entries] == [("visitor 2", "done"),
                                                                             ("visitor 1", "cancelled")]
        assert board.most_rows == 1 and board.served == 1
    finally:
        stream.stop()
    assert not stream.running


def test_a_pair_the_stream_cannot_draft_with_uses_prompt_lookup(pair):
    target, _, tokenizer = pair
    stream = SharedStream(target, None)
    stream.start()
    try:
        [*_, last] = stream.submit(prompt_ids(tokenizer, PROMPTS[0]), 12, "visitor 1")
    finally:
        stream.stop()
    assert "prompt lookup" in stream.drafting
    assert last.tokens == alone(target, prompt_ids(tokenizer, PROMPTS[0]), 12)


@pytest.mark.parametrize("text, limit, start, end", [
    ("short text", 40, "short text", "short text"),
    ("the quick brown fox jumps over the lazy dog", 20, "the quick brown\u2026", "\u2026over the lazy dog"),
    ("x" * 50, 20, "x" * 19 + "\u2026", "\u2026" + "x" * 19),  # one long word: cut in it, still marked
])
def test_card_texts_are_cut_between_words_with_an_ellipsis(text, limit, start, end):
    assert shared_stream.head_text(text, limit) == start and shared_stream.tail_text(text, limit) == end
    assert len(start) <= limit and len(end) <= limit
