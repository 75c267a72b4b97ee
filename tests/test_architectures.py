"""Every decoder family a user plausibly pairs with a draft is exact, and every family the loop cannot serve is refused.

Tiny randomly initialised models built from configs (3-layer target, 1-layer draft of the same family: the target's
first layer plus noise, so it agrees often but not always), a left-padded batch of 4 prompts, greedy decoding: every
row equals ``target.generate(row)`` without padding, token for token, under several budgets and ``e``. Models with
sliding-window attention get windows of ``WINDOW`` tokens and generations longer than three windows, so every row's
window slides over holes (rejected drafts, block filler) and left padding.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM
from transformers.cache_utils import get_layer_types_and_kwargs

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from test_bad_input import ForwardCounter
from test_sampling_distribution import ROWS, chi_square_p_value, exact_joint, sampled_joint
from tiny_models import PAD, greedy_alone, left_pad, noisy_copy, random_prompts, sharpen

VOCAB, BATCH, WINDOW = 96, 4, 8
NEW_TOKENS = 3 * WINDOW + 2
COMMON = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=256, pad_token_id=PAD, bos_token_id=2, eos_token_id=1,
              tie_word_embeddings=False)  # tied random embeddings make many families repeat their last token
DROP = object()  # an override value that removes a common field the family does not take


def tiny(model_type: str, num_layers: int, seed: int, overrides=None, vocab_size: int = VOCAB,
         auto=AutoModelForCausalLM):
    """A random fp32 model of ``model_type`` in eval mode. ``overrides``: config fields, or a function of the layer
    count returning them (for per-layer fields)."""
    overrides = overrides(num_layers) if callable(overrides) else (overrides or {})
    fields = {**COMMON, "vocab_size": vocab_size, "num_hidden_layers": num_layers, **overrides}
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{name: value for name, value in fields.items() if value is not DROP})
    return auto.from_config(config).eval()


def early_exit_draft(target, model_type: str, overrides, noise: float = 0.3, num_layers: int = 1):
    """The target's first ``num_layers`` layers (every weight whose name and shape match) plus Gaussian noise."""
    draft = tiny(model_type, num_layers, seed=1, overrides=overrides)
    own = draft.state_dict()
    draft.load_state_dict({name: weight for name, weight in target.state_dict().items()
                           if name in own and own[name].shape == weight.shape}, strict=False)
    return noisy_copy(draft, noise, seed=2)


def windows(model) -> set[int]:
    """Sliding-window sizes the model's layers use."""
    _, layer_kwargs = get_layer_types_and_kwargs(model.config)
    sizes = {kwargs["sliding_window"] for kwargs in layer_kwargs if "sliding_window" in kwargs}
    return sizes


def target_alone(target, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt generated on its own, unpadded: the reference (``NEW_TOKENS`` tokens per row)."""
    return greedy_alone(target, prompts, NEW_TOKENS)


def assert_exact(target, draft, runs: list[dict], seed: int = 3) -> tuple[int, int]:
    """Every run's rows equal the target alone; returns (accepted, verified) drafts over all runs."""
    prompts = random_prompts(BATCH, target.config.vocab_size, seed, min_length=4, max_length=15)
    references = target_alone(target, prompts)
    input_ids, mask = left_pad(prompts)
    accepted = verified = 0
    for options in runs:
        out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                              do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              pad_token_id=PAD, return_dict_in_generate=True, **options)
        assert torch.equal(out.sequences[:, : input_ids.shape[1]], input_ids), options
        for row, reference in enumerate(references):
            assert out.sequences[row, input_ids.shape[1]:].tolist() == reference, f"row {row} differs, {options}"
        accepted += out.tetris_stats.accepted_tokens
        verified += out.tetris_stats.verified_tokens
    return accepted, verified


RUNS = [
    dict(num_assistant_tokens=3, tetris_extra_tokens=0, tetris_budget=BATCH),  # C = B
    dict(num_assistant_tokens=2, tetris_extra_tokens=2, tetris_budget=1, tetris_max_holes=2),  # C = 1, repacking often
    dict(tetris_strategy="fixed", num_assistant_tokens=3),
    dict(num_assistant_tokens=4, tetris_extra_tokens=1, tetris_budget=4 * BATCH),  # C = kB
]
FULL_ATTENTION_RUNS = RUNS[:2]  # the 2D-mask path: test_greedy_exactness.py covers budgets and e at length on Llama

FULL_ATTENTION = {  # test id: (model_type, config overrides)
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),
    "phi3": ("phi3", {}),
    "gpt2": ("gpt2", {}),
    "gpt_neox": ("gpt_neox", {}),
    "opt": ("opt", {"ffn_dim": 64, "word_embed_proj_dim": 32}),
    "falcon": ("falcon", {"head_dim": DROP}),
    "starcoder2": ("starcoder2", {}),
    "granite": ("granite", {}),
    "olmo": ("olmo", {}),
    "olmo2": ("olmo2", {}),
    "stablelm": ("stablelm", {}),
    "gpt_bigcode": ("gpt_bigcode", {}),
    "bloom": ("bloom", {}),
    "cohere": ("cohere", {}),
    "phi": ("phi", {}),
    "gptj": ("gptj", {"rotary_dim": 4}),
    "codegen": ("codegen", {"rotary_dim": 4}),
    "helium": ("helium", {}),
    "glm": ("glm", {}),
    "smollm3": ("smollm3", {}),
    "nemotron": ("nemotron", {}),
    "persimmon": ("persimmon", {}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt_neo": ("gpt_neo", lambda layers: {"attention_types": [[["global"], layers]]}),
    "qwen2_moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                "shared_expert_intermediate_size": 16}),
}
SLIDING_WINDOW = {
    "mistral_window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "ministral": ("ministral", {"sliding_window": WINDOW}),
    "gemma2": ("gemma2", {"sliding_window": WINDOW}),
    "gemma3_text": ("gemma3_text", {"sliding_window": WINDOW, "sliding_window_pattern": 2}),
    "gemma3n_text": ("gemma3n_text", lambda layers: {  # the last layer reuses the first one's keys and values
        "sliding_window": WINDOW, "num_kv_shared_layers": 1 if layers == 3 else 0, "laurel_rank": 4,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"][:layers],
        "activation_sparsity_pattern": [0.0] * layers}),
    "cohere2": ("cohere2", {"sliding_window": WINDOW, "sliding_window_pattern": 2}),
    "olmo3": ("olmo3", {"sliding_window": WINDOW}),
    "exaone4": ("exaone4", {"sliding_window": WINDOW, "sliding_window_pattern": 2}),
    "vaultgemma": ("vaultgemma", {"sliding_window": WINDOW}),
    "gpt_oss": ("gpt_oss", {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2}),
}


@pytest.mark.parametrize("family", list(FULL_ATTENTION) + list(SLIDING_WINDOW))
def test_greedy_rows_equal_target_alone(family):
    model_type, overrides = {**FULL_ATTENTION, **SLIDING_WINDOW}[family]
    target = tiny(model_type, 3, seed=0, overrides=overrides)
    assert windows(target) == ({WINDOW} if family in SLIDING_WINDOW else set())
    draft = early_exit_draft(target, model_type, overrides)
    accepted, verified = assert_exact(target, draft, RUNS if family in SLIDING_WINDOW else FULL_ATTENTION_RUNS)
    assert 0 < accepted < verified  # drafts accepted and rejected: rows advance unevenly and leave holes


@pytest.mark.parametrize("target_family,draft_family", [("llama", "gpt2"), ("gemma2", "qwen2")])
def test_a_draft_of_another_family_is_exact(target_family, draft_family):
    """Only the vocabulary is shared; a small vocabulary makes the random draft agree sometimes."""
    target_type, target_overrides = {**FULL_ATTENTION, **SLIDING_WINDOW}[target_family]
    draft_type, draft_overrides = FULL_ATTENTION[draft_family]
    target = tiny(target_type, 3, seed=0, overrides=target_overrides, vocab_size=12)
    draft = tiny(draft_type, 1, seed=1, overrides=draft_overrides, vocab_size=12)
    accepted, verified = assert_exact(target, draft, RUNS[:2])
    assert 0 < accepted < verified


@pytest.fixture(scope="module")
def windowed_pair():
    small = {"sliding_window": 2, "hidden_size": 16, "intermediate_size": 32, "head_dim": 4}
    target = sharpen(tiny("mistral", 2, seed=21, overrides=small, vocab_size=6), 12)
    draft = sharpen(tiny("mistral", 1, seed=22, overrides=small, vocab_size=6), 12)  # disagrees often
    return target, draft


# Half the rows' drafts go unverified each step (C = B/2): block filler and rejected drafts leave holes right where
# a window of 2 looks.
WINDOWED_SAMPLING = dict(num_assistant_tokens=3, tetris_extra_tokens=1, tetris_budget=ROWS // 2)


def test_sampling_on_a_sliding_window_model_follows_the_target_distribution(windowed_pair):
    """Chi-square of the first 4 tokens (8 positions: four windows of 2) against the exact law of the target."""
    target, draft = windowed_pair
    counts, stats = sampled_joint(target, draft, 1.0, 1.0, "tetris", new_tokens=4, **WINDOWED_SAMPLING)
    assert 0 < stats.accepted_tokens < stats.verified_tokens
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0, new_tokens=4)) > 1e-3


def windows_measured_in_slots(layout, key_positions, key_valid, query_positions, dtype):
    """The bug this file guards against: sliding windows counted in cache slots (what transformers does with a 2D
    mask), so holes left by rejected drafts take the place of real tokens in the window."""
    slots, block = key_positions.shape[1], query_positions.shape[1]
    query_slots = torch.arange(slots - block, slots)
    slot_distance = query_slots[:, None] - torch.arange(slots)[None, :]  # (L, S): the queries are the last L slots
    visible = key_valid[:, None, :] & (query_positions[:, :, None] >= key_positions[:, None, :])
    masks = {kind: (visible if window is None else visible & (slot_distance < window))[:, None]
             for kind, window in layout.windows.items()}
    return masks if layout.keyed else next(iter(masks.values()))


def test_chi_square_catches_windows_measured_in_slots(windowed_pair, monkeypatch):
    """Teeth: with windows counted in slots instead of positions, the same chi-square test fails (p ~ 1e-21)."""
    monkeypatch.setattr("tetris_hf.kv.position_masks", windows_measured_in_slots)
    target, draft = windowed_pair
    counts, _ = sampled_joint(target, draft, 1.0, 1.0, "tetris", new_tokens=4, **WINDOWED_SAMPLING)
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0, new_tokens=4)) < 1e-3


REFUSED = {  # test id: (model_type, config overrides, loader, words the message must contain)
    "mamba": ("mamba", {"state_size": 4}, AutoModelForCausalLM, "recurrent state"),
    "mamba2": ("mamba2", {"num_heads": 4, "head_dim": 16, "state_size": 4, "n_groups": 1}, AutoModelForCausalLM,
               "recurrent state"),
    "falcon_mamba": ("falcon_mamba", {"state_size": 4}, AutoModelForCausalLM, "recurrent state"),
    "jamba": ("jamba", {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "num_experts": 2,
                        "mamba_d_state": 4}, AutoModelForCausalLM, "recurrent state"),
    "recurrent_gemma": ("recurrent_gemma", {"lru_width": 32, "attention_window_size": 8,
                                            "block_types": ["recurrent", "attention"]}, AutoModelForCausalLM,
                        "recurrent state"),
    "bamba": ("bamba", {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 4, "attn_layer_indices": [1]},
              AutoModelForCausalLM, "recurrent state"),
    "rwkv": ("rwkv", {"attention_hidden_size": 32}, AutoModelForCausalLM, "recurrent state"),
    "xlstm": ("xlstm", {"num_heads": 4, "embedding_dim": 32}, AutoModelForCausalLM, "recurrent state"),
    # not marked stateful by transformers: refused by its layer types ("conv", "linear_attention")
    "lfm2": ("lfm2", {"full_attn_idxs": [1]}, AutoModelForCausalLM, "layer types ['conv', 'full_attention']"),
    "qwen3_next": ("qwen3_next", {"linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 8,
                                  "linear_value_head_dim": 8, "num_experts": 2, "num_experts_per_tok": 1,
                                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
                   AutoModelForCausalLM, "recurrent state"),
    "llama4_text": ("llama4_text", {"attention_chunk_size": 8, "num_local_experts": 2, "intermediate_size_mlp": 64},
                    AutoModelForCausalLM, "chunked_attention"),
    "gpt_neo_local": ("gpt_neo", {"window_size": WINDOW, "attention_types": [[["global", "local"], 1]]},
                      AutoModelForCausalLM, "local attention layers"),
    "bart": ("bart", {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4,
                      "decoder_attention_heads": 4, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32},
             AutoModelForSeq2SeqLM, "encoder-decoder"),
    "t5": ("t5", {"d_model": 32, "d_ff": 32, "num_layers": 1, "num_heads": 4, "d_kv": 8}, AutoModelForSeq2SeqLM,
           "encoder-decoder"),
    "gemma3": ("gemma3", {"text_config": {**COMMON, "vocab_size": VOCAB, "num_hidden_layers": 2},
                          "vision_config": {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                                            "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
                          "mm_tokens_per_image": 4, "boi_token_index": 90, "eoi_token_index": 91,
                          "image_token_index": 92},
               AutoModelForImageTextToText, "multimodal"),
}


@pytest.mark.parametrize("family", list(REFUSED))
@pytest.mark.parametrize("role", ["target", "draft"])
def test_unservable_families_are_refused_before_any_forward(family, role):
    model_type, overrides, auto, reason = REFUSED[family]
    model = tiny(model_type, 2, seed=0, overrides=overrides, auto=auto)
    llama = tiny("llama", 1, seed=1)
    target, draft = (model, llama) if role == "target" else (llama, model)
    counter = ForwardCounter(target, draft)
    try:
        with pytest.raises(ValueError, match=rf"{role} model .*\({model.config.model_type}\): .*") as error:
            target.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), assistant_model=draft, custom_generate="tetris",
                            max_new_tokens=5, pad_token_id=PAD)
    finally:
        counter.remove()
    assert reason in str(error.value)
    assert counter.count == 0, "a model ran before the error"
