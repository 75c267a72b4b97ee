"""examples/gpu_check.py: its CPU smoke run writes a complete report, and its random target contains its drafts."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", EXAMPLES / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_random_target_computes_its_drafts_logits_at_residual_scale_zero(gpu_check):
    ids = torch.randint(3, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        target, narrow, early = gpu_check.build_random_models("tiny", 0.0, 0, "cpu", torch.float32)
        logits = [model(ids).logits for model in (target, narrow, early)]
        assert torch.allclose(logits[0], logits[1], atol=1e-5)
        assert torch.allclose(logits[0], logits[2], atol=1e-5)
        target, narrow, early = gpu_check.build_random_models("tiny", 0.05, 0, "cpu", torch.float32)
        assert (target(ids).logits - narrow(ids).logits).abs().max() > 1e-3  # the rest of the target now counts


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_exits_with_message(gpu_check, capsys):
    assert gpu_check.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_cpu_smoke_run_writes_every_part_and_exact_outputs(tmp_path):
    report_path = tmp_path / "report.json"
    env = dict(os.environ, TETRIS_HF_CACHE=str(tmp_path / "cache"), PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "gpu_check.py"), "--device", "cpu", "--shape", "tiny", "--out",
         str(report_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "exactness: OK" in result.stdout
    report = json.loads(report_path.read_text())
    parts = report["parts"]
    assert parts["smol: load"]["status"] == "skipped"
    for name in ("tiny: build", "tiny+half: eager", "tiny+half: host reads", "tiny+1l: eager", "tiny+1l: host reads",
                 "tiny+eagle: eager", "tiny+eagle: host reads"):
        assert parts[name]["status"] == "done", (name, parts[name])
    for name in ("tiny+1l: nf4", "tiny+1l: int8", "tiny+half: compiled", "tiny+1l: compiled", "tiny+eagle: compiled"):
        assert parts[name]["status"] == "skipped" and parts[name]["reason"], (name, parts[name])

    cells = {(cell["pair"], cell["batch"]): cell for cell in report["timing"]}
    assert set(cells) == {(pair, batch) for pair in ("tiny+half", "tiny+1l", "tiny+eagle") for batch in (1, 8, 32, 64)}
    for cell in cells.values():
        assert cell["variant"] == "eager"
        for mode in ("plain", "fixed", "tetris", "adaptive"):
            assert cell["modes"][mode]["tokens"] > 0 and cell["modes"][mode]["tokens_per_s"] > 0
        for mode in ("fixed", "tetris", "adaptive", "tetris-padded"):  # fp32 on a CPU: identical to plain, every row
            check = cell["modes"][mode]["vs_plain"]
            assert check["identical"] == check["rows"] == cell["batch"], check
            assert 0 <= cell["modes"][mode]["acceptance_rate"] <= 1
    assert max(cell["modes"]["tetris"]["acceptance_rate"] for cell in cells.values()) > 0  # the drafts agree sometimes
    assert cells[("tiny+eagle", 8)]["modes"]["tetris"]["draft_seconds"] > 0  # the head drafted

    reads = {(cell["pair"], cell["mode"]): cell for cell in report["host_reads"]}
    assert set(reads) == {(pair, mode) for pair in ("tiny+half", "tiny+1l", "tiny+eagle")
                          for mode in ("plain", "fixed", "tetris", "adaptive")}
    assert all(cell["steady_max"] is not None and len(cell["per_step"]) == cell["steps"] for cell in reads.values())

    assert max(cell["modes"]["tetris-padded"]["computed_per_selected"] for cell in cells.values()) > 1.0
    assert all(cell["modes"]["tetris"]["computed_per_selected"] == 1.0 for cell in cells.values())

    streams = {cell["pair"]: cell for cell in report["stream"]}
    assert set(streams) == {"tiny+half", "tiny+1l", "tiny+eagle"}
    for cell in streams.values():
        names = [run["name"] for run in cell["runs"]]
        assert names == ["hf-generate-batch", "generate-chunks", "tetris-chunks", "stream-tetris",
                         "stream-tetris-apart", "stream-fixed", "stream-fixed-apart"]
        assert all(run["equal"] == f"{cell['requests']}/{cell['requests']}" for run in cell["runs"]), cell["runs"]

    table = report_path.with_suffix(".md").read_text()
    assert "A stream of 256 requests, tiny+eagle" in table
    assert "Packed against padded" in table
    assert "| tiny+1l | eager | 64 |" in table and "| tiny+half | tetris | no | 8 |" in table
