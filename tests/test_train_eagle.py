"""``tetris-hf train-eagle``: an EAGLE-3 head trained with training-time test (TTT) on a frozen target.

The unrolled training forward is checked against the head drafting from a cache the way inference does (every step,
every root, both attention implementations); training lowers the loss at every unrolled step; the held-out numbers
equal what drafting from the cache against the target's own ``generate`` measures; the command runs end to end on a
tiny target, resumes to the same weights as an uninterrupted run, writes the published format that
``EagleDraft.from_pretrained`` reads back with the same drafts, and refuses bad input before training.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from eagle_checkpoints import tiny_target
from test_models import tiny_model_dir, tiny_sharegpt
from tiny_models import EOS
from tetris_hf.candidate_generators.eagle import EagleDraft
from tetris_hf.tools import train_eagle
from tetris_hf.tools.cli import UsageError, build_parser
from tetris_hf.tools.train_eagle import Sample

GAIN = 30.0  # output head scale of the tiny targets: peaked distributions, so greedy tokens have no near ties


def peaked_target(dtype=torch.float32, attn_implementation="sdpa", seed=7):
    target = tiny_target("llama", num_layers=8, seed=seed, dtype=dtype, attn_implementation=attn_implementation)
    target.lm_head.weight.data.mul_(GAIN)
    return target


def features_of(head, target, input_ids):
    with torch.no_grad():
        return head.target_features(target(input_ids, output_hidden_states=list(head.aux_layer_ids)))


def draft_from_cache(head, tokens: list[int], features: torch.Tensor, inputs: list[int]) -> tuple[list, list[int]]:
    """The head at inference: the context ``tokens`` (newest last) read with the target's ``features`` of every token
    but the newest, then one position per entry of ``inputs`` reading the head's own previous output, on a
    DynamicCache. Returns the outputs (context's last, then each step's) and the greedy token of each."""
    cache = DynamicCache()
    result = head(torch.tensor([tokens[1:]]), target_features=features[None, : len(tokens) - 1],
                  past_key_values=cache)
    outputs, tokens_out = [result.features[0, -1]], [int(result.logits[0, -1].argmax())]
    for index, token in enumerate(inputs):
        position = torch.tensor([[len(tokens) - 1 + index]])
        result = head(torch.tensor([[token]]), draft_features=outputs[-1][None, None], position_ids=position,
                      past_key_values=cache)
        outputs.append(result.features[0, -1])
        tokens_out.append(int(result.logits[0, -1].argmax()))
    return outputs, tokens_out


# -- the unrolled forward ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_unrolled_step_sees_exactly_what_it_sees_when_drafting(attention):
    """Step s of root j: the head's output after reading the context through x_{j+1} with real features, then
    x_{j+2} .. x_{j+s} with its own outputs, drafting from a cache one root at a time."""
    target = peaked_target(torch.float64, attention)
    torch.manual_seed(0)
    head = EagleDraft.for_target(target, torch.arange(3, 60))
    input_ids = torch.randint(3, 96, (2, 9))
    features = features_of(head, target, input_ids)
    steps = 3
    with torch.no_grad():
        outputs = train_eagle.unroll(head, input_ids, features, steps)
    assert [tuple(output.shape) for output in outputs] == [(2, 9 - s, 32) for s in range(1, steps + 1)]
    for row in range(2):
        tokens = input_ids[row].tolist()
        for root in range(9 - steps):
            with torch.no_grad():
                expected, _ = draft_from_cache(head, tokens[: root + 2], features[row],
                                               tokens[root + 2 : root + steps + 1])
            for step in range(steps):
                torch.testing.assert_close(outputs[step][row, root], expected[step], rtol=0, atol=1e-6,
                                           msg=f"row {row} root {root} step {step + 1}")


def test_ttt_mask_worked_example():
    """Length 4, step 2: keys are step-1 roots 0 1 2, then step-2 roots 0 1."""
    expected = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(train_eagle.ttt_mask(4, 2, True, torch.float32, "cpu")[0, 0], expected)
    additive = train_eagle.ttt_mask(4, 2, False, torch.float32, "cpu")[0, 0]
    assert torch.equal(additive == 0, expected) and bool((additive[~expected] == torch.finfo(torch.float32).min).all())


def test_unroll_refuses_more_steps_than_the_row_allows():
    target = peaked_target()
    head = EagleDraft.for_target(target)
    input_ids = torch.randint(3, 96, (1, 4))
    with pytest.raises(ValueError, match="rows longer than 4 tokens"):
        train_eagle.unroll(head, input_ids, features_of(head, target, input_ids), 4)


def test_step_s_of_root_j_is_scored_against_p_j_plus_s(monkeypatch):
    """Root j's s-th draft is the token after x_{j+s}: its loss is zero exactly when its logits are the target's at
    position j + s (the head's own logits are replaced by the outputs given)."""
    monkeypatch.setattr(train_eagle, "draft_logits", lambda head, output: output)
    target_logits = torch.randn(2, 9, 11)
    scored = torch.ones(2, 9, dtype=torch.bool)
    counts = [2 * (9 - s) for s in range(1, 4)]
    aligned = [target_logits[:, s:] for s in range(1, 4)]
    loss, sums = train_eagle.ttt_loss(None, aligned, target_logits, scored, counts)
    assert float(loss) == pytest.approx(0.0, abs=1e-6) and sums == pytest.approx([0.0] * 3, abs=1e-5)
    shifted = [target_logits[:, s - 1 : -1] for s in range(1, 4)]
    loss, sums = train_eagle.ttt_loss(None, shifted, target_logits, scored, counts)
    assert all(total > 1.0 for total in sums)
    weights = [0.8 ** (s - 1) / count for s, count in zip(range(1, 4), counts)]
    assert float(loss) == pytest.approx(sum(w * total for w, total in zip(weights, sums)), rel=1e-5)


def test_accepted_length_counts_the_leading_matches_plus_the_bonus_token():
    # roots 0 1 2 (T = 7, k = 4); matches by step: root 0: 1 1 0 1 -> 3, root 1: 0 1 1 1 -> 1, root 2: 1 1 1 1 -> 5
    per_root = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    matches = [torch.zeros(1, 7 - s, dtype=torch.bool) for s in range(1, 5)]
    for step in range(4):
        matches[step][0, :3] = per_root[:, step]
    scored = torch.ones(1, 7, dtype=torch.bool)
    assert [float(x) for x in train_eagle.accepted_lengths(matches, scored)] == [9.0, 3.0]
    scored[0, 6] = False  # root 2 needs p_3 .. p_6
    assert [float(x) for x in train_eagle.accepted_lengths(matches, scored)] == [4.0, 2.0]


# -- training ------------------------------------------------------------------------------------------------------


def repetitive_rows(count: int, length: int = 24) -> list[Sample]:
    patterns = [[5, 9, 14, 22, 31, 40], [7, 7, 50, 61], [12, 33, 44, 12, 70], [80, 3, 91]]
    return [Sample((patterns[index % len(patterns)] * length)[:length]) for index in range(count)]


def test_training_lowers_the_loss_at_every_unrolled_step():
    target = peaked_target()
    torch.manual_seed(0)
    head = EagleDraft.for_target(target, torch.arange(3, 96)).float()
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    rows = repetitive_rows(8)
    losses = [train_eagle.train_step(head, target, rows, optimizer, steps=3, pad_id=0, rows=head.target_ids,
                                     micro_batch_size=4) for _ in range(30)]
    first, last = losses[0], losses[-1]
    assert all(after < 0.3 * before for before, after in zip(first, last)), (first, last)


def test_train_step_runs_the_head_once_per_unrolled_step_and_micro_batch():
    target = peaked_target()
    head = EagleDraft.for_target(target, torch.arange(3, 96)).float()
    calls = []
    head.register_forward_hook(lambda module, args, kwargs_or_output: calls.append(1))
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
    losses = train_eagle.train_step(head, target, repetitive_rows(4, 12), optimizer, steps=5, pad_id=0,
                                    rows=head.target_ids, micro_batch_size=2)
    assert len(losses) == 5 and len(calls) == 2 * 5


def test_held_out_numbers_are_what_drafting_from_the_cache_gets_against_generate():
    """First-token agreement, the accepted length of 4-draft greedy chains and the acceptance by position given the
    earlier positions were accepted (the loop's quantity), recomputed root by root: the head drafts from a cache with
    its own tokens; the target's greedy tokens come from its own ``generate``."""
    target = peaked_target()
    torch.manual_seed(0)
    head = EagleDraft.for_target(target, torch.arange(3, 80)).float()
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    prompts = [[5, 9, 14], [7, 7, 50, 61, 8], [12, 33, 44, 12], [80, 3, 91, 4, 4, 4]]
    continuations = train_eagle.continue_greedily(target, prompts, 14, 0, [EOS])
    samples = [Sample(prompt + continuation, len(prompt) - 1) for prompt, continuation in zip(prompts, continuations)]
    for _ in range(15):
        train_eagle.train_step(head, target, samples, optimizer, steps=3, pad_id=0, rows=head.target_ids,
                               micro_batch_size=4)
    held_out = train_eagle.prepare_held_out(target, head.aux_layer_ids, samples, 0, head.target_ids, 2, "cpu")
    metrics = train_eagle.evaluate(head, held_out)

    agree = agree_count = accepted = chains = 0
    reached_by_position, accepted_by_position = [0] * 4, [0] * 4
    with torch.no_grad():
        for sample in samples:
            features = features_of(head, target, torch.tensor([sample.ids]))[0]
            for root in range(sample.loss_from - 1, len(sample.ids) - 2):  # p_{root+1} scored
                context = sample.ids[: root + 2]
                greedy = target.generate(torch.tensor([context]), do_sample=False, max_new_tokens=4,
                                         pad_token_id=0)[0, len(context):].tolist()
                drafted = []
                _, first = draft_from_cache(head, context, features, [])
                drafted.append(first[0])
                while len(drafted) < 4:
                    drafted = draft_from_cache(head, context, features, drafted)[1]
                agree += drafted[0] == greedy[0]
                agree_count += 1
                for position in range(min(4, len(sample.ids) - 2 - root)):  # p_{root+1+position} scored
                    reached_by_position[position] += 1
                    if drafted[position] != greedy[position]:
                        break
                    accepted_by_position[position] += 1
                if root + 4 <= len(sample.ids) - 2:  # p_{root+1} .. p_{root+4} scored
                    leading = next((index for index in range(4) if drafted[index] != greedy[index]), 4)
                    accepted += 1 + leading
                    chains += 1
    assert agree_count > 20 and 0 < agree < agree_count
    assert metrics["agreement"] == pytest.approx(agree / agree_count, abs=1e-12)
    assert metrics["accepted"] == pytest.approx(accepted / chains, abs=1e-12)
    assert metrics["conditional"] == list(zip(accepted_by_position, reached_by_position))
    assert reached_by_position[0] > reached_by_position[1] > 0 and accepted_by_position[1] > 0


# -- saving ----------------------------------------------------------------------------------------------------------


def test_a_saved_head_loads_back_in_the_published_format_and_drafts_the_same_tokens(tmp_path):
    target = peaked_target()
    torch.manual_seed(0)
    vocabulary = torch.tensor([1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 90, 91, 92, 93, 94, 95])
    head = EagleDraft.for_target(target, vocabulary)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(0.05 * torch.randn_like(param))  # not the initial weights
    head.save_pretrained(tmp_path)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 16 and config["vocab_size"] == 96 and config["target_hidden_size"] == 32
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # hs[2, 4, 5], SpecForge ids
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["fc.weight"].shape == (32, 96) and tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)
    assert tensors["lm_head.weight"].shape == (16, 32) and "embed_tokens.weight" not in tensors
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(torch.arange(16) + tensors["d2t"], vocabulary)
    assert tensors["t2d"].dtype == torch.bool and torch.equal(tensors["t2d"].nonzero().flatten(), vocabulary)

    loaded = EagleDraft.from_pretrained(tmp_path, target=target)
    assert loaded.aux_layer_ids == head.aux_layer_ids and torch.equal(loaded.target_ids, head.target_ids)
    for (name, mine), (other, theirs) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert name == other and torch.equal(mine, theirs), name
    rows = [torch.randint(3, 96, (length,)).tolist() for length in (3, 7, 12)]
    with torch.no_grad():
        for row in rows:
            features = features_of(head, target, torch.tensor([row]))[0]
            drafts = [draft_from_cache(model, row, features, [])[1] for model in (head, loaded)]
            for _ in range(3):
                drafts = [draft_from_cache(model, row, features, tokens)[1] for model, tokens in
                          zip((head, loaded), drafts)]
            assert drafts[0] == drafts[1] and set(drafts[0]) <= set(vocabulary.tolist())


# -- the command -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    """A tiny target (8 layers, peaked outputs) with a word-level tokenizer and chat template, and 40 chats."""
    folder = tmp_path_factory.mktemp("train_eagle")
    model_dir = tiny_model_dir(folder / "model")
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=29, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.lm_head.weight.data.mul_(GAIN)
    model.save_pretrained(model_dir)
    return model_dir, tiny_sharegpt(folder / "chats.json")


def run(*argv: str) -> int:
    args = build_parser().parse_args(["train-eagle", *argv])
    return args._main(args)


def held_out_rows(output) -> list[Sample]:
    """The held-out rows of a run: prompt + the target's continuation, scored on the continuation."""
    rows = []
    for line in (output / train_eagle.CONTINUATIONS["held_out"]).read_text().splitlines():
        batch = json.loads(line)
        rows += [Sample(prompt + continuation, len(prompt) - 1)
                 for prompt, continuation in zip(batch["prompts"], batch["continuations"])]
    return rows


def common(material, output) -> list[str]:
    model_dir, data = material
    return ["--target", model_dir, "--data", data, "--output", str(output), "--device", "cpu", "--seq-len", "40",
            "--gen-tokens", "16", "--batch-size", "4", "--micro-batch-size", "2", "--eval-samples", "4",
            "--eval-every", "3", "--ttt-steps", "3", "--draft-vocab", "20", "--lr", "1e-2", "--gen-batch-size", "8"]


def test_the_command_trains_resumes_to_the_same_weights_and_writes_a_loadable_head(material, tmp_path, capsys):
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert run(*common(material, whole), "--max-steps", "6") == 0
    assert run(*common(material, halves), "--max-steps", "3") == 0
    assert run(*common(material, halves), "--max-steps", "6", "--resume") == 0
    out = capsys.readouterr().out
    assert "resuming at step 3" in out and "held-out first-token agreement" in out

    weights = [load_file(folder / "model.safetensors") for folder in (whole, halves)]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
    checkpoints = [torch.load(folder / "checkpoint.pt", weights_only=False) for folder in (whole, halves)]
    assert checkpoints[0]["step"] == checkpoints[1]["step"] == 6
    assert checkpoints[0]["seen"] == checkpoints[1]["seen"] > 0
    for state, other in zip(checkpoints[0]["optimizer"]["state"].values(),
                            checkpoints[1]["optimizer"]["state"].values()):
        assert torch.equal(state["exp_avg_sq"], other["exp_avg_sq"])

    record = json.loads((whole / "PROVENANCE.json").read_text())
    training = record["training"]
    assert training["steps"] == 6 and training["ttt_steps"] == 3 and training["tokens_seen"] > 0
    assert training["stopped"] == "--max-steps 6 reached" and training["wall_seconds"] > 0
    assert all(len(entry["train_kl_by_step"]) == 3 for entry in record["history"][1:])
    assert "SHAREGPT_RESERVED_TAIL" in record["data"]["source"] and record["machine"]["device"] == "cpu"
    assert len(json.loads((halves / "PROVENANCE.json").read_text())["training"]["sessions"]) == 2
    assert (whole / "PROVENANCE.md").read_text().startswith("# An EAGLE-3 head")

    # the saved head, reloaded, measures what the in-memory head measured at the end of training
    from tetris_hf.tools.models import load_target

    target, _ = load_target(material[0])
    head = EagleDraft.from_pretrained(whole, target=target)
    samples = held_out_rows(whole)
    held_out = train_eagle.prepare_held_out(target, head.aux_layer_ids, samples, 0, head.target_ids, 2, "cpu")
    metrics = train_eagle.evaluate(head, held_out)
    assert round(metrics["agreement"], 4) == record["held_out"]["agreement"]
    assert round(metrics["accepted"], 4) == record["held_out"]["accepted"]
    assert [list(pair) for pair in metrics["conditional"]] == record["held_out"]["conditional_counts"]

    # what was generated, and how fast, is recorded; the held-out label says what the held-out rows were
    generation = record["data"]["generation"]
    assert generation["train"]["prompts"] == 35 and generation["held_out"]["prompts"] == 4
    assert all(stats["tokens"] > 0 and stats["tokens_per_second"] > 0 for stats in generation.values())
    held_label = next(line for line in (whole / "PROVENANCE.md").read_text().splitlines()
                      if line.startswith("Held out:"))
    assert "greedy continuations" in held_label and "assistant tokens" in held_label

    with pytest.raises(UsageError, match="holds an earlier run: pass --resume"):
        run(*common(material, whole), "--max-steps", "7")
    with pytest.raises(UsageError, match="--ttt-steps 3 then, 4 now"):
        run(*common(material, whole), "--max-steps", "7", "--resume", "--ttt-steps", "4")


def test_a_run_can_start_from_a_trained_head_and_train_on_fewer_prompts(material, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    assert run(*common(material, first), "--max-steps", "3") == 0
    argv = common(material, second)
    del argv[argv.index("--draft-vocab") : argv.index("--draft-vocab") + 2]  # the head's own vocabulary
    assert run(*argv, "--init-head", str(first), "--train-prompts", "8", "--max-steps", "2") == 0

    before, after = (json.loads((folder / "PROVENANCE.json").read_text()) for folder in (first, second))
    # step 0 of the second run measures the first run's final head, on the same held-out rows
    start = after["history"][0]
    for key in ("agreement", "accepted", "conditional_counts", "step_agreement"):
        assert start[key] == before["held_out"][key], key
    assert before["history"][0]["accepted"] != before["held_out"]["accepted"]  # (the first run did learn something)
    assert after["draft_vocabulary"].startswith("--init-head's: 20 of 29")
    first_head, second_head = (load_file(folder / "model.safetensors") for folder in (first, second))
    assert torch.equal(first_head["d2t"], second_head["d2t"])
    assert not torch.equal(first_head["fc.weight"], second_head["fc.weight"])  # trained on from there
    assert after["data"]["generation"]["train"]["prompts"] == 8  # only the first 8 training chats' first turns
    assert str(first) in (second / "PROVENANCE.md").read_text().split("- initial weights: ")[1].splitlines()[0]
    assert "--init-head" in after["command"] and "--train-prompts 8" in after["command"]

    with pytest.raises(UsageError, match="--init-head takes the head's own draft vocabulary"):
        run(*common(material, tmp_path / "third"), "--init-head", str(first))
    with pytest.raises(UsageError, match="no config.json there"):
        run(*argv[:argv.index("--output")], "--output", str(tmp_path / "fourth"), *argv[argv.index("--output") + 2:],
            "--init-head", str(tmp_path / "nowhere"))


@pytest.mark.parametrize("precision, loss_mask", [("--no-bf16", "all"), ("--bf16", "assistant")])
def test_whole_chats_without_self_distillation(material, tmp_path, precision, loss_mask):
    argv = [*common(material, tmp_path), "--no-self-distill", "--tokens", "480", precision, "--loss-mask", loss_mask]
    assert run(*argv) == 0
    record = json.loads((tmp_path / "PROVENANCE.json").read_text())
    assert record["data"]["self_distill"] is False and record["training"]["tokens_seen"] >= 480
    assert record["training"]["bf16"] is (precision == "--bf16") and record["data"]["loss_mask"] == loss_mask
    assert record["held_out"]["agreement"] >= 0.0  # evaluated (under the same autocast as training)
    assert ("assistant tokens" in record["data"]["training"]) is (loss_mask == "assistant")
    # the recorded command, parsed back, is this run's: --no-self-distill and --no-bf16 included
    recorded = build_parser().parse_args(shlex.split(record["command"])[1:])
    assert vars(recorded) == vars(build_parser().parse_args(["train-eagle", *argv]))
    assert recorded.self_distill is False and recorded.bf16 is (precision == "--bf16")


@pytest.mark.parametrize("flags, message", [
    (["--draft-vocab", "30"], "--draft-vocab 30 exceeds the target's 29-token vocabulary"),
    (["--device", "nonsense"], "unknown --device 'nonsense'"),
    (["--eval-samples", "40"], "all taken by --eval-samples 40: nothing left to train on"),
    (["--ttt-steps", "39"], "--seq-len 40 leaves no room to unroll --ttt-steps 39"),
    (["--gen-tokens", "40"], "leaves no room for a prompt"),
    (["--resume"], "checkpoint.pt does not exist"),
    (["--train-prompts", "0"], "--train-prompts must be a positive number"),
])
def test_bad_input_is_refused_with_a_clear_error(material, tmp_path, flags, message):
    with pytest.raises(UsageError, match=message):
        run(*common(material, tmp_path / "out"), *flags)


@pytest.mark.parametrize("content, message", [
    ('[{"id": "1", "conversations": [{"from": "gpt", "value": "hello"}]}]', "holds no chat that starts with a human"),
    ("[]", "holds no complete record"),
])
def test_empty_data_is_refused(material, tmp_path, content, message):
    data = tmp_path / "empty.json"
    data.write_text(content)
    argv = common(material, tmp_path / "out")
    argv[argv.index("--data") + 1] = str(data)
    with pytest.raises(UsageError, match=message):
        run(*argv)
