"""``tetris-hf bound`` on tiny random Llamas: right positions, every method where theory puts it, files written."""

import json

import pytest
import torch

from tetris_hf.tools import multidraft
from tetris_hf.tools import bound, models
from tetris_hf.tools.cli import main as cli_main
from tetris_hf.tools.models import PairInfo

from tiny_models import noisy_copy, tiny_llama
from tiny_tokenizer import tiny_tokenizer

PROMPTS = [[5, 6, 7, 8], [10, 11, 12], [3, 40, 41, 42, 43, 9], [20]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab_size=64, num_layers=2, hidden_size=32, seed=0)
    return target, noisy_copy(target, scale=1.0, seed=1)


@pytest.fixture(scope="module")
def report(pair):
    target, draft = pair
    return bound.bound_table(target, draft, None, PROMPTS, positions_per_prompt=4, ns=(2, 3), temperatures=(0.7, 1.0),
                             max_new_tokens=8, show_progress=False)


def test_positions_are_the_targets_own_greedy_predictions(pair):
    target, draft = pair
    logits = bound.position_logits(target, draft, PROMPTS, positions_per_prompt=4, max_new_tokens=8)
    assert logits.target.shape == logits.draft.shape == (4 * len(PROMPTS), 64)
    assert torch.equal(logits.target.argmax(-1), logits.next_tokens)  # greedy: the generated token is the argmax
    assert logits.prompt.tolist() == [i for i in range(len(PROMPTS)) for _ in range(4)]
    assert not torch.equal(logits.target, logits.draft)


def test_every_row_holds_every_method_with_an_interval(report):
    assert report["positions"] == 16 and report["prompts"] == 4 and report["vocab_size"] == 64
    assert [(row["temperature"], row["n"]) for row in report["rows"]] == [(0.7, 2), (0.7, 3), (1.0, 2), (1.0, 3)]
    for row in report["rows"]:
        assert set(row["methods"]) == set(bound.METHODS) and set(row["gaps"]) == set(bound.GAPS)
        for stats in row["methods"].values():
            assert 0 <= stats["mean"] <= 1 and stats["low"] <= stats["mean"] <= stats["high"]
            assert stats["computed"] == "exact"  # V=64, n<=3: RRS without replacement is enumerated
            assert len(stats["values"]) == 16
    json.dumps(report)


def test_verifiers_stay_under_their_bound_at_every_position(report):
    for row in report["rows"]:
        values = {name: torch.tensor(stats["values"]) for name, stats in row["methods"].items()}
        for verifier, optimum in [("rrs", "optimal_iid"), ("kseq", "optimal_iid"), ("rrs_wor", "optimal_wor")]:
            assert (values[verifier] <= values[optimum] + 1e-12).all(), (row["temperature"], row["n"], verifier)
            assert (values["single"] <= values[verifier] + 1e-12).all()
        gap = row["gaps"]["optimal_wor - rrs_wor"]
        assert gap["mean"] == pytest.approx(float((values["optimal_wor"] - values["rrs_wor"]).mean()))


def test_values_are_the_closed_forms_of_the_temperature_scaled_distributions(pair, report):
    target, draft = pair
    logits = bound.position_logits(target, draft, PROMPTS, positions_per_prompt=4, max_new_tokens=8)
    p = torch.softmax(logits.target.double() / 0.7, -1)
    q = torch.softmax(logits.draft.double() / 0.7, -1)
    row = next(r for r in report["rows"] if r["temperature"] == 0.7 and r["n"] == 3)
    expected = multidraft.optimal_acceptance(p, q, 3, replacement=False)
    assert torch.allclose(torch.tensor(row["methods"]["optimal_wor"]["values"], dtype=torch.float64), expected)


def test_interval_is_clustered_by_prompt():
    values = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    clustered = bound.mean_interval(values, torch.tensor([0, 0, 1, 1]))
    independent = bound.mean_interval(values, torch.tensor([0, 1, 2, 3]))
    assert clustered["mean"] == independent["mean"] == 0.5
    assert clustered["high"] - clustered["low"] > independent["high"] - independent["low"]


def test_command_writes_json_and_plot_and_prints_the_table(pair, tmp_path, monkeypatch, capsys):
    target, draft = pair
    info = PairInfo(target="tiny target", draft="tiny draft", draft_kind="model", seconds=0.0)
    monkeypatch.setattr(models, "load_default_pair", lambda *args, **kwargs: (target, draft, tiny_tokenizer(), info))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello how are you", "raw": true}\n{"prompt": "the quick brown fox", "raw": true}\n')
    status = cli_main(["bound", "--prompts", str(prompts), "--num-prompts", "2", "--positions-per-prompt", "3", "--max-new-tokens", "5", "--ns",
                       "2", "--temperatures", "1.0", "--device", "cpu", "--output", str(tmp_path), "--no-progress"])
    assert status == 0
    written = json.loads((tmp_path / "bound.json").read_text())
    assert written["positions"] == 6 and written["pair"]["draft"] == "tiny draft"
    assert (tmp_path / "bound.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "optimum, without replacement" in out and "gap: optimal_wor - rrs_wor" in out


@pytest.mark.parametrize("flag,value", [("--ns", "0,2"), ("--temperatures", "0"), ("--positions-per-prompt", "0")])
def test_bad_arguments_are_usage_errors(flag, value, capsys):
    assert cli_main(["bound", flag, value]) == 2
    assert "tetris-hf bound: error:" in capsys.readouterr().err
