"""One step of draft trees, drawn: what each row drafted, what TETRIS selected under the batch's budget, what the
target accepted.

    python examples/tree_step_picture.py                      # writes docs/tree-step.png and docs/tree-step.json

It runs the real loop (``custom_generate="tetris"``, ``tetris_tree_width=3``, greedy) on the offline default pair
(SmolLM2-135M-Instruct and the shipped 2-layer draft) for four short chat prompts at ``B = 4``, records every tree
step by wrapping three of the loop's seams from the outside (the drafter's ``propose_tree``, and the ``tree_block``
and ``accept_tree_greedy`` that :mod:`tetris_hf.tree_step` calls; nothing in the library changes), picks the step
that accepted the most tokens, and draws it: per row, the tree from the row's last token (the root) to depth
``K = k + e``, every node labelled with its token and path probability (the product of the draft's ``q`` along its
path: the score TETRIS ranks by), the nodes the target verified filled, the accepted path in red.
"""

from __future__ import annotations

import argparse
import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a linked list is in one sentence.",
)


# ---------------------------------------------------------------------------------------------------------------
# Capture: one dict per tree step, from the loop's own tensors


@contextmanager
def capture_tree_steps(steps: list[dict]):
    """While active, every tree step of the loop appends ``{"tree", "selected", "block", "acceptance", "context"}``
    to ``steps`` (CPU tensors). Wraps, and restores on exit: ``BatchedDraftCandidateGenerator.propose_tree``,
    ``tetris_hf.tree_step.tree_block`` and ``tetris_hf.tree_step.accept_tree_greedy``."""
    import tetris_hf.tree_step as tree_step
    from tetris_hf.candidate_generators import BatchedDraftCandidateGenerator

    originals = (BatchedDraftCandidateGenerator.propose_tree, tree_step.tree_block, tree_step.accept_tree_greedy)
    propose_tree, tree_block, accept_tree_greedy = originals

    def propose(self, sequences, lengths, depth, width, rows):
        grown = propose_tree(self, sequences, lengths, depth, width, rows)
        context = [sequences[b, max(int(lengths[b]) - 12, 0): int(lengths[b])].tolist() for b in range(len(lengths))]
        steps.append({"tree": grown.tree._replace(**{f: getattr(grown.tree, f).cpu() for f in grown.tree._fields}),
                      "context": context, "rows": rows.cpu().tolist(), "depth": depth, "width": width})
        return grown

    def block(selected, *args, **kwargs):
        result = tree_block(selected, *args, **kwargs)
        steps[-1].update(selected=selected.cpu(), block=result._replace(**{f: getattr(result, f).cpu()
                                                                           for f in result._fields}))
        return result

    def accept(*args, **kwargs):
        result = accept_tree_greedy(*args, **kwargs)
        steps[-1]["acceptance"] = result._replace(**{f: getattr(result, f).cpu() for f in result._fields})
        return result

    BatchedDraftCandidateGenerator.propose_tree = propose
    tree_step.tree_block, tree_step.accept_tree_greedy = block, accept
    try:
        yield steps
    finally:
        BatchedDraftCandidateGenerator.propose_tree = propose_tree
        tree_step.tree_block, tree_step.accept_tree_greedy = tree_block, accept_tree_greedy


def step_record(step: dict, decode, budget: int) -> dict:
    """A captured step as plain data: per row its context, root token and nodes (token, text, parent, depth, path
    probability, selected, accepted), the accepted count and the target's next token.

    ``decode``: token id -> text."""
    tree, selected, block, acceptance = step["tree"], step["selected"], step["block"], step["acceptance"]
    rows = []
    for b in range(tree.tokens.shape[0]):
        accepted = int(acceptance.num_accepted[b])
        path_slots = acceptance.path[b, :accepted].tolist()
        path_nodes = {int(block.node_index[b, slot - 1]) for slot in path_slots}
        nodes = []
        for n in range(tree.tokens.shape[1]):
            if not bool(tree.valid[b, n]):
                continue
            token = int(tree.tokens[b, n])
            nodes.append({"index": n, "token": token, "text": decode(token), "parent": int(tree.parents[b, n]),
                          "depth": int(tree.depths[b, n]), "path_prob": math.exp(float(tree.log_scores[b, n])),
                          "selected": bool(selected[b, n]), "accepted": n in path_nodes})
        root = int(block.tokens[b, 0])
        next_token = int(acceptance.next_tokens[b])
        rows.append({"row": step["rows"][b], "context": decode(step["context"][b]), "root": root,
                     "root_text": decode(root), "nodes": nodes, "verified": int(selected[b].sum()),
                     "accepted": accepted, "next_token": next_token, "next_text": decode(next_token)})
    return {"budget": budget, "width": step["width"], "depth": step["depth"], "rows": rows}


# ---------------------------------------------------------------------------------------------------------------
# Drawing


def _label(text: str) -> str:
    shown = text.replace("\n", "\\n").replace(" ", "\u00b7")
    return shown if len(shown) <= 10 else shown[:9] + "\u2026"


def draw_step(record: dict, path: str | Path, title: str | None = None) -> Path:
    """Draw :func:`step_record`'s dict to ``path``: one panel per row, depth left to right, a depth's nodes top to
    bottom by score (best first); verified nodes filled, the accepted path in red, the rest hollow and grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    per_depth = max([sum(1 for n in row["nodes"] if n["depth"] == d) for row in rows
                     for d in range(1, record["depth"] + 1)] + [1])
    figure, axes = plt.subplots(len(rows), 1, figsize=(2.1 * (record["depth"] + 1) + 1, (per_depth * 0.95 + 1.0)
                                                       * len(rows) + 0.6), squeeze=False)
    for axis, row in zip(axes[:, 0], rows):
        place = {-1: (0.0, (per_depth - 1) / 2)}  # the root
        rank = {}
        for node in row["nodes"]:  # node order is depth by depth, best first within a depth
            r = rank.get(node["depth"], 0)
            rank[node["depth"]] = r + 1
            place[node["index"]] = (float(node["depth"]), float(r))
        for node in row["nodes"]:
            (x0, y0), (x1, y1) = place[node["parent"]], place[node["index"]]
            on_path = node["accepted"]
            axis.plot([x0, x1], [y0, y1], color="#d62728" if on_path else "#bbbbbb", linewidth=2.6 if on_path else 0.9,
                      zorder=1)
        x, y = place[-1]
        axis.text(x, y, _label(row["root_text"]) + "\n(root)", ha="center", va="center", fontsize=7.5, zorder=3,
                  bbox=dict(boxstyle="round,pad=0.3", facecolor="#fff2cc", edgecolor="black"))
        for node in row["nodes"]:
            x, y = place[node["index"]]
            face = "#9ecae1" if node["selected"] else "white"
            edge = "#d62728" if node["accepted"] else ("#08519c" if node["selected"] else "#aaaaaa")
            axis.text(x, y, f"{_label(node['text'])}\n{node['path_prob']:.2g}", ha="center", va="center",
                      fontsize=7.5, zorder=3, color="black" if node["selected"] else "#777777",
                      bbox=dict(boxstyle="round,pad=0.3", facecolor=face, edgecolor=edge,
                                linewidth=2.0 if node["accepted"] else 1.0))
        axis.set_xlim(-0.6, record["depth"] + 0.6)
        axis.set_ylim(per_depth - 0.4, -0.6)
        axis.axis("off")
        axis.set_title(f"row {row['row']}: \u2026{_label_context(row['context'])}   |   verified {row['verified']} "
                       f"nodes, accepted {row['accepted']}, then the target's {_label(row['next_text'])!r}",
                       fontsize=8.5, loc="left")
    figure.suptitle(title or (f"One step of draft trees: width w = {record['width']}, depth K = {record['depth']}, "
                              f"budget C = {record['budget']} nodes for the batch (TETRIS: the batch's C best path "
                              f"probabilities).\nFilled: verified; red: accepted path; numbers: path probability "
                              f"under the draft"), fontsize=9.5)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _label_context(text: str) -> str:
    return text.replace("\n", "\\n")[-48:]


# ---------------------------------------------------------------------------------------------------------------
# Running the loop


def run(width: int = 3, k: int = 4, extra: int = 2, max_new_tokens: int = 24) -> tuple[list[dict], dict]:
    """Every tree step of one greedy call on :data:`PROMPTS` with the default pair; and what was run."""
    import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
    from tetris_hf.tools.models import load_default_pair

    target, draft, tokenizer, info = load_default_pair(device="cpu")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in PROMPTS]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    steps: list[dict] = []
    with capture_tree_steps(steps), torch.no_grad():
        out = target.generate(**batch, assistant_model=draft, custom_generate="tetris", tetris_strategy="tetris",
                              tetris_tree_width=width, num_assistant_tokens=k, tetris_extra_tokens=extra,
                              max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                              return_dict_in_generate=True)
    budget = k * len(PROMPTS)
    records = [step_record(step, lambda ids: tokenizer.decode(ids if isinstance(ids, list) else [ids]), budget)
               for step in steps if "acceptance" in step]
    meta = {"target": info.target, "draft": info.draft, "prompts": list(PROMPTS), "tetris_tree_width": width,
            "num_assistant_tokens": k, "tetris_extra_tokens": extra, "max_new_tokens": max_new_tokens,
            "steps": len(records), "accepted_tokens": out.tetris_stats.accepted_tokens,
            "verified_nodes": out.tetris_stats.verified_tokens}
    return records, meta


def most_accepted(records: list[dict]) -> int:
    """The step whose rows accepted the most drafts (the first such)."""
    totals = [sum(row["accepted"] for row in record["rows"]) for record in records]
    return max(range(len(records)), key=lambda index: (totals[index], -index))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(ROOT / "docs" / "tree-step.png"))
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument("--step", type=int, default=None, help="tree step to draw (default: the most accepted)")
    args = parser.parse_args(argv)
    records, meta = run(width=args.width)
    index = most_accepted(records) if args.step is None else args.step
    record = records[index]
    output = draw_step(record, args.output)
    json_path = output.with_suffix(".json")
    json_path.write_text(json.dumps({**meta, "drawn_step": index + 1, "record": record}, indent=1))
    accepted = [row["accepted"] for row in record["rows"]]
    print(f"drew tree step {index + 1} of {len(records)} (accepted per row {accepted}) to {output}; "
          f"data in {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
