"""vLLM as a ``stream-bench`` system, without vLLM: the suite never needs it installed.

- Absent vLLM (no python given, a missing file, a python that cannot ``import vllm``): one line saying why, and the
  bench runs its other systems.
- The subprocess protocol (``tetris_hf/tools/vllm_worker.py``'s docstring), tested against a fake worker that speaks
  it. This is a protocol test only: the fake generates nothing real, so it proves how requests and replies travel and
  how a reply becomes a bench run, never anything about vLLM's speed or outputs.
"""

import importlib.util
import json
import sys
import textwrap

import pytest

import tetris_hf.tools.stream_bench as stream_bench
from tetris_hf.tools.vllm_system import (ENV_PYTHON, VLLMEngine, VLLMSettings, VLLMUnavailable, find_vllm,
                                         is_vllm_system, speculative_config, thread_binding, worker_environment)
from tiny_models import EOS, PAD, random_prompts, tiny_llama

# A fake worker: reads the engine config, says ready, and answers each generate with the first two prompt tokens, the
# first stop token and one token after it (which the host must cut). It records what it received in $FAKE_VLLM_RECORD.
FAKE_WORKER = textwrap.dedent('''
    import json, os, sys
    record = {"config": json.loads(sys.stdin.readline()), "requests": [],
              "env": {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                                                           "VLLM_ENABLE_V1_MULTIPROCESSING", "PYTHONPATH")}}
    print(json.dumps({"event": "ready", "startup_seconds": 12.5, "vllm_version": "fake", "omp_bind": "0"}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "exit":
            break
        record["requests"].append(request)
        stop = request["stop_token_ids"][0]
        outputs = [{"tokens": prompt[:2] + [stop, 7], "first_token": 0.01 * i, "finished": 0.02 * (i + 1)}
                   for i, prompt in enumerate(request["prompts"])]
        print(json.dumps({"event": "generated", "seconds": 0.5, "outputs": outputs, "occupancy": [[0.1, 3], [0.2, 1]],
                          "steps": 2, "row_steps": 4, "spec": None, "profile": None}), flush=True)
    with open(os.environ["FAKE_VLLM_RECORD"], "w") as out:
        json.dump(record, out)
''')


def test_absent_vllm_is_one_line_naming_the_way_to_get_it(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_PYTHON, raising=False)
    with pytest.raises(VLLMUnavailable, match=r"--vllm-python or \$TETRIS_HF_VLLM_PYTHON.*setup_vllm.sh"):
        find_vllm(None)
    with pytest.raises(VLLMUnavailable, match="is not an executable file"):
        find_vllm(str(tmp_path / "no-such-python"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this venv has vLLM installed")
def test_a_python_without_vllm_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(ENV_PYTHON, sys.executable)  # the flag's absence falls back to the variable
    with pytest.raises(VLLMUnavailable, match="cannot import vllm") as error:
        find_vllm(None)
    assert "\n" not in str(error.value)


def test_the_bench_without_vllm_says_so_and_runs_the_other_systems():
    target = tiny_llama(seed=71)
    prompts = random_prompts(4, target.config.vocab_size, seed=5, min_length=2, max_length=12)
    config = stream_bench.StreamBenchConfig(max_new_tokens=4, max_batch_sizes=(2,),
                                            systems=("generate-chunks", "vllm", "vllm-ngram"), strategies=("plain",),
                                            lookup=True)
    lines = []
    report = stream_bench.run_stream_bench(target, None, prompts, {EOS}, PAD, config, log=lines.append)
    assert [row["name"] for row in report["runs"][2]] == ["generate-chunks", "stream-plain"]
    assert [line for line in lines if "not run" in line] == ["  vllm, vllm-ngram not run: no vLLM python "
                                                             "(see --vllm-python)"]


def test_settings_for_vllm_follow_the_bench():
    assert speculative_config("vllm", 4, 3) is None
    assert speculative_config("vllm-ngram", 5, 2) == {"method": "ngram", "num_speculative_tokens": 5,
                                                      "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    assert speculative_config("vllm-ngram-k8", 5, 2)["num_speculative_tokens"] == 8  # its own k, not the bench's
    assert [is_vllm_system(name) for name in ("vllm", "vllm-ngram", "vllm-ngram-k12", "vllm-ngram-k0",
                                              "vllm-ngram-k", "vllm-ngram-k8x", "generate-chunks")] == \
        [True, True, True, False, False, False, False]
    for name in ("vllm-eagle", "vllm-ngram-k0", "vllm-ngram-k"):
        with pytest.raises(ValueError, match="unknown vLLM system"):
            speculative_config(name, 4, 3)
    env = worker_environment(sys.executable, threads=2)
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == thread_binding(2)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "PYTHONPATH" not in env


def test_protocol_with_a_fake_worker_requests_replies_and_runs(monkeypatch, tmp_path):
    """Protocol test (a fake worker, no vLLM): the engine config carries max_num_seqs = the batch size, the bench's
    k and n-gram sizes and the threads; each generate sends the token ids, max new tokens and end tokens; a reply
    becomes a run whose rows are cut after their end token, with start-up and warm-up reported apart."""
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    target = tiny_llama(seed=71)
    prompts = random_prompts(3, target.config.vocab_size, seed=6, min_length=3, max_length=9)
    config = stream_bench.StreamBenchConfig(max_new_tokens=6, max_batch_sizes=(3,),
                                            systems=("generate-chunks", "vllm-ngram"), strategies=(), repeats=2,
                                            num_assistant_tokens=5, max_ngram=2,
                                            vllm=VLLMSettings(sys.executable, "model-dir", "fake", str(tmp_path),
                                                              str(worker)))
    report = stream_bench.run_stream_bench(target, None, prompts, {EOS}, PAD, config, log=lambda line: None)
    sent = json.loads(record.read_text())
    assert sent["config"] == {"model": "model-dir", "dtype": "float32", "max_num_seqs": 3,
                              "max_model_len": max(map(len, prompts)) + 6,
                              "speculative_config": {"method": "ngram", "num_speculative_tokens": 5,
                                                     "prompt_lookup_max": 2, "prompt_lookup_min": 1}}
    import torch

    assert sent["env"]["OMP_NUM_THREADS"] == str(torch.get_num_threads()) and sent["env"]["PYTHONPATH"] is None
    assert len(sent["requests"]) == 3  # one engine: a warm-up (2 new tokens), then both repeats
    assert [request["max_tokens"] for request in sent["requests"]] == [2, 6, 6]
    assert sent["requests"][1] == {"op": "generate", "prompts": prompts, "max_tokens": 6, "stop_token_ids": [EOS],
                                   "profile": False}
    median = next(run for run in report["medians"][3] if run.name == "vllm-ngram")
    assert median.tokens == [prompt[:2] + [EOS] for prompt in prompts]  # the token after the end token is cut
    assert median.seconds == 0.5 and median.occupancy == [(0.1, 3), (0.2, 1)] and median.tokens_per_row_step == 9 / 4
    row = next(row for row in report["runs"][3] if row["name"] == "vllm-ngram")
    assert row["startup_seconds"] == 13.0 and row["equal"].endswith("/3")  # start-up 12.5 s + warm-up 0.5 s
    assert "engine start-up and warm-up, not counted in tok/s: vllm-ngram 13.0 s" in stream_bench.format_table(
        report["runs"][3], "generate-chunks")
    assert (tmp_path / "vllm-ngram-b3.log").is_file()
    words = stream_bench.verdict(report["runs"][3])
    assert "Against vLLM: generate-chunks" in words and "vLLM's best (vllm-ngram," in words


def test_protocol_a_worker_error_is_raised_with_the_log_tail(tmp_path):
    """Protocol test: a worker that fails reports an error event; the host raises it with the worker log's tail."""
    worker = tmp_path / "failing_worker.py"
    worker.write_text("import json, sys\nsys.stdin.readline()\nprint('loading...', file=sys.stderr)\n"
                      "print(json.dumps({'event': 'error', 'message': 'ValueError: no such model'}), flush=True)\n")
    engine = VLLMEngine(sys.executable, "nowhere", max_num_seqs=2, max_model_len=64, threads=1,
                        log_path=tmp_path / "log.txt", worker=worker)
    with pytest.raises(RuntimeError, match=r"vLLM failed: ValueError: no such model.*\n  loading\.\.\."):
        with engine:
            engine.start(timeout=60)
