"""`tetris-hf bench` end to end on tiny models: every metric in its JSON, a greedy mismatch fails it, bad input exits
2; transformers' prompt lookup as a baseline row, and prompt-lookup drafting (``--draft lookup``) for the speculative
runs."""

import json

import pytest
import torch

import tetris_hf.tools.bench as bench
import tetris_hf.logits.verification as verification
from tetris_hf.tools.cli import main as cli_main
from tiny_models import noisy_copy, tiny_llama
from tiny_tokenizer import SENTENCES, tiny_tokenizer

METRICS = {
    "tokens_per_second", "latency_mean_s", "latency_p50_s", "latency_p99_s", "acceptance_rate", "vsr",
    "target_forwards_per_token", "tokens_per_row_step", "peak_memory_mb", "output_tokens", "agreement_with_generate",
}


@pytest.fixture(scope="module")
def tiny_pair():
    tokenizer = tiny_tokenizer()
    target = tiny_llama(len(tokenizer), num_layers=2, seed=61)
    return target, noisy_copy(target, 0.3, seed=62), tokenizer


def test_bench_reports_every_metric_for_every_strategy(tiny_pair):
    target, draft, tokenizer = tiny_pair
    config = bench.BenchConfig(batch_size=3, max_new_tokens=8, num_assistant_tokens=(2, 3), extra_tokens=(1, 2),
                               hf_assisted_prompts=2)
    report = bench.run_bench(target, draft, tokenizer, SENTENCES[:5], config, show_progress=False)
    names = [run["name"] for run in report["runs"]]
    assert names == ["generate", "hf-assisted", "fixed k=2", "tetris k=2 e=1 C=6", "tetris k=2 e=2 C=6",
                     "adaptive k=2 e=2", "fixed k=3", "tetris k=3 e=1 C=9", "tetris k=3 e=2 C=9", "adaptive k=3 e=2"]
    assert report["mismatches"] == []
    for run in report["runs"]:
        assert METRICS <= set(run), run["name"]
        assert run["output_tokens"] > 0 and run["tokens_per_second"] > 0
        assert run["agreement_with_generate"]["exact_match"] == 1.0
        if run["strategy"] in ("fixed", "tetris"):
            assert 0 <= run["vsr"] <= 1 and run["accepted_tokens"] <= run["verified_tokens"]
    assert report["runs"][1]["requests"] == 2  # hf-assisted on its subset
    json.dumps(report)  # serialisable


def test_greedy_mismatch_is_reported(tiny_pair, monkeypatch):
    target, draft, tokenizer = tiny_pair
    real = verification.verify_greedy

    def off_by_one(*args):
        num_accepted, next_tokens = real(*args)
        return num_accepted, (next_tokens + 1) % len(tokenizer)

    monkeypatch.setattr("tetris_hf.logits.verification.verify_greedy", off_by_one)
    config = bench.BenchConfig(batch_size=2, max_new_tokens=5, strategies=("generate", "tetris"), extra_tokens=(1,))
    report = bench.run_bench(target, draft, tokenizer, SENTENCES[:2], config, show_progress=False)
    assert len(report["mismatches"]) == 1 and report["mismatches"][0].startswith("tetris k=4 e=1")


def test_repeats_are_interleaved_and_the_median_run_is_reported(tiny_pair):
    target, draft, tokenizer = tiny_pair
    config = bench.BenchConfig(batch_size=2, max_new_tokens=4, strategies=("generate", "adaptive"),
                               num_assistant_tokens=(2,), extra_tokens=(1,), repeats=3)
    report = bench.run_bench(target, draft, tokenizer, SENTENCES[:2], config, show_progress=False)
    assert report["mismatches"] == [] and report["cost_profile_seconds"] >= 0  # profiled before the timed runs
    assert [run["name"] for run in report["runs"]] == ["generate", "adaptive k=2 e=1"]
    for run in report["runs"]:
        speeds = run["tokens_per_second_repeats"]
        assert len(speeds) == 3 and sorted(speeds)[1] == pytest.approx(run["tokens_per_second"])
    runs = [bench.RunResult("r", "fixed", {}, 1, 10, seconds, [], 0, 0, 0, 0, 0, 0.0, []) for seconds in (3, 1, 2, 4)]
    assert bench.median_run(runs).seconds == 2 and bench.median_run(runs).repeat_seconds == [3, 1, 2, 4]


def test_hf_lookup_runs_every_prompt_one_at_a_time_and_equals_generate(tiny_pair):
    target, draft, tokenizer = tiny_pair
    config = bench.BenchConfig(batch_size=3, max_new_tokens=8, strategies=("generate", "hf-lookup"),
                               num_assistant_tokens=(2, 3), max_ngram=2)
    report = bench.run_bench(target, draft, tokenizer, SENTENCES[:5], config, show_progress=False)
    assert [run["name"] for run in report["runs"]] == ["generate", "hf-lookup k=2 n=2", "hf-lookup k=3 n=2"]
    assert report["runs"][1]["options"] == {"prompt_lookup_num_tokens": 2, "max_matching_ngram_size": 2}
    assert report["mismatches"] == []
    for run in report["runs"][1:]:
        assert run["requests"] == 5 and run["agreement_with_generate"]["exact_match"] == 1.0
        assert run["output_tokens"] == report["runs"][0]["output_tokens"]
        # one request per call: every target forward is one row-step; some steps emit an accepted lookup draft too
        assert run["tokens_per_row_step"] > 1 and run["acceptance_rate"] is None


def test_lookup_plan_drafts_by_prompt_lookup_without_a_draft_model():
    config = bench.BenchConfig(batch_size=2, strategies=("generate", "hf-lookup", "fixed", "tetris", "adaptive"),
                               num_assistant_tokens=(3,), extra_tokens=(1,), lookup=True, max_ngram=2)
    runs = bench.plan_runs(config, 2)
    assert [name for name, _, _ in runs] == ["generate", "hf-lookup k=3 n=2", "fixed k=3 n=2", "tetris k=3 e=1 C=6 n=2",
                                             "adaptive k=3 e=1 n=2"]
    for _, strategy, options in runs[2:]:
        assert options["prompt_lookup_num_tokens"] == 3 and options["max_matching_ngram_size"] == 2
        assert "num_assistant_tokens" not in options
    assert bench.drafting(None) == {} and "assistant_model" in bench.drafting(object())


def test_lookup_drafting_runs_every_tetris_strategy_and_equals_generate(tiny_pair):
    target, _, tokenizer = tiny_pair
    config = bench.BenchConfig(batch_size=3, max_new_tokens=8, strategies=("generate", "fixed", "tetris", "adaptive"),
                               num_assistant_tokens=(2,), extra_tokens=(1,), lookup=True)
    report = bench.run_bench(target, None, tokenizer, SENTENCES[:5], config, show_progress=False)
    assert [run["name"] for run in report["runs"]] == ["generate", "fixed k=2 n=3", "tetris k=2 e=1 C=6 n=3",
                                                       "adaptive k=2 e=1 n=3"]
    assert report["mismatches"] == [] and report["draft_cost"] == []
    assert report["cost_profile_seconds"] >= 0  # adaptive's target-only profile, before the timed runs
    for run in report["runs"][1:]:  # adaptive may draft nothing when its timings say drafting does not pay
        assert run["agreement_with_generate"]["exact_match"] == 1.0
        assert run["drafted_tokens"] > 0 or run["strategy"] == "adaptive"
    with pytest.raises(ValueError, match="draft=None with config.lookup"):
        bench.run_bench(target, None, tokenizer, SENTENCES[:2], bench.BenchConfig(), show_progress=False)


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory, tiny_pair):
    target, _, tokenizer = tiny_pair
    directory = tmp_path_factory.mktemp("tiny-target")
    target.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture()
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": sentence}) + "\n" for sentence in SENTENCES[:4]))
    return path


def test_command_writes_json_and_plot(saved_target, prompt_file, tmp_path, capsys):
    output = tmp_path / "out"
    code = cli_main(["bench", "--target", str(saved_target), "--draft", "early-exit:1", "--prompts", str(prompt_file),
                     "--num-prompts", "4", "--batch-size", "2", "--max-new-tokens", "6", "--extra-tokens", "1,2",
                     "--hf-assisted-prompts", "1", "--device", "cpu", "--output", str(output), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((output / "results.json").read_text())
    assert [run["name"] for run in report["runs"]][:3] == ["generate", "hf-assisted", "fixed k=4"]
    assert (output / "bench.png").stat().st_size > 10_000
    assert "tok/s" in capsys.readouterr().out


def test_command_runs_humaneval_edit_with_hf_lookup(saved_target, tmp_path, capsys):
    output = tmp_path / "edit"
    code = cli_main(["bench", "--target", str(saved_target), "--draft", "early-exit:1", "--prompts", "humaneval-edit",
                     "--num-prompts", "3", "--max-prompt-tokens", "1000", "--batch-size", "2", "--max-new-tokens", "6",
                     "--strategies", "generate,hf-lookup", "--device", "cpu", "--output", str(output), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((output / "results.json").read_text())
    assert report["prompts"]["set"] == "humaneval-edit" and report["prompts"]["count"] == 3
    assert [run["name"] for run in report["runs"]] == ["generate", "hf-lookup k=4 n=3"]
    assert report["mismatches"] == [] and report["runs"][1]["requests"] == 3
    assert "hf-lookup k=4 n=3" in capsys.readouterr().out


def test_command_with_lookup_drafting(saved_target, prompt_file, tmp_path, capsys):
    output = tmp_path / "lookup"
    code = cli_main(["bench", "--target", str(saved_target), "--draft", "lookup", "--max-ngram", "2",
                     "--prompts", str(prompt_file), "--num-prompts", "4", "--batch-size", "2", "--max-new-tokens", "6",
                     "--strategies", "generate,hf-lookup,fixed,tetris", "--extra-tokens", "1", "--device", "cpu",
                     "--output", str(output), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((output / "results.json").read_text())
    assert report["pair"]["draft_kind"] == "lookup" and report["mismatches"] == []
    assert [run["name"] for run in report["runs"]] == ["generate", "hf-lookup k=4 n=2", "fixed k=4 n=2",
                                                       "tetris k=4 e=1 C=8 n=2"]
    assert "draft step / target step" not in capsys.readouterr().out  # no draft model to time


@pytest.mark.parametrize("arguments,message", [
    (["--prompts", "nosuchset"], "unknown prompt set"),
    (["--draft", "lookup", "--strategies", "generate,hf-assisted"], "hf-assisted needs a draft model"),
    (["--draft", "lookup", "--draft-vocab", "8"], "--draft lookup has none"),
    (["--max-ngram", "0"], "--max-ngram must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--strategies", "generate,warp"], "unknown strategy"),
    (["--target", "/nonexistent/model.gguf"], "does not exist"),
    (["--draft", "DRAFT_WITH_OTHER_VOCAB"], "vocabularies differ"),
    (["--prompts", "EMPTY_FILE"], "holds no prompts"),
])
def test_bad_input_is_one_line_and_exit_code_2(arguments, message, saved_target, tmp_path, capsys):
    if "DRAFT_WITH_OTHER_VOCAB" in arguments:
        other = tmp_path / "other"
        tiny_llama(200, seed=3).save_pretrained(other)
        arguments = ["--draft", str(other)]
    if "EMPTY_FILE" in arguments:
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        arguments = ["--prompts", str(empty)]
    base = ["bench", "--target", str(saved_target), "--draft", "early-exit:1", "--device", "cpu", "--no-progress",
            "--output", str(tmp_path / "out")]
    if "--target" in arguments:
        base = ["bench", "--device", "cpu", "--no-progress"]
    code = cli_main(base + arguments)
    err = capsys.readouterr().err.strip()
    assert code == 2
    last_line = err.splitlines()[-1]  # earlier lines can only be transformers' weight-loading progress bars
    assert last_line.startswith("tetris-hf bench: error:") and message in last_line, err
    assert "Traceback" not in err and sum("error" in line for line in err.splitlines()) == 1, err


def test_a_missing_shipped_metric_stops_the_bench_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """The greedy outputs are checked by the shipped metric after the runs; an install without it fails at once, in
    one line naming the file (here before the absent target is even looked at)."""
    from tetris_hf.tools import metrics

    monkeypatch.setattr(metrics, "OUTPUT_AGREEMENT", str(tmp_path / "output_agreement.py"))
    code = cli_main(["bench", "--target", str(tmp_path / "no-target"), "--device", "cpu", "--no-progress",
                     "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and str(tmp_path / "output_agreement.py") in err and len(err.splitlines()) == 1, err


def test_the_command_line_writes_its_lines_as_they_come_into_a_redirected_log(tmp_path, monkeypatch):
    """A long bench redirected to a file shows its progress lines as they are printed (no PYTHONUNBUFFERED=1)."""
    import io
    import sys

    logs = [io.TextIOWrapper(io.BytesIO(), encoding="utf-8") for _ in range(2)]  # block-buffered, like a file
    assert not any(log.line_buffering for log in logs)
    monkeypatch.setattr(sys, "stdout", logs[0])
    monkeypatch.setattr(sys, "stderr", logs[1])
    assert cli_main(["bench", "--target", str(tmp_path / "no-target"), "--device", "cpu", "--no-progress",
                     "--output", str(tmp_path / "out")]) == 2
    assert all(log.line_buffering for log in logs)
    assert b"error:" in logs[1].buffer.getvalue()  # the error line is in the log already, before any flush


def test_data_parallel_under_accelerate_launch(saved_target, prompt_file, tmp_path):
    """Two CPU processes split the prompts; the main process writes the gathered results."""
    import os
    import subprocess
    import sys

    output = tmp_path / "dp"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "tetris_hf.tools.bench", "--target", str(saved_target), "--draft", "early-exit:1",
               "--prompts", str(prompt_file), "--num-prompts", "4", "--batch-size", "2", "--max-new-tokens", "5",
               "--strategies", "generate,fixed,tetris", "--extra-tokens", "1", "--device", "cpu",
               "--output", str(output), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((output / "results.json").read_text())
    assert report["num_processes"] == 2
    assert report["mismatches"] == []
    assert [run["requests"] for run in report["runs"]] == [4, 4, 4]
    assert report["runs"][0]["output_tokens"] == report["runs"][2]["output_tokens"] > 0


@pytest.mark.parametrize("flag", ["--load-in-4bit", "--load-in-8bit"])
def test_bench_with_a_quantized_target(flag, prompt_file, tmp_path, capsys):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is absent: pip install -e '.[test]' (scripts/setup.sh)")
    tokenizer = tiny_tokenizer()
    target_dir = tmp_path / "target"
    tiny_llama(len(tokenizer), num_layers=2, seed=63, hidden_size=64).save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    output = tmp_path / "q"
    code = cli_main(["bench", "--target", str(target_dir), "--draft", "early-exit:1", "--prompts", str(prompt_file),
                     "--num-prompts", "3", "--batch-size", "3", "--max-new-tokens", "5", "--strategies",
                     "generate,tetris", "--extra-tokens", "1", "--device", "cpu", "--output", str(output),
                     "--no-progress", flag])
    assert code == 0, capsys.readouterr().err
    report = json.loads((output / "results.json").read_text())
    assert "bitsandbytes" in report["pair"]["target"] and report["mismatches"] == []


def test_sources_run_each_speculative_run_per_draft_source_and_equal_generate(tiny_pair):
    target, draft, tokenizer = tiny_pair
    config = bench.BenchConfig(batch_size=3, max_new_tokens=8, strategies=("generate", "tetris", "adaptive"),
                               num_assistant_tokens=(2,), extra_tokens=(1,), max_ngram=2,
                               sources=("model", "lookup", "hybrid"))
    runs = bench.plan_runs(config, 3)
    assert [name for name, _, _ in runs] == [
        "generate", "tetris k=2 e=1 C=6 model", "adaptive k=2 e=1 model", "tetris k=2 e=1 C=6 lookup n=2",
        "adaptive k=2 e=1 lookup n=2", "tetris k=2 e=1 C=6 hybrid n=2", "adaptive k=2 e=1 hybrid n=2"]
    options = {name: options for name, _, options in runs}
    assert options["tetris k=2 e=1 C=6 model"] == {"num_assistant_tokens": 2, "tetris_extra_tokens": 1}
    assert options["tetris k=2 e=1 C=6 lookup n=2"] == {"prompt_lookup_num_tokens": 2, "max_matching_ngram_size": 2,
                                                        "tetris_extra_tokens": 1, "assistant_model": None}
    assert options["tetris k=2 e=1 C=6 hybrid n=2"] == {"num_assistant_tokens": 2, "tetris_extra_tokens": 1,
                                                        "prompt_lookup_num_tokens": 2, "max_matching_ngram_size": 2}
    with pytest.raises(ValueError, match="--sources compares"):
        bench.plan_runs(bench.BenchConfig(sources=("model", "hybrid"), tree_widths=(1, 2)), 2)
    # repeated phrases, so that lookup matches in some rows and not in others
    texts = [SENTENCES[0] + " " + SENTENCES[0], SENTENCES[1], SENTENCES[2] + " " + SENTENCES[2]]
    report = bench.run_bench(target, draft, tokenizer, texts, config, show_progress=False)
    assert report["mismatches"] == [] and report["cost_profile_seconds"] >= 0
    by_name = {run["name"]: run for run in report["runs"]}
    assert list(by_name) == [name for name, _, _ in runs]
    for name, run in by_name.items():
        assert run["agreement_with_generate"]["exact_match"] == 1.0, name
    assert by_name["tetris k=2 e=1 C=6 model"]["drafted_tokens"] > 0
    assert by_name["tetris k=2 e=1 C=6 hybrid n=2"]["drafted_tokens"] > 0
    assert by_name["tetris k=2 e=1 C=6 model"]["lookup_share_of_verified"] == 0
    assert by_name["tetris k=2 e=1 C=6 lookup n=2"]["lookup_share_of_verified"] in (None, 1.0)
    assert 0 < by_name["tetris k=2 e=1 C=6 hybrid n=2"]["lookup_share_of_verified"] < 1  # both sources served rows
    json.dumps(report)
    table = bench.format_table(report["runs"], "generate")
    assert table.splitlines()[0].split()[-1] == "lookup"  # lookup's share of the verified cells, by run


def test_sources_are_checked_on_the_command_line(saved_target, prompt_file, tmp_path, capsys):
    base = ["bench", "--target", str(saved_target), "--prompts", str(prompt_file), "--device", "cpu", "--output",
            str(tmp_path / "out"), "--no-progress"]
    assert cli_main([*base, "--draft", "early-exit:1", "--sources", "model,draft"]) == 2
    assert "--sources takes a comma list of model, lookup, hybrid" in capsys.readouterr().err
    assert cli_main([*base, "--draft", "lookup", "--sources", "lookup,hybrid"]) == 2
    assert "--sources needs a draft model" in capsys.readouterr().err
    assert cli_main([*base, "--draft", "early-exit:1", "--sources", "hybrid", "--tree-width", "1,2"]) == 2
    assert "leave out --tree-width" in capsys.readouterr().err


def test_confidence_threshold_runs_each_speculative_run_stopped_too(tiny_pair):
    target, draft, tokenizer = tiny_pair
    config = bench.BenchConfig(batch_size=1, max_new_tokens=8, strategies=("generate", "fixed"),
                               num_assistant_tokens=(3,), confidence_threshold=0.9)
    assert [name for name, _, _ in bench.plan_runs(config, 1)] == ["generate", "fixed k=3", "fixed k=3 stop<0.9"]
    report = bench.run_bench(target, draft, tokenizer, SENTENCES[:2], config, show_progress=False)
    assert report["mismatches"] == []
    full, stopped = report["runs"][1:]
    assert stopped["options"]["tetris_confidence_threshold"] == 0.9
    assert stopped["drafted_tokens"] < full["drafted_tokens"]  # a noisy draft is rarely that sure
