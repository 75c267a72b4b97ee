"""Tiny random Whisper models (built from a config) and drafts for them, for the encoder-decoder tests.

Vocabulary of 96: EOS (and pad) 1; decoder start 90, languages 91 (en) and 92 (de), tasks 93 (transcribe) and 94
(translate), no-timestamps 95. Weights are drawn wider than Whisper's init (std 2 / sqrt(fan_in), cross-attention 6x)
so that rows depend on their audio and greedy output varies, and EOS's output row is scaled up so rows end at
different lengths (checked by the tests that rely on it).
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration

VOCAB, EOS, START, EN, DE, TRANSCRIBE, TRANSLATE, NO_TIMESTAMPS = 96, 1, 90, 91, 92, 93, 94, 95
MELS, FRAMES = 8, 60  # encoder positions: FRAMES / 2


def whisper_config(decoder_layers: int = 2, encoder_layers: int = 2, d_model: int = 32, vocab: int = VOCAB,
                   **special) -> WhisperConfig:
    ids = {"pad_token_id": EOS, "bos_token_id": START, "eos_token_id": EOS, "decoder_start_token_id": START, **special}
    return WhisperConfig(vocab_size=vocab, num_mel_bins=MELS, encoder_layers=encoder_layers,
                         decoder_layers=decoder_layers, d_model=d_model, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model,
                         max_source_positions=FRAMES // 2, max_target_positions=64, suppress_tokens=[],
                         begin_suppress_tokens=[], attn_implementation="sdpa", **ids)


def whisper_generation_config(suppress_tokens=(5, 6), begin_suppress_tokens=(EOS, 7), eos=EOS, start=START,
                              languages=(EN, DE), tasks=(TRANSCRIBE, TRANSLATE),
                              no_timestamps=NO_TIMESTAMPS) -> GenerationConfig:
    """Whisper's generation settings: language and task tokens, suppressed tokens, no timestamps."""
    return GenerationConfig(decoder_start_token_id=start, eos_token_id=eos, pad_token_id=eos, bos_token_id=start,
                            is_multilingual=True, lang_to_id={"<|en|>": languages[0], "<|de|>": languages[1]},
                            task_to_id={"transcribe": tasks[0], "translate": tasks[1]},
                            no_timestamps_token_id=no_timestamps, suppress_tokens=list(suppress_tokens),
                            begin_suppress_tokens=list(begin_suppress_tokens), max_length=64)


def spread_weights(model: torch.nn.Module, seed: int, std: float = 2.0, cross: float = 6.0,
                   eos_scale: float = 2.0, eos: int = EOS) -> torch.nn.Module:
    """Redraw every matrix with std ``std / sqrt(fan_in)`` (``cross`` times that in cross-attention), then scale the
    EOS row of the (tied) output head by ``eos_scale``; in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                scale = std * (cross if "encoder_attn" in name else 1.0) / parameter.shape[1] ** 0.5
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
        model.get_output_embeddings().weight[eos] *= eos_scale
    return model


def tiny_whisper(seed: int = 0, decoder_layers: int = 2) -> WhisperForConditionalGeneration:
    """A random 2-layer WhisperForConditionalGeneration; fp32, eval mode."""
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(whisper_config(decoder_layers)).eval()
    model.generation_config = whisper_generation_config()
    return spread_weights(model, seed)


def _add_noise(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return model


def _decoder_state(target: WhisperForConditionalGeneration, layers: list[int]) -> dict:
    """The target decoder's embeddings, final norm and the decoder ``layers`` (renumbered 0..), by name."""
    state = {}
    for name, tensor in target.model.decoder.state_dict().items():
        if name.startswith("layers."):
            index = int(name.split(".")[1])
            if index in layers:
                state[f"layers.{layers.index(index)}." + name.split(".", 2)[2]] = tensor.clone()
        else:
            state[name] = tensor.clone()
    return state


def full_draft(target: WhisperForConditionalGeneration, noise: float = 0.2, seed: int = 1):
    """A smaller full Whisper with its own encoder: the target's encoder and first decoder layer, plus noise."""
    draft = WhisperForConditionalGeneration(whisper_config(decoder_layers=1)).eval()
    draft.model.encoder.load_state_dict(copy.deepcopy(target.model.encoder.state_dict()))
    draft.model.decoder.load_state_dict(_decoder_state(target, [0]))
    draft.generation_config = copy.deepcopy(target.generation_config)
    return _add_noise(draft, noise, seed)


def causal_draft(target: WhisperForConditionalGeneration, noise: float = 0.2, seed: int = 2):
    """A decoder-only WhisperForCausalLM reading the target's encoder outputs: the target's first and last decoder
    layers plus noise (distil-whisper's initialisation)."""
    last = target.config.decoder_layers - 1
    draft = WhisperForCausalLM(whisper_config(decoder_layers=2)).eval()
    draft.model.decoder.load_state_dict(_decoder_state(target, [0, last]))
    draft.generation_config = copy.deepcopy(target.generation_config)
    return _add_noise(draft, noise, seed)


def features(batch_size: int, seed: int = 0) -> torch.Tensor:
    """``(B, MELS, FRAMES)`` random log-mel-like features."""
    return torch.randn(batch_size, MELS, FRAMES, generator=torch.Generator().manual_seed(seed))
