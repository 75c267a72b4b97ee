"""The Hub folder is what ``tetris-hf export-hub DIR`` writes: the strategy's library modules as flat files with
relative imports, found by reading the package's imports; it loads by path and names missing requirements.
``tetris-hf export-space DIR`` writes the Space: examples/space/'s files and the same folder as its strategy/.
Neither is kept in git; the module exports the Hub folder once (:func:`exported`).

(That the folder runs with the package not importable at all is tests/test_custom_generate_folder.py's business, and
the Space's is tests/test_space_isolated.py's.)
"""

import ast
import dataclasses
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tetris_hf
from tetris_hf.tools import hub_export
from tetris_hf.tools.cli import main as cli_main
from tetris_hf.tools.hub_export import ExportError, export, installed_version, library_closure
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, tiny_llama

REPO = Path(__file__).resolve().parents[1]


def _files(folder: Path) -> dict[str, str | bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes() if path.suffix == ".png" else path.read_text(encoding="utf-8")
        for path in sorted(folder.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The Hub folder, written once for the module by ``tetris-hf export-hub``; tests that change it copy it first."""
    folder = tmp_path_factory.mktemp("hub") / "tetris"
    assert cli_main(["export-hub", str(folder)]) == 0
    return folder


def test_export_commands_write_every_file_and_the_same_files_again(exported, tmp_path, capsys):
    capsys.readouterr()
    first = _files(exported)
    assert cli_main(["export-hub", str(exported)]) == 0  # again, into the folder it wrote
    printed = capsys.readouterr().out.splitlines()
    assert _files(exported) == first
    assert sorted(str(Path(line).relative_to(exported)) for line in printed) == sorted(first)

    space = tmp_path / "space"
    written = []
    for _ in range(2):
        assert cli_main(["export-space", str(space)]) == 0
        printed = capsys.readouterr().out.splitlines()
        written.append(_files(space))
        assert sorted(str(Path(line).relative_to(space)) for line in printed) == sorted(written[-1])
    assert written[0] == written[1]
    strategy = {name.removeprefix("strategy/"): text for name, text in written[0].items()
                if name.startswith("strategy/")}
    assert strategy == first  # the Space's strategy/ is the Hub folder
    app_files = {path.name for path in hub_export.space_files()}
    assert {"app.py", "README.md", "requirements.txt", "space_models.py", "tetris_runs.py"} <= app_files
    assert {name for name in written[0] if not name.startswith("strategy/")} == app_files


@pytest.mark.parametrize("where", ["missing/parent/dir", "a-file", "a-file/dir"])
@pytest.mark.parametrize("command", ["export-hub", "export-space"])
def test_a_directory_that_cannot_be_written_is_one_line_and_exit_status_2(tmp_path, capsys, command, where):
    (tmp_path / "a-file").write_text("not a folder")
    assert cli_main([command, str(tmp_path / where)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"tetris-hf {command}: error: {tmp_path / where}") and error.count("\n") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file"]  # nothing written


def test_python_m_hub_export_is_export_hub(tmp_path):
    """``python -m tetris_hf.tools.hub_export DIR`` runs ``tetris-hf export-hub DIR``: here its refusal, one line."""
    result = subprocess.run([sys.executable, "-m", "tetris_hf.tools.hub_export", str(tmp_path / "no" / "dir")],
                            capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr == f"tetris-hf export-hub: error: {tmp_path / 'no' / 'dir'}: its parent {tmp_path / 'no'} " \
        "is not an existing folder; create it first\n"


def test_export_holds_the_library_closure_and_no_tool(exported):
    code = sorted(path.name for path in (exported / "custom_generate").glob("*.py"))
    expected = {"generate", "generation", "decoding", "kv", "strategies", "selection", "cost_model", "stopping",
                "outputs", "candidate_generators", "candidate_generators_batched_draft", "logits",
                "logits_processing", "logits_verification", "continuous", "stream"}
    assert expected <= {Path(name).stem for name in code}
    assert hub_export.TOOLS == {"tetris_hf.tools"}
    assert not any(module.name.startswith("tetris_hf.tools") for module in hub_export.library_closure())
    assert not {"bench", "cli", "models", "data", "simulate", "hub_export"} & {Path(name).stem for name in code}


def test_exported_modules_import_each_other_relatively_and_only_torch_transformers_and_their_dependencies(exported):
    """safetensors (EAGLE checkpoints) and tqdm (generate_batch's progress bar) are dependencies of transformers
    itself: nothing new to install."""
    code = exported / "custom_generate"
    outside = set()
    for path in code.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module, f"{path.name}:{node.lineno}: only `from .flat import`"
                assert (code / f"{node.module}.py").is_file(), f"{path.name} imports .{node.module}, not exported"
            elif isinstance(node, ast.ImportFrom):
                outside.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                outside.update(alias.name.split(".")[0] for alias in node.names)
    assert "tetris_hf" not in outside
    imported = ("safetensors", "torch", "tqdm", "transformers")
    assert {name for name in outside if name not in sys.stdlib_module_names} == set(imported)
    requirements = (code / "requirements.txt").read_text().split()
    assert requirements == [f"{name}>={installed_version(name)}" for name in imported]


def test_a_module_added_to_the_library_is_exported_without_changing_the_exporter(tmp_path, monkeypatch):
    package = tmp_path / "package"
    shutil.copytree(REPO / "tetris_hf", package, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    (package / "extras").mkdir()
    (package / "extras" / "__init__.py").write_text('"""Extras."""\n')
    (package / "extras" / "helper.py").write_text('"""A helper."""\n\nfrom ..kv import SlotCache\n\nHELPER = 1\n')
    selection = package / "selection.py"
    selection.write_text(selection.read_text() + "\n\ndef _uses_helper():\n    from .extras.helper import HELPER\n"
                                                  "\n    return HELPER\n")
    monkeypatch.setattr(hub_export, "PACKAGE_DIR", package)
    export(tmp_path / "repo")
    code = tmp_path / "repo" / "custom_generate"
    assert "    from .extras_helper import HELPER\n" in (code / "selection.py").read_text()
    assert "from .kv import SlotCache\n" in (code / "extras_helper.py").read_text()
    assert not (code / "extras.py").exists()  # the package's __init__ is not imported, so not exported
    assert "`custom_generate/extras_helper.py` | `tetris_hf/extras/helper.py` | A helper. |" in (
        tmp_path / "repo" / "README.md").read_text()


def test_a_library_module_that_imports_a_tool_is_refused_with_the_chain(monkeypatch):
    monkeypatch.setattr(hub_export, "TOOLS", hub_export.TOOLS | {"tetris_hf.selection"})
    with pytest.raises(ExportError, match=r"tool module tetris_hf\.selection \(tetris_hf\.selection <- "
                                          r"tetris_hf\.strategies <- .*tetris_hf\.generation\)"):
        library_closure()


def test_model_card_lists_every_option_field_file_and_requirement(exported):
    card = (exported / "README.md").read_text()
    front_matter = card.split("---")[1]
    assert "- custom_generate" in front_matter
    for option in dataclasses.fields(tetris_hf.TetrisOptions):
        assert f"| `{option.name}` |" in card
    for field in dataclasses.fields(tetris_hf.TetrisStats):
        assert f"`{field.name}`" in card
    assert ".sequences" in card and ".tetris_stats" in card
    assert "## What `trust_remote_code=True` runs" in card
    for path in (exported / "custom_generate").glob("*.py"):
        if path.name != "generate.py":
            assert f"| `custom_generate/{path.name}` |" in card
    for line in (exported / "custom_generate" / "requirements.txt").read_text().split():
        assert f"`{line}`" in card
    assert "pip install tetris-hf" not in card


def test_exported_folder_by_path_equals_package_call(exported):
    target = tiny_llama(60, seed=61)
    draft = noisy_copy(target, 0.4, seed=62)
    input_ids, mask = left_pad(random_prompts(4, 60, seed=63))
    kwargs = dict(attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=10, pad_token_id=PAD,
                  return_dict_in_generate=True, tetris_extra_tokens=1, tetris_budget=5)
    by_package = tetris_hf.generate(target, input_ids, **kwargs)
    by_folder = target.generate(input_ids, custom_generate=str(exported), trust_remote_code=True, **kwargs)
    assert torch.equal(by_package.sequences, by_folder.sequences)
    assert by_package.tetris_stats.budget_per_step == by_folder.tetris_stats.budget_per_step
    assert by_package.tetris_stats.accepted_tokens == by_folder.tetris_stats.accepted_tokens


def test_exported_folder_serves_the_request_stream_like_the_package(exported):
    """The folder imported as a package (as the Space imports its copy): generate.py re-exports generate_batch and
    init_continuous_batching from the exported request stream, whose outputs equal the package's."""
    import importlib.util

    code = exported / "custom_generate"
    spec = importlib.util.spec_from_file_location("exported_tetris", code / "__init__.py",
                                                  submodule_search_locations=[str(code)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["exported_tetris"] = package
    try:
        generate_py = importlib.import_module("exported_tetris.generate")
        assert generate_py.__all__ == ["generate", "generate_batch", "init_continuous_batching"]
        assert generate_py.generate_batch.__module__ == "exported_tetris.continuous"
        target = tiny_llama(60, seed=71)
        draft = noisy_copy(target, 0.4, seed=72)
        prompts = random_prompts(5, 60, seed=73)
        kwargs = dict(assistant_model=draft, max_new_tokens=8, max_batch_size=2, eos_token_id=None)
        by_folder = generate_py.generate_batch(target, prompts, **kwargs)
        by_package = tetris_hf.generate_batch(target, prompts, **kwargs)
        assert [out.generated_tokens for out in by_folder.values()] == \
            [out.generated_tokens for out in by_package.values()]
        with generate_py.init_continuous_batching(target, assistant_model=draft, max_batch_size=2,
                                                  eos_token_id=None) as manager:
            request_id = manager.add_request(prompts[0], max_new_tokens=8)
            assert manager.get_result(request_id, timeout=60).generated_tokens == \
                by_package["req_0"].generated_tokens
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] == "exported_tetris"]:
            del sys.modules[name]


def test_missing_requirements_are_named(exported, tmp_path):
    shutil.copytree(exported, tmp_path / "repo")
    (tmp_path / "repo" / "custom_generate" / "requirements.txt").write_text(
        "tetris-hf==999.0\nsurely-not-installed-xyz>=1.0\ntorch>=2.0\n"
    )
    model = tiny_llama(32, num_layers=1)
    with pytest.raises(ImportError, match="Missing requirements") as error:
        model.generate(torch.tensor([[3, 4]]), assistant_model=model, custom_generate=str(tmp_path / "repo"),
                       trust_remote_code=True, max_new_tokens=2)
    message = str(error.value)
    assert "tetris-hf==999.0 (installed: " in message
    assert "surely-not-installed-xyz>=1.0 (installed: None)" in message
    assert "torch" not in message  # satisfied requirements are not listed


def test_missing_imported_package_is_named(exported, tmp_path):
    shutil.copytree(exported, tmp_path / "repo")
    generate_py = tmp_path / "repo" / "custom_generate" / "generate.py"
    generate_py.write_text("import surely_not_installed_module\n" + generate_py.read_text())
    model = tiny_llama(32, num_layers=1)
    with pytest.raises(ImportError, match="surely_not_installed_module"):
        model.generate(torch.tensor([[3, 4]]), assistant_model=model, custom_generate=str(tmp_path / "repo"),
                       trust_remote_code=True, max_new_tokens=2)
