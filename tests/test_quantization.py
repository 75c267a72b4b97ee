"""bitsandbytes 4-bit and 8-bit targets run the TETRIS loop on CPU (bitsandbytes 0.50.2's CPU backend), greedy rows
equal to the same quantized target alone; without a usable backend, the helper says what is missing."""

import warnings

import pytest
import torch
from transformers import LlamaForCausalLM

import tetris_hf  # noqa: F401
from tetris_hf.quantization import QuantizationUnavailableError, quantization_config
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, sharpen, tiny_llama

bitsandbytes = pytest.importorskip("bitsandbytes",
                                   reason="bitsandbytes is absent: pip install -e '.[test]' (scripts/setup.sh)")

VOCAB = 96


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """A sharpened tiny Llama saved to disk (to reload quantized) and an fp32 draft close to it."""
    target = sharpen(tiny_llama(VOCAB, seed=81, hidden_size=64), 6.0)
    folder = tmp_path_factory.mktemp("target")
    target.save_pretrained(folder)
    return folder, noisy_copy(target, 0.3, seed=82)


def _load(folder, config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LlamaForCausalLM.from_pretrained(folder, quantization_config=config).eval()


def _assert_rows_equal_target_alone(target, draft, strategy):
    prompts = random_prompts(5, VOCAB, seed=83, max_length=7)
    input_ids, mask = left_pad(prompts)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 8-bit: "inputs will be cast from torch.float32 to float16"
        out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                              tetris_strategy=strategy, return_dict_in_generate=True, **kwargs)
        for row, prompt in enumerate(prompts):
            alone = target.generate(torch.tensor([prompt]), **kwargs)[0]
            start = input_ids.shape[1] - len(prompt)
            assert torch.equal(out.sequences[row, start : start + alone.shape[0]], alone), f"row {row}"
    assert out.tetris_stats.accepted_tokens > 0


@pytest.mark.parametrize("strategy", ["tetris", "fixed"])
def test_4bit_target_rows_equal_same_quantized_target_alone(saved_pair, strategy):
    folder, draft = saved_pair
    target = _load(folder, quantization_config(load_in_4bit=True, device="cpu"))
    assert type(target.model.layers[0].mlp.down_proj) is bitsandbytes.nn.Linear4bit
    _assert_rows_equal_target_alone(target, draft, strategy)


@pytest.mark.parametrize("strategy", ["tetris", "fixed"])
def test_8bit_target_rows_equal_same_quantized_target_alone(saved_pair, strategy):
    folder, draft = saved_pair
    target = _load(folder, quantization_config(load_in_8bit=True, device="cpu"))
    assert type(target.model.layers[0].mlp.down_proj) is bitsandbytes.nn.Linear8bitLt
    _assert_rows_equal_target_alone(target, draft, strategy)


def test_quantized_draft_with_quantized_target(saved_pair):
    folder, _ = saved_pair
    target = _load(folder, quantization_config(load_in_8bit=True, device="cpu"))
    draft = _load(folder, quantization_config(load_in_4bit=True, device="cpu"))  # same weights, another precision
    _assert_rows_equal_target_alone(target, draft, "tetris")


def test_quantization_differs_from_full_precision(saved_pair):
    folder, _ = saved_pair
    full = LlamaForCausalLM.from_pretrained(folder).eval()
    quantized = _load(folder, quantization_config(load_in_4bit=True, device="cpu"))
    input_ids = torch.tensor([random_prompts(1, VOCAB, seed=84, min_length=6)[0]])
    with torch.no_grad():
        assert not torch.allclose(full(input_ids).logits, quantized(input_ids).logits, atol=1e-3)


def test_helper_flags():
    assert quantization_config() is None
    with pytest.raises(ValueError, match="not both"):
        quantization_config(load_in_4bit=True, load_in_8bit=True)
    config = quantization_config(load_in_4bit=True, device="cpu")
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_compute_dtype == torch.float32
    assert quantization_config(load_in_8bit=True, device="cpu").load_in_8bit


def test_missing_bitsandbytes_is_named(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    for flags in (dict(load_in_4bit=True), dict(load_in_8bit=True)):
        with pytest.raises(QuantizationUnavailableError, match=r"needs bitsandbytes.*pip install bitsandbytes"):
            quantization_config(**flags, device="cpu")


def test_old_bitsandbytes_is_named(monkeypatch):
    monkeypatch.setattr(bitsandbytes, "__version__", "0.42.0")
    with pytest.raises(QuantizationUnavailableError, match=r"bitsandbytes>=0\.46\.1, found 0\.42\.0"):
        quantization_config(load_in_4bit=True, device="cpu")


def test_backend_that_cannot_run_is_named(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise NotImplementedError("no kernel for this device")

    monkeypatch.setattr(bitsandbytes.nn.Linear4bit, "forward", no_kernel)
    monkeypatch.setattr(bitsandbytes.nn.Linear8bitLt, "forward", no_kernel)
    for flags, mode in ((dict(load_in_4bit=True), "4-bit"), (dict(load_in_8bit=True), "8-bit")):
        with pytest.raises(QuantizationUnavailableError, match=f"cannot run {mode}.* on cpu .*no kernel"):
            quantization_config(**flags, device="cpu")


def test_transformers_names_bitsandbytes_when_it_is_missing(saved_pair, monkeypatch):
    """Bypassing the helper: transformers' own check already names the package to install."""
    from transformers import BitsAndBytesConfig
    from transformers.quantizers import quantizer_bnb_4bit, quantizer_bnb_8bit

    folder, _ = saved_pair
    for module, config in ((quantizer_bnb_4bit, BitsAndBytesConfig(load_in_4bit=True)),
                           (quantizer_bnb_8bit, BitsAndBytesConfig(load_in_8bit=True))):
        monkeypatch.setattr(module, "is_bitsandbytes_available", lambda: False)
        with pytest.raises(ImportError, match="pip install -U bitsandbytes"):
            LlamaForCausalLM.from_pretrained(folder, quantization_config=config)
