"""The Space's models, loaded with transformers alone: a target by Hub id or folder, and a draft for it.

Drafts (``TETRIS_SPACE_DRAFT`` / ``--draft``):

- ``early-exit:N``: the target's first ``N`` layers, its final norm and its head (untrained; low acceptance);
- a draft in the tetris-hf draft format (``draft_config.json`` + ``draft.safetensors``, written by
  ``tetris-hf distill``), in a local folder or a Hub repository: a model of the target's class with the draft's own
  layers and final norm, sharing the target's embedding and head (same tensors, no copy);
- ``eagle:PATH_OR_REPO``: a published EAGLE-1 or EAGLE-3 head (one layer drafting from the target's own hidden
  states), loaded by the ``EagleDraft`` of the Space's own strategy copy (``strategy/custom_generate``); e.g. the head
  a tetris-hf checkout ships for SmolLM2-135M, ``eagle:tetris_hf/tools/assets/eagle-smollm2-135m``;
- anything else: a causal LM with the target's vocabulary, by Hub id or folder.

This mirrors ``tetris_hf.tools.models`` (the package's tools) for the draft kinds above, so the Space needs nothing but
transformers and its own files.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

DEFAULT_TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_DRAFT = "early-exit:4"
DRAFT_CONFIG_NAME = "draft_config.json"
DRAFT_WEIGHTS_NAME = "draft.safetensors"
DRAFT_FORMAT = "tetris-hf-draft"
EAGLE_PREFIX = "eagle:"
EAGLE_MODULE = Path(__file__).resolve().parent / "strategy" / "custom_generate" / "candidate_generators_eagle.py"
STRATEGY_PACKAGE = "space_strategy"  # the strategy copy's folder, as a package (see strategy_module)


def load_target(name_or_path: str, device: str):
    """``(model, tokenizer)`` by Hub id or local folder; model in eval mode on ``device``, tokenizer left-padding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32).to(device).eval()
    return model, tokenizer


def shared_head_draft(target, num_layers: int):
    """A model of the target's class with ``num_layers`` decoder layers whose embedding, rotary embedding and LM head
    *are* the target's; its layers and final norm are allocated on the target's device but not initialised."""
    decoder = target.model
    if not 1 <= num_layers <= target.config.num_hidden_layers:
        raise ValueError(f"a draft needs 1 to {target.config.num_hidden_layers} layers, got {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:num_layers])
    with torch.device("meta"):
        draft = type(target)(config)
    draft.model.embed_tokens, draft.model.rotary_emb, draft.lm_head = decoder.embed_tokens, decoder.rotary_emb, \
        target.lm_head
    weight = decoder.embed_tokens.weight
    draft.model.layers.to_empty(device=weight.device).to(weight.dtype)
    draft.model.norm.to_empty(device=weight.device).to(weight.dtype)
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def early_exit_draft(target, num_layers: int):
    """The target's first ``num_layers`` layers (copied), its final norm (copied) and its head (shared)."""
    draft = shared_head_draft(target, num_layers)
    with torch.no_grad():
        draft.model.layers.load_state_dict(target.model.layers[:num_layers].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    return draft


def tetris_draft_folder(name_or_path: str) -> Path | None:
    """The local folder of a tetris-hf format draft (downloaded when ``name_or_path`` is a Hub repository holding
    one), or ``None`` when ``name_or_path`` is something else."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local if (local / DRAFT_CONFIG_NAME).is_file() else None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        folder = Path(snapshot_download(name_or_path, allow_patterns=[DRAFT_CONFIG_NAME, DRAFT_WEIGHTS_NAME]))
    except HFValidationError:
        return None
    return folder if (folder / DRAFT_CONFIG_NAME).is_file() else None


def load_tetris_draft(target, folder: Path):
    """A draft in the tetris-hf draft format, attached to ``target``'s embedding and head."""
    from safetensors.torch import load_file

    config = json.loads((folder / DRAFT_CONFIG_NAME).read_text())
    if config.get("format") != DRAFT_FORMAT:
        raise ValueError(f"{folder / DRAFT_CONFIG_NAME} is not a {DRAFT_FORMAT} config")
    for key in ("model_type", "hidden_size", "vocab_size"):
        if getattr(target.config, key) != config["target"][key]:
            raise ValueError(f"the draft in {folder} was trained for a target with {key}={config['target'][key]!r}; "
                             f"this target has {getattr(target.config, key)!r}")
    draft = shared_head_draft(target, int(config["num_layers"]))
    tensors = load_file(str(folder / DRAFT_WEIGHTS_NAME))
    shared = {"model.embed_tokens.weight", "lm_head.weight"}
    own = {name: param for name, param in draft.named_parameters(remove_duplicate=False) if name not in shared}
    if set(tensors) != set(own):
        raise ValueError(f"the draft weights in {folder} do not fit a {config['num_layers']}-layer "
                         f"{target.config.model_type}: {sorted(set(tensors) ^ set(own))[:3]}")
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(tensors[name])  # cast to the target's dtype and device
    return draft


def load_eagle_head(target, name_or_path: str):
    """A published EAGLE head for ``target`` (folder or Hub id), through the strategy copy's ``EagleDraft`` (which
    refuses, before any forward, a head that does not fit the target)."""
    return strategy_module(EAGLE_MODULE.stem).EagleDraft.from_pretrained(name_or_path, target=target)


def strategy_module(name: str):
    """Module ``name`` of the strategy copy's folder (EAGLE heads here, the request stream in :mod:`shared_stream`),
    imported as part of a package (``space_strategy``), so that its relative imports (``from .checks import ...``)
    find their siblings there and not in an installed tetris_hf."""
    package = sys.modules.get(STRATEGY_PACKAGE)
    if package is None:
        spec = importlib.util.spec_from_file_location(STRATEGY_PACKAGE, EAGLE_MODULE.parent / "__init__.py",
                                                      submodule_search_locations=[str(EAGLE_MODULE.parent)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[STRATEGY_PACKAGE] = package  # (the folder has no __init__.py: an empty package)
    return importlib.import_module(f"{STRATEGY_PACKAGE}.{name}")


# ---------------------------------------------------------------------------------------------------------------
# The models in words a visitor understands: what each is and how often the draft agrees, no local paths


def public_name(name_or_path: str | os.PathLike) -> str:
    """A Hub id as it is; a local file or folder by its own name only (the page is public: no paths)."""
    local = Path(name_or_path).expanduser()
    return local.name if local.exists() else str(name_or_path)


def target_words(model, name: str) -> str:
    """``SmolLM2-135M-Instruct, 30 layers, fp32``."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.").replace("float", "fp")
    return f"{name}, {model.config.num_hidden_layers} layers, {dtype}"


def trained_draft_words(num_layers: int, config: dict) -> str:
    """A tetris-hf draft from its ``draft_config.json``: what it is and, where its training measured it, how often
    it picks the target's own next token on held-out text."""
    words = f"a {num_layers}-layer draft trained for this target (it shares the target's embedding and head)"
    agreement = config.get("metadata", {}).get("agreement")
    if agreement is not None:
        words += f"; it picks the target's next token {float(agreement):.0%} of the time on held-out text"
    return words


def early_exit_words(num_layers: int, target) -> str:
    return (f"the target's own first {num_layers} of {target.config.num_hidden_layers} layers and its head, "
            "untrained (an early exit)")


def eagle_words(head, source: str | None = None) -> str:
    kind = "EAGLE-3" if head.feature_kind == "eagle3" else "EAGLE-1"
    where = f" ({public_name(source)})" if source else ""
    return f"an {kind} head{where}: one layer trained to draft from the target's own hidden states"


def pair_words(target: str, draft: str) -> str:
    """The page's model lines (Markdown)."""
    return f"**Target:** {target}  \n**Draft:** {draft}"


def load_draft(target, name_or_path: str) -> tuple[torch.nn.Module, str]:
    """``(draft, description)`` for ``target``: ``early-exit:N``, a tetris-hf draft (folder or Hub id),
    ``eagle:PATH_OR_REPO``, or a model; the description in words (:func:`public_name`: no local paths)."""
    from transformers import AutoModelForCausalLM

    if name_or_path.startswith(EAGLE_PREFIX):
        source = name_or_path[len(EAGLE_PREFIX):]
        head = load_eagle_head(target, source)
        return head, eagle_words(head, source)
    if name_or_path.startswith("early-exit:"):
        layers = int(name_or_path.split(":", 1)[1])
        return early_exit_draft(target, layers), early_exit_words(layers, target)
    folder = tetris_draft_folder(name_or_path)
    if folder is not None:
        draft = load_tetris_draft(target, folder)
        config = json.loads((folder / DRAFT_CONFIG_NAME).read_text())
        return draft, f"{trained_draft_words(draft.config.num_hidden_layers, config)} ({public_name(name_or_path)})"
    draft = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=next(target.parameters()).dtype)
    if draft.get_output_embeddings().weight.shape[0] != target.get_output_embeddings().weight.shape[0]:
        raise ValueError(f"the draft {name_or_path!r} has another vocabulary than the target")
    return draft.to(target.device).eval(), (f"{public_name(name_or_path)}, a separate "
                                            f"{draft.config.num_hidden_layers}-layer model with the target's "
                                            "vocabulary")


def load_pair(target: str | None = None, draft: str | None = None, device: str = "cpu"):
    """``(target, draft, tokenizer, description)``: ``target`` defaults to ``$TETRIS_SPACE_TARGET`` or
    :data:`DEFAULT_TARGET`, ``draft`` to ``$TETRIS_SPACE_DRAFT`` or :data:`DEFAULT_DRAFT`."""
    target_name = target or os.environ.get("TETRIS_SPACE_TARGET") or DEFAULT_TARGET
    draft_name = draft or os.environ.get("TETRIS_SPACE_DRAFT") or DEFAULT_DRAFT
    target_model, tokenizer = load_target(target_name, device)
    draft_model, draft_description = load_draft(target_model, draft_name)
    return (target_model, draft_model, tokenizer,
            pair_words(target_words(target_model, public_name(target_name)), draft_description))
