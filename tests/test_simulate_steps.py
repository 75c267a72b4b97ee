"""``tetris-hf simulate replay-steps``: bench step traces (chains and draft trees) replay on a cost curve with the step
times, tokens and ratios worked out by hand."""

import argparse
import json

import pytest
import torch

from tetris_hf.cost_model import CostProfile, StepCostModel
from tetris_hf.tools import bench, simulate
from tetris_hf.tools.cli import UsageError

# target forward over r rows x t tokens: 10 + r t ms; draft forward over r rows: r ms. Both are linear in each
# argument, so the cost model's piecewise-linear interpolation (and extrapolation) reproduces them exactly.
LINEAR = CostProfile({(r, t): 10.0 + r * t for r in (1, 8, 64) for t in (1, 2, 4, 8, 16)}, {1: 1.0, 8: 8.0, 64: 64.0})


def constant_trace(drafted: int, verified: int, accepted: int, width: int, rows: int = 50) -> simulate.StepTrace:
    full = lambda value: torch.full((rows,), value, dtype=torch.long)  # noqa: E731
    return simulate.StepTrace("run", width, 16, full(drafted), full(verified), full(accepted))


def test_step_seconds_count_k_draft_forwards_over_the_frontier_and_one_block():
    cost = StepCostModel(LINEAR)
    # tree, w = 3: the root's forward over 16 rows, 5 forwards over 16 x 3 frontier nodes, a block of 1 + 9 per row
    assert simulate.step_seconds(cost, 16, 6, 9, 3) == pytest.approx((16 + 5 * 48 + (10 + 16 * 10)) / 1000)
    # chain: 6 forwards over 16 rows, the same block: the chain simulator's step time
    assert simulate.step_seconds(cost, 16, 6, 9, 1) == pytest.approx((6 * 16 + 170) / 1000)
    assert simulate.step_seconds(cost, 16, 6, 9, 1) == pytest.approx(cost.step_seconds(16, 6, 9))
    assert simulate.step_seconds(cost, 16, 0, 0, 3) == pytest.approx(26 / 1000)  # a plain step: the target alone
    assert simulate.plain_tokens_per_second(cost, 16) == pytest.approx(16 / 0.026)


def test_a_constant_trace_replays_to_the_hand_computed_tokens_and_seconds():
    cost = StepCostModel(LINEAR)
    result = simulate.replay_steps(constant_trace(drafted=4, verified=5, accepted=2, width=2), cost, 8, steps=10)
    assert result.tokens == 10 * 8 * (2 + 1)
    assert result.seconds == pytest.approx(10 * (8 + 3 * 16 + (10 + 8 * 6)) / 1000)
    assert result.verified == 10 * 8 * 5 and result.accepted == 10 * 8 * 2
    (entry,) = simulate.simulate_steps([constant_trace(4, 5, 2, 2)], cost, [8], row_steps=80, min_steps=10)
    assert entry["tokens_per_row_step"] == 3 and entry["tokens_per_verified_node"] == pytest.approx(3 / 5)
    (at_8,) = entry["by_batch"]
    assert at_8["steps"] == 10
    assert at_8["ratio"] == pytest.approx((240 / result.seconds) / (8 / 0.018))


def test_the_widest_row_sizes_the_block_and_the_deepest_k_the_draft():
    cost = StepCostModel(LINEAR)
    # two kinds of row-step; with B = 64 a step all but surely holds both, so it pays for K = 5 and a block of 1 + 7
    trace = simulate.StepTrace("mixed", 2, 16, torch.tensor([3, 5]), torch.tensor([1, 7]), torch.tensor([0, 3]))
    result = simulate.replay_steps(trace, cost, 64, steps=20, seed=1)
    assert result.seconds == pytest.approx(20 * (64 + 4 * 128 + (10 + 64 * 8)) / 1000)
    assert result.tokens == 20 * 64 + result.accepted
    assert 0.4 < result.accepted / (3 * 20 * 64) < 0.6  # each kind drawn about half the time


def test_bench_step_traces_drop_each_calls_prompt_step_and_finished_rows(tmp_path):
    run = {"run": "tetris k=2 e=1 C=4 w=2", "strategy": "tetris", "options": {"tetris_tree_width": 2},
           "tree_width": 2, "batch_size": 2,
           "calls": [[[0, [0, 0], [0, 0]], [3, [3, 1], [2, 0]], [3, [4, -1], [1, -1]]],  # row 1 finished
                     [[0, [0, 0], [0, 0]], [3, [2, 2], [2, 1]]]]}
    path = bench.write_step_traces(tmp_path / "step-traces.jsonl", [run], {"target": "tiny"})
    (trace,) = simulate.read_step_traces(path)
    assert trace.run == run["run"] and trace.tree_width == 2 and trace.batch_size == 2
    assert trace.drafted.tolist() == [3, 3, 3, 3, 3]
    assert trace.verified.tolist() == [3, 1, 4, 2, 2] and trace.accepted.tolist() == [2, 0, 1, 2, 1]
    assert trace.tokens_per_row_step == pytest.approx(11 / 5)
    assert trace.tokens_per_verified_node == pytest.approx(11 / 12)
    assert trace.header["target"] == "tiny"
    with pytest.raises(ValueError, match="recorded no step"):
        simulate.step_traces_from_run({**run, "calls": [[[0, [0, 0], [0, 0]]]]})


def test_replay_steps_cli_prints_ratios_and_writes_json(tmp_path, capsys):
    calls = [[[0, [0] * 4, [0] * 4]] + [[4, [5] * 4, [2] * 4]] * 6]
    runs = [{"run": name, "strategy": "tetris", "options": {}, "tree_width": width, "batch_size": 4, "calls": calls}
            for name, width in (("tetris chain", 1), ("tetris w=2", 2))]
    traces = bench.write_step_traces(tmp_path / "step-traces.jsonl", runs, {})
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps([{"model": "t", "B": r, "L": t, "ms": 10.0 + r * t} for r in (1, 8, 64)
                                 for t in (1, 2, 4, 8, 16)] + [{"model": "d", "B": r, "L": 1, "ms": float(r)}
                                                               for r in (1, 8, 64)]))
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    args = parser.parse_args(["replay-steps", "--traces", str(traces), "--curve", str(curve), "--row-steps", "64",
                              "--min-steps", "4", "--output", str(tmp_path / "out")])
    assert simulate.main(args) == 0
    printed = capsys.readouterr().out
    assert "tetris w=2" in printed and "B=4" in printed and "B=16" in printed
    report = json.loads((tmp_path / "out" / "simulate-steps.json").read_text())
    assert report["batch_sizes"][:2] == [4, 16] and "Row-steps are independent draws" in report["assumptions"]
    chain, tree = report["curves"][0]["results"]
    assert chain["tokens_per_row_step"] == tree["tokens_per_row_step"] == 3
    at_4 = [entry["by_batch"][0] for entry in (chain, tree)]
    plain = 4 / ((10 + 4) / 1000)
    chain_step = (4 * 4 + (10 + 4 * 6)) / 1000
    tree_step = (4 + 3 * 8 + (10 + 4 * 6)) / 1000
    assert at_4[0]["ratio"] == pytest.approx(12 / chain_step / plain)
    assert at_4[1]["ratio"] == pytest.approx(12 / tree_step / plain)
    args = parser.parse_args(["replay-steps", "--traces", str(traces), "--traces", str(traces), "--curve", str(curve),
                              "--batch-sizes", "4", "--output", str(tmp_path / "two")])
    assert simulate.main(args) == 0  # several files: each run named by its file's prompt set (here none: the folder)
    two = json.loads((tmp_path / "two" / "simulate-steps.json").read_text())
    names = [r["run"] for r in two["curves"][0]["results"]]
    assert names == [f"{tmp_path.name}: tetris chain", f"{tmp_path.name}: tetris w=2"] * 2
    with pytest.raises(UsageError, match="bad step traces"):
        simulate.main(parser.parse_args(["replay-steps", "--traces", str(curve), "--curve", str(curve)]))
