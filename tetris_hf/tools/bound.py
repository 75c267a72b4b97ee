"""``tetris-hf bound``: the optimal multi-draft acceptance against the verifiers, on a real pair's distributions.

For each prompt the target generates greedily; target and draft then run once over prompt + generation
(teacher-forced), which gives, at positions spread along the target's own generation, the target's next-token
distribution p and the draft's q. After temperature, for each number of drafts n it computes per position
(:mod:`tetris_hf.tools.multidraft`): the optimum with i.i.d. drafts and without replacement, the greedy construction's
optimum (which its verifier reaches), and the exact acceptance of single-draft SD, RRS (both draft laws) and K-SEQ;
RRS without replacement falls back to an unbiased Monte Carlo estimate where enumeration is impractical, and says
so. Acceptance is ``P(output is one of the drafts)``, the quantity the optimum bounds.

It prints means with 95% intervals, and the gaps that answer the questions (each verifier to its bound, without vs
with replacement, greedy vs both) as paired differences over the same positions. Intervals are normal, with a
standard error clustered by prompt (positions of one generation are not independent). Writes ``bound.json`` and
``bound.png`` to ``--output``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from . import multidraft
from .cli import UsageError, load_pair, load_prompt_set, number_list, prompt_texts, resolve_device

METHODS = {  # name -> label, in table and plot order
    "single": "single draft (reference)",
    "rrs": "RRS, i.i.d. drafts",
    "kseq": "K-SEQ, i.i.d. drafts",
    "optimal_iid": "optimum, i.i.d. drafts",
    "rrs_wor": "RRS, without replacement",
    "optimal_wor": "optimum, without replacement",
    "greedy": "greedy construction (optimum = its verifier)",
}
GAPS = {  # name -> (larger, smaller): paired differences over the same positions
    "optimal_iid - rrs": ("optimal_iid", "rrs"),
    "optimal_iid - kseq": ("optimal_iid", "kseq"),
    "optimal_wor - rrs_wor": ("optimal_wor", "rrs_wor"),
    "optimal_wor - optimal_iid": ("optimal_wor", "optimal_iid"),
    "greedy - optimal_iid": ("greedy", "optimal_iid"),
    "greedy - optimal_wor": ("greedy", "optimal_wor"),
}
Z_95 = 1.959963984540054


@dataclasses.dataclass
class Positions:
    """Per-position logits of one model pair: ``target`` and ``draft`` ``(N, V)`` float32 on CPU, ``next_tokens``
    ``(N,)`` (what the target generated there) and ``prompt`` ``(N,)`` (index of the prompt each came from)."""

    target: Tensor
    draft: Tensor
    next_tokens: Tensor
    prompt: Tensor


def _pick(count: int, wanted: int) -> list[int]:
    """Up to ``wanted`` indices spread evenly over ``range(count)``, first and last included."""
    if count <= wanted:
        return list(range(count))
    return sorted({round(i * (count - 1) / (wanted - 1)) for i in range(wanted)}) if wanted > 1 else [0]


@torch.inference_mode()
def position_logits(
    target, draft, prompts: Sequence[Sequence[int]], *, positions_per_prompt: int, max_new_tokens: int, progress=None
) -> Positions:
    """Greedy generation with the target per prompt, then one teacher-forced forward of each model over prompt +
    generation; logits are kept at up to ``positions_per_prompt`` positions spread along the generation (the
    position predicting generated token i)."""
    device = next(target.parameters()).device
    rows = {"target": [], "draft": [], "next_tokens": [], "prompt": []}
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        mask = torch.ones_like(ids)
        sequence = target.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
            pad_token_id=target.generation_config.pad_token_id,
        )
        generated = sequence.shape[1] - ids.shape[1]
        picked = [ids.shape[1] - 1 + i for i in _pick(generated, positions_per_prompt)]  # predicts token i
        if picked:
            chosen, full_mask = torch.tensor(picked, device=device), torch.ones_like(sequence)
            rows["target"].append(target(sequence, attention_mask=full_mask).logits[0, chosen].float().cpu())
            rows["draft"].append(draft(sequence, attention_mask=full_mask).logits[0, chosen].float().cpu())
            rows["next_tokens"].append(sequence[0, chosen + 1].cpu())
            rows["prompt"].append(torch.full((len(picked),), index, dtype=torch.long))
        if progress is not None:
            progress.update(1)
    if not rows["target"]:
        raise ValueError("no positions: every generation was empty (max_new_tokens=0 or EOS at once)")
    return Positions(**{key: torch.cat(value) for key, value in rows.items()})


def mean_interval(values: Tensor, groups: Tensor) -> dict[str, float]:
    """Mean of ``values`` ``(N,)`` with a 95% normal interval; standard error clustered by ``groups`` ``(N,)``
    (independent positions when there is a single group)."""
    values = values.double()
    mean = values.mean()
    _, cluster = groups.unique(return_inverse=True)
    clusters = int(cluster.max()) + 1
    if clusters > 1:
        sums = torch.zeros(clusters, dtype=values.dtype).index_add_(0, cluster, values - mean)
        error = math.sqrt(clusters / (clusters - 1) * float((sums**2).sum())) / len(values)
    else:
        error = float(values.std() / math.sqrt(len(values))) if len(values) > 1 else 0.0
    return {"mean": float(mean), "low": float(mean) - Z_95 * error, "high": float(mean) + Z_95 * error}


def acceptances(p: Tensor, q: Tensor, n: int, *, mc_samples: int, generator: torch.Generator) -> dict:
    """Every method of :data:`METHODS` at every position: ``{name: ((N,) float64, "exact" | "monte_carlo")}``."""
    vocab = p.shape[-1]
    wor_method = multidraft.rrs_acceptance_method(vocab, n, replacement=False)
    rrs_wor = multidraft.rrs_acceptance(p, q, n, replacement=False, num_samples=mc_samples, generator=generator)
    return {
        "single": (multidraft.single_draft_acceptance(p, q), "exact"),
        "rrs": (multidraft.rrs_acceptance(p, q, n), "exact"),
        "kseq": (multidraft.kseq_acceptance(p, q, n), "exact"),
        "optimal_iid": (multidraft.optimal_acceptance(p, q, n), "exact"),
        "rrs_wor": (rrs_wor, wor_method),
        "optimal_wor": (multidraft.optimal_acceptance(p, q, n, replacement=False), "exact"),
        "greedy": (multidraft.greedy_acceptance(p, q, n), "exact"),
    }


def bound_table(
    target,
    draft,
    tokenizer,
    prompts: Sequence[str | Sequence[int]],
    *,
    positions_per_prompt: int,
    ns: Sequence[int] = (2, 3, 4),
    temperatures: Sequence[float] = (0.5, 0.7, 1.0),
    max_new_tokens: int,
    mc_samples: int = 256,
    seed: int = 0,
    show_progress: bool = True,
) -> dict:
    """The optimum vs the verifiers along the target's own generations; JSON-ready.

    ``prompts``: token-id lists, or strings encoded with ``tokenizer`` (rendered chats already hold their special
    tokens, so none are added). Returns ``{"config", "prompts", "positions", "vocab_size", "methods", "rows",
    "seconds"}``; each row (one temperature and n) holds per method ``mean``/``low``/``high``, ``computed``
    (``"exact"`` or ``"monte_carlo"``) and the per-position ``values``, and the paired ``gaps`` of :data:`GAPS`.
    """
    from tqdm.auto import tqdm

    if positions_per_prompt < 1 or max_new_tokens < 1 or mc_samples < 1:
        raise ValueError("positions_per_prompt, max_new_tokens and mc_samples must be at least 1")
    if not ns or min(ns) < 1:
        raise ValueError(f"ns must be numbers of drafts >= 1, got {tuple(ns)}")
    if not temperatures or min(temperatures) <= 0:
        raise ValueError(f"temperatures must be positive, got {tuple(temperatures)}")
    token_lists = [
        tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else list(prompt)
        for prompt in prompts
    ]
    if not token_lists or not all(token_lists):
        raise ValueError("every prompt needs at least one token")

    start = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    rows = []
    with tqdm(total=len(token_lists) + len(temperatures) * len(ns), desc="bound", unit="step",
              disable=not show_progress, file=sys.stderr) as bar:
        bar.set_postfix_str("generating")
        logits = position_logits(target, draft, token_lists, positions_per_prompt=positions_per_prompt,
                                 max_new_tokens=max_new_tokens, progress=bar)
        for temperature in temperatures:
            p = torch.softmax(logits.target.double() / temperature, -1)
            q = torch.softmax(logits.draft.double() / temperature, -1)
            for n in ns:
                bar.set_postfix_str(f"T={temperature} n={n}")
                per_position = acceptances(p, q, n, mc_samples=mc_samples, generator=generator)
                methods = {
                    name: {**mean_interval(values, logits.prompt), "computed": computed, "values": values.tolist()}
                    for name, (values, computed) in per_position.items()
                }
                gaps = {
                    name: mean_interval(per_position[larger][0] - per_position[smaller][0], logits.prompt)
                    for name, (larger, smaller) in GAPS.items()
                }
                rows.append({"temperature": temperature, "n": n, "methods": methods, "gaps": gaps})
                bar.update(1)
    return {
        "config": {"positions_per_prompt": positions_per_prompt, "ns": list(ns), "temperatures": list(temperatures),
                   "max_new_tokens": max_new_tokens, "mc_samples": mc_samples, "seed": seed},
        "prompts": len(token_lists),
        "positions": len(logits.prompt),
        "vocab_size": int(logits.target.shape[-1]),
        "methods": METHODS,
        "rows": rows,
        "seconds": time.perf_counter() - start,
    }


def _cell(stats: dict, signed: bool = False) -> str:
    mean = f"{stats['mean']:+.3f}" if signed else f"{stats['mean']:.3f}"
    return f"{mean} [{stats['low']:.3f}, {stats['high']:.3f}]"


def format_table(report: dict) -> str:
    """One block per temperature: methods (and gaps) down, n across; ``*`` marks Monte Carlo estimates."""
    ns = report["config"]["ns"]
    width = 24
    lines = [f"{report['positions']} positions from {report['prompts']} prompts, vocabulary {report['vocab_size']}; "
             f"mean [95% interval]; * = Monte Carlo estimate"]
    for temperature in report["config"]["temperatures"]:
        rows = {row["n"]: row for row in report["rows"] if row["temperature"] == temperature}
        columns = "".join(f"{'n=' + str(n):<{width}}" for n in ns)
        header = f"{'temperature ' + str(temperature):<46}{columns}".rstrip()
        lines += ["", header, "-" * len(header)]
        for name, label in METHODS.items():
            cells = []
            for n in ns:
                stats = rows[n]["methods"][name]
                cells.append(f"{_cell(stats) + ('*' if stats['computed'] != 'exact' else ''):<{width}}")
            lines.append(f"{label:<46}" + "".join(cells).rstrip())
        for name in GAPS:
            cells = [f"{_cell(rows[n]['gaps'][name], signed=True):<{width}}" for n in ns]
            lines.append(f"{'gap: ' + name:<46}" + "".join(cells).rstrip())
    return "\n".join(lines)


def plot(report: dict, path: Path, title: str) -> None:
    """Bars per method with 95% intervals, grouped by n, one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures, ns = report["config"]["temperatures"], report["config"]["ns"]
    figure, axes = plt.subplots(
        1, len(temperatures), figsize=(5.5 * len(temperatures), 5), sharey=True, squeeze=False
    )
    width = 0.8 / len(METHODS)
    colours = plt.get_cmap("tab10").colors
    for axis, temperature in zip(axes[0], temperatures):
        rows = {row["n"]: row for row in report["rows"] if row["temperature"] == temperature}
        for m, (name, label) in enumerate(METHODS.items()):
            stats = [rows[n]["methods"][name] for n in ns]
            means = [s["mean"] for s in stats]
            errors = [[s["mean"] - s["low"] for s in stats], [s["high"] - s["mean"] for s in stats]]
            offsets = [i + (m - (len(METHODS) - 1) / 2) * width for i in range(len(ns))]
            axis.bar(offsets, means, width, yerr=errors, capsize=2, label=label, color=colours[m % len(colours)])
        axis.set_xticks(range(len(ns)), [f"n={n}" for n in ns])
        axis.set_title(f"temperature {temperature}")
        axis.set_ylim(0, 1)
        axis.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("acceptance P(output in drafts)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default="sharegpt", help="sharegpt | mtbench | humaneval | FILE.jsonl")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--positions-per-prompt", type=int, default=16, help="positions spread along each generation")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="length of the target's greedy generation")
    parser.add_argument("--ns", type=number_list(int), default=(2, 3, 4), help="numbers of drafts (comma list)")
    parser.add_argument("--temperatures", type=number_list(float), default=(0.5, 0.7, 1.0), help="comma list")
    parser.add_argument("--mc-samples", type=int, default=256,
                        help="Monte Carlo walks per position where RRS without replacement is not enumerable")
    parser.add_argument("--target", default=None, help="Hub id, local directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--draft", default=None, help="draft directory or model (default: the shipped draft)")
    parser.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (the bound runs on CPU)")
    parser.add_argument("--output", default="bound-out", help="directory for bound.json and bound.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")


def main(args) -> int:
    for flag in ("num_prompts", "positions_per_prompt", "max_new_tokens", "mc_samples"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if min(args.ns) < 1:
        raise UsageError(f"--ns must be numbers of drafts >= 1, got {','.join(map(str, args.ns))}")
    if min(args.temperatures) <= 0:
        raise UsageError(f"--temperatures must be positive, got {','.join(map(str, args.temperatures))}")
    device = resolve_device(args.device)
    prompt_set = load_prompt_set(args.prompts)
    target, draft, tokenizer, info = load_pair(args.target, args.draft, device)
    texts, note = prompt_texts(prompt_set, args.num_prompts, tokenizer)
    try:
        report = bound_table(
            target, draft, tokenizer, texts,
            positions_per_prompt=args.positions_per_prompt, ns=args.ns, temperatures=args.temperatures,
            max_new_tokens=args.max_new_tokens, mc_samples=args.mc_samples, seed=args.seed,
            show_progress=not args.no_progress,
        )
    except ValueError as error:  # e.g. every generation empty
        raise UsageError(str(error)) from None
    report.update(pair=dataclasses.asdict(info), prompt_set={"set": args.prompts, "count": len(texts), "note": note},
                  device=str(device), torch=torch.__version__, threads=torch.get_num_threads(), argv=sys.argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "bound.json").write_text(json.dumps(report, indent=1))
    plot(report, output / "bound.png", f"{args.prompts} x{len(texts)}, draft: {info.draft_kind}")
    print(f"target: {info.target}\ndraft:  {info.draft}\nprompts: {note}")
    print(format_table(report))
    print(f"{report['seconds']:.1f} s; wrote {output / 'bound.json'} and {output / 'bound.png'}")
    return 0


if __name__ == "__main__":
    from .cli import main as cli_main

    sys.exit(cli_main(["bound", *sys.argv[1:]]))
