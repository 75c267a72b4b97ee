"""`tetris-hf stream-bench` on tiny models: every system and stream strategy runs, every output equals static
generate()'s, the table names the faster baseline, and the plot is written."""

import pytest

import tetris_hf.tools.stream_bench as stream_bench
from tiny_models import EOS, PAD, noisy_copy, random_prompts, tiny_llama


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=71)
    return target, noisy_copy(target, 0.3, seed=72)


@pytest.mark.parametrize("lookup,hybrid", [(False, False), (True, False), (False, True)])
def test_every_run_serves_every_request_as_generate_does(pair, lookup, hybrid, tmp_path):
    target, draft = pair
    prompts = random_prompts(7, target.config.vocab_size, seed=5, min_length=2, max_length=30)
    prompts = [prompt + prompt[: len(prompt) // 2] for prompt in prompts]  # something for lookup to copy
    config = stream_bench.StreamBenchConfig(max_new_tokens=10, max_batch_sizes=(3,), strategies=("tetris", "adaptive"),
                                            lookup=lookup, hybrid=hybrid)
    report = stream_bench.run_stream_bench(target, None if lookup else draft, prompts, {EOS}, PAD, config,
                                           log=lambda line: None)
    summaries = report["runs"][3]
    assert [row["name"] for row in summaries] == ["hf-generate-batch", "generate-chunks", "tetris-chunks",
                                                  "stream-tetris", "stream-adaptive"]
    for row in summaries:
        assert row["equal"] == "7/7", row["name"]
        assert row["tokens"] > 0 and row["tokens_per_second"] > 0 and row["ttft_p50"] <= row["ttft_p99"]
    stream = summaries[-1]
    assert 0 < stream["mean_live_rows"] <= 3
    assert stream["tokens_per_row_step"] >= 1 and 0 <= stream["acceptance"] <= 1
    assert (stream["lookup_share"] is not None) == hybrid
    table = stream_bench.format_table(summaries, stream_bench.reference_name(summaries))
    assert "stream-tetris" in table and "x" in table
    words = stream_bench.verdict(summaries)  # the table in words: the fastest run, its ratio, and each stream's why
    fastest = max(summaries, key=lambda row: row["tokens_per_second"])
    assert words.startswith(f"Fastest: {fastest['name']}") and "every output equal" in words
    assert "stream-tetris:" in words and "stream-adaptive:" in words and "tokens a row-step" in words
    stream_bench.plot(report["medians"][3], tmp_path / "stream.png", "tiny")
    assert (tmp_path / "stream.png").stat().st_size > 1000


def summary(name: str, tokens_per_second: float, **extra) -> dict:
    return {"name": name, "tokens_per_second": tokens_per_second, "range": "1.0-2.0", "requests_per_second": 1.0,
            "ttft_p50": 1.0, "ttft_p99": 2.0, "per_token_p50": 0.1, "per_token_p99": 0.2, "mean_live_rows": 3.0,
            "equal": "4/4", **extra}


def test_the_verdict_weighs_drafting_against_the_stream_without_it_and_long_names_keep_the_columns():
    summaries = [summary("generate-chunks", 40.0), summary("stream-plain", 70.0, tokens_per_row_step=1.0),
                 summary("stream-fixed-lookup", 63.0, tokens_per_row_step=1.3, acceptance=0.2),
                 summary("stream-adaptive-suffix-w2", 56.0, tokens_per_row_step=1.1, acceptance=0.3)]
    words = stream_bench.verdict(summaries)
    assert words.startswith("Fastest: stream-plain, 70.0 tok/s = 1.75x the faster plain system (generate-chunks")
    assert ("Drafting against the same stream without it (stream-plain, 70.0 tok/s): the fastest drafting run, "
            "stream-fixed-lookup, is 0.90x it.") in words
    lines = stream_bench.format_table(summaries, "generate-chunks").splitlines()
    columns = {line.index(" 4/4") for line in lines[2:]}  # the last column, after every name's width
    assert len(columns) == 1 and lines[0].index("= generate") + len("= generate") == columns.pop() + len(" 4/4")


def test_prompts_apart_and_a_bench_without_static_chunks(pair):
    """``--prompts-apart`` runs each strategy again with every joining prompt read in forwards of its own; without
    static chunks the outputs are checked against transformers' generate_batch's."""
    target, draft = pair
    prompts = random_prompts(7, target.config.vocab_size, seed=6, min_length=2, max_length=30)
    config = stream_bench.StreamBenchConfig(max_new_tokens=10, max_batch_sizes=(3,), systems=("hf-generate-batch",),
                                            strategies=("fixed",), prompts_apart=True)
    report = stream_bench.run_stream_bench(target, draft, prompts, {EOS}, PAD, config, log=lambda line: None)
    summaries = report["runs"][3]
    assert [row["name"] for row in summaries] == ["hf-generate-batch", "stream-fixed", "stream-fixed-apart"]
    assert all(row["equal"] == "7/7" for row in summaries)


def test_the_plain_stream_drafts_nothing_and_serves_every_request_as_generate_does(pair):
    """``--strategies plain``: the stream with speculation off (``tetris_budget=0``), a continuous-batching engine
    without drafts: one token a row-step, nothing drafted, every output equal."""
    target, draft = pair
    prompts = random_prompts(7, target.config.vocab_size, seed=7, min_length=2, max_length=30)
    config = stream_bench.StreamBenchConfig(max_new_tokens=10, max_batch_sizes=(3,), systems=("generate-chunks",),
                                            strategies=("plain",))
    report = stream_bench.run_stream_bench(target, draft, prompts, {EOS}, PAD, config, log=lambda line: None)
    plain = report["runs"][3][-1]
    assert plain["name"] == "stream-plain" and plain["equal"] == "7/7"
    assert plain["tokens_per_row_step"] == 1.0


def test_suffix_drafts_from_a_seed_file_serve_every_request_as_generate_does(pair, tmp_path):
    """``--draft suffix --suffix-seed FILE``: every run drafts from a cache of its own seeded from the file (the
    earlier outputs make the stream accept drafts from its first step); outputs equal static generate()'s."""
    target, _ = pair
    prompts = random_prompts(6, target.config.vocab_size, seed=8, min_length=2, max_length=20)
    config = stream_bench.StreamBenchConfig(max_new_tokens=10, max_batch_sizes=(3,), systems=("generate-chunks",),
                                            strategies=("fixed",), lookup=True, suffix=True)
    unseeded = stream_bench.run_stream_bench(target, None, prompts, {EOS}, PAD, config, log=lambda line: None)
    seed = tmp_path / "seed.jsonl"
    seed.write_text("".join(f"{prompt + tokens}\n" for prompt, tokens in
                            zip(prompts, unseeded["medians"][3][0].tokens)))  # what plain decoding wrote
    config.suffix_seed = str(seed)
    report = stream_bench.run_stream_bench(target, None, prompts, {EOS}, PAD, config, log=lambda line: None)
    assert [row["name"] for row in report["runs"][3]] == ["generate-chunks", "stream-fixed"]
    assert all(row["equal"] == "6/6" for row in report["runs"][3])
    assert report["runs"][3][-1]["tokens_per_row_step"] > unseeded["runs"][3][-1]["tokens_per_row_step"]


@pytest.mark.parametrize("tree_width", [1, 2])
def test_lookup_and_suffix_side_by_side_run_each_strategy_once_per_source(pair, tree_width):
    """``--draft lookup,suffix``: each speculative stream strategy runs once with prompt lookup and once with suffix
    drafts in the same process (named by source), plain once; every output equals static generate()'s, and the two
    sources really draft differently (a suffix run drafts from the cache where lookup has no match). With
    ``--tree-width 2`` the suffix runs draft trees (named ``-suffix-w2``)."""
    target, _ = pair
    prompts = random_prompts(6, target.config.vocab_size, seed=9, min_length=2, max_length=20)
    prompts = prompts + prompts  # the later requests repeat earlier ones: the suffix cache has their outputs
    config = stream_bench.StreamBenchConfig(max_new_tokens=10, max_batch_sizes=(3,), systems=("generate-chunks",),
                                            strategies=("plain", "fixed"), lookup=True, sources=("lookup", "suffix"),
                                            tree_width=tree_width)
    report = stream_bench.run_stream_bench(target, None, prompts, {EOS}, PAD, config, log=lambda line: None)
    rows = {row["name"]: row for row in report["runs"][3]}
    suffix = "stream-fixed-suffix" + ("-w2" if tree_width == 2 else "")
    assert list(rows) == ["generate-chunks", "stream-plain", "stream-fixed-lookup", suffix]
    assert all(row["equal"] == "12/12" for row in rows.values())
    assert rows[suffix]["tokens_per_row_step"] > rows["stream-fixed-lookup"]["tokens_per_row_step"]


@pytest.mark.parametrize("min_prob", [None, 0.0, 0.3])
def test_suffix_runs_take_the_minimum_survival_given(pair, min_prob):
    target, _ = pair
    config = stream_bench.StreamBenchConfig(max_new_tokens=4, max_batch_sizes=(2,), systems=(), strategies=("fixed",),
                                            lookup=True, suffix=True, suffix_min_prob=min_prob)
    options = stream_bench.speculative_options(target, None, config)()
    assert options.get("tetris_suffix_min_prob") == min_prob  # (None: left to the option's default)


def test_compiled_streams_run_beside_eager_ones_their_compiling_run_timed_apart(pair):
    """``--compiled``: each stream strategy once eager and once with ``tetris_compile=True``; the compiled one's first
    run (which compiles) is run before the timed repeats and reported as its start-up; every output equal."""
    target, _ = pair
    prompts = random_prompts(5, target.config.vocab_size, seed=10, min_length=2, max_length=20)
    config = stream_bench.StreamBenchConfig(max_new_tokens=6, max_batch_sizes=(3,), systems=("generate-chunks",),
                                            strategies=("plain",), lookup=True, compiled=True)
    lines = []
    report = stream_bench.run_stream_bench(target, None, prompts, {EOS}, PAD, config, log=lines.append)
    rows = {row["name"]: row for row in report["runs"][3]}
    assert list(rows) == ["generate-chunks", "stream-plain", "stream-plain-compiled"]
    assert all(row["equal"] == "5/5" for row in rows.values())
    assert rows["stream-plain-compiled"]["startup_seconds"] > 0 and "startup_seconds" not in rows["stream-plain"]
    assert any("stream-plain-compiled: compile run" in line and "graphs compiled" in line for line in lines)


@pytest.mark.parametrize("argv, words", [
    (["--suffix-seed", "seed.jsonl"], "pass --draft suffix too"),
    (["--draft", "suffix", "--suffix-seed", "no-such-file.jsonl"], "no such file"),
    (["--draft", "lookup", "--tree-width", "2"], "suffix drafts grow trees"),
    (["--draft", "suffix", "--tree-width", "0"], "suffix drafts grow trees"),
    (["--draft", "suffix", "--tree-width", "2", "--compiled"], "compiled steps draft chains only"),
    (["--draft", "lookup", "--suffix-min-prob", "0.2"], "for suffix drafts; pass --draft suffix"),
    (["--draft", "suffix", "--suffix-min-prob", "1.5"], r"a number in \[0, 1\)"),
])
def test_bad_combinations_are_refused_before_any_model_loads(argv, words, tmp_path, monkeypatch):
    import argparse

    from tetris_hf.tools.cli import UsageError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "seed.jsonl").write_text("[1, 2]\n")
    parser = argparse.ArgumentParser()
    stream_bench.add_arguments(parser)
    with pytest.raises(UsageError, match=words):
        stream_bench.main(parser.parse_args(["--device", "cpu", *argv]))
