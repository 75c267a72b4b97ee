"""The EAGLE-3 recipe of ``tetris-hf train-eagle`` against the reference trainer's (issue #32, part 3).

The loss mask takes the assistant tokens of a chat-templated row and nothing else, and drops positions whose target
argmax the draft vocabulary cannot draft; the unroll defaults to the reference's 7 steps; the held-out acceptance by
position is conditional, as the decoding loop counts it, with Wilson intervals; the self-distilled continuations are
generated in batches into a file that an interrupted run continues; the recorded command parses back to the run's
arguments, and the provenance's held-out label says what the held-out rows were.
"""

from __future__ import annotations

import json
import math
import shlex

import pytest
import torch
from transformers import AutoTokenizer

from test_models import tiny_model_dir
from tiny_models import EOS, PAD, random_prompts, sharpen, tiny_llama
from tetris_hf.tools import train_eagle
from tetris_hf.tools.cli import UsageError, build_parser
from tetris_hf.tools.train_eagle import Sample

CHAT = [
    {"role": "system", "content": "you are small"},
    {"role": "user", "content": "what is the cat"},
    {"role": "assistant", "content": "a cat is a small dog"},
    {"role": "user", "content": "why"},
    {"role": "assistant", "content": "the dog sat on the mat"},
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A word-level tokenizer with a ChatML-like template: ``<|im_start|> role content <|im_end|>`` per turn."""
    return AutoTokenizer.from_pretrained(tiny_model_dir(tmp_path_factory.mktemp("chat") / "model"))


# -- the loss mask ----------------------------------------------------------------------------------------------------


def test_the_assistant_mask_is_exactly_the_assistant_turns_content_and_end_of_turn_tokens(chat_tokenizer):
    ids, assistant = train_eagle.assistant_tokens([CHAT], chat_tokenizer, max_tokens=1000)
    words = chat_tokenizer.convert_ids_to_tokens(ids.tolist())
    assert " ".join(words) == ("<|im_start|> system you are small <|im_end|> <|im_start|> user what is the cat <|im_end|> "
                               "<|im_start|> assistant a cat is a small dog <|im_end|> <|im_start|> user why "
                               "<|im_end|> <|im_start|> assistant the dog sat on the mat <|im_end|>")
    masked = [word for word, flag in zip(words, assistant.tolist()) if flag]
    assert masked == "a cat is a small dog <|im_end|> the dog sat on the mat <|im_end|>".split()
    # the first assistant turn is tokens 15-21 (p_14 .. p_20 predict them), the second 28-34 (p_27 .. p_33)
    assert [t for t, flag in enumerate(assistant.tolist()) if flag] == [*range(15, 22), *range(28, 35)]
    scored = Sample(ids.tolist(), labels=assistant.tolist()).scored()
    assert [t for t, flag in enumerate(scored) if flag] == [*range(14, 21), *range(27, 34)]


def test_the_assistant_mask_follows_the_stream_across_chats_and_stops_at_max_tokens(chat_tokenizer):
    one, flags = train_eagle.assistant_tokens([CHAT], chat_tokenizer, max_tokens=1000)
    two, _ = train_eagle.assistant_tokens([CHAT[:3]], chat_tokenizer, max_tokens=1000)
    cut = len(one) + len(two) - 3  # the second chat's last 3 tokens, "small dog <|im_end|>", are cut off
    ids, assistant = train_eagle.assistant_tokens([CHAT, CHAT[:3], CHAT], chat_tokenizer, max_tokens=cut)
    assert ids.shape == assistant.shape == (cut,)
    assert torch.equal(ids[: len(one)], one) and torch.equal(assistant[: len(one)], flags)
    assert assistant[len(one):].tolist() == [False] * 15 + [True] * 4  # "a cat is a" of its assistant turn


def test_positions_whose_target_argmax_the_draft_vocabulary_lacks_are_not_scored(monkeypatch):
    """``--loss-mask assistant`` with a reduced vocabulary (the reference's ``t2d[argmax] * loss_mask``): the loss
    sees the assistant mask AND the target argmax inside the draft vocabulary; the denominator keeps every assistant
    position."""
    target = sharpen(tiny_llama(64, num_layers=6, seed=3), 30.0)
    from tetris_hf.candidate_generators.eagle import EagleDraft

    vocabulary = torch.arange(3, 40)
    head = EagleDraft.for_target(target, vocabulary).float()
    in_vocab = torch.zeros(64, dtype=torch.bool)
    in_vocab[vocabulary] = True
    samples = [Sample(list(range(5, 17)), loss_from=4), Sample(list(range(20, 30)), loss_from=2)]
    seen = {}

    def spy(head_, outputs, target_draft, scored, counts):
        seen["scored"], seen["counts"] = scored, counts
        return outputs[0].sum() * 0, [0.0] * len(outputs)

    monkeypatch.setattr(train_eagle, "ttt_loss", spy)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
    train_eagle.train_step(head, target, samples, optimizer, steps=2, pad_id=0, rows=head.target_ids,
                           micro_batch_size=2, in_draft_vocab=in_vocab)
    input_ids, attention_mask, assistant = train_eagle.pack(samples, 0, "cpu")
    with torch.no_grad():
        argmax = target(input_ids, attention_mask=attention_mask).logits.argmax(dim=-1)
    assert torch.equal(seen["scored"], assistant & in_vocab[argmax])
    assert 0 < int(seen["scored"].sum()) < int(assistant.sum())  # some argmaxes fall outside, some inside
    assert seen["counts"] == [int(assistant[:, s:].sum()) for s in (1, 2)]


# -- training-time test ---------------------------------------------------------------------------------------------


def test_the_unroll_defaults_to_the_reference_seven_steps_and_is_configurable():
    parse = build_parser().parse_args
    assert parse(["train-eagle", "--output", "x"]).ttt_steps == 7 == train_eagle.DEFAULT_TTT_STEPS
    assert parse(["train-eagle", "--output", "x", "--ttt-steps", "3"]).ttt_steps == 3


# -- the held-out metric ----------------------------------------------------------------------------------------------


def test_conditional_acceptance_counts_a_position_only_after_the_earlier_ones_were_accepted():
    # T = 8, k = 3: matches of step s are (1, 8 - s); roots 0 .. 4 with every p_t scored (t = 1 .. 7)
    by_root = {0: [1, 1, 0], 1: [0, 1, 1], 2: [1, 0, 1], 3: [1, 1, 1], 4: [1, 1, 1]}
    matches = [torch.zeros(1, 8 - s, dtype=torch.bool) for s in (1, 2, 3)]
    for root, flags in by_root.items():
        for step, flag in enumerate(flags):
            matches[step][0, root] = bool(flag)
    matches[0][0, 5:] = torch.tensor([True, False])  # roots 5, 6 reach position 1 only (then the row ends)
    matches[1][0, 5] = True
    scored = torch.ones(1, 8, dtype=torch.bool)
    scored[0, 7] = False  # the last position never is
    accepted, reached = train_eagle.conditional_acceptance(matches, scored)
    # position 1: roots 0..5 (p_{j+1}, j <= 5), accepted 0 2 3 4 5 -> 5/6
    # position 2: roots 0 2 3 4 (accepted 1; root 5 would need p_7), accepted 0 3 4 -> 3/4
    # position 3: roots 0 3 4 (accepted 1, 2), accepted 3 4 (root 4 needs p_7: not scored) -> roots 0 3: 1/2
    assert reached == [6, 4, 2] and accepted == [5, 3, 1]
    teacher_forced = [int((match & scored[:, s:]).sum()) for s, match in enumerate(matches, start=1)]
    assert teacher_forced == [5, 4, 3]  # unconditioned: every root counted at every step


def test_walked_chains_start_where_the_last_chain_emitted_its_tokens():
    """The loop's roots: after a chain that accepts a drafts, the next starts a + 1 positions on."""
    scored = torch.tensor([[True] * 6 + [False]])
    first = torch.tensor([[1, 0, 0, 1, 0, 1]], dtype=torch.bool)  # step 1 matches at roots 0, 3, 5
    second = torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.bool)  # step 2 matches at roots 1 .. 4
    accepted, reached, tokens, chains = train_eagle.walked_acceptance([first, second], scored)
    # chains at root 0 (accepts 1: 2 tokens), root 2 (0: 1 token), root 3 (2: 3 tokens); root 6 is not scored
    assert (accepted, reached, tokens, chains) == ([2, 1], [3, 2], 6, 3)
    # every root instead: step 1 reached at roots 0 .. 4 (p_{j+1} scored), step 2 at roots 0 and 3
    assert train_eagle.conditional_acceptance([first, second], scored) == ([2, 1], [5, 2])
    # rows are walked apart; a row with no scored position drafts nothing
    both = train_eagle.walked_acceptance([torch.cat([first, first]), torch.cat([second, second])],
                                         torch.cat([scored, torch.zeros_like(scored)]))
    assert both == ([2, 1], [3, 2], 6, 3)
    # a root drafts only where its first draft is scored: p_0 alone (a continuation of one token) gives no chain
    assert train_eagle.walked_acceptance([torch.ones(1, 3, dtype=torch.bool)],
                                         torch.tensor([[True, False, False, False]])) == ([0], [0], 0, 0)


def test_wilson_intervals_match_the_textbook_values():
    low, high = train_eagle.wilson_interval(5, 10)
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)
    assert [round(x, 4) for x in train_eagle.wilson_interval(0, 10)] == [0.0, 0.2775]
    assert [round(x, 4) for x in train_eagle.wilson_interval(10, 10)] == [0.7225, 1.0]
    assert all(math.isnan(x) for x in train_eagle.wilson_interval(0, 0))


# -- self-distilled data ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target():
    return sharpen(tiny_llama(64, num_layers=2, seed=5), 10.0)


SETTINGS = {"target": "tiny", "max_new_tokens": 6}


def counting_generate(target, calls):
    def generate(batch):
        calls.append(len(batch))
        return train_eagle.continue_greedily(target, batch, 6, PAD, [EOS])

    return generate


def test_continuations_come_from_batched_generate_calls_and_the_file_records_their_speed(tiny_target, tmp_path,
                                                                                          capsys, monkeypatch):
    prompts = random_prompts(9, 64, seed=1)
    generate_calls = []
    original = tiny_target.generate
    monkeypatch.setattr(tiny_target, "generate",
                        lambda *a, **k: generate_calls.append(k["input_ids"].shape[0]) or original(*a, **k))
    path = tmp_path / "continuations.jsonl"
    batches = []
    continuations, stats = train_eagle.generate_continuations(path, prompts, counting_generate(tiny_target, batches),
                                                              batch_size=4, settings=SETTINGS)
    assert batches == generate_calls == [4, 4, 1]  # one batched generate() per 4 prompts
    assert continuations == [train_eagle.continue_greedily(tiny_target, [p], 6, PAD, [EOS])[0] for p in prompts]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["first"] for line in lines] == [0, 4, 8] and sum(line["seconds"] for line in lines) > 0
    assert stats["prompts"] == 9 and stats["tokens"] == sum(map(len, continuations))
    assert stats["tokens_per_second"] == pytest.approx(stats["tokens"] / stats["seconds"], rel=0.05)
    assert "tokens/s" in capsys.readouterr().out


def test_a_partial_file_is_continued_not_restarted(tiny_target, tmp_path):
    prompts = random_prompts(9, 64, seed=2)
    path = tmp_path / "continuations.jsonl"
    first = []
    done, _ = train_eagle.generate_continuations(path, prompts[:5], counting_generate(tiny_target, first),
                                                 batch_size=2, settings=SETTINGS)
    assert first == [2, 2, 1]
    again = []
    continuations, stats = train_eagle.generate_continuations(path, prompts, counting_generate(tiny_target, again),
                                                              batch_size=2, settings=SETTINGS)
    assert again == [2, 2] and continuations[:5] == done and len(continuations) == stats["prompts"] == 9
    # a deadline already past starts no call: the file's continuations so far, and None
    late = []
    partial, stats = train_eagle.generate_continuations(tmp_path / "other.jsonl", prompts, counting_generate(
        tiny_target, late), batch_size=2, settings=SETTINGS, deadline=0.0)
    assert partial is None and late == [] and stats["prompts"] == 0


def test_a_cut_off_last_line_is_dropped_with_a_message_and_generated_again(tiny_target, tmp_path, capsys):
    prompts = random_prompts(6, 64, seed=3)
    path = tmp_path / "continuations.jsonl"
    whole, _ = train_eagle.generate_continuations(path, prompts, counting_generate(tiny_target, []), batch_size=2,
                                                  settings=SETTINGS)
    text = path.read_bytes()
    path.write_bytes(text[: len(text) - 17])  # the last line's write was interrupted
    capsys.readouterr()
    calls = []
    continuations, _ = train_eagle.generate_continuations(path, prompts, counting_generate(tiny_target, calls),
                                                          batch_size=2, settings=SETTINGS)
    assert "its last line (line 3) is cut off" in capsys.readouterr().out
    assert calls == [2] and continuations == whole
    assert [json.loads(line)["first"] for line in path.read_text().splitlines()] == [0, 2, 4]


@pytest.mark.parametrize("damage, message", [
    (lambda text, lines: "\n".join(["{not json"] + lines[1:]) + "\n", "line 1 is not a line that train-eagle writes"),
    (lambda text, lines: text.replace('"max_new_tokens": 6', '"max_new_tokens": 7'), "other prompts or settings"),
])
def test_a_file_of_other_settings_or_damaged_before_its_end_is_refused(tiny_target, tmp_path, damage, message):
    prompts = random_prompts(6, 64, seed=4)
    path = tmp_path / "continuations.jsonl"
    train_eagle.generate_continuations(path, prompts, counting_generate(tiny_target, []), batch_size=2,
                                       settings=SETTINGS)
    text = path.read_text()
    path.write_text(damage(text, text.splitlines()))
    with pytest.raises(UsageError, match=message):
        train_eagle.generate_continuations(path, prompts, counting_generate(tiny_target, []), batch_size=2,
                                           settings=SETTINGS)


# -- provenance -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [
    [],
    ["--no-self-distill", "--no-bf16", "--loss-mask", "all"],
    ["--self-distill", "--bf16", "--resume", "--max-seconds", "4300", "--lr", "0.002", "--ttt-steps", "3"],
    ["--target", "some dir/with spaces", "--data", "it's.json", "--max-steps", "5", "--vocab-tokens", "1000"],
    ["--init-head", "a head/dir", "--train-prompts", "640"],
])
def test_a_recorded_command_parses_back_to_the_same_arguments(flags):
    """So that running it again trains the same head: every argument written out, ``--no-x`` included."""
    args = build_parser().parse_args(["train-eagle", "--output", "out dir", *flags])
    command = train_eagle.command_line(args)
    words = shlex.split(command)
    assert words[:2] == ["tetris-hf", "train-eagle"]
    assert vars(build_parser().parse_args(words[1:])) == vars(args)


def test_the_held_out_label_is_the_held_out_data_the_record_names(tmp_path):
    history = [{"step": 0, "tokens": 0, "agreement": 0.5, "accepted": 1.5, "step_agreement": [0.5, 0.25],
                "conditional_acceptance": [0.5, None], "conditional_counts": [[1, 2], [0, 0]],
                "conditional_wilson95": [[0.0945, 0.9055], None], "kl": 1.0, "coverage": 0.9}]
    record = {"format": "f", "target": "t", "aux_hidden_states": [2, 4, 5], "draft_vocabulary": "v",
              "data": {"source": "s", "held_out": "whole chats rendered with the chat template, every position",
                       "training": "rows", "generation": {"held_out": None, "train": None}},
              "training": {"loss": "l", "lr": 0.1, "bf16": False, "steps": 1, "batch_size": 2, "tokens_seen": 3,
                           "scored_positions_seen": 2, "epochs": 0.1, "wall_seconds": 1.0, "tokens_per_second": 3.0,
                           "stopped": "done"},
              "held_out": history[-1], "history": history, "machine": {}, "command": "tetris-hf train-eagle"}
    train_eagle._write_provenance(tmp_path, record)
    text = (tmp_path / "PROVENANCE.md").read_text()
    label = next(line for line in text.splitlines() if line.startswith("Held out:"))
    assert label.startswith("Held out: whole chats rendered with the chat template, every position.")
    assert "greedy continuations" not in label and "continuations generated (batched generate()): none" in text
    assert "| 0 | 0 | [0.5, 0.25] | 0.500 [0.095, 0.905] (1/2); - (0/0) | 1.50 | 0.900 |" in text
