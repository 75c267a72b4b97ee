"""oneDNN linear layers: the same model, oneDNN's kernels; the loop's output stays the target's own."""

import pytest
import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf.cpu_kernels import OneDNNLinear, onednn_available, restore_linears, use_onednn_linears
from test_greedy_exactness import NEW_TOKENS, target_alone
from tiny_models import PAD, left_pad, random_prompts, target_and_draft, tiny_llama

pytestmark = pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this PyTorch build")


def test_switched_layers_compute_what_linear_does_and_keep_the_models_weights():
    model = tiny_llama(97, num_layers=2, seed=0)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        before = model(ids).logits
    keys = list(model.state_dict())
    switched = use_onednn_linears(model)
    assert switched == sum(isinstance(module, OneDNNLinear) for module in model.modules()) > 0
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied weights stay tied
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert restore_linears(model) == switched
    assert not any(isinstance(module, OneDNNLinear) for module in model.modules())


def test_greedy_rows_equal_the_target_alone_with_onednn_linears():
    target, draft = target_and_draft(97, seed=3, draft_kind="noisy")
    use_onednn_linears(target)
    use_onednn_linears(draft)
    prompts = random_prompts(5, 97, seed=4)
    input_ids, mask = left_pad(prompts)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                          max_new_tokens=NEW_TOKENS, tetris_strategy="tetris", pad_token_id=PAD, eos_token_id=None)
    assert [row[input_ids.shape[1]:].tolist() for row in out] == target_alone(target, prompts, None)


def test_a_model_with_nothing_to_switch_is_refused_by_name():
    with pytest.raises(ValueError, match="Embedding has no nn.Linear"):
        use_onednn_linears(torch.nn.Embedding(4, 4))


def test_a_cost_profile_measured_on_one_kernel_is_not_read_for_the_other():
    from tetris_hf.cost_model import profile_key

    target, draft = target_and_draft(97, seed=3, draft_kind="noisy")
    before = profile_key(target, draft), profile_key(target, None)
    use_onednn_linears(target)
    assert profile_key(target, draft) != before[0] and profile_key(target, None) != before[1]
    restore_linears(target)
    assert (profile_key(target, draft), profile_key(target, None)) == before


def test_the_reordered_weight_follows_the_weight_when_it_changes():
    layer = torch.nn.Linear(8, 6)
    use_onednn_linears(layer)
    rows = torch.randn(3, 8)
    with torch.no_grad():
        first = layer(rows)
        layer.weight.mul_(2)  # in place: a new version of the same storage
        torch.testing.assert_close(layer(rows), torch.nn.functional.linear(rows, layer.weight, layer.bias))
        layer.load_state_dict({"weight": torch.randn(6, 8), "bias": torch.zeros(6)})
        torch.testing.assert_close(layer(rows), rows @ layer.weight.T)
        torch.testing.assert_close(layer(rows[:1]), rows[:1] @ layer.weight.T)  # one row: F.linear
    assert not torch.allclose(first, layer(rows).detach())
    restore_linears(layer)
    assert "_onednn_packed" not in layer.__dict__
