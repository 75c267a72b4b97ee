"""The Hub-style folder gives the same output as the registered name, from any working directory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tetris_hf  # noqa: F401
from tetris_hf.tools.hub_export import export
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, tiny_llama


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory) -> Path:
    """The Hub folder as ``tetris-hf export-hub`` writes it (not kept in git), once for the module."""
    folder = tmp_path_factory.mktemp("hub") / "tetris-copy"
    export(folder)
    return folder


def test_local_folder_equals_registered_name(hub_folder):
    target = tiny_llama(60, seed=51)
    draft = noisy_copy(target, 0.4, seed=52)
    input_ids, mask = left_pad(random_prompts(4, 60, seed=53))
    kwargs = dict(attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=10, pad_token_id=PAD)
    by_name = target.generate(input_ids, custom_generate="tetris", **kwargs)
    by_folder = target.generate(input_ids, custom_generate=str(hub_folder), trust_remote_code=True, **kwargs)
    assert torch.equal(by_name, by_folder)


def test_name_resolves_from_any_directory(tmp_path):
    script = (
        "import torch, tetris_hf\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "c = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=1)\n"
        "torch.manual_seed(0)\n"  # random weights whose rows do not both stop at once (EOS): the shape is fixed
        "m = LlamaForCausalLM(c).eval()\n"
        "out = m.generate(torch.tensor([[3, 4], [5, 6]]), assistant_model=m, custom_generate='tetris',"
        " max_new_tokens=3, do_sample=False)\n"
        "print(tuple(out.shape))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("(2, 5)")


# ---------------------------------------------------------------------------------------------------------------
# The folder stands alone: an export runs in a Python that cannot import tetris_hf at all.

ISOLATED_SCRIPT = '''
import sys
import torch
from transformers import AutoModelForCausalLM

target = AutoModelForCausalLM.from_pretrained("target").eval()
draft = AutoModelForCausalLM.from_pretrained("draft").eval()
inputs = torch.load("inputs.pt")
common = dict(attention_mask=inputs["mask"], assistant_model=draft, do_sample=False, max_new_tokens=10,
              pad_token_id=0, return_dict_in_generate=True, custom_generate=FOLDER, trust_remote_code=True)
calls = {"tetris": [], "adaptive": []}

def callback_for(name):
    def on_step(record, loop):
        calls[name].append((type(loop.strategy).__name__, type(loop).__module__))
    return on_step

tetris = target.generate(inputs["ids"], tetris_extra_tokens=1, tetris_budget=5,
                         tetris_step_callback=callback_for("tetris"), **common)
adaptive = target.generate(inputs["ids"], tetris_strategy="adaptive", tetris_step_callback=callback_for("adaptive"),
                           **common)
report({
    "tetris": tetris.sequences.tolist(), "tetris_budgets": tetris.tetris_stats.budget_per_step,
    "tetris_steps": tetris.tetris_stats.steps, "tetris_calls": calls["tetris"],
    "adaptive": adaptive.sequences.tolist(), "adaptive_steps": adaptive.tetris_stats.steps,
    "adaptive_calls": calls["adaptive"],
    "tetris_hf_loaded": sorted(name for name in sys.modules if name.split(".")[0] == "tetris_hf"),
})
'''


def test_copied_folder_runs_without_the_package_and_equals_the_registered_name(hub_folder, tmp_path):
    """The exported folder in a temporary folder, loaded by path in a Python where tetris_hf cannot be imported, gives
    the registered name's greedy output token for token; tetris_budget, tetris_strategy="adaptive" and
    tetris_step_callback reach it."""
    from isolated_python import run_isolated

    folder = hub_folder
    target = tiny_llama(60, seed=71)
    draft = noisy_copy(target, 0.4, seed=72)
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    input_ids, mask = left_pad(random_prompts(4, 60, seed=73))
    torch.save({"ids": input_ids, "mask": mask}, tmp_path / "inputs.pt")

    kwargs = dict(attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=10, pad_token_id=PAD,
                  return_dict_in_generate=True, custom_generate="tetris")
    by_name = target.generate(input_ids, tetris_extra_tokens=1, tetris_budget=5, **kwargs)
    result = run_isolated(f"FOLDER = {str(folder)!r}\n" + ISOLATED_SCRIPT, tmp_path)

    assert result["tetris_hf_loaded"] == []
    assert torch.equal(torch.tensor(result["tetris"]), by_name.sequences)
    assert result["tetris_budgets"] == by_name.tetris_stats.budget_per_step
    assert set(result["tetris_budgets"][1:]) == {5}  # tetris_budget reached the loop (step 0 reads the prompt)
    assert len(result["tetris_calls"]) == result["tetris_steps"] > 1  # the callback ran after every step
    strategies, modules = zip(*result["tetris_calls"] + result["adaptive_calls"])
    assert all(module.startswith("transformers_modules.") for module in modules)  # the folder's copy ran
    assert set(strategies[: result["tetris_steps"]]) == {"TetrisSelection"}
    assert set(strategies[result["tetris_steps"]:]) == {"AdaptiveBudget"}
    assert len(result["adaptive_calls"]) == result["adaptive_steps"]
    assert torch.equal(torch.tensor(result["adaptive"]), by_name.sequences)  # greedy: the target's own output
