"""EAGLE heads (``tetris_hf.candidate_generators.eagle``) read from published-format checkpoints.

Random heads are written exactly as the public trainers write them (``eagle_checkpoints.py``) and loaded against tiny
random llama / qwen2 / qwen3 / mistral targets. Fidelity: the head, run batched on left-padded rows of different lengths
(with transformers' DynamicCache and a 2D mask, or driven by ``SlotCache`` like the loop will), drafts the same greedy
tokens with the same confidences (log max q) as an independent plain-torch implementation of the published forward
(own RMSNorm, RoPE and attention, float64), recomputed from scratch for each row alone at every draft step. Misfit
checkpoints are refused before any forward, with a message naming the field.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import DynamicCache

from eagle_checkpoints import HIDDEN, VOCAB, eagle1_checkpoint, eagle3_checkpoint, tiny_target, write_checkpoint
from tetris_hf.attention import AttentionLayout
from tetris_hf.candidate_generators.eagle import HEAD_OUTPUT, EagleDraft
from tetris_hf.kv import SlotCache
from tiny_models import left_pad, random_prompts

LAYERS = 8  # default EAGLE-3 layers (2, L // 2, L - 3) = hs[2], hs[4], hs[5], all distinct
STEPS = 4  # autoregressive draft steps per round


# -- an independent implementation of the published forwards: plain torch, float64, one row, no cache --------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE in the Llama (rotate-half) layout: ``x`` ``(heads, T, d)``, ``positions`` ``(T,)``."""
    dim = x.shape[-1]
    frequencies = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * frequencies[None]  # (T, d/2)
    angles = torch.cat([angles, angles], dim=-1)
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return x * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()


class Reference:
    """The published EAGLE-1 / EAGLE-3 forward over one row's whole sequence of head positions."""

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor], target, aux: tuple[int, ...]):
        self.kind = "eagle3" if any(name.startswith("midlayer.") for name in tensors) else "eagle1"
        self.prefix = "midlayer." if self.kind == "eagle3" else "layers.0."
        self.w = {name: tensor.double() for name, tensor in tensors.items() if tensor.is_floating_point()}
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.eps = config["rms_norm_eps"]
        self.theta = config.get("rope_theta", 10000.0)
        self.embedding = self.w.get("embed_tokens.weight")
        if self.embedding is None:
            self.embedding = target.get_input_embeddings().weight.detach().double()
        self.target_head = target.get_output_embeddings().weight.detach().double()
        self.vocab = self.target_head.shape[0]
        draft_rows = self.w["lm_head.weight"].shape[0] if self.kind == "eagle3" else self.vocab
        if "d2t" in tensors and draft_rows < self.vocab:
            self.target_ids = torch.arange(draft_rows) + tensors["d2t"]
        else:
            self.target_ids = torch.arange(draft_rows)
        self.target, self.aux = target, aux

    def features(self, tokens: list[int]) -> torch.Tensor:
        """``(T, F)`` the target's features for a row read alone: hs[L] (EAGLE-1), cat of the aux hs (EAGLE-3)."""
        with torch.no_grad():
            hidden = self.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        if self.kind == "eagle1":
            return hidden[-1][0].double()
        return torch.cat([hidden[index][0] for index in self.aux], dim=-1).double()

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.w[name + ".weight"].T
        return out + self.w[name + ".bias"] if name + ".bias" in self.w else out

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[0]
        p = self.prefix + "self_attn."
        q = self.linear(p + "q_proj", x).view(length, self.heads, -1).transpose(0, 1)
        k = self.linear(p + "k_proj", x).view(length, self.kv_heads, -1).transpose(0, 1)
        v = self.linear(p + "v_proj", x).view(length, self.kv_heads, -1).transpose(0, 1)
        positions = torch.arange(length)
        q, k = rotate(q, positions, self.theta), rotate(k, positions, self.theta)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=0)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=0)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(dim=-1) @ v).transpose(0, 1).reshape(length, -1)
        return self.linear(p + "o_proj", out)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        p = self.prefix + "mlp."
        return self.linear(p + "down_proj", torch.nn.functional.silu(self.linear(p + "gate_proj", x))
                           * self.linear(p + "up_proj", x))

    def run(self, tokens: list[int], features: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Head positions ``0..T-1``: ``tokens[j]`` with ``features[j]`` (``("target", f)`` or ``("draft", out)``).

        Returns ``(T, H)`` outputs and ``(T, V)`` logits over the target vocabulary (``-inf`` outside the draft's).
        """
        embedded = self.embedding[torch.tensor(tokens)]
        if self.kind == "eagle1":
            x = self.linear("fc", torch.cat([embedded, torch.stack([f for _, f in features])], dim=-1))
            h1 = x + self.attention(x)
            out = h1 + self.mlp(rms_norm(h1, self.w["layers.0.post_attention_layernorm.weight"], self.eps))
            return out, out @ self.target_head.T
        h = torch.stack([self.linear("fc", f) if kind == "target" else f for kind, f in features])
        x = torch.cat([rms_norm(embedded, self.w["midlayer.input_layernorm.weight"], self.eps),
                       rms_norm(h, self.w["midlayer.hidden_norm.weight"], self.eps)], dim=-1)
        h1 = h + self.attention(x)
        out = h1 + self.mlp(rms_norm(h1, self.w["midlayer.post_attention_layernorm.weight"], self.eps))
        draft = rms_norm(out, self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T
        logits = torch.full((len(tokens), self.vocab), float("-inf"), dtype=torch.float64)
        logits[:, self.target_ids] = draft
        return out, logits

    def draft(self, row: list[int], steps: int) -> tuple[list[int], list[float]]:
        """Greedy drafts after a row whose last token is the newest (not read by the target), and their log max q;
        every step recomputes the whole sequence from scratch."""
        features = [("target", f) for f in self.features(row[:-1])]
        tokens = list(row[1:])  # head position j: feature j with token j + 1
        drafted, confidences = [], []
        for _ in range(steps):
            out, logits = self.run(tokens, features)
            log_q = logits[-1].log_softmax(dim=-1)
            token = int(log_q.argmax())
            drafted.append(token)
            confidences.append(float(log_q[token]))
            tokens.append(token)
            features.append(("draft", out[-1]))
        return drafted, confidences


# -- the head, batched -------------------------------------------------------------------------------------------


def context_block(reference: Reference, rows: list[list[int]]):
    """Left-padded head inputs for rows whose last token is the newest: ``(B, n)`` tokens 1.., ``(B, n, F)`` the
    target's features at positions 0.. (each row's computed alone, so the head is tested, not the target), mask."""
    input_ids, mask = left_pad([row[1:] for row in rows])
    features = torch.zeros(*input_ids.shape, reference.features(rows[0][:1]).shape[-1], dtype=torch.float64)
    for index, row in enumerate(rows):
        if len(row) > 1:
            features[index, -(len(row) - 1):] = reference.features(row[:-1])
    return input_ids, features, mask


def pick(log_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    confidence, token = log_q.max(dim=-1)
    return token, confidence


def draft_dynamic(head: EagleDraft, reference: Reference, rows: list[list[int]], steps: int):
    """The head on transformers' DynamicCache, with 2D masks and positions counted from the mask."""
    input_ids, features, mask = context_block(reference, rows)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cache = DynamicCache()
    outputs = head(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                   target_features=features, logits_to_keep=1)
    tokens, confidences = [], []
    for step in range(steps):
        token, confidence = pick(outputs.logits[:, -1].double().log_softmax(dim=-1))
        tokens.append(token)
        confidences.append(confidence)
        if step == steps - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        outputs = head(input_ids=token[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache,
                       draft_features=outputs.features[:, -1:])
    return torch.stack(tokens, dim=1), torch.stack(confidences, dim=1)


def draft_slots(head: EagleDraft, cache: SlotCache, block_ids, block_features, steps: int, input_mask=None,
                real_lengths=None):
    """The head driven by SlotCache as the loop will: one block read with the target's features, then drafts that
    read the head's own output. Returns ``(B, steps)`` tokens and confidences."""
    logits, features = cache.forward(head, block_ids, input_mask, real_lengths=real_lengths,
                                     row_inputs={"target_features": block_features}, hidden_states=HEAD_OUTPUT)
    last = (real_lengths - 1) if real_lengths is not None else torch.full((len(block_ids),), block_ids.shape[1] - 1)
    rows = torch.arange(len(block_ids))
    logits, features = logits[rows, last], features[rows, last]
    tokens, confidences = [], []
    for step in range(steps):
        token, confidence = pick(logits.double().log_softmax(dim=-1))
        tokens.append(token)
        confidences.append(confidence)
        if step == steps - 1:
            break
        logits, features = cache.forward(head, token[:, None], None, step=True,
                                         row_inputs={"draft_features": features[:, None]}, hidden_states=HEAD_OUTPUT)
        logits, features = logits[:, -1], features[:, -1]
    return torch.stack(tokens, dim=1), torch.stack(confidences, dim=1)


def assert_same_drafts(tokens, confidences, reference: Reference, rows, steps):
    for index, row in enumerate(rows):
        expected_tokens, expected_confidences = reference.draft(row, steps)
        assert tokens[index].tolist() == expected_tokens, f"row {index} (length {len(row)})"
        torch.testing.assert_close(confidences[index].double(), torch.tensor(expected_confidences, dtype=torch.float64),
                                   atol=1e-5, rtol=0)


# -- fidelity ------------------------------------------------------------------------------------------------------

CASES = {
    # name: (family, attention, checkpoint, weights file, aux hs indices the reference reads)
    "eagle1-llama": ("llama", "sdpa", lambda: eagle1_checkpoint(seed=1, bias=False), "safetensors", (LAYERS,)),
    "eagle1-qwen2-qkv-bias-embedding": ("qwen2", "eager", lambda: eagle1_checkpoint(
        seed=2, bias=None, qkv_bias=True, embedding=True), "bin", (LAYERS,)),
    "eagle3-qwen3-d2t-layer-ids": ("qwen3", "sdpa", lambda: eagle3_checkpoint(
        seed=3, draft_vocab=40, layer_ids=[0, 2, 5]), "safetensors", (1, 3, 6)),
    "eagle3-mistral-full-vocab-embedding": ("mistral", "sdpa", lambda: eagle3_checkpoint(
        seed=4, draft_vocab=None, embedding=True, specforge=False, rope_theta=None), "bin", (2, 4, 5)),
    "eagle3-llama-wider-head": ("llama", "eager", lambda: eagle3_checkpoint(
        seed=5, hidden=48, target_hidden=HIDDEN, embedding=True, rope_theta=500000.0), "safetensors", (2, 4, 5)),
}


@pytest.fixture(params=sorted(CASES))
def case(request, tmp_path):
    family, attention, make, weights, aux = CASES[request.param]
    target = tiny_target(family, num_layers=LAYERS, seed=7, dtype=torch.float64, attn_implementation=attention)
    config, tensors = make()
    folder = write_checkpoint(tmp_path / "head", config, tensors, weights)
    head = EagleDraft.from_pretrained(folder, target=target)
    assert head.aux_layer_ids == aux
    rows = [[3 + token for token in row] for row in random_prompts(4, VOCAB - 3, seed=11, min_length=2, max_length=9)]
    return head, Reference(config, tensors, target, aux), rows


@torch.no_grad()
def test_batched_drafts_on_a_dynamic_cache_equal_the_published_forward_row_by_row(case):
    head, reference, rows = case
    tokens, confidences = draft_dynamic(head, reference, rows, STEPS)
    assert_same_drafts(tokens, confidences, reference, rows, STEPS)


@torch.no_grad()
def test_slot_cache_drafts_then_rereads_accepted_tokens_like_the_published_forward(case):
    """Round 1 drafts; a verification accepts a different number per row plus a bonus token; the drafted entries become
    holes and the accepted tokens are read again with the target's real features (right filler, ``real_lengths``);
    round 2 drafts. Both rounds equal the reference on each row's context from scratch."""
    head, reference, rows = case
    cache = SlotCache(len(rows), torch.device("cpu"), max_holes=2, capacity=8)  # small: it grows and repacks
    input_ids, features, mask = context_block(reference, rows)
    tokens, confidences = draft_slots(head, cache, input_ids, features, STEPS, input_mask=mask)
    assert_same_drafts(tokens, confidences, reference, rows, STEPS)

    drafted_from = cache.pointer - (STEPS - 1)
    cache.keep_prefix(drafted_from, torch.zeros(len(rows), dtype=torch.long))  # every drafted entry becomes a hole
    accepted = [2, 0, 3, 1]
    bonus = [5, 9, 17, 33]
    new_rows = [row + tokens[index, : accepted[index]].tolist() + [bonus[index]] for index, row in enumerate(rows)]
    lengths = torch.tensor([count + 1 for count in accepted])
    block_ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    block_features = torch.zeros(*block_ids.shape, features.shape[-1], dtype=torch.float64)
    for index, (row, new_row) in enumerate(zip(rows, new_rows)):
        start = len(row) - 1  # the first position the head's cache holds no real feature for
        block_ids[index, : lengths[index]] = torch.tensor(new_row[start + 1 :])
        block_features[index, : lengths[index]] = reference.features(new_row[:-1])[start:]
    tokens, confidences = draft_slots(head, cache, block_ids, block_features, STEPS, real_lengths=lengths)
    assert_same_drafts(tokens, confidences, reference, new_rows, STEPS)


# -- loading -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_both_formats_load_from_both_weights_files_against_each_family(family, weights, tmp_path):
    target = tiny_target(family, num_layers=LAYERS)
    one = EagleDraft.from_pretrained(write_checkpoint(tmp_path / "one", *eagle1_checkpoint(), weights), target=target)
    assert (one.feature_kind, one.aux_layer_ids, one.feature_size) == ("eagle1", (LAYERS,), HIDDEN)
    assert one.get_input_embeddings() is target.get_input_embeddings()  # shared, not copied
    assert one.get_output_embeddings() is target.get_output_embeddings()
    config, tensors = eagle3_checkpoint(embedding=True)
    three = EagleDraft.from_pretrained(write_checkpoint(tmp_path / "three", config, tensors, weights), target=target)
    assert (three.feature_kind, three.aux_layer_ids, three.feature_size) == ("eagle3", (2, 4, 5), 3 * HIDDEN)
    assert torch.equal(three.get_input_embeddings().weight, tensors["embed_tokens.weight"].float())
    assert three.get_output_embeddings() is None  # a reduced vocabulary: logits are scattered into V columns
    assert three.config.vocab_size == VOCAB and three.config.draft_vocab_size == 40
    layout = AttentionLayout.of(three)
    assert layout.implementation == "sdpa" and not layout.windowed


def test_aux_layers_read_config_ids_as_layer_outputs_and_explicit_ids_verbatim(tmp_path):
    target = tiny_target("llama", num_layers=LAYERS)
    default = write_checkpoint(tmp_path / "default", *eagle3_checkpoint())
    assert EagleDraft.from_pretrained(default, target=target).aux_layer_ids == (2, 4, 5)  # (2, L // 2, L - 3)
    # SpecForge's defaults [1, L // 2 - 1, L - 4] are outputs of those layers: the same hidden states
    specforge = write_checkpoint(tmp_path / "specforge", *eagle3_checkpoint(layer_ids=[1, 3, 4]))
    assert EagleDraft.from_pretrained(specforge, target=target).aux_layer_ids == (2, 4, 5)
    assert EagleDraft.from_pretrained(specforge, target=target, aux_layer_ids=[0, 1, 7]).aux_layer_ids == (0, 1, 7)


@torch.no_grad()
def test_feature_tap_captures_what_output_hidden_states_holds(tmp_path):
    target = tiny_target("qwen3", num_layers=LAYERS)
    input_ids, mask = left_pad([[5, 6, 7, 8], [9, 10]])
    hidden = target(input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for make, expected in ((eagle1_checkpoint, hidden[LAYERS]), (eagle3_checkpoint, torch.cat(
            [hidden[2], hidden[4], hidden[5]], dim=-1))):
        folder = write_checkpoint(tmp_path / make.__name__, *make())
        head = EagleDraft.from_pretrained(folder, target=target)
        outputs = target(input_ids, attention_mask=mask, output_hidden_states=list(head.aux_layer_ids))
        assert torch.equal(head.target_features(outputs), expected)


@torch.no_grad()
def test_reduced_vocabulary_logits_are_minus_infinity_outside_the_draft_vocabulary(tmp_path):
    target = tiny_target("llama", num_layers=LAYERS)
    config, tensors = eagle3_checkpoint(draft_vocab=40)
    head = EagleDraft.from_pretrained(write_checkpoint(tmp_path / "head", config, tensors), target=target)
    logits = head(input_ids=torch.tensor([[4, 5, 6]]), target_features=torch.randn(1, 3, 3 * HIDDEN)).logits
    inside = tensors["t2d"]
    assert logits.shape == (1, 3, VOCAB)
    assert torch.isfinite(logits[..., inside]).all() and torch.isneginf(logits[..., ~inside]).all()
    torch.testing.assert_close(logits.softmax(dim=-1).sum(dim=-1), torch.ones(1, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_the_head_follows_the_target_dtype(dtype, tmp_path):
    target = tiny_target("llama", num_layers=LAYERS, dtype=dtype)
    for make in (eagle1_checkpoint, eagle3_checkpoint):
        head = EagleDraft.from_pretrained(write_checkpoint(tmp_path / make.__name__, *make()), target=target)
        assert head.dtype == dtype and head.device == target.device
        assert {parameter.dtype for parameter in head.parameters()} == {dtype}
        assert head.rotary_emb.inv_freq.dtype == torch.float32  # the target keeps its frequencies in float32 too
        with torch.no_grad():
            outputs = head(input_ids=torch.tensor([[4, 5]]),
                           target_features=torch.randn(1, 2, head.feature_size, dtype=dtype))
        assert outputs.logits.dtype == dtype and outputs.features.dtype == dtype


# -- bad input: refused before any forward --------------------------------------------------------------------------


@pytest.fixture
def no_forward(monkeypatch):
    """Any forward of a head or of the target fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a forward ran before the error")

    monkeypatch.setattr(EagleDraft, "forward", forbidden)
    target = tiny_target("llama", num_layers=LAYERS)
    monkeypatch.setattr(target, "forward", forbidden)
    return target


def without(tensors: dict, *names: str) -> dict:
    return {name: tensor for name, tensor in tensors.items() if name not in names}


def with_tensor(tensors: dict, name: str, tensor: torch.Tensor) -> dict:
    return {**tensors, name: tensor}


def with_field(config: dict, **fields) -> dict:
    return {**config, **fields}


def shifted_d2t():
    config, tensors = eagle3_checkpoint(draft_vocab=40)
    d2t = tensors["d2t"].clone()
    d2t[-1] += VOCAB  # the last draft id lands past the target's vocabulary
    return config, with_tensor(tensors, "d2t", d2t)


MISFITS = {
    # name: (config and tensors, from_pretrained kwargs, message pattern)
    "eagle1 hidden size": (lambda: eagle1_checkpoint(hidden=48), {},
                           r"`hidden_size` \(48\).*target's hidden size \(32\)"),
    "eagle3 target hidden size": (lambda: eagle3_checkpoint(target_hidden=48), {}, r"`target_hidden_size` \(48\)"),
    "eagle3 wider head without embedding": (lambda: eagle3_checkpoint(hidden=48, target_hidden=HIDDEN), {},
                                            r"`hidden_size` \(48\).*no `embed_tokens.weight`"),
    "eagle1 vocabulary": (lambda: (lambda c, t: (with_field(c, vocab_size=100), t))(*eagle1_checkpoint()), {},
                          r"`vocab_size` \(100\).*\(96 logits\)"),
    "eagle3 vocabulary": (lambda: eagle3_checkpoint(vocab=128, embedding=True), {}, r"`vocab_size` \(128\)"),
    "d2t out of range": (shifted_d2t, {}, r"`d2t` maps 1 draft ids outside the target's vocabulary of 96"),
    "d2t missing": (lambda: (lambda c, t: (c, without(t, "d2t")))(*eagle3_checkpoint()), {}, r"no `d2t` tensor"),
    "config layer ids beyond the target": (lambda: eagle3_checkpoint(layer_ids=[1, 3, 9]), {},
                                           r"eagle_aux_hidden_state_layer_ids \(1, 3, 9\).*8 decoder layers"),
    "explicit layer ids beyond the target": (eagle3_checkpoint, {"aux_layer_ids": (2, 4, 8)},
                                             r"aux_layer_ids \(2, 4, 8\).*8 decoder layers"),
    "last hidden state only": (lambda: (lambda c, t: (with_field(c, eagle_config={"use_aux_hidden_state": False}),
                                                      t))(*eagle3_checkpoint()), {}, r"use_aux_hidden_state` is false"),
    "missing layer tensor": (lambda: (lambda c, t: (c, without(t, "midlayer.hidden_norm.weight")))(
        *eagle3_checkpoint()), {}, r"missing tensors \['midlayer.hidden_norm.weight'\]"),
    "missing fc bias": (lambda: (lambda c, t: (c, without(t, "fc.bias")))(*eagle1_checkpoint(bias=None)), {},
                        r"missing tensors \['fc.bias'\].*set `\"bias\": false`"),
    "eagle3 attention over one hidden size": (lambda: (lambda c, t: (c, with_tensor(
        t, "midlayer.self_attn.q_proj.weight", torch.zeros(32, 32))))(*eagle3_checkpoint()), {},
        r"`midlayer.self_attn.q_proj.weight` has shape \(32, 32\), expected \(32, 64\)"),
    "not an eagle head": (lambda: (eagle1_checkpoint()[0], {"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}),
                          {}, r"neither `midlayer.\*` \(EAGLE-3\) nor `layers.0.\*` \(EAGLE-1\)"),
}


@pytest.mark.parametrize("misfit", sorted(MISFITS))
def test_misfit_checkpoints_are_refused_before_any_forward(misfit, no_forward, tmp_path):
    make, kwargs, message = MISFITS[misfit]
    folder = write_checkpoint(tmp_path / "head", *make())
    with pytest.raises(ValueError, match=message):
        EagleDraft.from_pretrained(folder, target=no_forward, **kwargs)


def test_default_layers_on_a_too_shallow_target_are_refused(monkeypatch, tmp_path):
    shallow = tiny_target("llama", num_layers=2)  # L - 3 < 0: no layer input to read
    monkeypatch.setattr(shallow, "forward", lambda *args, **kwargs: pytest.fail("a forward ran before the error"))
    folder = write_checkpoint(tmp_path / "head", *eagle3_checkpoint())
    with pytest.raises(ValueError, match=r"the default \(2, L // 2, L - 3\) \(2, 1, -1\).*2 decoder layers"):
        EagleDraft.from_pretrained(folder, target=shallow)


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_truncated_weights_files_are_refused_with_a_clear_error(weights, no_forward, tmp_path):
    folder = write_checkpoint(tmp_path / "head", *eagle3_checkpoint(), weights)
    path = os.path.join(folder, "model.safetensors" if weights == "safetensors" else "pytorch_model.bin")
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match="truncated or corrupt.*download it again"):
        EagleDraft.from_pretrained(folder, target=no_forward)


def test_a_folder_without_weights_is_refused(no_forward, tmp_path):
    folder = write_checkpoint(tmp_path / "head", *eagle1_checkpoint())
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match="no weights file.*model.safetensors, pytorch_model.bin"):
        EagleDraft.from_pretrained(folder, target=no_forward)
