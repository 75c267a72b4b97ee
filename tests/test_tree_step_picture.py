"""examples/tree_step_picture.py: a captured tree step turns into the data it draws (selected nodes, the accepted path)
and a picture, on trees.py's worked example; the capture records what the loop did and restores the seams it wraps."""

import importlib.util
import json
from pathlib import Path

import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
import tetris_hf.tree_step as tree_step
import tetris_hf.trees as trees
from tetris_hf.candidate_generators import BatchedDraftCandidateGenerator
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, tiny_llama

_spec = importlib.util.spec_from_file_location(
    "tree_step_picture", Path(__file__).resolve().parents[1] / "examples" / "tree_step_picture.py")
picture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(picture)

WORDS = ["r", "the", "a", "cat", "dog"]


def worked_example() -> dict:
    """trees.py's example: nodes [the, a, cat, dog], budget 3 selects [the, cat, dog], the target follows the-dog."""
    tokens = torch.tensor([[1, 2, 3, 4]])
    parents = torch.tensor([[-1, -1, 0, 0]])
    depths = torch.tensor([[1, 1, 2, 2]])
    scores = torch.tensor([[-0.2, -1.9, -0.7, -1.4]])
    tree = trees.DraftTree(tokens, parents, depths, scores, torch.ones(1, 4, dtype=torch.bool))
    selected = trees.select_tree_nodes(scores, tree.valid, parents, 3)
    block = trees.tree_block(selected, parents, depths, tokens, torch.tensor([0]), 3)
    argmax = torch.tensor([[1, 4, 0, 2]])  # at r: the; at the: dog; after dog: a
    acceptance = trees.accept_tree_greedy(block.tokens, block.parents, argmax, 2)
    return {"tree": tree, "selected": selected, "block": block, "acceptance": acceptance, "context": [[0]],
            "rows": [0], "depth": 2, "width": 2}


def decode(ids):
    return " ".join(WORDS[i] for i in ids) if isinstance(ids, list) else WORDS[ids]


def test_worked_example_becomes_the_drawn_data_and_a_picture(tmp_path):
    record = picture.step_record(worked_example(), decode, budget=3)
    (row,) = record["rows"]
    assert [node["text"] for node in row["nodes"]] == ["the", "a", "cat", "dog"]
    assert [node["selected"] for node in row["nodes"]] == [True, False, True, True]
    assert [node["accepted"] for node in row["nodes"]] == [True, False, False, True]
    assert row["verified"] == 3 and row["accepted"] == 2 and row["next_text"] == "a" and row["root_text"] == "r"
    assert abs(row["nodes"][0]["path_prob"] - 0.8187) < 1e-3  # exp(-0.2)
    json.dumps(record)
    path = picture.draw_step(record, tmp_path / "step.png")
    assert path.stat().st_size > 5_000
    assert picture.most_accepted([record, {**record, "rows": [{**row, "accepted": 0}]}]) == 0


def test_capture_records_every_tree_step_and_restores_the_seams():
    target = tiny_llama(64, num_layers=2, seed=5)
    draft = noisy_copy(target, 0.3, seed=6)
    input_ids, mask = left_pad(random_prompts(3, 64, seed=5))
    seams = (BatchedDraftCandidateGenerator.propose_tree, tree_step.tree_block, tree_step.accept_tree_greedy)
    steps = []
    with picture.capture_tree_steps(steps):
        out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                              tetris_tree_width=2, num_assistant_tokens=2, tetris_extra_tokens=1, max_new_tokens=10,
                              do_sample=False, pad_token_id=PAD, return_dict_in_generate=True)
    assert (BatchedDraftCandidateGenerator.propose_tree, tree_step.tree_block, tree_step.accept_tree_greedy) == seams
    records = [picture.step_record(step, lambda ids: str(ids), budget=6) for step in steps]
    stats = out.tetris_stats
    assert sum(row["accepted"] for record in records for row in record["rows"]) == stats.accepted_tokens
    assert sum(row["verified"] for record in records for row in record["rows"]) == stats.verified_tokens
    for record in records:
        assert sum(row["verified"] for row in record["rows"]) <= 6  # the budget C = k B
        for row in record["rows"]:
            assert sum(node["accepted"] for node in row["nodes"]) == row["accepted"]
            assert all(node["selected"] for node in row["nodes"] if node["accepted"])
