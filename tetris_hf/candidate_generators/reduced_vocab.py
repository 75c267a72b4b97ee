"""Reduced-vocabulary drafts (``tetris_draft_vocab=``, FR-Spec): :class:`ReducedVocabDraft` wraps a causal LM so that
its head scores ``N`` chosen tokens only, every other token ``-inf``; :func:`reduced_vocab_draft` picks the subset (an
int ``N`` from the draft's frequency table, :func:`attach_token_counts`, or token ids). Design and why it is lossless:
docs/design.md, section "Reduced-vocabulary drafts".
"""

from __future__ import annotations

import copy
import hashlib
import math

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from ..checks import output_vocab_size
from ..options import check_draft_vocab_spec

TOKEN_COUNTS_ATTRIBUTE = "tetris_token_counts"  # (V,) int64 on the draft model: how often each token was seen
TOKEN_COUNTS_SOURCE_ATTRIBUTE = "tetris_token_counts_source"  # one line saying what was counted
_WRAPPERS_ATTRIBUTE = "_tetris_reduced_vocab_drafts"  # {subset digest: ReducedVocabDraft} cached on the draft


def token_counts(tokenizer, texts, vocab_size: int) -> torch.Tensor:
    """``(vocab_size,)`` int64: how often each token id occurs in ``texts`` tokenized (no special tokens added)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    texts = list(texts)
    for start in range(0, len(texts), 256):
        for ids in tokenizer(texts[start : start + 256], add_special_tokens=False)["input_ids"]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


def attach_token_counts(model: nn.Module, counts: torch.Tensor, source: str) -> None:
    """Give ``model`` the frequency table ``tetris_draft_vocab=N`` picks its ``N`` tokens from: ``counts`` ``(V,)``
    non-negative, ``V`` the model's output vocabulary; ``source`` says what was counted."""
    vocab = output_vocab_size(model)
    if counts.dim() != 1 or counts.shape[0] != vocab:
        raise ValueError(f"token counts must have shape ({vocab},) for this model, got {tuple(counts.shape)}")
    setattr(model, TOKEN_COUNTS_ATTRIBUTE, counts.detach().to("cpu", torch.long))
    setattr(model, TOKEN_COUNTS_SOURCE_ATTRIBUTE, source)
    model.__dict__.pop(_WRAPPERS_ATTRIBUTE, None)  # subsets chosen from the old table are stale


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``counts`` ``(V,)``, ties broken by the lower id; ``(size,)`` sorted."""
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values


def resolve_token_ids(model: nn.Module, spec) -> torch.Tensor:
    """The token ids ``spec`` (``tetris_draft_vocab``) names for ``model``: ``(N,)`` int64, sorted, on CPU. Raises
    ValueError for a bad subset or an int ``N`` for a draft that carries no frequency table."""
    check_draft_vocab_spec(spec)
    vocab = output_vocab_size(model)
    if isinstance(spec, torch.Tensor):
        if int(spec.max()) >= vocab:
            raise ValueError(f"`tetris_draft_vocab` holds token id {int(spec.max())}, out of range for the draft's "
                             f"{vocab}-token vocabulary")
        return spec.detach().to("cpu", torch.long).sort().values
    if spec > vocab:
        raise ValueError(f"`tetris_draft_vocab={spec}` is larger than the draft's vocabulary ({vocab} tokens)")
    counts = getattr(model, TOKEN_COUNTS_ATTRIBUTE, None)
    if counts is None:
        raise ValueError(
            f"`tetris_draft_vocab={spec}` picks the draft's {spec} most frequent tokens, but this draft carries no "
            "token frequency table: load a tetris-hf draft directory that ships one (`tetris-hf distill "
            "--draft-vocab N`), attach one with attach_token_counts(draft, token_counts(tokenizer, texts, vocab_size), "
            "source) from tetris_hf.candidate_generators.reduced_vocab, or pass the token ids as a 1-D tensor"
        )
    return most_frequent(counts, spec)


def _scaled(logits: torch.Tensor, config) -> torch.Tensor:
    """The element-wise post-processing transformers applies after the head (Gemma's final-logit soft-capping,
    Cohere's ``logit_scale``, Granite's ``logits_scaling``), the same on the subset as on the full vocabulary."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text_config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    scale = getattr(text_config, "logit_scale", None)
    if scale is not None and text_config.model_type.startswith("cohere"):
        logits = logits * scale
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling is not None and text_config.model_type.startswith("granite"):
        logits = logits / scaling
    return logits


class ReducedVocabDraft(nn.Module):
    """A causal LM whose head scores only ``token_ids``; every other token's logit is ``-inf``. Its forward takes what
    a causal LM's takes and runs the model's decoder, the subset's head rows (and bias), then the post-head scaling.

    ``model`` is not modified (the wrapper copies the ``N`` head rows, again when they change); ``token_ids``:
    ``(N,)`` distinct ids below ``V``; ``source``: where the subset came from, one line.
    """

    def __init__(self, model: nn.Module, token_ids: torch.Tensor, source: str = "given token ids"):
        super().__init__()
        self.model = model
        self.vocab_size = output_vocab_size(model)
        head = model.get_output_embeddings()
        self.register_buffer("token_ids", token_ids.to(head.weight.device, torch.long), persistent=False)
        self._head_version = None
        self._refresh_head()
        digest = hashlib.sha1(token_ids.cpu().numpy().tobytes()).hexdigest()[:12]
        # A config of its own, so that profiles and caches keyed by the config tell this draft from the full one.
        self.config = copy.deepcopy(model.config)
        self.config.tetris_draft_vocab = {"size": int(token_ids.numel()), "sha1": digest}
        self.generation_config = getattr(model, "generation_config", None)
        described = getattr(model, "tetris_description", type(model).__name__)
        self.tetris_description = f"{described}, head restricted to {token_ids.numel()} tokens ({source})"

    def _refresh_head(self) -> None:
        """Copy the subset's head rows (and bias) unless the head's weights are unchanged since the last copy."""
        head = self.model.get_output_embeddings()
        version = (head.weight.data_ptr(), head.weight._version)
        if version == self._head_version:
            return
        with torch.no_grad():
            self.head_weight = head.weight.index_select(0, self.token_ids).detach()  # (N, d)
            bias = getattr(head, "bias", None)
            self.head_bias = None if bias is None else bias.index_select(0, self.token_ids).detach()  # (N,)
        self._head_version = version

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep: int | torch.Tensor = 0, **kwargs) -> CausalLMOutputWithPast:
        """Returns ``.logits`` ``(B, L_kept, V)`` (``-inf`` outside the subset; ``L_kept`` per ``logits_to_keep``) and
        ``.past_key_values``."""
        self._refresh_head()
        outputs = self.model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache, **kwargs,
        )
        hidden = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)  # (B, L_kept, d)
        weight = self.head_weight.to(hidden.device)
        subset = hidden @ weight.T  # (B, L_kept, N)
        if self.head_bias is not None:
            subset = subset + self.head_bias.to(hidden.device)
        subset = _scaled(subset, self.model.config)
        logits = subset.new_full((*subset.shape[:-1], self.vocab_size), -math.inf)
        logits.index_copy_(-1, self.token_ids.to(subset.device), subset)
        return CausalLMOutputWithPast(logits=logits, past_key_values=outputs.past_key_values)

    @torch.no_grad()
    def check_against(self, tokens: int = 6) -> None:
        """Raise ValueError unless this wrapper's subset logits agree with the full model's on a short random
        sequence (a family whose head output is processed in a way :func:`_scaled` does not know)."""
        device = self.model.get_input_embeddings().weight.device
        generator = torch.Generator().manual_seed(0)
        probe = torch.randint(0, self.vocab_size, (1, tokens), generator=generator).to(device)
        expected = self.model(input_ids=probe, use_cache=False).logits.float()[..., self.token_ids.to(device)]
        got_full = self(input_ids=probe, use_cache=False).logits.float()
        got = got_full[..., self.token_ids.to(device)]
        half = self.model.dtype in (torch.float16, torch.bfloat16)
        tolerance = (2e-2 if half else 1e-4) * (1.0 + float(expected.abs().max()))
        outside = torch.ones(self.vocab_size, dtype=torch.bool, device=got_full.device)
        outside[self.token_ids.to(got_full.device)] = False
        agrees = torch.allclose(got, expected, rtol=0, atol=tolerance)
        if not agrees or not bool(torch.isneginf(got_full[..., outside]).all()):
            difference = float((got - expected).abs().max())
            raise ValueError(
                f"`tetris_draft_vocab` cannot restrict {type(self.model).__name__}'s head: its logits differ from the "
                f"full model's on the subset by {difference:.3g} (its forward post-processes the head output in a way "
                "tetris_hf does not reproduce); use the full vocabulary for this draft"
            )


def reduced_vocab_draft(model: nn.Module, spec) -> nn.Module:
    """``model`` itself when ``spec`` (``tetris_draft_vocab``) is ``None``, else its :class:`ReducedVocabDraft`, cached
    on the model per subset and checked once against the full model. Refusals come before any forward."""
    if spec is None:
        return model
    if isinstance(model, ReducedVocabDraft):
        raise ValueError("the draft already has a reduced vocabulary: pass the original model with tetris_draft_vocab")
    if getattr(model, "feature_kind", None) is not None:
        raise ValueError("`tetris_draft_vocab` reshapes a draft model's head; an EAGLE head carries its own draft "
                         "vocabulary (its d2t mapping): drop tetris_draft_vocab")
    token_ids = resolve_token_ids(model, spec)
    digest = hashlib.sha1(token_ids.numpy().tobytes()).hexdigest()
    cache = model.__dict__.setdefault(_WRAPPERS_ATTRIBUTE, {})
    if digest not in cache:
        if isinstance(spec, torch.Tensor):
            source = "given token ids"
        else:
            source = f"the {spec} most frequent in {getattr(model, TOKEN_COUNTS_SOURCE_ATTRIBUTE, 'its token counts')}"
        wrapper = ReducedVocabDraft(model, token_ids, source)
        wrapper.check_against()
        cache[digest] = wrapper
    return cache[digest]
