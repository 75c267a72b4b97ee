"""Targets and drafts placed by accelerate (``device_map``) run the TETRIS loop, greedy-identical to the unplaced target.

On a CPU-only machine accelerate has two places for a weight: ``"cpu"`` and ``"disk"`` (offloaded to
``offload_folder``, loaded into memory by a hook on every forward). ``device_map="auto"`` alone keeps everything on
the CPU and dispatches nothing; with a ``max_memory`` smaller than the model it splits the layers between CPU and
disk; an explicit map can put any module anywhere. All three are tested here, for the target and for the draft.
"""

import pytest
import torch
from transformers import LlamaForCausalLM

import tetris_hf  # noqa: F401
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, sharpen, tiny_llama

VOCAB = 80
LAYERS = 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The reference target in memory, and target and draft saved to disk (to reload with a device_map)."""
    target = sharpen(tiny_llama(VOCAB, num_layers=LAYERS, seed=91, hidden_size=64), 6.0)
    draft = noisy_copy(target, 0.3, seed=92)
    root = tmp_path_factory.mktemp("placement")
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return target, root


def _split_map() -> dict[str, str]:
    """Embedding, first half of the layers and the head on the CPU; the other layers and the norm on disk."""
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "disk", "lm_head": "cpu"}
    for layer in range(LAYERS):
        device_map[f"model.layers.{layer}"] = "cpu" if layer < LAYERS // 2 else "disk"
    return device_map


def _auto_split_max_memory(folder) -> dict:
    """A CPU budget that holds the embedding and a layer or two, not the whole model (accelerate keeps a margin for
    the largest layer, so 80% of the footprint is what leaves about half the layers on the CPU)."""
    footprint = LlamaForCausalLM.from_pretrained(folder).get_memory_footprint()
    return {"cpu": int(0.8 * footprint)}


def _layer_places(device_map: dict[str, str]) -> set[str]:
    return {place for name, place in device_map.items() if name.startswith("model.layers.")}


def _load(folder, placement: str, offload_folder):
    if placement == "auto":
        kwargs = dict(device_map="auto")
    elif placement == "auto-max-memory":
        kwargs = dict(device_map="auto", max_memory=_auto_split_max_memory(folder), offload_folder=offload_folder)
    else:
        kwargs = dict(device_map=_split_map(), offload_folder=offload_folder)
    return LlamaForCausalLM.from_pretrained(folder, **kwargs).eval()


def _assert_equal_to_reference(reference, target, draft):
    prompts = random_prompts(5, VOCAB, seed=93, max_length=8)
    input_ids, mask = left_pad(prompts)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                          return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, reference.generate(input_ids, attention_mask=mask, **kwargs))
    for row, prompt in enumerate(prompts):
        alone = reference.generate(torch.tensor([prompt]), **kwargs)[0]
        start = input_ids.shape[1] - len(prompt)
        assert torch.equal(out.sequences[row, start : start + alone.shape[0]], alone), f"row {row}"
    assert out.tetris_stats.accepted_tokens > 0


@pytest.mark.parametrize("placement", ["auto", "auto-max-memory", "explicit-split"])
def test_placed_target_and_draft_equal_unplaced_target(saved, placement, tmp_path):
    reference, root = saved
    target = _load(root / "target", placement, tmp_path / "target-offload")
    draft = _load(root / "draft", placement, tmp_path / "draft-offload")
    if placement == "auto":
        assert getattr(target, "hf_device_map", None) is None  # CPU only: nothing to dispatch
    else:
        for model in (target, draft):  # the decoder layers themselves are split between CPU and disk
            assert _layer_places(model.hf_device_map) == {"cpu", "disk"}, model.hf_device_map
    _assert_equal_to_reference(reference, target, draft)


def test_placed_target_with_in_memory_draft(saved, tmp_path):
    reference, root = saved
    target = _load(root / "target", "explicit-split", tmp_path / "offload")
    assert target.hf_device_map["model.layers.3"] == "disk"
    assert target.model.layers[3].mlp.down_proj.weight.device.type == "meta"  # weights stay on disk between forwards
    assert target.model.layers[0].mlp.down_proj.weight.device.type == "cpu"
    _assert_equal_to_reference(reference, target, noisy_copy(reference, 0.3, seed=92))


def test_split_target_sampling_runs(saved, tmp_path):
    _, root = saved
    target = _load(root / "target", "explicit-split", tmp_path / "target-offload")
    draft = _load(root / "draft", "auto", tmp_path / "draft-offload")
    input_ids, mask = left_pad(random_prompts(4, VOCAB, seed=94))
    torch.manual_seed(0)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                          do_sample=True, max_new_tokens=10, pad_token_id=PAD, min_new_tokens=10)
    assert out.shape == (4, input_ids.shape[1] + 10)
