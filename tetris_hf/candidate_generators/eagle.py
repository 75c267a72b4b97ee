"""EAGLE draft heads (EAGLE-1 and EAGLE-3) loaded from their published checkpoints, runnable like a causal LM.

:class:`EagleDraft` (``from_pretrained``, ``for_target``, ``save_pretrained``) drafts from the target's hidden states
("features") and returns logits over the target's vocabulary. Notation (``hs``, ``H``, ``L``, ``V``), alignment, both
versions' formulas and which layers EAGLE-3 reads: docs/design.md, section "EAGLE heads".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.utils import ModelOutput, cached_file

from ..attention import base_implementation
from ..checks import output_vocab_size
from ..kv import select_features

EAGLE1, EAGLE3 = "eagle1", "eagle3"
CONFIG_NAME = "config.json"
WEIGHTS_NAMES = ("model.safetensors", "pytorch_model.bin")
# Checkpoint tensor-name prefixes of the decoder layer, and the name of that layer here (``EagleDraft.layer``).
LAYER_PREFIXES = {EAGLE1: "layers.0.", EAGLE3: "midlayer."}
AUX_IDS_FIELD = "eagle_config.eagle_aux_hidden_state_layer_ids"
# config.json fields copied from a target's config that the head's one Llama layer does not follow (the reference code
# builds the same full-attention layer whatever they say).
TARGET_ONLY_FIELDS = ("model_type", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
                      "torch_dtype", "dtype")


@dataclass
class EagleOutput(ModelOutput):
    """What :meth:`EagleDraft.forward` returns: ``logits`` ``(B, K, V)`` over the target's vocabulary (``-inf``
    outside a reduced draft vocabulary), ``features`` ``(B, L, H)`` the head's output at every block position (the next
    drafted token's ``draft_features``), the cache it wrote to, and ``hidden_states``, numbered as transformers numbers
    a model's: the layer's input ``h`` and its output (``features``, index :data:`HEAD_OUTPUT`)."""

    logits: torch.Tensor | None = None
    features: torch.Tensor | None = None
    past_key_values: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


# the head's output among its hidden states, as SlotCache.forward(head, ..., hidden_states=HEAD_OUTPUT) returns it
HEAD_OUTPUT = (1,)


@dataclass
class _Borrowed:
    """The target's modules the head uses without owning them (kept out of the head's parameters and state dict, so
    ``head.to(...)`` never moves the target's)."""

    embed_tokens: nn.Module | None = None
    lm_head: nn.Module | None = None


class EagleDraft(nn.Module):
    """An EAGLE-1 or EAGLE-3 head on a target model. Build it with :meth:`from_pretrained` (or :meth:`for_target`).

    Attributes: ``feature_kind`` (``"eagle1"`` or ``"eagle3"``); ``aux_layer_ids``, the target hidden states read, in
    ``hs`` indices, concatenated in this order; ``feature_size`` F; ``config``, the head's ``LlamaConfig``
    (``vocab_size`` the target's ``V``).
    """

    def __init__(self, config: LlamaConfig, kind: str, aux_layer_ids: tuple[int, ...], feature_size: int,
                 fc_bias: bool, qkv_bias: bool, draft_vocab_size: int, own_embedding: bool):
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.feature_kind = kind
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.feature_size = feature_size
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = draft_vocab_size
        self._borrowed = _Borrowed()
        self.register_buffer("target_ids", None, persistent=False)  # (Vd,) target id of each draft id, reduced vocab
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(2 * hidden if kind == EAGLE1 else feature_size, hidden, bias=fc_bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        attention = layer.self_attn
        attention_input = hidden if kind == EAGLE1 else 2 * hidden  # EAGLE-3 attends over cat(embedding, feature)
        for name in ("q_proj", "k_proj", "v_proj"):
            rows = getattr(attention, name).out_features
            setattr(attention, name, nn.Linear(attention_input, rows, bias=qkv_bias))
        if kind == EAGLE1:
            layer.input_layernorm = nn.Identity()  # the first (and only) EAGLE-1 layer has no input norm
        else:
            layer.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.layer = layer
        self.rotary_emb: LlamaRotaryEmbedding | None = None  # built on the head's device once the weights are in

    # -- loading -----------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, target: nn.Module,
                        aux_layer_ids: tuple[int, ...] | list[int] | None = None, revision: str | None = None,
                        cache_dir: str | os.PathLike | None = None, local_files_only: bool | None = None,
                        token: str | bool | None = None) -> "EagleDraft":
        """Load a published EAGLE-1 or EAGLE-3 head for ``target``, on its device and in its dtype, from a folder or a
        Hub repo (``revision``, ``cache_dir``, ``local_files_only``, ``token`` as in transformers); the embedding is
        the checkpoint's, else the target's (shared). ``aux_layer_ids`` (EAGLE-3 only): ``hs`` indices to read in
        place of the config's.

        Raises ValueError before anything runs, naming the field: sizes or a vocabulary that differ from the target's,
        ``d2t`` entries outside it, layer ids it does not have, missing or misshapen tensors, an unreadable file.
        """
        hub = {name: value for name, value in dict(revision=revision, cache_dir=cache_dir,
                                                   local_files_only=local_files_only, token=token).items()
               if value is not None}
        config_dict, tensors, source = read_checkpoint(path_or_repo_id, **hub)
        return cls.from_state_dict(config_dict, tensors, target, aux_layer_ids=aux_layer_ids, source=source)

    @classmethod
    def from_state_dict(cls, config_dict: dict, tensors: dict[str, torch.Tensor], target: nn.Module,
                        aux_layer_ids=None, source: str = "the checkpoint") -> "EagleDraft":
        """:meth:`from_pretrained` on a config dict and tensors already read (published names)."""
        kind = checkpoint_kind(tensors, source)
        target_config = target.config.get_text_config(decoder=True)
        target_hidden, target_layers = target_config.hidden_size, target_config.num_hidden_layers
        target_vocab = output_vocab_size(target)
        check_config(config_dict, kind, target_hidden, target_vocab, source)
        if kind == EAGLE1:
            if aux_layer_ids is not None:
                raise ValueError("`aux_layer_ids` applies to EAGLE-3 heads only: an EAGLE-1 head reads the target's "
                                 f"last hidden state (hs[{target_layers}]); drop the argument")
            aux = (target_layers,)
        else:
            aux = resolve_aux_layer_ids(config_dict, aux_layer_ids, target_layers, source)
        feature_size = target_hidden * len(aux)
        own_embedding = "embed_tokens.weight" in tensors
        if not own_embedding and config_dict["hidden_size"] != target_hidden:
            raise ValueError(f"{source}: the head's `hidden_size` ({config_dict['hidden_size']}) differs from the "
                             f"target's ({target_hidden}) and the checkpoint has no `embed_tokens.weight`, so the "
                             "target's embedding cannot be used; load a head that ships its embedding")
        config = head_config(config_dict, tensors, kind, target_vocab, target_config, source)
        draft_vocab = int(tensors["lm_head.weight"].shape[0]) if "lm_head.weight" in tensors else target_vocab
        fc_bias = bool(config_dict.get("bias", True)) if kind == EAGLE1 else False  # the reference's default: true
        qkv_bias = bool(config_dict.get("qkv_bias", False)) if kind == EAGLE1 else False
        with torch.device("meta"):  # no random initialisation: every weight comes from the checkpoint
            head = cls(config, kind, aux, feature_size, fc_bias, qkv_bias, draft_vocab, own_embedding)
        state = checkpoint_state(head, tensors, kind, source, bias_field="bias" in config_dict)
        target_ids = draft_to_target(tensors, draft_vocab, target_vocab, source) if kind == EAGLE3 else None
        # -- every check passed: load --
        head.load_state_dict(state, strict=True, assign=True)
        embedding = target.get_input_embeddings()
        device, dtype = embedding.weight.device, target.dtype
        head.to(device=device, dtype=dtype)
        head.target_ids = None if target_ids is None else target_ids.to(device)
        head._borrowed = _Borrowed(embed_tokens=None if own_embedding else embedding,
                                   lm_head=target.get_output_embeddings() if kind == EAGLE1 else None)
        head.rotary_emb = LlamaRotaryEmbedding(config).to(device)  # float32 frequencies, like the target's
        return head.eval()

    @classmethod
    def for_target(cls, target: nn.Module, draft_vocab_ids: torch.Tensor | None = None,
                   aux_layer_ids: tuple[int, ...] | list[int] | None = None) -> "EagleDraft":
        """A fresh EAGLE-3 head for ``target``, to be trained, built through :meth:`from_state_dict` (so it is what
        :meth:`save_pretrained` then :meth:`from_pretrained` give back). Random layer and ``fc`` (seed the global RNG
        first); ``lm_head`` the target's output rows, ``norm`` the scale of its final norm.

        Args:
            draft_vocab_ids: ``(Vd,)`` distinct target token ids the head scores; ``None``: the whole vocabulary.
            aux_layer_ids: ``hs`` indices of the three target hidden states to read (default ``(2, L // 2, L - 3)``).

        Raises ValueError for token ids out of range, repeated or empty, and layer ids the target does not have.
        """
        target_config = target.config.get_text_config(decoder=True)
        hidden, layers = target_config.hidden_size, target_config.num_hidden_layers
        vocab = output_vocab_size(target)
        source = "EagleDraft.for_target"
        aux = resolve_aux_layer_ids({}, (2, layers // 2, layers - 3) if aux_layer_ids is None else aux_layer_ids,
                                    layers, source)
        target_ids = _draft_vocab_ids(draft_vocab_ids, vocab, source)
        draft_vocab = target_ids.numel()
        config_dict = {**_llama_fields(target_config, "LlamaForCausalLMEagle3", vocab),
                       **_eagle3_fields(draft_vocab, hidden, aux)}
        config = head_config(config_dict, {}, EAGLE3, vocab, target_config, source)
        with torch.device("cpu"):
            fresh = cls(config, EAGLE3, aux, 3 * hidden, False, False, draft_vocab, own_embedding=False).float()
        tensors = {_published_name(name, EAGLE3): tensor.detach() for name, tensor in fresh.state_dict().items()}
        output = target.get_output_embeddings()
        if output is not None and tuple(output.weight.shape) == (vocab, hidden):
            tensors["lm_head.weight"] = output.weight.detach().float().cpu()[target_ids].clone()
        norm = getattr(target.get_decoder(), "norm", None)
        if isinstance(getattr(norm, "weight", None), torch.Tensor) and tuple(norm.weight.shape) == (hidden,):
            with torch.no_grad():  # its output on a vector of ones: the scale whatever its convention (Gemma: 1 + w)
                ones = norm.weight.new_ones(1, hidden)
                tensors["norm.weight"] = norm(ones)[0].float().cpu()
        if draft_vocab < vocab:
            tensors.update(_vocab_map(target_ids, vocab))
        return cls.from_state_dict(config_dict, tensors, target, aux_layer_ids=aux, source=source)

    def save_pretrained(self, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> str:
        """Write the head in the published format :meth:`from_pretrained` reads (``config.json``,
        ``model.safetensors``; EAGLE-3 in SpecForge's layout). The target's embedding and head are not written.
        ``dtype``: of the weights written (default: the head's). Returns the directory."""
        eagle3 = self.feature_kind == EAGLE3
        fields = _llama_fields(self.config, "LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM", self.vocab_size)
        if eagle3:
            fields.update(_eagle3_fields(self.draft_vocab_size, self.feature_size // len(self.aux_layer_ids),
                                         self.aux_layer_ids))
        else:
            fields["bias"] = self.fc.bias is not None
            if self.layer.self_attn.q_proj.bias is not None:
                fields["qkv_bias"] = True
        fields["torch_dtype"] = str(dtype or self.dtype).removeprefix("torch.")
        tensors = {_published_name(name, self.feature_kind): tensor.detach().to("cpu", dtype or tensor.dtype)
                   .contiguous() for name, tensor in self.state_dict().items()}
        if eagle3 and self.target_ids is not None:
            tensors.update(_vocab_map(self.target_ids.to("cpu", torch.long), self.vocab_size))
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, CONFIG_NAME), "w", encoding="utf-8") as file:
            json.dump(fields, file, indent=2)
        save_file(tensors, os.path.join(directory, WEIGHTS_NAMES[0]), metadata={"format": "pt"})
        return os.fspath(directory)

    # -- the model surface (what SlotCache and the loop read) --------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens if self._borrowed.embed_tokens is None else self._borrowed.embed_tokens

    def get_output_embeddings(self) -> nn.Module | None:
        """The module whose rows are the logits' columns: the target's ``lm_head`` (EAGLE-1) or the head's own;
        ``None`` for a reduced draft vocabulary."""
        if self.feature_kind == EAGLE1:
            return self._borrowed.lm_head
        return self.lm_head if self.target_ids is None else None

    # -- forward -----------------------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Cache | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                target_features: torch.Tensor | None = None, draft_features: torch.Tensor | None = None,
                **kwargs) -> EagleOutput:
        """One block of head positions, batched (padding, holes and per-row positions in the mask and positions).

        Args:
            input_ids: ``(B, L)`` at head position ``j``, the token AFTER feature ``j``'s token.
            attention_mask: ``(B, cached + L)`` 2D mask of real tokens, or a prepared 4D mask; ``None``: causal.
            position_ids: ``(B, L)`` the features' positions; ``None``: counting on from the cache's length.
            past_key_values: the head's own cache (one layer), appended to unless ``use_cache`` is ``False``.
            logits_to_keep: as transformers' ``slice_logits_to_keep`` reads it (0: every position).
            target_features: ``(B, L, F)`` the target's features (context and accepted tokens), or
            draft_features: ``(B, L, H)`` the head's own output at the previous positions (drafted tokens); exactly
                one of the two.

        Returns:
            :class:`EagleOutput`: ``logits`` ``(B, K, V)`` over the target's vocabulary, ``features`` ``(B, L, H)``.
        """
        h, attention_input = self._inputs(input_ids, target_features, draft_features)
        cache = past_key_values if use_cache is not False else None
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=h.device)[None].expand(
                input_ids.shape[0], -1)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=attention_mask,
                                  past_key_values=cache, position_ids=position_ids)
        position_embeddings = self.rotary_emb(h, position_ids)
        # (the loop's attention arguments, e.g. a packed read's packing, as transformers hands a forward's down)
        attention_arguments = {name: value for name, value in kwargs.items() if name.startswith("tetris_")}
        attended, _ = self.layer.self_attn(hidden_states=attention_input, position_embeddings=position_embeddings,
                                           attention_mask=mask, past_key_values=cache, **attention_arguments)
        h1 = h + attended
        out = h1 + self.layer.mlp(self.layer.post_attention_layernorm(h1))  # (B, L, H)
        kept = slice_logits_to_keep(out, logits_to_keep)
        return EagleOutput(logits=self.logits(kept), features=out, past_key_values=past_key_values,
                           hidden_states=(h, out))

    def _inputs(self, input_ids: torch.Tensor, target_features: torch.Tensor | None,
                draft_features: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``h`` ``(B, L, H)`` and the attention input (``(B, L, H)`` EAGLE-1, ``(B, L, 2H)``
        EAGLE-3)."""
        if (target_features is None) == (draft_features is None):
            raise ValueError("pass exactly one of `target_features` (the target's, for context and accepted tokens) "
                             "and `draft_features` (the head's own output, for drafted tokens)")
        embedded = self.get_input_embeddings()(input_ids).to(self.dtype)  # (B, L, H)
        if target_features is not None:
            check_width("target_features", target_features, self.feature_size, input_ids)
            features, real = target_features.to(self.dtype), True
        else:
            check_width("draft_features", draft_features, self.config.hidden_size, input_ids)
            features, real = draft_features.to(self.dtype), False
        if self.feature_kind == EAGLE1:  # every position: fc(cat(embedding, feature)); the layer has no input norm
            h = self.fc(torch.cat([embedded, features], dim=-1))
            return h, h
        # a real position: fc(cat3); a drafted one: the previous output as it is
        h = self.fc(features) if real else features
        layer = self.layer
        return h, torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(h)], dim=-1)  # (B, L, 2H)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` head outputs -> ``(..., V)`` logits over the target's vocabulary."""
        if self.feature_kind == EAGLE1:
            return self._borrowed.lm_head(out)
        draft = self.lm_head(self.norm(out))  # (..., Vd)
        if self.target_ids is None:
            return draft
        full = draft.new_full((*draft.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.target_ids, draft)

    def probe_forward(self, num_ids: int) -> "TokenFeatureCall":
        """The head called with features made from its tokens (a fixed random row per id below ``num_ids``), as
        :func:`~tetris_hf.packed_probe.packs_exactly` reads it."""
        return TokenFeatureCall(self, num_ids)

    def target_features(self, outputs) -> torch.Tensor:
        """``(B, T, F)`` this head's features from a target forward run with
        ``output_hidden_states=list(head.aux_layer_ids)``."""
        return select_features(outputs.hidden_states, self.aux_layer_ids)



class TokenFeatureCall:
    """:meth:`EagleDraft.probe_forward`'s callable; attributes as the head's."""

    def __init__(self, head: EagleDraft, num_ids: int):
        self._head = head
        generator = torch.Generator().manual_seed(0)
        self._table = torch.randn(num_ids, head.feature_size, generator=generator).to(head.device, head.dtype)

    def __call__(self, **kwargs):
        return self._head.forward(**kwargs, target_features=self._table[kwargs["input_ids"]])

    def __getattr__(self, name: str):
        return getattr(self._head, name)


# -- reading and validating checkpoints ------------------------------------------------------------------------------


def read_checkpoint(path_or_repo_id, **hub) -> tuple[dict, dict[str, torch.Tensor], str]:
    """``config.json`` as a dict, the tensors (CPU, as stored) and the weights file's name; ``hub``: transformers'
    ``revision``, ``cache_dir``, ``local_files_only``, ``token``."""
    path_or_repo_id = os.fspath(path_or_repo_id)
    config_path = cached_file(path_or_repo_id, CONFIG_NAME, _raise_exceptions_for_missing_entries=False, **hub)
    if config_path is None:
        raise ValueError(f"{path_or_repo_id}: no {CONFIG_NAME}; an EAGLE head folder holds {CONFIG_NAME} and one of "
                         f"{', '.join(WEIGHTS_NAMES)}")
    try:
        with open(config_path, encoding="utf-8") as file:
            config_dict = json.load(file)
    except (OSError, ValueError) as error:
        raise ValueError(f"{config_path} is not readable JSON ({error}); download it again") from error
    for name in WEIGHTS_NAMES:
        weights_path = cached_file(path_or_repo_id, name, _raise_exceptions_for_missing_entries=False, **hub)
        if weights_path is not None:
            return config_dict, load_tensors(weights_path), weights_path
    raise ValueError(f"{path_or_repo_id}: no weights file; an EAGLE head folder holds one of "
                     f"{', '.join(WEIGHTS_NAMES)}")


def load_tensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` or ``.bin`` file; ``ValueError`` for a truncated or corrupt one."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors = load_file(path, device="cpu")
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors, zip and unpickling errors have no common type
        raise ValueError(f"cannot read the weights file {path}: it is truncated or corrupt ({type(error).__name__}: "
                         f"{error}); download it again") from error
    if not isinstance(tensors, dict) or not all(isinstance(value, torch.Tensor) for value in tensors.values()):
        raise ValueError(f"the weights file {path} does not hold a flat {{name: tensor}} state dict")
    return tensors


def checkpoint_kind(tensors: dict[str, torch.Tensor], source: str) -> str:
    """``"eagle3"`` (``midlayer.*`` tensors) or ``"eagle1"`` (``layers.0.*``)."""
    if any(name.startswith(LAYER_PREFIXES[EAGLE3]) for name in tensors):
        return EAGLE3
    if any(name.startswith(LAYER_PREFIXES[EAGLE1]) for name in tensors):
        extra = sorted({name.split(".")[1] for name in tensors if name.startswith("layers.")} - {"0"})
        if extra:
            raise ValueError(f"{source}: tensors of layers {extra} besides layer 0; tetris_hf reads one-layer EAGLE "
                             "heads (`num_hidden_layers: 1`)")
        return EAGLE1
    raise ValueError(f"{source}: neither `midlayer.*` (EAGLE-3) nor `layers.0.*` (EAGLE-1) tensors, so this is not an "
                     f"EAGLE head checkpoint (tensors: {sorted(tensors)[:8]}...)")


def check_config(config_dict: dict, kind: str, target_hidden: int, target_vocab: int, source: str) -> None:
    """The head's config.json against the target: sizes, vocabulary, one layer."""
    for field in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if not isinstance(config_dict.get(field), int):
            raise ValueError(f"{source}: config.json has no integer `{field}`; an EAGLE head's config is a Llama "
                             "config (see the trainer's config.json)")
    if config_dict.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{source}: config.json says `num_hidden_layers: {config_dict['num_hidden_layers']}`; "
                         "tetris_hf reads one-layer EAGLE heads, whose config says 1")
    field = "target_hidden_size" if kind == EAGLE3 and "target_hidden_size" in config_dict else "hidden_size"
    if config_dict[field] != target_hidden:
        raise ValueError(f"{source}: the head's `{field}` ({config_dict[field]}) differs from the target's hidden "
                         f"size ({target_hidden}): it was trained for another target; load the head made for this "
                         "model")
    vocab = config_dict.get("vocab_size")
    if vocab != target_vocab:
        raise ValueError(f"{source}: the head's `vocab_size` ({vocab}) differs from the target's vocabulary "
                         f"({target_vocab} logits): it was trained for another tokenizer; load the head made for this "
                         "model")


def resolve_aux_layer_ids(config_dict: dict, explicit, num_layers: int, source: str) -> tuple[int, ...]:
    """The EAGLE-3 head's target hidden states in ``hs`` indices (``explicit``, else the config's output-of-layer
    ids plus one, else the default), each the input of one of the target's ``num_layers`` layers."""
    if explicit is not None:
        ids, field = tuple(int(index) for index in explicit), "aux_layer_ids"
        shown = ids
    else:
        eagle_config = config_dict.get("eagle_config") or {}
        if eagle_config.get("use_aux_hidden_state") is False:
            raise ValueError(f"{source}: `eagle_config.use_aux_hidden_state` is false: this head reads the "
                             "target's last hidden state only, a variant tetris_hf does not load (use an EAGLE-3 head "
                             "that reads three layers, or an EAGLE-1 head)")
        configured = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if configured is not None:
            field, shown = AUX_IDS_FIELD, tuple(configured)
            ids = tuple(int(index) + 1 for index in configured)  # SpecForge/SGLang: output of layer k = hs[k + 1]
        else:
            field = "the default (2, L // 2, L - 3)"
            ids = shown = (2, num_layers // 2, num_layers - 3)
    if len(ids) != 3:
        raise ValueError(f"{source}: {field} names {len(ids)} layers {shown}; an EAGLE-3 head reads 3 (its fc takes "
                         "3 x hidden_size)")
    bad = [index for index in ids if not 0 <= index < num_layers]
    if bad:
        raise ValueError(f"{source}: {field} {shown} needs hidden states hs{list(ids)} (layer inputs), but the target "
                         f"has {num_layers} decoder layers (hs[0] .. hs[{num_layers - 1}] are layer inputs): this head "
                         "was made for a deeper target; load the head made for this model, or pass `aux_layer_ids=`")
    return ids


def head_config(config_dict: dict, tensors: dict, kind: str, target_vocab: int, target_config,
                source: str) -> LlamaConfig:
    """The head's ``LlamaConfig``: config.json's fields, one layer, the target's vocabulary and attention
    implementation, and the head size the attention weights have."""
    fields = {name: value for name, value in config_dict.items()
              if not name.startswith("_") and name not in TARGET_ONLY_FIELDS}
    fields.update(num_hidden_layers=1, vocab_size=target_vocab, attention_bias=False, mlp_bias=False)
    q_name = LAYER_PREFIXES[kind] + "self_attn.q_proj.weight"
    heads = config_dict["num_attention_heads"]
    if q_name in tensors:
        rows = int(tensors[q_name].shape[0])
        if rows % heads:
            raise ValueError(f"{source}: `{q_name}` has {rows} rows, not a multiple of `num_attention_heads` "
                             f"({heads}); the config does not describe these weights")
        fields["head_dim"] = rows // heads  # the reference uses hidden_size // heads; the weights say which
    config = LlamaConfig(**fields)
    config._attn_implementation = base_implementation(getattr(target_config, "_attn_implementation", None) or "sdpa")
    return config


def checkpoint_state(head: EagleDraft, tensors: dict[str, torch.Tensor], kind: str, source: str,
                     bias_field: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the head's parameter names, every one present and of the right shape
    (``bias_field``: config.json has a ``bias`` key, for the message)."""
    published = {_published_name(name, kind): name for name in head.state_dict()}  # published name -> head name
    missing = [name for name in published if name not in tensors]
    if missing:
        hint = ""
        if "fc.bias" in missing:
            hint = (" (config.json has no `\"bias\": false`, and the reference code then gives fc a bias; set "
                    "`\"bias\": false` if this head has none)" if not bias_field else
                    " (config.json says `\"bias\": true`; set it to false if this head's fc has no bias)")
        unexpected = sorted(set(tensors) - set(published) - {"d2t", "t2d"})
        others = f"; it has tensors the {kind} format does not name: {unexpected[:8]}" if unexpected else ""
        raise ValueError(f"{source}: missing tensors {missing}{hint}{others}")
    own = head.state_dict()
    state = {}
    for name, head_name in published.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(own[head_name].shape):
            raise ValueError(f"{source}: `{name}` has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(own[head_name].shape)} from config.json and the target; the config does not "
                             "describe these weights (or the head was made for another target)")
        if not tensor.is_floating_point():
            raise ValueError(f"{source}: `{name}` holds {tensor.dtype} values; weights are floating point")
        state[head_name] = tensor
    return state


def draft_to_target(tensors: dict[str, torch.Tensor], draft_vocab: int, target_vocab: int,
                    source: str) -> torch.Tensor | None:
    """``(Vd,)`` the target id of each draft id (``i + d2t[i]``), validated; ``None`` for the target's vocabulary."""
    if draft_vocab == target_vocab:
        return None
    if draft_vocab > target_vocab:
        raise ValueError(f"{source}: `lm_head.weight` has {draft_vocab} rows, more than the target's {target_vocab} "
                         "tokens; a draft vocabulary is a subset of the target's")
    d2t = tensors.get("d2t")
    if d2t is None:
        raise ValueError(f"{source}: the draft vocabulary ({draft_vocab} rows of `lm_head.weight`) is smaller than the "
                         f"target's ({target_vocab}) but there is no `d2t` tensor mapping draft ids to target ids")
    if d2t.dim() != 1 or d2t.shape[0] != draft_vocab or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"{source}: `d2t` must be ({draft_vocab},) integers (one offset per draft id), got shape "
                         f"{tuple(d2t.shape)} and dtype {d2t.dtype}")
    target_ids = torch.arange(draft_vocab) + d2t.long()
    outside = ((target_ids < 0) | (target_ids >= target_vocab)).nonzero().flatten()
    if outside.numel():
        first = int(outside[0])
        raise ValueError(f"{source}: `d2t` maps {outside.numel()} draft ids outside the target's vocabulary of "
                         f"{target_vocab} (e.g. draft id {first} + d2t {int(d2t[first])} = {int(target_ids[first])}); "
                         "the head was made for another tokenizer")
    if torch.unique(target_ids).numel() != draft_vocab:
        raise ValueError(f"{source}: `d2t` maps several draft ids to one target id; the mapping is corrupt")
    t2d = tensors.get("t2d")
    if t2d is not None:
        t2d = t2d.bool()
        if t2d.shape != (target_vocab,) or int(t2d.sum()) != draft_vocab or not bool(t2d[target_ids].all()):
            raise ValueError(f"{source}: `t2d` (which target ids are in the draft vocabulary) disagrees with `d2t`; "
                             "the checkpoint is inconsistent")
    return target_ids


def is_eagle_head(model: nn.Module) -> bool:
    """Whether ``model`` is an :class:`EagleDraft`, whichever copy of this module defined its class (told by its
    ``feature_kind``)."""
    return getattr(model, "feature_kind", None) in (EAGLE1, EAGLE3) and hasattr(model, "aux_layer_ids")


def check_width(name: str, features: torch.Tensor, width: int, input_ids: torch.Tensor) -> None:
    if features.shape != (*input_ids.shape, width):
        raise ValueError(f"`{name}` has shape {tuple(features.shape)}, expected {(*input_ids.shape, width)} "
                         "(input_ids' shape plus the feature width)")


# -- writing checkpoints (EagleDraft.for_target, EagleDraft.save_pretrained) ----------------------------------------


def _published_name(name: str, kind: str) -> str:
    """A head parameter's name in the published checkpoint (``layer.*`` -> ``midlayer.*`` / ``layers.0.*``)."""
    return LAYER_PREFIXES[kind] + name[len("layer."):] if name.startswith("layer.") else name


def _rope_fields(rope: dict | None) -> dict:
    """transformers' ``rope_parameters`` as published ``rope_theta`` (and ``rope_scaling`` for a scaled RoPE)."""
    if not isinstance(rope, dict):
        return {}
    rope = rope.get("full_attention", rope)
    fields = {"rope_theta": rope["rope_theta"]} if rope.get("rope_theta") is not None else {}
    if rope.get("rope_type", "default") != "default":
        fields["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    return fields


def _draft_vocab_ids(draft_vocab_ids: torch.Tensor | None, vocab: int, source: str) -> torch.Tensor:
    """``(Vd,)`` the sorted target ids a fresh head scores (every id for ``None``), validated."""
    if draft_vocab_ids is None:
        return torch.arange(vocab)
    target_ids = torch.as_tensor(draft_vocab_ids).detach().to("cpu").flatten()
    if target_ids.is_floating_point() or target_ids.dtype == torch.bool or target_ids.numel() == 0:
        raise ValueError(f"{source}: `draft_vocab_ids` must be a non-empty 1-D tensor of token ids, got "
                         f"{target_ids.numel()} values of dtype {target_ids.dtype}")
    target_ids = target_ids.long().sort().values
    if int(target_ids[0]) < 0 or int(target_ids[-1]) >= vocab:
        raise ValueError(f"{source}: `draft_vocab_ids` holds ids outside the target's vocabulary of {vocab} "
                         f"(min {int(target_ids[0])}, max {int(target_ids[-1])})")
    if torch.unique(target_ids).numel() != target_ids.numel():
        raise ValueError(f"{source}: `draft_vocab_ids` repeats token ids; give each once")
    return target_ids


def _llama_fields(config, architecture: str, vocab: int) -> dict:
    """The published ``config.json`` fields of a one-layer head with ``config``'s sizes (a target's, or the head's
    own ``LlamaConfig``) scoring ``vocab`` target tokens."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    return {
        "architectures": [architecture], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": config.intermediate_size, "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or hidden // heads,
        "hidden_act": getattr(config, "hidden_act", "silu"), "rms_norm_eps": getattr(config, "rms_norm_eps", 1e-6),
        "max_position_embeddings": config.max_position_embeddings,
        **_rope_fields(getattr(config, "rope_parameters", None)), "num_hidden_layers": 1, "vocab_size": vocab,
        "tie_word_embeddings": False,
        **{name: getattr(config, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(config, name, None) is not None},
    }


def _eagle3_fields(draft_vocab: int, target_hidden: int, aux: tuple[int, ...]) -> dict:
    """An EAGLE-3 head's own config.json fields; ``aux`` in ``hs`` indices, written as SpecForge's output-of-layer ids
    (``hs[k]`` is id ``k - 1``)."""
    return {"draft_vocab_size": draft_vocab, "target_hidden_size": target_hidden,
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": [index - 1 for index in aux]}}


def _vocab_map(target_ids: torch.Tensor, vocab: int) -> dict[str, torch.Tensor]:
    """``d2t`` ``(Vd,)`` int64 (draft id + ``d2t[draft id]`` = target id) and ``t2d`` ``(V,)`` bool of the sorted
    ``target_ids`` ``(Vd,)``."""
    return {"d2t": target_ids - torch.arange(target_ids.numel()),
            "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, target_ids, True)}
