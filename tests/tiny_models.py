"""Tiny randomly initialised Llama models and left-padded batches for the tests."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

PAD, EOS, BOS = 0, 1, 2


def tiny_llama(vocab_size: int = 64, num_layers: int = 2, seed: int = 0, hidden_size: int = 32) -> LlamaForCausalLM:
    """A random Llama; pad 0, eos 1, bos 2; fp32, eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )
    return LlamaForCausalLM(config).eval()


def noisy_copy(model: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A draft that agrees with ``model`` often but not always: its weights plus Gaussian noise."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return draft


def left_pad(prompts: list[list[int]], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T)`` input_ids and attention_mask, left-padded."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return input_ids, mask


def random_prompts(batch_size: int, vocab_size: int, seed: int, min_length: int = 1, max_length: int = 9):
    """Prompts of different lengths that avoid the special tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_length, max_length + 1, (batch_size,), generator=generator).tolist()
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def sharpen(model: LlamaForCausalLM, factor: float) -> LlamaForCausalLM:
    """Scale the output head so the (near-uniform) random distributions become peaked, in place."""
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return model


def target_and_draft(vocab_size: int, seed: int, draft_kind: str, noise: float = 0.4):
    """A 2-layer target and a draft for it: ``"noisy"`` (the target plus noise: agrees often), ``"independent"``
    (another random model: agrees by chance) or ``"same"`` (the target itself: always agrees)."""
    target = tiny_llama(vocab_size, num_layers=2, seed=seed)
    if draft_kind == "noisy":
        return target, noisy_copy(target, noise, seed)
    if draft_kind == "independent":
        return target, tiny_llama(vocab_size, num_layers=1, seed=seed + 100)
    if draft_kind == "same":
        return target, target
    raise ValueError(f"unknown draft kind {draft_kind!r}")


def greedy_alone(target, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt generated on its own, unpadded, exactly ``new_tokens`` tokens (the reference for exactness)."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=PAD)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs
