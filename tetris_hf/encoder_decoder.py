"""Encoder-decoder targets (Whisper) in the batched loop.

``target.generate(input_features, assistant_model=draft, custom_generate="tetris", ...)`` on a
``WhisperForConditionalGeneration`` reaches :func:`generate`; the loop decodes with each model's decoder seen as a
decoder-only causal LM (:class:`DecoderView`), each row attending to its own encoder outputs
(:mod:`tetris_hf.cross_attention`). Design and what is refused: docs/design.md, "Encoder-decoder targets (Whisper)".
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation.logits_process import SuppressTokensAtBeginLogitsProcessor
from transformers.generation.utils import GenerationMixin
from transformers.modeling_outputs import CausalLMOutput

from .candidate_generators.reduced_vocab import resolve_token_ids
from .checks import check_same_vocabulary
from .decoding import tetris_decoding
from .options import TetrisOptions, pop_options
from .outputs import TetrisGenerateOutput

WHISPER_TARGETS = ("WhisperForConditionalGeneration",)
WHISPER_DRAFTS = ("WhisperForConditionalGeneration", "WhisperForCausalLM")


def is_encoder_decoder(model: torch.nn.Module) -> bool:
    """The model has an encoder and a decoder (``config.is_encoder_decoder``)."""
    return bool(getattr(model.config, "is_encoder_decoder", False))


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the loop cannot serve the encoder-decoder ``model`` as a target (a sentence), or ``None`` (Whisper)."""
    name = type(model).__name__
    if name in WHISPER_TARGETS:
        return None
    model_type = getattr(model.config, "model_type", "")
    if model_type in ("t5", "mt5", "umt5", "longt5", "switch_transformers", "pop2piano", "udop"):
        return ("an encoder-decoder other than Whisper: T5-style decoders add a relative position bias computed "
                "from cache slot indices, not from the positions tetris_hf passes, so the holes rejected drafts "
                "leave would shift it (the missing piece: a position bias read from `position_ids`)")
    return (f"an encoder-decoder, and only Whisper ({', '.join(WHISPER_TARGETS)}) is wired so far; {name} would need "
            "a decoder view that takes per-row `position_ids` and a prepared 4D self-attention mask, and its "
            "cross-attention keys and values kept per row (tetris_hf.cross_attention), which is checked for Whisper "
            "only")


class DecoderView(torch.nn.Module):
    """An encoder-decoder's decoder and output head, seen as a decoder-only causal LM by the loop. The
    :class:`~tetris_hf.kv.SlotCache` that first runs the view turns :attr:`memory` into per-row cross-attention keys
    and values (:class:`~tetris_hf.cross_attention.CrossAttention`).

    Args:
        model: a ``WhisperForConditionalGeneration`` or a ``WhisperForCausalLM``.
        memory: ``(B, S, d)`` the encoder outputs this decoder attends to, one row per row of the call.
        head_ids: ``(N,)`` token ids the head scores (a draft's ``tetris_draft_vocab``; every other logit is
            ``-inf``), or ``None`` (the whole vocabulary).
    """

    def __init__(self, model: torch.nn.Module, memory: torch.Tensor, head_ids: torch.Tensor | None = None):
        super().__init__()
        self.model = model
        self.memory = memory
        self.head_ids = head_ids
        self.head_weight = None
        self.config = model.config
        if head_ids is not None:
            self.config = copy.deepcopy(model.config)  # its own, so cost profiles tell it from the full head
            self.config.tetris_draft_vocab = {"size": int(head_ids.numel()),
                                               "sha1": hashlib.sha1(head_ids.cpu().numpy().tobytes()).hexdigest()[:12]}
            weight = model.get_output_embeddings().weight
            self.head_ids = head_ids.to(weight.device)
            self.head_weight = weight.detach().index_select(0, self.head_ids)  # (N, d)
        self._timing_cache: tuple[object, DynamicCache] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def decoder(self) -> torch.nn.Module:
        return self.model.model.decoder

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask=None, position_ids: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = True, encoder_hidden_states: torch.Tensor | None = None,
                logits_to_keep: int = 0) -> CausalLMOutput:
        """Logits ``(B, L or logits_to_keep, V)`` of the block ``input_ids`` ``(B, L)``. ``past_key_values``: the
        slot cache's ``EncoderDecoderCache`` (with ``encoder_hidden_states``), or another cache (a cost profile's
        timing), given cross-attention over the first row's memory for every row."""
        if not isinstance(past_key_values, EncoderDecoderCache):
            past_key_values, encoder_hidden_states = self._timing_inputs(past_key_values, input_ids.shape[0])
        hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              encoder_hidden_states=encoder_hidden_states, past_key_values=past_key_values,
                              use_cache=True).last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        if self.head_weight is None:
            return CausalLMOutput(logits=self.model.get_output_embeddings()(hidden))
        subset = hidden @ self.head_weight.T  # (B, L, N): Whisper's head has no bias
        logits = subset.new_full((*subset.shape[:-1], self.config.vocab_size), -float("inf"))
        return CausalLMOutput(logits=logits.index_copy_(-1, self.head_ids, subset))

    def _timing_inputs(self, cache, rows: int) -> tuple[EncoderDecoderCache, torch.Tensor]:
        if self._timing_cache is None or self._timing_cache[0] is not cache:
            self._timing_cache = (cache, DynamicCache())
        cross = self._timing_cache[1]
        memory = self.memory[:1].expand(rows, -1, -1)
        if cross.get_seq_length() > 0:
            memory = memory[:, :0]
        return EncoderDecoderCache(cache, cross), memory


def check_encoder_decoder_pair(model: torch.nn.Module, assistant_model: torch.nn.Module | None,
                               options: TetrisOptions) -> None:
    """Refuse what the encoder-decoder loop does not do, naming the argument, before anything runs."""
    reason = unsupported_reason(model)
    if reason is not None:
        family = getattr(model.config, "model_type", None) or type(model).__name__
        raise ValueError(f"tetris_hf cannot use the target model {type(model).__name__} ({family}): {reason}")
    if assistant_model is None:
        raise ValueError("custom_generate='tetris' on Whisper needs a draft: pass `assistant_model=` (a smaller "
                         "WhisperForConditionalGeneration, or a WhisperForCausalLM that reads the target's encoder "
                         "outputs)")
    if type(assistant_model).__name__ not in WHISPER_DRAFTS:
        raise ValueError(f"`assistant_model` for a Whisper target must be one of {', '.join(WHISPER_DRAFTS)} (it must "
                         f"read the audio), got {type(assistant_model).__name__}")
    for name, value, default in (("prompt_lookup_num_tokens", options.prompt_lookup_num_tokens, None),
                                 ("tetris_suffix_num_tokens", options.tetris_suffix_num_tokens, None),
                                 ("tetris_tree_width", options.tetris_tree_width, 1),
                                 ("tetris_compile", options.tetris_compile, False)):
        if value != default and value is not None:
            raise ValueError(f"`{name}` is not supported with an encoder-decoder target yet (Whisper runs with a "
                             "draft model's chains); leave it unset")
    check_same_vocabulary(model, assistant_model)
    if type(assistant_model).__name__ == "WhisperForCausalLM":
        target_width, draft_width = model.config.d_model, assistant_model.config.d_model
        if target_width != draft_width:
            raise ValueError(f"the WhisperForCausalLM draft reads the target's encoder outputs (width {target_width}) "
                             f"but its cross-attention expects width {draft_width}: pass a full "
                             "WhisperForConditionalGeneration draft instead, or one made for this target")
    else:
        for field in ("num_mel_bins", "max_source_positions"):
            if getattr(model.config, field) != getattr(assistant_model.config, field):
                raise ValueError(f"the draft's encoder reads other features than the target's ({field} "
                                 f"{getattr(assistant_model.config, field)} vs {getattr(model.config, field)})")


def check_whisper_settings(generation_config, logits_processor) -> None:
    """Short-form Whisper only: refuse timestamps (and long-form audio, which needs them) and no-speech detection."""
    if generation_config is not None and getattr(generation_config, "return_timestamps", False):
        raise ValueError("`return_timestamps=True` (needed for long-form audio, over 30 s) is not supported by "
                         "custom_generate='tetris': timestamp tokens follow rules over each row's whole sequence "
                         "(WhisperTimeStampLogitsProcessor) that the batched loop does not apply per drafted position; "
                         "pass return_timestamps=False with audio of at most 30 s")
    if generation_config is not None and getattr(generation_config, "no_speech_threshold", None) is not None:
        raise ValueError("`no_speech_threshold` is not supported by custom_generate='tetris' (it reads the scores of "
                         "the whole batch's first step); leave it unset")
    for processor in logits_processor or []:
        name = type(processor).__name__
        if name in ("WhisperTimeStampLogitsProcessor", "WhisperNoSpeechDetection"):
            raise ValueError(f"{name} is not supported by custom_generate='tetris' (short-form, "
                             "return_timestamps=False only)")


def with_begin_suppression(model: torch.nn.Module, logits_processor, decoder_input_ids: torch.Tensor | None,
                           device: torch.device) -> list:
    """``logits_processor`` with the ``begin_suppress_tokens`` processor, which Whisper's ``generate`` drops whenever
    an ``assistant_model`` is passed, put back at ``begin_index`` = the decoder prompt's length as in plain decoding."""
    processors = list(logits_processor or [])
    tokens = getattr(model.generation_config, "begin_suppress_tokens", None)
    if not tokens or decoder_input_ids is None:
        return processors
    if any(isinstance(processor, SuppressTokensAtBeginLogitsProcessor) for processor in processors):
        return processors
    begin = SuppressTokensAtBeginLogitsProcessor(tokens, begin_index=decoder_input_ids.shape[-1], device=device)
    return [begin, *processors]


def generate(model: torch.nn.Module, *args, **kwargs):
    """:func:`tetris_hf.generation.generate` for an encoder-decoder target, reached from Whisper's ``generate``; hands
    over to :func:`encoder_decoder_decoding` after transformers' generic preparation.

    Args:
        model: a ``WhisperForConditionalGeneration``.
        *args, **kwargs: what Whisper's ``generate`` passes on: ``input_features`` ``(B, n_mels, frames)`` (first
            positional or ``inputs``), ``decoder_input_ids`` ``(B, P)``, ``logits_processor``, ``generation_config``,
            ``assistant_model`` and tetris_hf's options.

    Returns:
        ``(B, P + new)`` sequences (Whisper's ``generate`` then strips the decoder prompt), or a
        :class:`~tetris_hf.outputs.TetrisGenerateOutput` with ``return_dict_in_generate=True``.
    """
    assistant_model = kwargs.pop("assistant_model", None)
    streamer = kwargs.pop("streamer", None)
    kwargs.pop("custom_generate", None)
    options = dataclasses.replace(pop_options(kwargs), tetris_pack=False)  # a packed row would lose its memory
    check_encoder_decoder_pair(model, assistant_model, options)
    head_ids = None
    if options.tetris_draft_vocab is not None:  # the draft's view scores those tokens (not build_drafter's wrapper)
        head_ids = resolve_token_ids(assistant_model, options.tetris_draft_vocab)
        options = dataclasses.replace(options, tetris_draft_vocab=None)
    check_whisper_settings(kwargs.get("generation_config"), kwargs.get("logits_processor"))
    features = args[0] if args else kwargs.get("inputs", kwargs.get("input_features"))
    full_draft = type(assistant_model).__name__ != "WhisperForCausalLM"
    if full_draft and (features is None or not torch.is_tensor(features) or features.dim() != 3):
        raise ValueError("a full Whisper draft reads the audio itself: pass `input_features` of shape (batch_size, "
                         "num_mel_bins, frames), not only `encoder_outputs`")
    kwargs["logits_processor"] = with_begin_suppression(model, kwargs.get("logits_processor"),
                                                        kwargs.get("decoder_input_ids"), model.device)
    draft_memory = None
    if full_draft:  # its own encoder, once per row
        with torch.no_grad():
            draft_features = features.to(assistant_model.device, assistant_model.dtype)
            draft_memory = assistant_model.get_encoder()(draft_features).last_hidden_state
    decoding = functools.partial(encoder_decoder_decoding, assistant_model=assistant_model,
                                 draft_memory=draft_memory, options=options, streamer=streamer, head_ids=head_ids)
    return GenerationMixin.generate(model, *args, custom_generate=decoding, **kwargs)


@torch.no_grad()
def encoder_decoder_decoding(model: torch.nn.Module, input_ids: torch.LongTensor, logits_processor,
                             stopping_criteria, generation_config, *, assistant_model: torch.nn.Module,
                             draft_memory: torch.Tensor | None, options: TetrisOptions, streamer=None,
                             head_ids: torch.Tensor | None = None, **model_kwargs):
    """The batched loop on the two decoders, called by ``generate()`` after its preparation.

    Args:
        model: the target ``WhisperForConditionalGeneration``.
        input_ids: ``(B, P)`` the decoder prompts (start, language, task, no-timestamps tokens).
        logits_processor, stopping_criteria, generation_config: as ``generate()`` prepared them.
        assistant_model: the draft (a full Whisper or a ``WhisperForCausalLM``).
        draft_memory: ``(B0, S, d')`` the full draft's encoder outputs (``None``: the draft reads the target's); ``B0``
            divides ``B`` (``num_return_sequences`` copies each row).
        head_ids: ``(N,)`` the tokens the draft's head scores (``tetris_draft_vocab``), or ``None``.
        model_kwargs: ``encoder_outputs`` (the target's, ``(B, S, d)``), ``decoder_attention_mask`` ``(B, P)``.
    """
    encoder_outputs = model_kwargs.get("encoder_outputs")
    if encoder_outputs is None:
        raise ValueError("the encoder-decoder loop needs `encoder_outputs` from generate()'s preparation")
    memory = encoder_outputs[0] if not torch.is_tensor(encoder_outputs) else encoder_outputs
    batch_size = input_ids.shape[0]
    if draft_memory is None:
        draft_memory = memory.to(assistant_model.device, assistant_model.dtype)
    elif draft_memory.shape[0] != batch_size:  # num_return_sequences: rows repeated after the draft's encoder ran
        draft_memory = draft_memory.repeat_interleave(batch_size // draft_memory.shape[0], dim=0)
    target = DecoderView(model, memory)
    draft = DecoderView(assistant_model, draft_memory, head_ids)
    result = tetris_decoding(target, input_ids, logits_processor, stopping_criteria, generation_config,
                             assistant_model=draft, options=options, streamer=streamer,
                             attention_mask=model_kwargs.get("decoder_attention_mask"))
    if isinstance(result, TetrisGenerateOutput):  # Whisper splits the output by row and keeps the fields it knows:
        result = TetrisGenerateOutput(sequences=result.sequences)  # the statistics: `tetris_step_callback`'s loop
    return result
