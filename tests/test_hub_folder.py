"""The Hub folder is what ``python -m tetris_hf.hub_export`` writes, loads by path, and names missing requirements."""

import dataclasses
from pathlib import Path

import pytest
import torch

import tetris_hf
from tetris_hf.hub_export import export, installed_version, main
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, tiny_llama

REPO = Path(__file__).resolve().parents[1]
HUB_FOLDER = REPO / "hub"
EXPORTED = ("README.md", "custom_generate/generate.py", "custom_generate/requirements.txt")


def _files(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): path.read_text(encoding="utf-8")
        for path in sorted(folder.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_committed_hub_folder_equals_fresh_export(tmp_path):
    export(tmp_path)
    fresh, committed = _files(tmp_path), _files(HUB_FOLDER)
    assert sorted(fresh) == sorted(EXPORTED)
    assert committed == fresh, "hub/ is stale: run `python -m tetris_hf.hub_export hub/` and commit the result"


def test_export_command_writes_the_folder(tmp_path, capsys):
    main([str(tmp_path / "repo")])  # what `python -m tetris_hf.hub_export DIR` runs
    assert sorted(_files(tmp_path / "repo")) == sorted(EXPORTED)
    assert len(capsys.readouterr().out.splitlines()) == len(EXPORTED)


def test_model_card_lists_every_option_tag_and_pinned_version(tmp_path):
    export(tmp_path)
    card = (tmp_path / "README.md").read_text()
    front_matter = card.split("---")[1]
    assert "- custom_generate" in front_matter
    for option in dataclasses.fields(tetris_hf.TetrisOptions):
        assert f"| `{option.name}` |" in card
    for field in dataclasses.fields(tetris_hf.TetrisStats):
        assert f"`{field.name}`" in card
    assert ".sequences" in card and ".tetris_stats" in card
    requirements = (tmp_path / "custom_generate" / "requirements.txt").read_text().split()
    assert requirements == [f"tetris-hf=={installed_version()}"]


def test_exported_folder_by_path_equals_package_call(tmp_path):
    export(tmp_path / "repo")
    target = tiny_llama(60, seed=61)
    draft = noisy_copy(target, 0.4, seed=62)
    input_ids, mask = left_pad(random_prompts(4, 60, seed=63))
    kwargs = dict(attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=10, pad_token_id=PAD,
                  return_dict_in_generate=True, tetris_extra_tokens=1, tetris_budget=5)
    by_package = tetris_hf.generate(target, input_ids, **kwargs)
    by_folder = target.generate(input_ids, custom_generate=str(tmp_path / "repo"), trust_remote_code=True, **kwargs)
    assert torch.equal(by_package.sequences, by_folder.sequences)
    assert by_package.tetris_stats.budget_per_step == by_folder.tetris_stats.budget_per_step
    assert by_package.tetris_stats.accepted_tokens == by_folder.tetris_stats.accepted_tokens


def test_missing_requirements_are_named(tmp_path):
    export(tmp_path / "repo")
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


def test_missing_imported_package_is_named(tmp_path):
    export(tmp_path / "repo")
    generate_py = tmp_path / "repo" / "custom_generate" / "generate.py"
    generate_py.write_text("import surely_not_installed_module\n" + generate_py.read_text())
    model = tiny_llama(32, num_layers=1)
    with pytest.raises(ImportError, match="surely_not_installed_module"):
        model.generate(torch.tensor([[3, 4]]), assistant_model=model, custom_generate=str(tmp_path / "repo"),
                       trust_remote_code=True, max_new_tokens=2)
