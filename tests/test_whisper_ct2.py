"""The CTranslate2 -> transformers Whisper converter, on a small synthetic model.bin written in the shipped layout (the
real whisper-base file is 145 MB and comes only with the speech bench's own command), and the speech set helpers."""

import json
import struct

import numpy as np
import pytest
import torch

from tetris_hf.tools.speech import normalize, sentences, word_error_rate, word_errors
from tetris_hf.tools.whisper_ct2 import (CT2FormatError, read_ct2, whisper_from_ct2, whisper_generation_config,
                                         write_ct2)
from tiny_whisper import features, tiny_whisper


def ct2_variables(model) -> dict[str, np.ndarray]:
    """What CTranslate2's Whisper converter writes for ``model`` (float16): fused attention projections (self: q, k,
    v; cross: q, then k and v), zero k biases, layer norms as gamma/beta, and its scalar settings."""
    state = {name: tensor.detach().numpy().astype(np.float16) for name, tensor in model.state_dict().items()}
    out = {}

    def norm(ct2, hf):
        out[f"{ct2}/gamma"], out[f"{ct2}/beta"] = state[f"{hf}.weight"], state[f"{hf}.bias"]

    def linear(ct2, hf):
        out[f"{ct2}/weight"], out[f"{ct2}/bias"] = state[f"{hf}.weight"], state[f"{hf}.bias"]

    def fused(ct2, hf, names):
        out[f"{ct2}/weight"] = np.concatenate([state[f"{hf}.{name}.weight"] for name in names])
        out[f"{ct2}/bias"] = np.concatenate([state.get(f"{hf}.{name}.bias", np.zeros(state[f"{hf}.{name}.weight"]
                                                                                      .shape[0], np.float16))
                                             for name in names])

    for side, layers in (("encoder", model.config.encoder_layers), ("decoder", model.config.decoder_layers)):
        out[f"{side}/num_heads"] = np.array(4, dtype=np.int16)
        out[f"{side}/position_encodings/encodings"] = state[f"model.{side}.embed_positions.weight"]
        norm(f"{side}/layer_norm", f"model.{side}.layer_norm")
        for index in range(layers):
            ct2, hf = f"{side}/layer_{index}", f"model.{side}.layers.{index}"
            fused(f"{ct2}/self_attention/linear_0", f"{hf}.self_attn", ("q_proj", "k_proj", "v_proj"))
            linear(f"{ct2}/self_attention/linear_1", f"{hf}.self_attn.out_proj")
            norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
            if side == "decoder":
                linear(f"{ct2}/attention/linear_0", f"{hf}.encoder_attn.q_proj")
                fused(f"{ct2}/attention/linear_1", f"{hf}.encoder_attn", ("k_proj", "v_proj"))
                linear(f"{ct2}/attention/linear_2", f"{hf}.encoder_attn.out_proj")
                norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
            linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1")
            linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")
            norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
    linear("encoder/conv1", "model.encoder.conv1")
    linear("encoder/conv2", "model.encoder.conv2")
    out["decoder/embeddings/weight"] = state["model.decoder.embed_tokens.weight"]
    out["decoder/activation"] = np.array(3, dtype=np.int8)
    out["decoder/alignment_layer"] = np.array(-1, dtype=np.int16)
    return dict(sorted(out.items()))  # CTranslate2 writes variables in name order


def serialize(variables: dict[str, np.ndarray], aliases: dict[str, str]) -> bytes:
    """The layout as read from the shipped whisper-base model.bin, written independently of the tool's writer."""
    def text(value):
        return struct.pack("<H", len(value) + 1) + value.encode() + b"\0"

    dtype_ids = {np.dtype(np.float16): 4, np.dtype(np.int8): 1, np.dtype(np.int16): 2}
    blob = struct.pack("<I", 6) + text("WhisperSpec") + struct.pack("<I", 3) + struct.pack("<I", len(variables))
    for name, array in variables.items():
        blob += text(name) + struct.pack("<B", array.ndim) + b"".join(struct.pack("<I", d) for d in array.shape)
        blob += struct.pack("<B", dtype_ids[array.dtype]) + struct.pack("<I", array.nbytes) + array.tobytes()
    blob += struct.pack("<I", len(aliases)) + b"".join(text(a) + text(b) for a, b in aliases.items())
    return blob


ALIASES = {"decoder/projection/weight": "decoder/embeddings/weight"}


@pytest.fixture(scope="module")
def shipped_file(tmp_path_factory):
    model = tiny_whisper(seed=7).to(torch.float16).to(torch.float32)  # the export is float16
    path = tmp_path_factory.mktemp("ct2") / "model.bin"
    path.write_bytes(serialize(ct2_variables(model), ALIASES))
    return model, path


def test_reader_reads_the_shipped_layout(shipped_file):
    model, path = shipped_file
    spec, variables, aliases = read_ct2(path)
    assert spec == "WhisperSpec" and aliases == ALIASES
    assert variables["decoder/num_heads"] == 4 and variables["decoder/activation"] == 3
    assert variables["decoder/layer_1/self_attention/linear_0/weight"].shape == (96, 32)


def test_writer_writes_the_same_bytes(shipped_file, tmp_path):
    model, path = shipped_file
    spec, variables, aliases = read_ct2(path)
    write_ct2(tmp_path / "again.bin", spec, variables, aliases)
    assert (tmp_path / "again.bin").read_bytes() == path.read_bytes()


def test_converted_model_equals_the_original(shipped_file):
    model, path = shipped_file
    converted = whisper_from_ct2(path, token_ids={"pad_token_id": 1, "bos_token_id": 90, "eos_token_id": 1,
                                                  "decoder_start_token_id": 90})
    original = model.state_dict()
    for name, tensor in converted.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    audio = features(2, seed=3)
    ids = torch.tensor([[90, 91, 93, 95, 12, 40]] * 2)
    with torch.no_grad():
        expected = model(input_features=audio, decoder_input_ids=ids).logits
        got = converted(input_features=audio, decoder_input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_truncated_file_names_the_fix(shipped_file, tmp_path):
    _, path = shipped_file
    half = tmp_path / "half.bin"
    half.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CT2FormatError, match="both parts"):
        read_ct2(half)


def test_generation_settings_come_from_the_export():
    tokenizer = {"added_tokens": [{"id": i, "content": c} for i, c in (
        (50257, "<|endoftext|>"), (50258, "<|startoftranscript|>"), (50259, "<|en|>"), (50260, "<|zh|>"),
        (50358, "<|translate|>"), (50359, "<|transcribe|>"), (50363, "<|notimestamps|>"))]}
    ct2 = {"lang_ids": [50259, 50260], "suppress_ids": [1, 2], "suppress_ids_begin": [220, 50257],
           "alignment_heads": [[3, 1]]}
    config = whisper_generation_config(json.loads(json.dumps(ct2)), tokenizer)
    assert config.lang_to_id == {"<|en|>": 50259, "<|zh|>": 50260}
    assert config.task_to_id == {"transcribe": 50359, "translate": 50358}
    assert (config.no_timestamps_token_id, config.decoder_start_token_id, config.eos_token_id) == (50363, 50258, 50257)
    assert config.begin_suppress_tokens == [220, 50257]


def test_word_error_rate_counts_word_edits():
    assert normalize("The quick-brown fox, jumps!") == ["the", "quick", "brown", "fox", "jumps"]
    assert word_errors("the quick brown fox", "the quick round fox jumps") == (2, 4)
    assert word_error_rate(["a b c", "d e"], ["a b c", "d"]) == pytest.approx(1 / 5)


def test_sentences_keep_speakable_prose():
    text = "Write a short poem about the sea and the sky. x = f(3)\nWhat is 2+2? Tell me a story about a brave knight."
    assert sentences(text) == ["Write a short poem about the sea and the sky.",
                               "Tell me a story about a brave knight."]


def test_speech_bench_without_the_model_names_its_installer(tmp_path, monkeypatch):
    """The real model is installed only by the speech bench's own command; without it the bench says so."""
    import argparse

    from tetris_hf.tools import speech_bench
    from tetris_hf.tools.cli import UsageError

    monkeypatch.setenv("TETRIS_HF_CACHE", str(tmp_path))
    parser = argparse.ArgumentParser()
    speech_bench.add_arguments(parser)
    with pytest.raises(UsageError, match="speech-bench.sh"):
        speech_bench.main(parser.parse_args([]))


def test_the_shipped_whisper_draft_is_complete_and_refuses_another_target():
    """The shipped draft: its own 2 decoder layers (float16, no embeddings: the target's are shared), its
    configuration and provenance, its token counts; and a target of another fingerprint is refused."""
    from safetensors import safe_open

    from tetris_hf.tools.distill_whisper import DEFAULT_WHISPER_DRAFT_DIR, SHARED, load_whisper_draft

    meta = json.loads((DEFAULT_WHISPER_DRAFT_DIR / "draft_config.json").read_text())
    assert meta["format"] == "tetris-hf-whisper-draft" and meta["config"]["decoder_layers"] == 2
    assert meta["metadata"]["held_out_agreement"] > meta["metadata"]["held_out_agreement_init"]
    with safe_open(str(DEFAULT_WHISPER_DRAFT_DIR / "draft.safetensors"), "pt") as file:
        names = set(file.keys())
        assert file.get_tensor("model.decoder.layers.1.fc1.weight").dtype == torch.float16
    assert not names & set(SHARED) and {name.split(".")[3] for name in names if ".layers." in name} == {"0", "1"}
    with safe_open(str(DEFAULT_WHISPER_DRAFT_DIR / "draft_vocab.safetensors"), "pt") as file:
        assert file.get_tensor("token_counts").shape == (meta["config"]["vocab_size"],)
    assert (DEFAULT_WHISPER_DRAFT_DIR / "PROVENANCE.md").is_file()
    with pytest.raises(ValueError, match="another target"):
        load_whisper_draft(tiny_whisper(seed=0))
