"""Issue #44's matrix: `adaptive` against the best non-speculative system and the best fixed/TETRIS run, cell by cell.

Each cell is one ``tetris-hf bench`` (static calls) or ``tetris-hf stream-bench`` (the stream) in a fresh process,
3 interleaved repeats, ``OMP_NUM_THREADS=1``; its ``results.json`` goes under ``--output/<cell>/``. A cell whose
results exist is not rerun, so the script resumes where it stopped. The table is printed (and written to
``--output/table.md``) from whatever cells exist::

    python examples/never_slower_matrix.py --output docs/bench-matrix            # run the missing cells, then the table
    python examples/never_slower_matrix.py --output docs/bench-matrix --table    # the table only

Ratios are per repeat (each system's repeat against the best plain system's same repeat), then the median: the
machine's drift between repeats cancels. "first" is the first repeat's ratio: a fresh process's first call of
`adaptive`, which pays its learning (the cost profile is cached across processes, the pair memory is not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

STATIC = "generate,fixed,tetris,adaptive"
SIZES = {1: 4, 4: 8, 16: 16}  # batch size -> prompts


def cells() -> list[tuple[str, list[str]]]:
    """(name, argv) of every cell, the stream and the cheapest first."""
    common = ["--max-new-tokens", "48", "--max-prompt-tokens", "512", "--repeats", "3", "--no-progress"]
    out = [("stream-main-job", ["stream-bench", "--prompts", "mixed", "--hybrid", "--num-prompts", "24",
                                "--max-batch-size", "8", "--max-new-tokens", "64", "--strategies",
                                "plain,tetris,adaptive", "--systems", "hf-generate-batch,generate-chunks",
                                "--repeats", "3"])]
    for prompts in ("humaneval-edit", "sharegpt-summarize"):
        for b in (1, 16):
            out.append((f"{prompts}-b{b}-lookup", ["bench", "--prompts", prompts, "--batch-size", str(b),
                                                   "--num-prompts", str(SIZES[b]), "--strategies", STATIC,
                                                   "--draft", "lookup", "--num-assistant-tokens", "4",
                                                   "--extra-tokens", "2", *common]))
    out.append(("mixed-b16-hybrid", ["bench", "--prompts", "mixed", "--batch-size", "16", "--num-prompts", "16",
                                     "--strategies", STATIC, "--sources", "hybrid", "--num-assistant-tokens", "4",
                                     "--extra-tokens", "2", *common]))
    for b in (16, 4, 1):
        for prompts in ("humaneval", "sharegpt", "mtbench"):
            for draft, flag in (("model", []), ("eagle", ["--draft", "eagle"])):
                out.append((f"{prompts}-b{b}-{draft}", ["bench", "--prompts", prompts, "--batch-size", str(b),
                                                        "--num-prompts", str(SIZES[b]), "--strategies", STATIC,
                                                        "--num-assistant-tokens", "2", "--extra-tokens", "2",
                                                        *flag, *common]))
    out.append(("stream-sharegpt-128", ["stream-bench", "--prompts", "sharegpt", "--num-prompts", "128",
                                        "--max-batch-size", "16", "--max-new-tokens", "32", "--max-prompt-tokens",
                                        "512", "--strategies", "plain,adaptive", "--systems",
                                        "hf-generate-batch,generate-chunks", "--repeats", "3"]))
    return out


def run_cell(name: str, argv: list[str], root: Path) -> None:
    out = root / name
    if (out / "results.json").exists():
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = ["tetris-hf", *argv, "--output", str(out)]
    print("$", "OMP_NUM_THREADS=1", " ".join(cmd), flush=True)
    log = root / f"{name}.log"
    with open(log, "w") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        print(f"  {name}: exit {done.returncode}, see {log}", flush=True)


def per_repeat(runs: dict[str, list[float]], names: list[str], against: list[str]) -> list[float]:
    """Best of ``names`` over best of ``against``, repeat by repeat."""
    reps = min(len(runs[n]) for n in names + against)
    return [max(runs[n][i] for n in names) / max(runs[n][i] for n in against) for i in range(reps)]


def static_row(name: str, data: dict) -> dict:
    runs = {r["name"]: r["tokens_per_second_repeats"] for r in data["runs"]}
    adaptive = [n for n in runs if n.startswith("adaptive")]
    speculative = [n for n in runs if n.startswith(("fixed", "tetris"))]
    return dict(cell=name, plain=statistics.median(runs["generate"]),
                adaptive=per_repeat(runs, adaptive, ["generate"]),
                best_spec=per_repeat(runs, speculative, ["generate"]),
                vs_spec=per_repeat(runs, adaptive, speculative),
                equal="yes" if not data.get("mismatches") else f"NO ({len(data['mismatches'])})")


def stream_row(name: str, data: dict) -> dict:
    (size, runs), = data["runs"].items()
    reps = {r["name"]: r["repeats"] for r in runs}
    plain = [n for n in reps if n in ("hf-generate-batch", "generate-chunks", "stream-plain")]
    adaptive = [n for n in reps if "adaptive" in n]
    speculative = [n for n in reps if n.endswith(("tetris", "fixed"))]
    equal = {r["name"]: r.get("equal") for r in runs}
    return dict(cell=f"{name} ({size} rows)", plain=max(statistics.median(reps[n]) for n in plain),
                adaptive=per_repeat(reps, adaptive, plain),
                best_spec=per_repeat(reps, speculative, plain) if speculative else [],
                vs_spec=per_repeat(reps, adaptive, speculative) if speculative else [],
                equal=", ".join(f"{v}" for v in sorted(set(equal.values()), key=str)))


def table(root: Path) -> str:
    lines = ["| cell | best plain tok/s | `adaptive` / best plain (median; repeats) | first | best fixed/TETRIS / "
             "best plain | `adaptive` / best fixed/TETRIS | outputs equal |", "|---|---|---|---|---|---|---|"]
    fmt = lambda xs: f"**{statistics.median(xs):.2f}x** ({', '.join(f'{x:.2f}' for x in xs)})" if xs else "-"
    median = lambda xs: f"{statistics.median(xs):.2f}x" if xs else "-"
    for name, argv in cells():
        path = root / name / "results.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        row = stream_row(name, data) if argv[0] == "stream-bench" else static_row(name, data)
        lines.append(f"| {row['cell']} | {row['plain']:.1f} | {fmt(row['adaptive'])} | {row['adaptive'][0]:.2f} | "
                     f"{median(row['best_spec'])} | {median(row['vs_spec'])} | {row['equal']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("docs/bench-matrix"))
    parser.add_argument("--table", action="store_true", help="print the table from the cells that exist, run none")
    parser.add_argument("--only", default="", help="comma list of cell names to run (default: all)")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    if not args.table:
        for name, argv in cells():
            if not only or name in only:
                run_cell(name, argv, args.output)
    text = table(args.output)
    (args.output / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
