"""The Hub-style folder gives the same output as the registered name, from any working directory."""

import os
import subprocess
import sys
from pathlib import Path

import torch

import tetris_hf  # noqa: F401
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, tiny_llama

HUB_FOLDER = Path(__file__).resolve().parents[1] / "hub"


def test_local_folder_equals_registered_name():
    target = tiny_llama(60, seed=51)
    draft = noisy_copy(target, 0.4, seed=52)
    input_ids, mask = left_pad(random_prompts(4, 60, seed=53))
    kwargs = dict(attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=10, pad_token_id=PAD)
    by_name = target.generate(input_ids, custom_generate="tetris", **kwargs)
    by_folder = target.generate(input_ids, custom_generate=str(HUB_FOLDER), trust_remote_code=True, **kwargs)
    assert torch.equal(by_name, by_folder)


def test_name_resolves_from_any_directory(tmp_path):
    script = (
        "import torch, tetris_hf\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "c = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=1)\n"
        "m = LlamaForCausalLM(c).eval()\n"
        "out = m.generate(torch.tensor([[3, 4], [5, 6]]), assistant_model=m, custom_generate='tetris',"
        " max_new_tokens=3, do_sample=False)\n"
        "print(tuple(out.shape))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("(2, 5)")
