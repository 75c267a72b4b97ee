"""`tetris-hf bench --draft eagle:DIR` end to end on a tiny target and a random EAGLE-3 head written in the published
format: the speculative runs draft with the head, every greedy output equals plain generate(), the report carries
the acceptance at each draft position and the head's step cost; what cannot run an EAGLE head is refused."""

import json

import pytest

from tetris_hf.candidate_generators.eagle import EagleDraft
from tetris_hf.tools.bench import PositionCounts
from tetris_hf.tools.cli import main as cli_main
from tiny_models import tiny_llama
from tiny_tokenizer import SENTENCES, tiny_tokenizer


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    tokenizer = tiny_tokenizer()
    target = tiny_llama(len(tokenizer), num_layers=6, seed=71)
    folder = tmp_path_factory.mktemp("eagle-bench")
    target.save_pretrained(folder / "target")
    tokenizer.save_pretrained(folder / "target")
    EagleDraft.for_target(target).save_pretrained(folder / "head")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": sentence}) + "\n" for sentence in SENTENCES[:4]))
    return folder


def test_bench_drafts_with_an_eagle_head(saved_pair, tmp_path, capsys):
    output = tmp_path / "out"
    code = cli_main(["bench", "--target", str(saved_pair / "target"), "--draft", f"eagle:{saved_pair / 'head'}",
                     "--prompts", str(saved_pair / "prompts.jsonl"), "--num-prompts", "4", "--batch-size", "2",
                     "--max-new-tokens", "8", "--strategies", "generate,fixed,tetris,adaptive", "--extra-tokens", "1",
                     "--device", "cpu", "--output", str(output), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads((output / "results.json").read_text())
    assert report["pair"]["draft_kind"] == "eagle" and report["mismatches"] == []
    assert "eagle3" in report["pair"]["draft"]
    runs = {run["name"]: run for run in report["runs"]}
    fixed = runs["fixed k=4"]
    assert fixed["drafted_tokens"] > 0 and fixed["agreement_with_generate"]["exact_match"] == 1.0
    rates = fixed["acceptance_by_position"]
    assert rates and len(rates) <= 4 and all(rate is None or 0.0 <= rate <= 1.0 for rate in rates)
    counts = fixed["acceptance_by_position_counts"]
    assert [hits / reached for hits, reached in counts] == rates and counts[0][1] >= counts[-1][1] > 0
    assert runs["generate"]["acceptance_by_position"] is None
    assert "draft step / target step" in out  # the head's step cost against the target's


def test_position_counts_follow_each_row_to_its_first_rejection():
    counts = PositionCounts()
    # step 1: row 0 verified 3 and accepted 1 (positions 1, 2 reached; 1 accepted), row 1 finished (-1);
    # step 2: row 0 verified 2 and accepted 2 (both reached and accepted), row 1 verified 0 (nothing reached)
    counts.add([[3, -1], [2, 0]], [[1, -1], [2, 0]])
    assert counts.reached == [2, 2] and counts.accepted == [2, 1]
    assert counts.rates() == [1.0, 0.5]


@pytest.mark.parametrize("arguments,message", [
    (["--strategies", "generate,hf-assisted"], "hf-assisted cannot run an EAGLE head"),
    (["--draft-vocab", "8"], "an EAGLE head has its own draft vocabulary"),
])
def test_what_cannot_run_an_eagle_head_is_refused(arguments, message, saved_pair, tmp_path, capsys):
    code = cli_main(["bench", "--target", str(saved_pair / "target"), "--draft", f"eagle:{saved_pair / 'head'}",
                     "--device", "cpu", "--no-progress", "--output", str(tmp_path / "out")] + arguments)
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err.splitlines()[-1], err


def test_a_missing_eagle_head_is_one_line(saved_pair, tmp_path, capsys):
    code = cli_main(["bench", "--target", str(saved_pair / "target"), "--draft", f"eagle:{tmp_path / 'nohead'}",
                     "--prompts", str(saved_pair / "prompts.jsonl"), "--device", "cpu", "--no-progress",
                     "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "does not exist" in err.splitlines()[-1] and "Traceback" not in err, err
