"""`tetris-hf bench --tree-width`: every speculative run repeated with draft trees at the same k, e and budget, named
``... w=W``; greedy tree runs equal plain generate(); tokens per verified node next to tokens per row-step and VSR;
step traces that account for every verified and accepted token and that the simulator reads; prompt lookup refused."""

import json

import pytest

import tetris_hf.tools.bench as bench
from tetris_hf.tools import simulate
from tetris_hf.tools.cli import main as cli_main
from tiny_models import noisy_copy, tiny_llama
from tiny_tokenizer import SENTENCES, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_pair():
    tokenizer = tiny_tokenizer()
    target = tiny_llama(len(tokenizer), num_layers=2, seed=61)
    return target, noisy_copy(target, 0.3, seed=62), tokenizer


def test_every_speculative_run_is_repeated_per_tree_width():
    config = bench.BenchConfig(batch_size=4, strategies=("generate", "fixed", "tetris"), num_assistant_tokens=(2,),
                               extra_tokens=(1,), tree_widths=(1, 3), draft_vocabs=(None, 8))
    runs = bench.plan_runs(config, 4)
    assert [name for name, _, _ in runs] == [
        "generate", "fixed k=2", "fixed k=2 w=3", "tetris k=2 e=1 C=8", "tetris k=2 e=1 C=8 w=3",
        "fixed k=2 N=8", "fixed k=2 N=8 w=3", "tetris k=2 e=1 C=8 N=8", "tetris k=2 e=1 C=8 N=8 w=3"]
    options = {name: opts for name, _, opts in runs}
    assert options["tetris k=2 e=1 C=8 w=3"] == {"num_assistant_tokens": 2, "tetris_extra_tokens": 1,
                                                 "tetris_tree_width": 3}  # the chain's options, plus the width
    assert "tetris_tree_width" not in options["tetris k=2 e=1 C=8"]
    with pytest.raises(ValueError, match="prompt lookup drafts chains only"):
        bench.plan_runs(bench.BenchConfig(lookup=True, tree_widths=(1, 2)), 4)


def test_tree_runs_equal_generate_and_report_tokens_per_verified_node(tiny_pair):
    target, draft, tokenizer = tiny_pair
    config = bench.BenchConfig(batch_size=3, max_new_tokens=8, strategies=("generate", "fixed", "tetris"),
                               num_assistant_tokens=(2,), extra_tokens=(1,), tree_widths=(1, 2))
    report = bench.run_bench(target, draft, tokenizer, SENTENCES[:5], config, show_progress=False)
    runs = {run["name"]: run for run in report["runs"]}
    assert list(runs) == ["generate", "fixed k=2", "fixed k=2 w=2", "tetris k=2 e=1 C=6", "tetris k=2 e=1 C=6 w=2"]
    assert report["mismatches"] == []
    assert runs["generate"]["tokens_per_verified_node"] is None  # nothing verified
    for name in list(runs)[1:]:
        run = runs[name]
        assert run["agreement_with_generate"]["exact_match"] == 1.0, name
        assert run["tokens_per_verified_node"] == pytest.approx(run["output_tokens"] / run["verified_tokens"])
        assert 0 <= run["vsr"] <= 1
        assert run["draft_seconds"] > 0 and run["verify_seconds"] > 0  # the loop's own split of the time
    assert runs["tetris k=2 e=1 C=6 w=2"]["options"]["tetris_tree_width"] == 2
    assert runs["tetris k=2 e=1 C=6 w=2"]["acceptance_by_position"] is None  # a chain's measure
    assert runs["tetris k=2 e=1 C=6"]["acceptance_by_position"] is not None
    table = bench.format_table(report["runs"], "generate")
    assert "tok/node" in table and "tetris k=2 e=1 C=6 w=2" in table

    traces = {trace["run"]: trace for trace in report["step_traces"]}
    assert list(traces) == list(runs)[1:]  # speculative runs only
    for name, trace in traces.items():
        assert trace["tree_width"] == (2 if name.endswith("w=2") else 1) and trace["batch_size"] == 3
        assert len(trace["calls"]) == 2  # 5 prompts in batches of 3
        steps = [step for call in trace["calls"] for step in call]
        assert sum(v for _, verified, _ in steps for v in verified if v >= 0) == runs[name]["verified_tokens"]
        assert sum(a for _, _, accepted in steps for a in accepted if a >= 0) == runs[name]["accepted_tokens"]
        assert all(call[0][0] == 0 for call in trace["calls"])  # the prompt's forward drafts nothing
    json.dumps(report)


def test_command_writes_step_traces_the_simulator_reads(tmp_path, tiny_pair, capsys):
    target, _, tokenizer = tiny_pair
    model_dir = tmp_path / "target"
    target.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": sentence}) + "\n" for sentence in SENTENCES[:4]))
    output = tmp_path / "out"
    base = ["bench", "--target", str(model_dir), "--prompts", str(prompts), "--num-prompts", "4",
            "--batch-size", "2", "--max-new-tokens", "6", "--device", "cpu", "--no-progress"]
    code = cli_main(base + ["--draft", "early-exit:1", "--strategies", "generate,tetris", "--extra-tokens", "1",
                            "--tree-width", "1,3", "--output", str(output)])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "tetris k=4 e=1 C=8 w=3" in printed and "step-traces.jsonl" in printed
    report = json.loads((output / "results.json").read_text())
    assert report["config"]["tree_widths"] == [1, 3] and report["mismatches"] == []
    assert "step_traces" not in report  # they go to their own file
    chain, tree = simulate.read_step_traces(output / "step-traces.jsonl")
    assert (chain.run, chain.tree_width, tree.run, tree.tree_width) == ("tetris k=4 e=1 C=8", 1,
                                                                        "tetris k=4 e=1 C=8 w=3", 3)
    assert int(tree.accepted.sum()) == report["runs"][2]["accepted_tokens"]

    code = cli_main(base + ["--draft", "lookup", "--tree-width", "2", "--output", str(tmp_path / "lookup")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("tetris-hf bench: error:") and "--tree-width" in err
