"""EAGLE heads in the loop: every proposal equals the head run from scratch on its row's context with the target's
features, greedy rows equal the target alone, sampling follows the target's law, host reads stay bounded."""

import pytest
import torch
from transformers import DynamicCache

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
import tetris_hf.logits.verification as verification
from eagle_checkpoints import VOCAB, eagle1_checkpoint, eagle3_checkpoint, tiny_target, write_checkpoint
from tetris_hf import EagleDraft
from tetris_hf.candidate_generators.eagle_drafter import EagleCandidateGenerator
from test_greedy_exactness import NEW_TOKENS, assert_rows_equal, pick_eos, target_alone
from test_sampling_distribution import CHEAP_VERIFY
from tiny_models import EOS, PAD, left_pad, random_prompts

LAYERS = 6
FORMATS = {
    "eagle1": lambda: eagle1_checkpoint(seed=1, dtype=torch.float32),
    "eagle3": lambda: eagle3_checkpoint(seed=2, draft_vocab=40, dtype=torch.float32),
    "eagle3-full-vocab": lambda: eagle3_checkpoint(seed=3, draft_vocab=None, dtype=torch.float32),
}


def load_pair(tmp_path, family: str, head_format: str, dtype=torch.float32):
    target = tiny_target(family, num_layers=LAYERS, seed=5, dtype=dtype)
    config, tensors = FORMATS[head_format]()
    head = EagleDraft.from_pretrained(write_checkpoint(tmp_path / head_format, config, tensors), target=target)
    return target, head


def prompts_for(batch_size: int, seed: int) -> list[list[int]]:
    return [[3 + token for token in row] for row in random_prompts(batch_size, VOCAB - 3, seed, 1, 9)]


@torch.no_grad()
def drafts_from_scratch(target, head, context: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The head on one row alone, no padding: the target reads ``context[:-1]`` (its features), the head reads
    ``context[1:]`` with them, then drafts ``num_tokens`` greedily from its own output."""
    ids = torch.tensor([context])
    features = None
    if len(context) > 1:
        features = head.target_features(target(ids[:, :-1], output_hidden_states=list(head.aux_layer_ids)))
    cache = DynamicCache()
    if features is None:  # one token: nothing to read yet
        raise AssertionError("the loop drafts only after the target has read a token")
    out = head(ids[:, 1:], target_features=features, past_key_values=cache, use_cache=True)
    tokens, log_q = [], []
    for _ in range(num_tokens):
        scores = out.logits[0, -1].float().log_softmax(-1)
        token = int(scores.argmax())
        tokens.append(token)
        log_q.append(scores.max())
        out = head(torch.tensor([[token]]), draft_features=out.features[:, -1:], past_key_values=cache, use_cache=True)
    return tokens, torch.stack(log_q)


def record_proposals(monkeypatch, drafter_class=EagleCandidateGenerator) -> list:
    """Every proposal ``drafter_class`` (the loop's EAGLE drafter by default) made: (tokens, log q, the rows' tokens
    so far, lengths, rows)."""
    proposals = []
    real_propose = drafter_class.propose

    def recording(self, sequences, lengths, num_tokens, rows=None, confidences=True, **options):
        context = sequences.clone()
        proposal = real_propose(self, sequences, lengths, num_tokens, rows, confidences, **options)
        if num_tokens:
            proposals.append((proposal.tokens.clone(), proposal.log_probs, context, lengths.clone(), rows.clone()))
        return proposal

    monkeypatch.setattr(drafter_class, "propose", recording)
    return proposals


def assert_proposals_equal_the_head_from_scratch(target, head, proposals: list, mask: torch.Tensor) -> None:
    """Every recorded proposal (:func:`record_proposals`) equals the head run from scratch on its row's context
    (``mask``: the call's left-padded prompts' mask)."""
    starts = (mask == 0).sum(dim=1)
    for tokens, log_q, context, lengths, rows in proposals:
        for row in range(tokens.shape[0]):
            row_context = context[row, int(starts[rows[row]]) : int(lengths[row])].tolist()
            expected, expected_log_q = drafts_from_scratch(target, head, row_context, tokens.shape[1])
            assert tokens[row].tolist() == expected, (row, row_context)
            torch.testing.assert_close(log_q[row].double(), expected_log_q.double(), atol=1e-4, rtol=1e-4)


def accept_two_drafts(monkeypatch):
    """A verifier that accepts every row's first two verified drafts (whatever the target says), so that accepted
    drafts are re-read with the target's features on every step (random heads are rarely right)."""
    real = verification.verify_greedy

    def accepting(drafts, verify_lengths, target_scores):
        _, next_tokens = real(drafts, torch.zeros_like(verify_lengths), target_scores)
        num_accepted = verify_lengths.clamp(max=2)
        return num_accepted, target_scores.argmax(-1).gather(1, num_accepted[:, None]).squeeze(1)

    monkeypatch.setattr(verification, "verify_greedy", accepting)


@pytest.mark.parametrize("family,head_format", [
    ("llama", "eagle1"), ("qwen2", "eagle3"), ("qwen3", "eagle3-full-vocab"), ("mistral", "eagle3"),
])
def test_every_proposal_equals_the_head_run_from_scratch(tmp_path, monkeypatch, family, head_format):
    """Left-padded rows of different lengths; plain steps, rejections and accepted drafts all feed the head."""
    target, head = load_pair(tmp_path, family, head_format, dtype=torch.float64)
    proposals = record_proposals(monkeypatch)
    accept_two_drafts(monkeypatch)
    input_ids, mask = left_pad(prompts_for(4, seed=3))
    target.generate(input_ids, attention_mask=mask, assistant_model=head, custom_generate="tetris", do_sample=False,
                    max_new_tokens=14, pad_token_id=PAD, eos_token_id=EOS, num_assistant_tokens=3,
                    tetris_extra_tokens=0, tetris_strategy="fixed", tetris_step_callback=lambda record, loop: None)
    assert len(proposals) >= 4
    assert_proposals_equal_the_head_from_scratch(target, head, proposals, mask)


def test_plain_steps_queue_the_heads_features_without_copying_what_waits(tmp_path, monkeypatch):
    """Three plain steps, then a drafting one, over and over: what plain steps queue for the head waits apart from the
    pending block (the block is not copied at every plain step: at 4 rows of 500 tokens it holds 14 MB of features),
    and every proposal after them still equals the head run from scratch."""
    from tetris_hf.step_strategy import DraftPlan
    from tetris_hf.strategies import FixedWindow

    target, head = load_pair(tmp_path, "llama", "eagle3", dtype=torch.float64)
    proposals = record_proposals(monkeypatch)
    accept_two_drafts(monkeypatch)
    calls = iter(range(10_000))
    monkeypatch.setattr(FixedWindow, "plan", lambda self, num_rows: DraftPlan(3, 3 * num_rows) if next(calls) % 4 == 3
                        else DraftPlan(0, 0))
    seen = []  # after each step: whether it drafted, the rows left, the stored block's storage, columns queued apart

    def watch(record, loop) -> None:  # (the stored block itself, not read through the property, which would join)
        drafter = loop.drafter
        block = drafter._pending_features
        seen.append((record.num_drafted, loop.batch.num_rows, None if block is None else block.data_ptr(),
                     len(drafter._feature_tail)))

    input_ids, mask = left_pad(prompts_for(4, seed=3))
    target.generate(input_ids, attention_mask=mask, assistant_model=head, custom_generate="tetris", do_sample=False,
                    max_new_tokens=20, pad_token_id=PAD, eos_token_id=EOS, num_assistant_tokens=3,
                    tetris_extra_tokens=0, tetris_strategy="fixed", tetris_step_callback=watch)
    # two plain steps in a row, no row leaving (a row that leaves takes its features along: the block is rebuilt)
    pairs = [(before, after) for before, after in zip(seen[1:], seen[2:])
             if before[0] == after[0] == 0 and before[1] == after[1]]
    assert len(pairs) >= 3 and len(proposals) >= 3
    for before, after in pairs:  # the same block, one more column queued apart
        assert after[2] == before[2] and after[3] == before[3] + 1
    assert_proposals_equal_the_head_from_scratch(target, head, proposals, mask)


@pytest.mark.parametrize("family,head_format,batch_size", [
    ("llama", "eagle1", 1), ("llama", "eagle3", 3), ("qwen2", "eagle1", 8), ("qwen3", "eagle3", 8),
    ("mistral", "eagle3-full-vocab", 3),
])
@pytest.mark.parametrize("strategy,options", [
    ("tetris", {}),
    ("tetris", {"tetris_budget": 2}),
    ("fixed", {"num_assistant_tokens": 2}),
    ("adaptive", {"tetris_cost_profile": CHEAP_VERIFY}),
    ("dsd", {"tetris_cost_profile": CHEAP_VERIFY}),
])
def test_greedy_rows_equal_the_target_alone(tmp_path, family, head_format, batch_size, strategy, options):
    out, references = assert_greedy_rows_equal_the_target_alone(tmp_path, family, head_format, batch_size,
                                                                tetris_strategy=strategy, **options)
    assert out.tetris_stats.emitted_tokens == sum(len(reference) for reference in references)


def assert_greedy_rows_equal_the_target_alone(tmp_path, family: str, head_format: str, batch_size: int, **options):
    """A random head of ``head_format`` for a tiny ``family`` target, ``batch_size`` left-padded rows (an EOS the
    rows reach when there are several): greedy rows with ``options`` equal the target alone. Returns the output
    and the references."""
    target, head = load_pair(tmp_path, family, head_format)
    prompts = prompts_for(batch_size, seed=batch_size)
    eos = pick_eos(target, prompts) if batch_size > 1 else EOS
    references = target_alone(target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=head, custom_generate="tetris",
                          do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD,
                          return_dict_in_generate=True, **options)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    return out, references
    assert not target._forward_pre_hooks and not any(layer._forward_pre_hooks for layer in target.model.layers), \
        "the head's hooks outlived the call"


@torch.no_grad()
def second_token_law(target, prompt: list[int]) -> torch.Tensor:
    """``(V,)`` the exact law of the second sampled token: ``sum_t p(t) p(. | t)``."""
    first = target(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
    batch = torch.tensor([prompt + [token] for token in range(first.shape[0])])
    return first @ target(batch).logits[:, -1].double().softmax(-1)


def sampled_second_tokens(target, head, prompt: list[int], rows: int) -> tuple[torch.Tensor, object]:
    torch.manual_seed(0)
    out = target.generate(torch.tensor([prompt] * rows), assistant_model=head, custom_generate="tetris",
                          do_sample=True, top_k=0, max_new_tokens=4, pad_token_id=PAD, eos_token_id=None,
                          num_assistant_tokens=1, tetris_extra_tokens=2, tetris_budget=rows,
                          return_dict_in_generate=True)
    return out.sequences[:, len(prompt) + 1], out.tetris_stats


def chi_square(tokens: torch.Tensor, law: torch.Tensor) -> float:
    from scipy.stats import chisquare

    rows = tokens.numel()
    counts = torch.bincount(tokens, minlength=law.shape[0]).double()
    keep = law * rows >= 5  # cells expected below 5 times are pooled
    observed, expected = counts[keep], law[keep] * rows
    if not keep.all():
        observed = torch.cat([observed, counts[~keep].sum()[None]])
        expected = torch.cat([expected, law[~keep].sum()[None] * rows])
    return chisquare(observed.numpy(), expected.numpy() * rows / expected.sum().item()).pvalue


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    target, head = load_pair(tmp_path_factory.mktemp("heads"), "llama", "eagle3")
    with torch.no_grad():  # peaked enough that the head's drafts are sometimes accepted
        target.lm_head.weight.mul_(3.0)
    return target, head


PROMPT, SAMPLED_ROWS = [5, 9, 12, 7], 6000


def test_sampling_with_a_partial_budget_follows_the_target_distribution(sampling_pair):
    """The second token is the first drafted one: its law is the target's, with C = B of 3B cells verified."""
    target, head = sampling_pair
    tokens, stats = sampled_second_tokens(target, head, PROMPT, SAMPLED_ROWS)
    assert 0 < stats.accepted_tokens < stats.verified_tokens < stats.drafted_tokens  # both branches, a partial budget
    assert chi_square(tokens, second_token_law(target, PROMPT)) > 1e-3


def test_chi_square_catches_a_verifier_that_skips_the_residual(sampling_pair, monkeypatch):
    import tetris_hf.logits.verification as verification

    target, head = sampling_pair
    monkeypatch.setattr(verification, "residual_distribution", lambda target_probs, draft_probs: (target_probs, None))
    tokens, _ = sampled_second_tokens(target, head, PROMPT, SAMPLED_ROWS)
    assert chi_square(tokens, second_token_law(target, PROMPT)) < 1e-3


def test_an_eagle_head_with_a_draft_vocab_is_refused(tmp_path):
    target, head = load_pair(tmp_path, "llama", "eagle3")
    input_ids, mask = left_pad([[5, 6, 7]])
    with pytest.raises(ValueError, match="carries its own draft vocabulary"):
        target.generate(input_ids, attention_mask=mask, assistant_model=head, custom_generate="tetris",
                        max_new_tokens=3, tetris_draft_vocab=10)
    assert not any(layer._forward_pre_hooks for layer in target.model.layers)


def test_compiled_eagle_steps_draft_what_the_head_drafts_from_scratch(tmp_path, monkeypatch):
    """The head's steps compile (static shapes): its features arrive as arguments of the call, padded for a batch
    bucket's dummy rows like its tokens. Every proposal equals the head run from scratch (accepted drafts re-read
    with the target's features, which the compiled verify forward returns; compiled targets' rows against the target
    alone: tests/test_compile.py)."""
    from torch._dynamo.utils import counters

    counters.clear()
    target, head = load_pair(tmp_path, "llama", "eagle3")
    proposals = record_proposals(monkeypatch)
    accept_two_drafts(monkeypatch)
    input_ids, mask = left_pad(prompts_for(3, seed=3))
    target.generate(input_ids, attention_mask=mask, assistant_model=head, custom_generate="tetris", do_sample=False,
                    max_new_tokens=10, pad_token_id=PAD, eos_token_id=EOS, num_assistant_tokens=3,
                    tetris_extra_tokens=0, tetris_strategy="fixed", tetris_compile=True,
                    tetris_step_callback=lambda record, loop: None)  # (a callback: proposals keep their log q)
    assert len(proposals) >= 3 and counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])
    assert_proposals_equal_the_head_from_scratch(target, head, proposals, mask)


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_steady_eagle_step_reads_the_device_at_most_twice(tmp_path, do_sample):
    from test_host_reads import host_reads

    target, head = load_pair(tmp_path, "llama", "eagle3")
    input_ids, mask = left_pad(prompts_for(8, seed=1))
    with host_reads.HostReads() as reads:
        target.generate(input_ids, attention_mask=mask, assistant_model=head, custom_generate="tetris",
                        max_new_tokens=30, do_sample=do_sample, pad_token_id=PAD,
                        tetris_step_callback=reads.step_done)
    steady = reads.per_step[2:-1]
    assert len(steady) >= 5
    assert max(steady) <= 2, reads.per_step
