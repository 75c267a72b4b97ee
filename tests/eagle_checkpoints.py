"""Random EAGLE heads written the way the public trainers write them, and tiny targets of several families.

config.json keys and tensor names follow ``shared/facts/eagle-formats.md``:

- EAGLE-1 (SafeAILab/EAGLE): a Llama config with ``num_hidden_layers: 1`` and ``bias``; tensors ``fc.weight``
  (H, 2H), ``fc.bias`` when bias is on, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``, optionally
  ``embed_tokens.weight``; no input norm, final norm or lm_head.
- EAGLE-3 (the reference trainer or SpecForge): a Llama config with ``draft_vocab_size`` (and optionally
  ``target_hidden_size``, ``eagle_config``, no ``rope_theta``); tensors ``midlayer.self_attn.*`` (q, k, v take 2H),
  ``midlayer.mlp.*``, ``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight``, ``fc.weight``
  (H, 3H), ``norm.weight``, ``lm_head.weight`` (Vd, H), ``d2t`` (Vd,) int64, ``t2d`` (V,) bool.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from tiny_models import BOS, EOS, PAD

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 96, 32, 4, 2, 8
FAMILY_FIELDS = {"mistral": {"sliding_window": None}}  # (a window longer than the tests' rows changes nothing)


def tiny_target(model_type: str, num_layers: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32,
                attn_implementation: str = "sdpa"):
    """A random target of ``model_type`` (llama, qwen2, qwen3, mistral, ...), eval mode, untied embeddings."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=num_layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=256,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
        **FAMILY_FIELDS.get(model_type, {}))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype).eval()


def _linear(generator, rows: int, columns: int, gain: float = 1.0) -> torch.Tensor:
    return torch.randn(rows, columns, generator=generator) * gain / columns**0.5


def _norm(generator, size: int) -> torch.Tensor:
    return 1.0 + 0.2 * torch.randn(size, generator=generator)  # not all ones: a norm weight that is skipped shows


def _layer(generator, prefix: str, hidden: int, attention_input: int, heads: int, kv_heads: int, head_dim: int,
           intermediate: int) -> dict[str, torch.Tensor]:
    tensors = {
        f"{prefix}self_attn.q_proj.weight": _linear(generator, heads * head_dim, attention_input),
        f"{prefix}self_attn.k_proj.weight": _linear(generator, kv_heads * head_dim, attention_input, gain=2.0),
        f"{prefix}self_attn.v_proj.weight": _linear(generator, kv_heads * head_dim, attention_input),
        f"{prefix}self_attn.o_proj.weight": _linear(generator, hidden, heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": _linear(generator, intermediate, hidden),
        f"{prefix}mlp.up_proj.weight": _linear(generator, intermediate, hidden),
        f"{prefix}mlp.down_proj.weight": _linear(generator, hidden, intermediate),
        f"{prefix}post_attention_layernorm.weight": _norm(generator, hidden),
    }
    return tensors


def llama_fields(hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> dict:
    """The plain LlamaForCausalLM config.json fields both trainers start from."""
    return {"hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": intermediate,
            "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.28.1",
            "use_cache": True, "vocab_size": vocab, "bos_token_id": BOS, "eos_token_id": EOS}


def eagle1_checkpoint(seed: int = 0, hidden: int = HIDDEN, vocab: int = VOCAB, bias: bool | None = True,
                      qkv_bias: bool = False, embedding: bool = False, rope_theta: float = 500000.0,
                      dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict[str, torch.Tensor]]:
    """An EAGLE-1 head's config.json and tensors. ``bias``: the config's ``bias`` (``None``: no key, the older heads,
    which then carry ``fc.bias``); ``qkv_bias``: Qwen2-style q/k/v biases (config ``qkv_bias: true``)."""
    generator = torch.Generator().manual_seed(seed)
    intermediate = 2 * hidden
    config = {"architectures": ["LlamaForCausalLM"], **llama_fields(hidden, HEADS, KV_HEADS, intermediate, vocab),
              "rope_theta": rope_theta}
    if bias is not None:
        config["bias"] = bias
    tensors = {"fc.weight": _linear(generator, hidden, 2 * hidden)}
    if bias is None or bias:
        tensors["fc.bias"] = 0.1 * torch.randn(hidden, generator=generator)
    tensors.update(_layer(generator, "layers.0.", hidden, hidden, HEADS, KV_HEADS, hidden // HEADS, intermediate))
    if qkv_bias:
        config["qkv_bias"] = True
        for name in ("q", "k", "v"):
            rows = tensors[f"layers.0.self_attn.{name}_proj.weight"].shape[0]
            tensors[f"layers.0.self_attn.{name}_proj.bias"] = 0.3 * torch.randn(rows, generator=generator)
    if embedding:
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=generator)
    return config, {name: tensor.to(dtype) for name, tensor in tensors.items()}


def eagle3_checkpoint(seed: int = 0, hidden: int = HIDDEN, vocab: int = VOCAB, draft_vocab: int | None = 40,
                      target_hidden: int | None = None, embedding: bool = False, layer_ids: list[int] | None = None,
                      rope_theta: float | None = None, specforge: bool = True,
                      dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict[str, torch.Tensor]]:
    """An EAGLE-3 head's config.json and tensors.

    Args:
        draft_vocab: the reduced vocabulary (a random subset of the target's, sorted, as ``d2t``/``t2d``); ``None``:
            the full vocabulary, no mapping written.
        target_hidden: writes ``target_hidden_size`` (fc takes 3 x that).
        layer_ids: writes ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge's output-of-layer ids).
        rope_theta: ``None`` leaves the key out (Llama's 10000 applies).
        specforge: ``architectures: ["LlamaForCausalLMEagle3"]`` (else the reference trainer's ``LlamaForCausalLM``).
    """
    generator = torch.Generator().manual_seed(seed)
    intermediate = 2 * hidden
    rows = vocab if draft_vocab is None else draft_vocab
    config = {"architectures": ["LlamaForCausalLMEagle3" if specforge else "LlamaForCausalLM"],
              **llama_fields(hidden, HEADS, KV_HEADS, intermediate, vocab), "draft_vocab_size": rows}
    if rope_theta is not None:
        config["rope_theta"] = rope_theta
    if target_hidden is not None:
        config["target_hidden_size"] = target_hidden
    if layer_ids is not None:
        config["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": layer_ids}
    feature = 3 * (target_hidden or hidden)
    tensors = _layer(generator, "midlayer.", hidden, 2 * hidden, HEADS, KV_HEADS, hidden // HEADS, intermediate)
    tensors.update({
        "midlayer.hidden_norm.weight": _norm(generator, hidden),
        "midlayer.input_layernorm.weight": _norm(generator, hidden),
        "fc.weight": _linear(generator, hidden, feature),
        "norm.weight": _norm(generator, hidden),
        "lm_head.weight": _linear(generator, rows, hidden, gain=4.0),  # peaked distributions
    })
    if embedding:
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=generator)
    tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    if draft_vocab is not None:
        target_ids = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
        tensors["d2t"] = target_ids - torch.arange(draft_vocab)  # draft id + d2t[draft id] = target id
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids] = True
        tensors["t2d"] = t2d
    return config, tensors


def write_checkpoint(folder: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor],
                     weights: str = "safetensors") -> str:
    """Write ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``) into ``folder``; returns it."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2)
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    if weights == "safetensors":
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    elif weights == "bin":
        torch.save(tensors, os.path.join(folder, "pytorch_model.bin"))
    else:
        raise ValueError(f"unknown weights format {weights!r}")
    return str(folder)
