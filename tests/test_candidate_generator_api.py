"""Our drafters as transformers ``CandidateGenerator``s: transformers' own assisted decoding (``_assisted_decoding``,
batch size 1) drafting with them gives the target's greedy output exactly, sampled tokens follow the target's law,
``get_candidates`` by hand returns the input followed by the drafts the draft would make from scratch, and what the
adapter cannot do is refused with the way to do it."""

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper

from eagle_checkpoints import eagle1_checkpoint, eagle3_checkpoint, tiny_target, write_checkpoint
from tetris_hf import EagleDraft
from tetris_hf.candidate_generators.batched_draft import BatchedDraftCandidateGenerator
from tetris_hf.candidate_generators.eagle_drafter import EagleCandidateGenerator
from tetris_hf.candidate_generators.prompt_lookup import BatchedPromptLookupCandidateGenerator
from tetris_hf.logits import PositionwiseLogitsProcessor
from test_prompt_lookup import lookup_one_row
from tiny_models import PAD, random_prompts, sharpen, target_and_draft, tiny_llama

NEW_TOKENS = 24


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and the tests' machine is shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def draft_drafter(draft, do_sample: bool = False, processors=()) -> BatchedDraftCandidateGenerator:
    return BatchedDraftCandidateGenerator(draft, PositionwiseLogitsProcessor(LogitsProcessorList(processors)),
                                          do_sample=do_sample)


def plug_in(monkeypatch, target, drafter) -> list[int]:
    """Make transformers' assisted decoding on ``target`` draft with ``drafter``; returns the ``num_matches`` of every
    step, as transformers reports them."""
    matches = []
    update = drafter.update_candidate_strategy

    def recording_update(input_ids, scores, num_matches):
        matches.append(int(num_matches))
        update(input_ids, scores, num_matches)

    def candidate_generator(generation_config, **kwargs):
        drafter.max_length = generation_config.max_length
        return drafter

    monkeypatch.setattr(drafter, "update_candidate_strategy", recording_update)
    monkeypatch.setattr(target, "_get_candidate_generator", candidate_generator)
    return matches


def greedy(model, ids: torch.Tensor, new_tokens: int, **kwargs) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                          pad_token_id=PAD, **kwargs)


@pytest.mark.parametrize("seed,num_tokens", [(0, 4), (1, 2), (2, 6)])
def test_transformers_loop_with_our_draft_equals_the_target_greedy(monkeypatch, seed, num_tokens):
    target, draft = target_and_draft(64, seed, "noisy", noise=0.3)
    prompts = [torch.tensor([prompt]) for prompt in random_prompts(3, 64, seed, 3, 9)]
    references = [greedy(target, ids, NEW_TOKENS) for ids in prompts]  # (EOS may stop a row early)
    drafter = draft_drafter(draft)  # one drafter for every call: each new prompt starts it over
    drafter.num_assistant_tokens = num_tokens
    matches = plug_in(monkeypatch, target, drafter)
    for ids, reference in zip(prompts, references):
        assert greedy(target, ids, NEW_TOKENS, assistant_model=draft).tolist() == reference.tolist()
    assert sum(matches) > 0, "no candidate was ever accepted: the draft did not draft"
    assert min(matches) < num_tokens, "every candidate was accepted: no rejection was exercised"


@pytest.mark.parametrize("prompt", [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [10, 11, 12, 10, 11, 12, 13]])
def test_transformers_loop_with_our_prompt_lookup_equals_the_target_greedy(monkeypatch, prompt):
    target = tiny_llama(64, seed=0)
    ids = torch.tensor([prompt])
    reference = greedy(target, ids, NEW_TOKENS)
    matches = plug_in(monkeypatch, target, BatchedPromptLookupCandidateGenerator(3, 1, max_tokens=8))
    # transformers enters assisted decoding for prompt lookup when `prompt_lookup_num_tokens` is set
    assert greedy(target, ids, NEW_TOKENS, prompt_lookup_num_tokens=4).tolist() == reference.tolist()
    assert sum(matches) > 0, "no lookup candidate was ever accepted"


def test_candidates_by_hand_are_the_input_then_the_drafts_from_scratch_after_any_verdict():
    """Each answer equals the draft's own greedy continuation of the sequence it is given, whatever the target kept
    of the last candidates (some, all, none), reported through update_candidate_strategy or not at all."""
    _, draft = target_and_draft(64, 3, "noisy", noise=0.3)
    drafter = draft_drafter(draft)
    sequence = torch.tensor([[7, 30, 12, 44, 9, 21]])
    target_tokens = iter([50, 51, 52, 53])
    for accepted, report in [(2, True), (4, False), (0, True), (1, False), (None, True)]:
        candidates, logits = drafter.get_candidates(sequence)
        assert logits is None  # greedy drafts: q is one-hot, transformers needs no logits
        assert candidates.tolist() == greedy(draft, sequence, 4).tolist()
        if accepted is None:
            break
        sequence = torch.cat([candidates[:, : sequence.shape[1] + accepted], torch.tensor([[next(target_tokens)]])],
                             dim=1)
        if report:
            drafter.update_candidate_strategy(sequence, None, accepted)
    another = torch.tensor([[3, 4, 5]])  # not a continuation: a new sequence
    assert drafter.get_candidates(another)[0].tolist() == greedy(draft, another, 4).tolist()


def test_lookup_candidates_by_hand_are_the_input_then_the_row_by_row_lookup():
    drafter = BatchedPromptLookupCandidateGenerator(3, 1, max_tokens=8)
    sequence = torch.tensor([[7, 8, 9, 10, 7, 8]])
    candidates, logits = drafter.get_candidates(sequence)
    expected, _ = lookup_one_row(sequence[0].tolist(), 4, range(1, 4))
    assert expected == [9, 10, 7, 8] and logits is None
    assert candidates.tolist() == [sequence[0].tolist() + expected]
    sequence = torch.cat([candidates[:, :8], torch.tensor([[11]])], dim=1)  # 2 accepted, then a new token
    drafter.update_candidate_strategy(sequence, None, 2)
    candidates, logits = drafter.get_candidates(sequence)  # 11 occurs nowhere before: no candidates
    assert candidates.tolist() == sequence.tolist() and logits is None


def test_drafts_per_call_follow_num_assistant_tokens_and_stop_before_max_length():
    _, draft = target_and_draft(64, 0, "noisy", noise=0.3)
    drafter = draft_drafter(draft)
    sequence = torch.tensor([[7, 30, 12, 44, 9, 21]])
    drafter.num_assistant_tokens = 2
    assert drafter.get_candidates(sequence)[0].shape == (1, 8)
    drafter.max_length = 8  # room for one draft and the target's token
    drafter.num_assistant_tokens = 5
    assert drafter.get_candidates(sequence)[0].shape == (1, 7)
    drafter.max_length = 7  # only the target's token fits
    candidates, logits = drafter.get_candidates(sequence)
    assert candidates.tolist() == sequence.tolist() and logits is None


def test_sampled_candidate_logits_softmax_to_the_drafters_q(monkeypatch):
    _, draft = target_and_draft(64, 0, "noisy", noise=0.3)
    drafter = draft_drafter(draft, do_sample=True, processors=[TemperatureLogitsWarper(0.7)])
    proposals = []
    propose = drafter.propose

    def recording(*args, **kwargs):
        proposals.append(propose(*args, **kwargs))
        return proposals[-1]

    monkeypatch.setattr(drafter, "propose", recording)
    sequence = torch.tensor([[7, 30, 12, 44, 9, 21]])
    candidates, logits = drafter.get_candidates(sequence)
    (proposal,) = proposals
    assert logits.shape == (1, 4, 64)
    torch.testing.assert_close(logits.softmax(dim=-1), proposal.probs)
    assert candidates[:, 6:].tolist() == proposal.tokens.tolist()


def first_sampled_tokens(monkeypatch, raw_logits: bool, runs: int = 500) -> tuple[torch.Tensor, torch.Tensor]:
    """The first token of ``runs`` calls of transformers' sampled assisted decoding (one draft each, temperature 0.3)
    drafting with our drafter, and the target's processed distribution there. ``raw_logits``: the drafter reports
    the draft's unprocessed distribution instead of the ``q`` it sampled from (a bug the check must catch)."""
    temperature, vocab = 0.3, 16
    target, draft = target_and_draft(vocab, 0, "independent")
    sharpen(target, 4), sharpen(draft, 4)
    drafter = draft_drafter(draft, do_sample=True, processors=[TemperatureLogitsWarper(temperature)])
    if raw_logits:
        propose = drafter.propose

        def unprocessed(*args, **kwargs):
            proposal = propose(*args, **kwargs)
            if proposal.probs is None:  # no drafts
                return proposal
            return proposal._replace(probs=(proposal.probs.log() * temperature).softmax(dim=-1))

        monkeypatch.setattr(drafter, "propose", unprocessed)
    plug_in(monkeypatch, target, drafter)
    ids = torch.tensor([[5, 9, 12, 3]])
    torch.manual_seed(1)
    firsts = [int(target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, do_sample=True,
                                  temperature=temperature, top_k=None, top_p=None, max_new_tokens=2,
                                  pad_token_id=PAD)[0, 4]) for _ in range(runs)]
    with torch.no_grad():
        p = (target(ids).logits[0, -1] / temperature).softmax(dim=-1)
    return torch.bincount(torch.tensor(firsts), minlength=vocab), p


def chi_square_p_value(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Cells expected fewer than 5 times are pooled into one bin."""
    expected = p.double() * counts.sum()
    rare = expected < 5
    observed, expected = counts[~rare].double(), expected[~rare]
    if rare.any():
        observed = torch.cat([observed, counts[rare].sum().double()[None]])
        expected = torch.cat([expected, (p.double()[rare].sum() * counts.sum())[None]])
    return float(chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue)


def test_sampled_first_tokens_follow_the_target_distribution(monkeypatch):
    assert chi_square_p_value(*first_sampled_tokens(monkeypatch, raw_logits=False)) > 1e-3


def test_chi_square_catches_candidate_logits_that_are_not_the_sampled_q(monkeypatch):
    assert chi_square_p_value(*first_sampled_tokens(monkeypatch, raw_logits=True)) < 1e-3


def test_a_batch_is_refused_naming_the_batched_way():
    _, draft = target_and_draft(64, 0, "noisy", noise=0.3)
    with pytest.raises(ValueError, match='one row.*custom_generate="tetris"'):
        draft_drafter(draft).get_candidates(torch.tensor([[5, 6, 7], [8, 9, 10]]))


def test_num_matches_that_do_not_fit_input_ids_are_refused():
    _, draft = target_and_draft(64, 0, "noisy", noise=0.3)
    drafter = draft_drafter(draft)
    candidates, _ = drafter.get_candidates(torch.tensor([[7, 30, 12, 44, 9, 21]]))
    with pytest.raises(ValueError, match="`num_matches` \\(1\\)"):
        drafter.update_candidate_strategy(torch.cat([candidates[:, :8], torch.tensor([[50]])], dim=1), None, 1)


@pytest.mark.parametrize("head_format,seed", [("eagle1", 1), ("eagle3", 2)])
def test_transformers_loop_with_our_eagle_head_equals_the_target_greedy(monkeypatch, tmp_path, head_format, seed):
    """An EAGLE head inside transformers' own assisted decoding: it asks for the verify forwards' hidden states
    (``requires_model_outputs``), no hook on the target, and the output is the target's greedy output."""
    target = tiny_target("llama", num_layers=6, seed=5)
    checkpoint = eagle1_checkpoint(seed=seed) if head_format == "eagle1" else eagle3_checkpoint(seed=seed,
                                                                                                draft_vocab=None)
    head = EagleDraft.from_pretrained(write_checkpoint(tmp_path / head_format, *checkpoint), target=target)
    drafter = EagleCandidateGenerator(head, PositionwiseLogitsProcessor(LogitsProcessorList()), do_sample=False)
    drafter.num_assistant_tokens = 3
    matches = plug_in(monkeypatch, target, drafter)
    drafted, get_candidates = [], drafter.get_candidates

    def recording_get_candidates(input_ids, **kwargs):
        candidates, logits = get_candidates(input_ids, **kwargs)
        drafted.append(candidates.shape[1] - input_ids.shape[1])
        return candidates, logits

    monkeypatch.setattr(drafter, "get_candidates", recording_get_candidates)
    for prompt in ([5, 6, 7], [9, 10, 11, 12, 13, 9, 10], [4]):
        ids = torch.tensor([prompt])
        reference = greedy(target, ids, NEW_TOKENS)
        assert greedy(target, ids, NEW_TOKENS, assistant_model=head).tolist() == reference.tolist()
    ours = [hook for module in target.modules() for hooks in (module._forward_hooks, module._forward_pre_hooks)
            for hook in hooks.values() if getattr(hook, "__module__", "").startswith("tetris_hf")]
    assert ours == []  # (transformers records hidden states through hooks of its own)
    # per call: the first step decodes plainly (no target forward yet), then 3 drafts a step, fewer only where the
    # length limit leaves no room (a random head on a random target is rejected: the accepting path is checked by hand
    # below)
    assert drafted[0] == 0 and drafted.count(0) <= 2 * 3 and drafted.count(3) >= 3 * (NEW_TOKENS - 4)


def test_an_eagle_head_drafts_what_it_would_from_scratch_through_the_adapter(tmp_path):
    """By hand: the first call decodes plainly (no target forward yet); after the target's forward over the prompt,
    the head's candidates are what it drafts on that row alone."""
    from test_eagle_loop import drafts_from_scratch

    target = tiny_target("llama", num_layers=6, seed=5)
    head = EagleDraft.from_pretrained(write_checkpoint(tmp_path / "eagle1", *eagle1_checkpoint(seed=1)), target=target)
    drafter = EagleCandidateGenerator(head, PositionwiseLogitsProcessor(LogitsProcessorList()), do_sample=False)
    drafter.num_assistant_tokens = 3
    prompt = torch.tensor([[5, 6, 7, 8]])
    candidates, logits = drafter.get_candidates(prompt, model_outputs=None, is_first_iteration=True)
    assert torch.equal(candidates, prompt) and logits is None  # nothing to draft from yet
    with torch.no_grad():
        outputs = target(prompt, output_hidden_states=True)
    token = outputs.logits[:, -1].argmax(-1, keepdim=True)
    grown = torch.cat([prompt, token], dim=1)
    drafter.update_candidate_strategy(grown, None, 0)
    candidates, _ = drafter.get_candidates(grown, model_outputs=outputs, is_first_iteration=False)
    expected, _ = drafts_from_scratch(target, head, grown[0].tolist(), 3)
    assert candidates[0, grown.shape[1]:].tolist() == expected
    # the target verifies [t, c1, c2, c3] and (as if it agreed) keeps c1, then adds its token after c1: the head reads
    # the features of that forward and drafts what it would on the longer row alone
    with torch.no_grad():
        full = target(candidates, output_hidden_states=True)
    verified = type(full)(logits=full.logits[:, -4:], hidden_states=tuple(h[:, -4:] for h in full.hidden_states))
    after = torch.cat([candidates[:, : grown.shape[1] + 1], full.logits[:, grown.shape[1]].argmax(-1, keepdim=True)],
                      dim=1)
    drafter.update_candidate_strategy(after, None, 1)
    again, _ = drafter.get_candidates(after, model_outputs=verified, is_first_iteration=False)
    expected, _ = drafts_from_scratch(target, head, after[0].tolist(), 3)
    assert again[0, after.shape[1]:].tolist() == expected
    with pytest.raises(ValueError, match="output_hidden_states=True"):
        drafter.get_candidates(after, model_outputs=type(outputs)(logits=outputs.logits), is_first_iteration=False)


def test_an_eagle_head_beside_prompt_lookup_is_refused_naming_custom_generate(tmp_path):
    """Hybrid drafting with a head reads the target's features but does not ask transformers' loop for them."""
    from tetris_hf.candidate_generators.hybrid import HybridCandidateGenerator

    target = tiny_target("llama", num_layers=2, seed=5)
    head = EagleDraft.from_pretrained(write_checkpoint(tmp_path / "eagle1", *eagle1_checkpoint(seed=1)),
                                      target=target)
    drafter = EagleCandidateGenerator(head, PositionwiseLogitsProcessor(LogitsProcessorList()), do_sample=False)
    hybrid = HybridCandidateGenerator(BatchedPromptLookupCandidateGenerator(3, 1, max_tokens=8), drafter)
    with pytest.raises(ValueError, match='hidden states.*custom_generate="tetris"'):
        hybrid.get_candidates(torch.tensor([[5, 6, 7]]))
