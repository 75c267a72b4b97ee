"""Reduced-vocabulary drafts (``tetris_draft_vocab``): the draft scores only a subset of tokens, output stays the
target's own (greedy: token for token; sampling: in distribution), bad subsets are refused before any forward."""

import pytest
import torch
from transformers import DynamicCache

import tetris_hf  # noqa: F401
from tetris_hf.candidate_generators.reduced_vocab import (
    ReducedVocabDraft,
    attach_token_counts,
    most_frequent,
    reduced_vocab_draft,
    token_counts,
)
from tetris_hf.cost_model import CostProfile, profile_key
from test_bad_input import refused
from test_greedy_exactness import generate_checked, pick_eos, target_alone
from test_sampling_distribution import CHEAP_VERIFY, ROWS, chi_square_p_value, exact_joint, sampled_joint
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, sharpen, target_and_draft, tiny_llama

# ---------------------------------------------------------------------------------------------------------------
# The wrapper computes the full model's logits on the subset, -inf elsewhere


def test_subset_logits_equal_the_full_models_and_the_rest_is_minus_inf():
    model = tiny_llama(50, seed=3)
    ids = torch.tensor([3, 7, 11, 20, 49])
    wrapper = ReducedVocabDraft(model, ids)
    prompt = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 0] = 0  # a hole in row 0's cache
    full_cache, reduced_cache = DynamicCache(), DynamicCache()
    with torch.no_grad():
        full = model(input_ids=prompt, attention_mask=mask[:, :6], past_key_values=full_cache, use_cache=True).logits
        reduced = wrapper(input_ids=prompt, attention_mask=mask[:, :6], past_key_values=reduced_cache,
                          use_cache=True).logits
        assert reduced.shape == full.shape == (2, 6, 50)
        torch.testing.assert_close(reduced[..., ids], full[..., ids])
        outside = torch.ones(50, dtype=torch.bool)
        outside[ids] = False
        assert torch.isneginf(reduced[..., outside]).all()
        # one more token on the caches, keeping the last logit only
        step = torch.tensor([[5], [9]])
        positions = torch.tensor([[5], [6]])
        full = model(input_ids=step, attention_mask=mask, position_ids=positions, past_key_values=full_cache,
                     use_cache=True, logits_to_keep=1).logits
        reduced = wrapper(input_ids=step, attention_mask=mask, position_ids=positions, past_key_values=reduced_cache,
                          use_cache=True, logits_to_keep=1).logits
    torch.testing.assert_close(reduced[..., ids], full[..., ids])


def test_the_head_copy_follows_in_place_changes_of_the_head():
    model = tiny_llama(30, seed=5)
    wrapper = ReducedVocabDraft(model, torch.tensor([2, 4, 8]))
    prompt = torch.tensor([[3, 9, 12]])
    with torch.no_grad():
        model.lm_head.weight.mul_(3)  # e.g. a training step
        torch.testing.assert_close(wrapper(prompt).logits[..., [2, 4, 8]], model(prompt).logits[..., [2, 4, 8]])


def _tiny(config_class, model_class, **extra):
    config = config_class(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, **extra)
    torch.manual_seed(0)
    return model_class(config).eval()


def _families():
    from transformers import (
        CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
        GraniteConfig, GraniteForCausalLM,
    )

    return {
        "gemma2 (final_logit_softcapping)": lambda: _tiny(Gemma2Config, Gemma2ForCausalLM, final_logit_softcapping=0.5),
        "gemma3 (final_logit_softcapping)": lambda: _tiny(Gemma3TextConfig, Gemma3ForCausalLM,
                                                          final_logit_softcapping=0.5),
        "cohere (logit_scale)": lambda: _tiny(CohereConfig, CohereForCausalLM, logit_scale=0.3),
        "granite (logits_scaling)": lambda: _tiny(GraniteConfig, GraniteForCausalLM, logits_scaling=4.0),
    }


@pytest.mark.parametrize("family", list(_families()))
def test_head_post_processing_is_kept(family):
    model = _families()[family]()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)  # logits large enough for soft-capping and scaling to matter
    wrapper = reduced_vocab_draft(model, torch.arange(5, 25))
    wrapper.check_against()  # raises if the subset's logits differ from the full model's
    prompt = torch.tensor([[4, 9, 13, 30]])
    with torch.no_grad():
        full = model(prompt).logits[..., 5:25]
        assert full.abs().max() > 0.1  # the post-processing changed something measurable
        torch.testing.assert_close(wrapper(prompt).logits[..., 5:25], full)


def test_unknown_post_processing_is_refused():
    class Doubled(type(tiny_llama(40))):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2 + 1
            return out

    model = Doubled(tiny_llama(40, seed=4).config).eval()
    with pytest.raises(ValueError, match="post-processes the head output"):
        reduced_vocab_draft(model, torch.arange(10))


# ---------------------------------------------------------------------------------------------------------------
# Greedy: token for token the target's output, with a subset that misses the target's argmax


def _half_vocab(vocab: int, seed: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: vocab // 2]


@pytest.mark.parametrize("vocab,batch,seed", [(64, 4, 0), (257, 6, 1)])
def test_greedy_rows_equal_target_alone_with_a_reduced_draft(vocab, batch, seed):
    target, draft = target_and_draft(vocab, seed, "noisy", noise=0.3)
    prompts = random_prompts(batch, vocab, seed)
    eos = pick_eos(target, prompts)
    references = target_alone(target, prompts, eos)
    subset = _half_vocab(vocab, seed)
    missed = sum(token not in set(subset.tolist()) for reference in references for token in reference)
    assert missed > 0, "the subset must miss some of the target's greedy tokens"
    input_ids, mask = left_pad(prompts)
    profile = CostProfile({(r, t): 10.0 + 0.1 * r * t for r in (1, 16) for t in (1, 2, 4, 8)}, {1: 0.5, 16: 1.0})
    runs = [
        dict(tetris_strategy="fixed", num_assistant_tokens=1),
        dict(tetris_strategy="fixed", num_assistant_tokens=3),
        dict(tetris_strategy="tetris", num_assistant_tokens=2, tetris_extra_tokens=2, tetris_budget=batch),
        dict(tetris_strategy="tetris", num_assistant_tokens=3, tetris_extra_tokens=1),
        dict(tetris_strategy="adaptive", num_assistant_tokens=2, tetris_extra_tokens=2, tetris_cost_profile=profile),
    ]
    accepted = 0
    for options in runs:
        stats = generate_checked(target, draft, input_ids, mask, references, eos, tetris_draft_vocab=subset,
                                 **options)
        accepted += stats.accepted_tokens
    assert accepted > 0  # the reduced draft is right sometimes


def test_int_size_takes_the_most_frequent_tokens_of_the_drafts_table():
    vocab = 80
    target, draft = target_and_draft(vocab, 7, "noisy", noise=0.3)
    counts = torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(1))
    attach_token_counts(draft, counts, "random test counts")
    wrapper = reduced_vocab_draft(draft, 30)
    assert torch.equal(wrapper.token_ids, torch.sort(counts, descending=True, stable=True).indices[:30].sort().values)
    assert reduced_vocab_draft(draft, 30) is wrapper  # cached per subset: the head copy and adaptive's memory persist
    prompts = random_prompts(3, vocab, 7)
    references = target_alone(target, prompts, eos=1)
    input_ids, mask = left_pad(prompts)
    generate_checked(target, draft, input_ids, mask, references, 1, tetris_draft_vocab=30, num_assistant_tokens=2)


def test_the_reduced_draft_is_profiled_as_a_draft_of_its_own():
    target, draft = target_and_draft(40, 8, "noisy")
    attach_token_counts(draft, torch.arange(40), "test")
    assert profile_key(target, reduced_vocab_draft(draft, 10)) != profile_key(target, draft)
    assert profile_key(target, reduced_vocab_draft(draft, 10)) != profile_key(target, reduced_vocab_draft(draft, 20))


def test_token_counts_and_most_frequent():
    class Tokenizer:  # one token per character
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[ord(c) - ord("a") for c in text] for text in texts]}

    counts = token_counts(Tokenizer(), ["abca", "cab", "d"], vocab_size=6)
    assert counts.tolist() == [3, 2, 2, 1, 0, 0]
    assert most_frequent(counts, 3).tolist() == [0, 1, 2]  # b and c tie: both kept, lower id first when cut
    assert most_frequent(counts, 2).tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------------------------
# Sampling: the joint law of the first tokens is the target's (chi-square), top-p included


@pytest.fixture(scope="module")
def sampling_pair():
    from test_sampling_distribution import VOCAB

    target = sharpen(tiny_llama(VOCAB, num_layers=2, seed=23, hidden_size=16), 12)
    draft = noisy_copy(target, 0.3, seed=5)  # agrees often, so the subset decides much of what is accepted
    return target, draft


@pytest.mark.parametrize("temperature,top_p,strategy,options", [
    (1.0, 1.0, "tetris", {}),
    (1.0, 0.8, "tetris", {}),
    (0.7, 0.9, "fixed", {}),
    (1.0, 1.0, "tetris", {"num_assistant_tokens": 1, "tetris_extra_tokens": 1, "tetris_budget": ROWS}),
    (1.0, 0.8, "adaptive", {"num_assistant_tokens": 1, "tetris_extra_tokens": 1, "tetris_budget": ROWS,
                            "tetris_cost_profile": CHEAP_VERIFY}),
])
def test_sampled_sequences_follow_the_target_distribution_with_a_reduced_draft(sampling_pair, temperature, top_p,
                                                                              strategy, options):
    from test_sampling_distribution import PROMPT

    target, draft = sampling_pair
    subset = torch.tensor([0, 3, 5])  # misses the target's argmax at some positions (checked below)
    with torch.no_grad():
        argmax = target(torch.tensor([PROMPT])).logits[0, -1].argmax().item()
    assert argmax not in subset.tolist()
    new_tokens = 4 if options else 3
    counts, stats = sampled_joint(target, draft, temperature, top_p, strategy, new_tokens=new_tokens,
                                  tetris_draft_vocab=subset, **options)
    assert 0 < stats.accepted_tokens < stats.verified_tokens
    assert chi_square_p_value(counts, exact_joint(target, temperature, top_p, new_tokens=new_tokens)) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# Bad subsets: refused with a message naming the problem, before any forward


@pytest.fixture(scope="module")
def models():
    return tiny_llama(40, seed=1), tiny_llama(40, num_layers=1, seed=2)


@pytest.mark.parametrize("value,error,match", [
    (41, ValueError, "larger than the draft's vocabulary"),
    (0, ValueError, ">= 1"),
    (True, TypeError, "int N"),
    (2.5, TypeError, "int N"),
    (torch.tensor([1, 40]), ValueError, "out of range"),
    (torch.tensor([-1, 3]), ValueError, "negative"),
    (torch.tensor([], dtype=torch.long), ValueError, "empty"),
    (torch.tensor([3, 5, 3]), ValueError, "duplicate"),
    (torch.tensor([[1, 2]]), TypeError, "1-D"),
    (torch.tensor([1.0, 2.0]), TypeError, "integer dtype"),
    (8, ValueError, "no token frequency table"),
])
def test_bad_draft_vocab_is_refused_before_any_forward(models, value, error, match):
    refused(models, error, match, tetris_draft_vocab=value)


def test_a_draft_that_is_already_reduced_is_refused(models):
    target, draft = models
    wrapper = ReducedVocabDraft(draft, torch.arange(10))
    with pytest.raises(ValueError, match="already has a reduced vocabulary"):
        target.generate(torch.tensor([[5, 6]]), assistant_model=wrapper, custom_generate="tetris", max_new_tokens=3,
                        pad_token_id=PAD, tetris_draft_vocab=5)


# ---------------------------------------------------------------------------------------------------------------
# The draft directory stores the table and the subset


def test_draft_directory_round_trip(tmp_path):
    from tetris_hf.tools.models import early_exit_draft, load_draft, load_draft_vocab, save_draft, save_draft_vocab

    target = tiny_llama(60, num_layers=3, seed=9)
    draft = early_exit_draft(target, 1)
    save_draft(draft, target, tmp_path)
    counts = torch.randint(0, 50, (60,), generator=torch.Generator().manual_seed(2))
    save_draft_vocab(tmp_path, counts, 20, "test counts", held_out_agreement={"20": 0.5})
    stored_counts, stored_ids, source = load_draft_vocab(tmp_path)
    assert torch.equal(stored_counts, counts) and source == "test counts"
    loaded = load_draft(target, str(tmp_path))
    assert torch.equal(reduced_vocab_draft(loaded, 20).token_ids, stored_ids)
    assert "20 most frequent in test counts" in reduced_vocab_draft(loaded, 20).tetris_description
    with pytest.raises(ValueError, match="between 1 and 60"):
        save_draft_vocab(tmp_path, counts, 61, "too many")


# ---------------------------------------------------------------------------------------------------------------
# The bench and the simulator take a draft vocabulary


def test_bench_repeats_every_speculative_run_per_draft_vocabulary():
    import tetris_hf.tools.bench as bench
    from tiny_tokenizer import SENTENCES, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    target = tiny_llama(len(tokenizer), num_layers=2, seed=61)
    draft = noisy_copy(target, 0.3, seed=62)
    attach_token_counts(draft, token_counts(tokenizer, SENTENCES, len(tokenizer)), "the test sentences")
    config = bench.BenchConfig(batch_size=3, max_new_tokens=8, strategies=("generate", "fixed", "adaptive"),
                               num_assistant_tokens=(2,), extra_tokens=(1,), draft_vocabs=(None, 12))
    report = bench.run_bench(target, draft, tokenizer, SENTENCES[:5], config, show_progress=False)
    assert [run["name"] for run in report["runs"]] == ["generate", "fixed k=2", "adaptive k=2 e=1",
                                                       "fixed k=2 N=12", "adaptive k=2 e=1 N=12"]
    assert report["mismatches"] == []
    assert report["runs"][3]["options"]["tetris_draft_vocab"] == 12
    assert [(c["vocab"], c["rows"]) for c in report["draft_cost"]] == [(None, 1), (None, 3), (12, 1), (12, 3)]
    assert "N=12" in bench.format_draft_costs(report["draft_cost"])


def test_bench_draft_vocab_flag():
    import argparse

    from tetris_hf.tools.bench import draft_vocab_list

    assert draft_vocab_list("full,8192,16384,8192") == (None, 8192, 16384)
    for bad in ("0", "-5", "big", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            draft_vocab_list(bad)


def test_simulate_records_traces_with_a_reduced_draft():
    from tetris_hf.tools.simulate import draft_as_ratio, record_traces

    target, draft = target_and_draft(64, 11, "noisy", noise=0.3)
    input_ids, mask = left_pad(random_prompts(3, 64, 11))
    rows = record_traces(target, draft, input_ids, mask, num_draft_tokens=3, draft_vocab=_half_vocab(64, 11),
                         max_new_tokens=10, do_sample=False, pad_token_id=PAD)
    assert rows and all(len(row["log_probs"]) == 3 for row in rows if row["verified"] == 3)
    profile = draft_as_ratio(CostProfile({(1, 1): 20.0, (1, 4): 30.0, (8, 1): 40.0}, {1: 9.0}), 0.1)
    assert profile.draft == {1: pytest.approx(2.0), 8: pytest.approx(4.0)}


def test_distill_stores_the_token_table_and_vocab_only_adds_one(tmp_path, capsys):
    import json

    from tetris_hf.tools import distill, models
    from test_models import distill_args, tiny_model_dir, tiny_sharegpt

    model_dir = tiny_model_dir(tmp_path / "model")
    data = tiny_sharegpt(tmp_path / "chats.json")
    common = ["--target", model_dir, "--data", data, "--layers", "1", "--tokens", "512", "--batch-size", "4",
              "--seq-len", "16", "--eval-tokens", "128", "--eval-every", "8", "--device", "cpu"]
    assert distill.main(distill_args(*common, "--draft-vocab", "12", "--eval-vocab", "20",
                                     "--output", str(tmp_path / "draft"))) == 0
    out = capsys.readouterr().out
    assert "with the 12 most frequent tokens only" in out and "with the 20 most frequent tokens only" in out
    entry = json.loads((tmp_path / "draft" / models.DRAFT_CONFIG_NAME).read_text())["draft_vocab"]
    assert entry["size"] == 12 and entry["counted_tokens"] == 512 and "ShareGPT" in entry["source"]
    assert set(entry["held_out_agreement"]) == {"12", "20"}
    counts, token_ids, _ = models.load_draft_vocab(tmp_path / "draft")
    assert token_ids.numel() == 12 and torch.equal(token_ids, most_frequent(counts, 12))

    (tmp_path / "draft" / models.DRAFT_VOCAB_NAME).unlink()  # a draft without a table, then --vocab-only
    assert distill.main(distill_args(*common, "--draft-vocab", "8", "--vocab-only", "--vocab-tokens", "300",
                                     "--output", str(tmp_path / "draft"))) == 0
    entry = json.loads((tmp_path / "draft" / models.DRAFT_CONFIG_NAME).read_text())["draft_vocab"]
    assert entry["size"] == 8 and entry["counted_tokens"] == 300


def test_distill_vocab_errors(tmp_path):
    from tetris_hf.tools import distill
    from tetris_hf.tools.cli import UsageError
    from test_models import distill_args

    with pytest.raises(UsageError, match="--vocab-only adds a --draft-vocab table"):
        distill.main(distill_args("--vocab-only", "--output", str(tmp_path)))
    with pytest.raises(UsageError, match="--draft-vocab must be a positive"):
        distill.main(distill_args("--draft-vocab", "0", "--output", str(tmp_path)))
    from test_models import tiny_model_dir

    model_dir = tiny_model_dir(tmp_path / "model")
    with pytest.raises(UsageError, match="--draft-vocab 500 exceeds the target's"):
        distill.main(distill_args("--target", model_dir, "--draft-vocab", "500", "--device", "cpu",
                                  "--output", str(tmp_path / "out")))
