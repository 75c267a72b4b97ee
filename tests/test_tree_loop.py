"""Draft trees in the real loop (``tetris_tree_width > 1``): greedy rows equal the target alone, sampled rows follow
the target's law (chi-square, with a negative control), both caches stay exact and bounded, a step reads the device
as often as a chain step, EAGLE heads draft trees from their own outputs, and what cannot take an ancestor mask is
refused."""

import pytest
import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
import tetris_hf.trees as trees
from tetris_hf.candidate_generators import BatchedDraftCandidateGenerator
from tetris_hf.options import TetrisOptions
from test_architectures import SLIDING_WINDOW, assert_exact, early_exit_draft, tiny, windows
from test_caches import assert_caches_match_fresh, make_loop, next_logits_fresh
from test_greedy_exactness import assert_rows_equal, pick_eos, target_alone
from test_host_reads import PREFIX_READERS, reads_per_step
from test_sampling_distribution import CHEAP_VERIFY, ROWS, chi_square_p_value, exact_joint, sampled_joint
from tiny_models import EOS, PAD, left_pad, noisy_copy, random_prompts, sharpen, target_and_draft, tiny_llama

NEW_TOKENS = 18  # test_greedy_exactness's target_alone generates this many


def tree_runs(batch: int, width: int) -> list[dict]:
    """Full and partial budgets, deep and shallow trees, fixed selection."""
    return [
        dict(tetris_tree_width=width, num_assistant_tokens=3, tetris_extra_tokens=1),  # C = k B
        dict(tetris_tree_width=width, num_assistant_tokens=2, tetris_extra_tokens=2, tetris_budget=1,
             tetris_max_holes=2),  # C = 1: most nodes unverified, repacking often
        dict(tetris_tree_width=width, num_assistant_tokens=3, tetris_extra_tokens=0, tetris_budget=batch * 3 * width),
        dict(tetris_tree_width=width, tetris_strategy="fixed", num_assistant_tokens=3),
    ]


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("batch,seed,draft_kind", [(1, 0, "noisy"), (3, 1, "independent"), (8, 2, "noisy")])
def test_greedy_rows_equal_target_alone(width, batch, seed, draft_kind):
    target, draft = target_and_draft(64, seed, draft_kind, noise=0.4)
    prompts = random_prompts(batch, 64, seed)  # different lengths: left padding
    eos = pick_eos(target, prompts) if batch > 1 else EOS  # some rows stop early (one row: it would at once)
    references = target_alone(target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    accepted = 0
    for options in tree_runs(batch, width):
        out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                              do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD,
                              return_dict_in_generate=True, **options)
        assert_rows_equal(out.sequences, input_ids, mask, references)
        stats = out.tetris_stats
        assert stats.emitted_tokens == sum(map(len, references)), options
        assert stats.accepted_tokens <= stats.verified_tokens <= stats.drafted_tokens
        accepted += stats.accepted_tokens
    if draft_kind == "noisy":
        assert accepted > 0


def test_greedy_with_prefix_reading_processors_and_adaptive():
    """Processors that read the tokens so far see each node's own path (repetition penalty, no-repeat n-grams, min
    new tokens); ``adaptive`` takes its budget from the cost model."""
    target = tiny_llama(40, seed=8)
    draft = noisy_copy(target, 0.3)
    prompts = random_prompts(4, 40, seed=8)
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, repetition_penalty=1.7,
                  min_new_tokens=5, no_repeat_ngram_size=3)
    references = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        references.append(target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)[0, len(prompt):].tolist())
    input_ids, mask = left_pad(prompts)
    for options in (dict(tetris_tree_width=3, tetris_budget=5),
                    dict(tetris_tree_width=2, tetris_strategy="adaptive", tetris_cost_profile=CHEAP_VERIFY),
                    dict(tetris_tree_width=2, tetris_strategy="dsd", tetris_cost_profile=CHEAP_VERIFY)):
        out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                              return_dict_in_generate=True, **kwargs, **options)
        assert_rows_equal(out.sequences, input_ids, mask, references)
        assert out.tetris_stats.accepted_tokens > 0, options


@pytest.mark.parametrize("family", ["mistral_window", "gemma2", "qwen2_window"])  # windowed; hybrid (both kinds)
def test_windowed_and_hybrid_families_are_exact(family):
    model_type, overrides = SLIDING_WINDOW[family]
    target = tiny(model_type, 3, seed=0, overrides=overrides)
    assert windows(target)
    draft = early_exit_draft(target, model_type, overrides)
    runs = [dict(tetris_tree_width=2, num_assistant_tokens=3, tetris_extra_tokens=1),
            dict(tetris_tree_width=3, num_assistant_tokens=2, tetris_extra_tokens=1, tetris_budget=2,
                 tetris_max_holes=2)]
    accepted, verified = assert_exact(target, draft, runs)
    assert 0 < accepted < verified


def test_eager_attention_takes_the_additive_ancestor_mask():
    target, draft = target_and_draft(64, 1, "noisy", noise=0.4)
    for model in (target, draft):
        model.set_attn_implementation("eager")
    prompts = random_prompts(4, 64, 1)
    references = target_alone(target, prompts, EOS)
    input_ids, mask = left_pad(prompts)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                          do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=PAD,
                          tetris_tree_width=3, tetris_budget=5)
    assert_rows_equal(out, input_ids, mask, references)


def test_caches_match_fresh_forward_after_every_tree_step():
    """After every step both caches give the logits of a fresh unpadded forward, and every tree node's draft law is
    the draft's on the node's own prefix (the draft's ancestor mask)."""
    target = tiny_llama(97, num_layers=2, seed=31)
    draft = noisy_copy(target, 0.5, seed=32)
    prompts = random_prompts(5, 97, seed=33, max_length=12)
    loop, padding = make_loop(target, draft, prompts, 30, tetris_tree_width=3, num_assistant_tokens=3,
                              tetris_extra_tokens=1, tetris_budget=6, tetris_max_holes=4)
    grown_trees = []
    real_propose = loop.drafter.propose_tree

    def keep_tree(sequences, lengths, depth, width, rows):
        grown = real_propose(sequences, lengths, depth, width, rows)
        texts = [sequences[index, int(padding[row]) : int(lengths[index])].tolist()
                 for index, row in enumerate(rows.tolist())]
        grown_trees.append((grown, texts))
        return grown

    loop.drafter.propose_tree = keep_tree
    steps_checked = 0
    with torch.no_grad():
        while not loop.done:
            loop.step()
            if grown_trees:
                grown, texts = grown_trees.pop()
                tree = grown.tree
                paths = trees.path_tokens(tree.tokens, tree.parents, tree.depths, int(tree.depths.max()))
                for node in [None, 0, 1, tree.tokens.shape[1] // 2]:  # the root's law, and some expanded nodes'
                    position = 0 if node is None else int(grown.expanded_of_node[node])
                    if position < 0:
                        continue
                    for index, text in enumerate(texts):
                        path = [] if node is None else paths[index, node, : int(tree.depths[index, node])].tolist()
                        fresh = next_logits_fresh(draft, text + path).log_softmax(-1)
                        torch.testing.assert_close(grown.expanded_log_probs[index, position], fresh, atol=1e-4,
                                                   rtol=0)
            if loop.done:
                break
            assert_caches_match_fresh(loop, target, draft, padding)
            steps_checked += 1
    assert steps_checked >= 5
    assert 0 < loop.stats.accepted_tokens < loop.stats.verified_tokens


def test_cache_length_stays_bounded_over_a_long_run():
    target = tiny_llama(64, num_layers=1, seed=41, hidden_size=16)
    draft = tiny_llama(64, num_layers=1, seed=42, hidden_size=16)  # mostly rejected: many holes
    max_holes, width, depth = 8, 3, 4
    loop, _ = make_loop(target, draft, random_prompts(4, 64, seed=43, max_length=10), 400, num_assistant_tokens=3,
                        tetris_extra_tokens=1, tetris_tree_width=width, tetris_max_holes=max_holes)
    # repacking works from a fill level read before the step's forwards: a cache may hold one tree's slots beyond
    allowed = max_holes + 1 + width * depth
    steps, worst_waste = 0, 0
    with torch.no_grad():
        while not loop.done and steps < 300:
            loop.step()
            steps += 1
            for slots in (loop.target_slots, loop.drafter.slots):
                worst_waste = max(worst_waste, slots.length - int(slots.live_lengths().max()))
    assert steps >= 100
    assert worst_waste <= allowed
    assert loop.target_slots.capacity == loop.target_slots.slot_mask.shape[1]  # never grew past what it was sized for


@pytest.mark.parametrize("options", [dict(tetris_tree_width=3), dict(tetris_tree_width=2, do_sample=True),
                                     dict(tetris_tree_width=3, tetris_strategy="fixed", **PREFIX_READERS)])
def test_a_tree_step_reads_the_device_at_most_twice(options):
    """As a chain step: the widest selection (with the caches' fill levels) and, when a row may have stopped, how
    many did."""
    steady = reads_per_step(**options)[2:-1]
    assert len(steady) >= 5
    assert max(steady) <= 2, steady


def test_cost_aware_strategies_read_the_device_once_per_tree_step_besides_the_loop(monkeypatch):
    """``adaptive`` (its budget chosen from the drafted tree, with the last steps' confidences in the same transfer)
    and ``dsd`` move what they learn and select on to the host in one transfer per step, as with chains."""
    from tetris_hf import strategies
    from tetris_hf.cost_model import CostProfile
    from test_host_reads import host_reads

    to_host = strategies._to_host
    rows, tokens = (1, 4, 16, 64), (1, 2, 4, 8)
    free_verification = CostProfile({(r, t): 10.0 for r in rows for t in tokens}, {r: 1e-3 for r in rows})
    target = tiny_llama(64, num_layers=2, seed=0)
    draft = noisy_copy(target, 0.3)
    input_ids, mask = left_pad(random_prompts(8, 64, seed=1))
    for strategy in ("adaptive", "dsd"):
        with host_reads.HostReads(host_files=("strategies.py", "goodput.py", "cost_model.py")) as reads:

            def transfer(tensors):
                reads.count += 1
                return to_host(tensors)

            monkeypatch.setattr(strategies, "_to_host", transfer)
            out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                                  max_new_tokens=40, tetris_step_callback=reads.step_done, tetris_strategy=strategy,
                                  tetris_cost_profile=free_verification, tetris_tree_width=3,
                                  return_dict_in_generate=True)
        steady = reads.per_step[3:-1]  # after the prompt step, the first probe and the first plan on it
        assert len(steady) >= 5
        assert max(steady) <= 3, (strategy, reads.per_step)
        assert out.tetris_stats.accepted_tokens > 0


def test_best_tree_budget_maximises_expected_tokens_per_second_as_brute_force():
    """``adaptive``'s ``C`` over trees: for every ``C``, select the ``C`` best nodes by survival, count the expected
    tokens and the widest row's block, and take the best rate (the smallest ``C`` on ties)."""
    from test_trees import random_trees
    from tetris_hf.goodput import best_tree_budget

    generator = torch.Generator().manual_seed(5)
    for trial in range(30):
        rows = int(torch.randint(1, 5, (), generator=generator))
        nodes = int(torch.randint(1, 10, (), generator=generator))
        tree = random_trees(generator, rows, nodes, invalid=0.2)
        survival = (tree.log_scores / 3).exp()  # falls along paths
        candidate = trees.path_products(tree.valid.double(), tree.parents) > 0
        verify_seconds = torch.rand(nodes + 1, generator=generator, dtype=torch.float64).cumsum(0) + 1.0
        fixed = float(torch.rand((), generator=generator)) * 3
        max_budget = None if trial % 3 else int(torch.randint(0, rows * nodes, (), generator=generator))
        rates = []
        for budget in range(int(candidate.sum()) + 1):
            if max_budget is not None and budget > max_budget:
                break
            chosen = trees.select_tree_nodes(survival.log(), tree.valid, tree.parents, budget)
            widest = int(chosen.sum(dim=1).max())
            rates.append((rows + float(survival[chosen].sum())) / (fixed + float(verify_seconds[widest])))
        expected = max(range(len(rates)), key=lambda c: (rates[c], -c))
        assert best_tree_budget(survival, candidate, fixed, verify_seconds, max_budget) == expected


def test_observed_chain_follows_the_accepted_path_then_the_best_children():
    from tetris_hf.tree_step import observed_chain

    # one row, width 2, depth 3: nodes 0-1 (depth 1), 2-3 (depth 2, children of 0), 4-5 (depth 3, children of 3 and 2)
    tree = trees.DraftTree(
        tokens=torch.tensor([[10, 11, 12, 13, 14, 15]]),
        parents=torch.tensor([[-1, -1, 0, 0, 3, 2]]),
        depths=torch.tensor([[1, 1, 2, 2, 3, 3]]),
        log_scores=torch.tensor([[-0.1, -2.0, -0.5, -0.7, -0.9, -1.5]]),
        valid=torch.ones(1, 6, dtype=torch.bool))
    selected = torch.tensor([[True, True, True, True, False, True]])
    # accepted path [0, 3]: then node 3's best child, 4, unselected
    log_probs, verified = observed_chain(tree, selected, torch.tensor([[0, 3, -1]]), torch.tensor([2]), 3)
    torch.testing.assert_close(log_probs, torch.tensor([[-0.1, -0.6, -0.2]]))
    assert verified.tolist() == [2]
    # nothing accepted: the chain is the best path from the root (0, then 2, then 5), all selected
    log_probs, verified = observed_chain(tree, selected, torch.full((1, 3), -1), torch.tensor([0]), 3)
    torch.testing.assert_close(log_probs, torch.tensor([[-0.1, -0.4, -1.0]]))
    assert verified.tolist() == [3]


# ------------------------------------------------------------------------------------------------------------------
# Sampling: the joint law of the first four tokens (the first from the prompt read, the rest through trees of depth
# up to 2), under a budget that leaves nodes unverified
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    target = sharpen(tiny_llama(6, num_layers=2, seed=21, hidden_size=16), 12)
    draft = sharpen(tiny_llama(6, num_layers=1, seed=22, hidden_size=16), 12)  # disagrees often
    return target, draft


SAMPLED_TREES = [
    ("tetris", dict(tetris_tree_width=2, num_assistant_tokens=1, tetris_extra_tokens=1, tetris_budget=ROWS)),
    ("tetris", dict(tetris_tree_width=3, num_assistant_tokens=2, tetris_extra_tokens=0, tetris_budget=ROWS)),
    ("fixed", dict(tetris_tree_width=3, num_assistant_tokens=2, tetris_extra_tokens=0)),
    ("adaptive", dict(tetris_tree_width=2, num_assistant_tokens=1, tetris_extra_tokens=1, tetris_budget=ROWS,
                      tetris_cost_profile=CHEAP_VERIFY)),
]


@pytest.mark.parametrize("strategy,options", SAMPLED_TREES)
def test_sampled_trees_follow_the_target_distribution(pair, strategy, options):
    target, draft = pair
    counts, stats = sampled_joint(target, draft, 1.0, 1.0, strategy, new_tokens=4, **options)
    assert 0 < stats.verified_tokens < stats.drafted_tokens  # selection left nodes out
    assert 0 < stats.accepted_tokens < stats.verified_tokens
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0, new_tokens=4)) > 1e-3


def test_chi_square_catches_siblings_tried_without_the_residual_update(pair, monkeypatch):
    """Teeth: trying the next sibling against ``p`` itself instead of ``norm(max(p - q, 0))`` is biased."""
    target, draft = pair
    monkeypatch.setattr(trees, "residual_distribution", lambda target_probs, draft_probs: (target_probs, None))
    strategy, options = SAMPLED_TREES[1]
    counts, _ = sampled_joint(target, draft, 1.0, 1.0, strategy, new_tokens=4, **options)
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0, new_tokens=4)) < 1e-3


# ------------------------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------------------------


def test_alibi_families_are_refused_naming_the_option():
    target = tiny("bloom", 2, seed=0)
    draft = tiny("bloom", 1, seed=1)
    input_ids, mask = left_pad([[5, 6, 7], [8, 9]])
    with pytest.raises(ValueError, match="tetris_tree_width.*ALiBi"):
        target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                        max_new_tokens=4, pad_token_id=PAD, tetris_tree_width=2)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                          max_new_tokens=4, pad_token_id=PAD)  # chains still work
    assert out.shape[1] == input_ids.shape[1] + 4


@pytest.mark.parametrize("options,words", [
    (dict(tetris_tree_width=0), "tetris_tree_width"),
    (dict(tetris_tree_width=1.5), "tetris_tree_width"),
    (dict(tetris_tree_width=2, prompt_lookup_num_tokens=3, num_assistant_tokens=3), "prompt lookup"),
])
def test_bad_tree_options_are_refused(options, words):
    with pytest.raises(ValueError, match=words):
        TetrisOptions(**options)


def test_width_one_runs_the_chain_path(monkeypatch):
    """``tetris_tree_width=1`` (the default) never grows a tree."""
    def no_tree(*args, **kwargs):
        raise AssertionError("a tree was drafted")

    monkeypatch.setattr(BatchedDraftCandidateGenerator, "propose_tree", no_tree)
    target, draft = target_and_draft(64, 0, "noisy")
    input_ids, mask = left_pad(random_prompts(3, 64, 0))
    target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                    max_new_tokens=8, pad_token_id=PAD, tetris_tree_width=1)


# ------------------------------------------------------------------------------------------------------------------
# EAGLE heads: a tree's nodes read the head's own output at their parents
# ------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def eagle_law_from_scratch(target, head, context: list[int], path: list[int]) -> torch.Tensor:
    """The head on one row alone: the target reads ``context[:-1]`` (features), the head reads ``context[1:]`` with
    them, then ``path`` one token at a time with its own output; ``(V,)`` its log-softmax after the last."""
    from transformers import DynamicCache

    ids = torch.tensor([context])
    features = head.target_features(target(ids[:, :-1], output_hidden_states=list(head.aux_layer_ids)))
    cache = DynamicCache()
    out = head(ids[:, 1:], target_features=features, past_key_values=cache, use_cache=True)
    for token in path:
        out = head(torch.tensor([[token]]), draft_features=out.features[:, -1:], past_key_values=cache,
                   use_cache=True)
    return out.logits[0, -1].float().log_softmax(-1)


def accept_two_levels(block_tokens, block_parents, target_argmax, max_depth=None):
    """A verifier that accepts each row's first node and that node's first selected child (whatever the target
    says), so that accepted nodes are re-read with the target's features at every step (random heads are rarely
    right)."""
    batch_size, slots = block_tokens.shape
    max_depth = slots - 1 if max_depth is None else max_depth
    first = torch.where(block_parents[:, 1:2] == 0, 1, -1) if slots > 1 else torch.full((batch_size, 1), -1)
    child = (block_parents == 1).long()
    second = torch.where(child.any(dim=1, keepdim=True) & (first >= 0), child.argmax(dim=1, keepdim=True), -1)
    path = torch.cat([first, second, torch.full((batch_size, max(max_depth, 2)), -1)], dim=1)[:, :max_depth]
    num_accepted = (path >= 0).sum(dim=1)
    last = torch.where(num_accepted > 0, path.gather(1, (num_accepted - 1).clamp(min=0)[:, None]).squeeze(1), 0)
    return trees.TreeAcceptance(path, num_accepted, target_argmax.gather(1, last[:, None]).squeeze(1))


def test_eagle_tree_nodes_see_their_parents_output(tmp_path, monkeypatch):
    """Every expanded node's law equals the head run from scratch on the node's own prefix, after steps that accepted
    nodes (re-read with the target's features) and left others as holes."""
    import tetris_hf.tree_step as tree_step
    from tetris_hf.candidate_generators.eagle_drafter import EagleCandidateGenerator
    from test_eagle_loop import load_pair, prompts_for

    target, head = load_pair(tmp_path, "llama", "eagle3", dtype=torch.float64)
    monkeypatch.setattr(tree_step, "accept_tree_greedy", accept_two_levels)
    grown_trees = []
    real_propose = EagleCandidateGenerator.propose_tree

    def recording(self, sequences, lengths, depth, width, rows):
        context = sequences.clone()
        grown = real_propose(self, sequences, lengths, depth, width, rows)
        grown_trees.append((grown, context, lengths.clone(), rows.clone()))
        return grown

    monkeypatch.setattr(EagleCandidateGenerator, "propose_tree", recording)
    input_ids, mask = left_pad(prompts_for(3, seed=3))
    target.generate(input_ids, attention_mask=mask, assistant_model=head, custom_generate="tetris", do_sample=False,
                    max_new_tokens=12, pad_token_id=PAD, num_assistant_tokens=3, tetris_extra_tokens=0,
                    tetris_tree_width=2, tetris_strategy="fixed")
    starts = (mask == 0).sum(dim=1)
    assert len(grown_trees) >= 3
    for grown, context, lengths, rows in grown_trees:
        tree = grown.tree
        paths = trees.path_tokens(tree.tokens, tree.parents, tree.depths, int(tree.depths.max()))
        for row in range(tree.tokens.shape[0]):
            row_context = context[row, int(starts[rows[row]]) : int(lengths[row])].tolist()
            torch.testing.assert_close(grown.expanded_log_probs[row, 0].float(),
                                       eagle_law_from_scratch(target, head, row_context, []), atol=1e-4, rtol=0)
            for node in range(tree.tokens.shape[1]):
                position = int(grown.expanded_of_node[node])
                if position >= 0:
                    path = paths[row, node, : int(tree.depths[row, node])].tolist()
                    torch.testing.assert_close(grown.expanded_log_probs[row, position].float(),
                                               eagle_law_from_scratch(target, head, row_context, path), atol=1e-4,
                                               rtol=0)


@pytest.mark.parametrize("head_format,batch_size,options", [
    ("eagle1", 3, dict(tetris_tree_width=2)),
    ("eagle3", 8, dict(tetris_tree_width=3, tetris_budget=5)),
    ("eagle3", 1, dict(tetris_tree_width=2, tetris_strategy="fixed")),
])
def test_eagle_tree_rows_equal_the_target_alone(tmp_path, head_format, batch_size, options):
    from test_eagle_loop import assert_greedy_rows_equal_the_target_alone

    assert_greedy_rows_equal_the_target_alone(tmp_path, "llama", head_format, batch_size, **options)


@pytest.mark.parametrize("drafter", ["model", "eagle"])
def test_a_tree_step_that_selects_no_node_still_emits_the_targets_token(tmp_path, monkeypatch, drafter):
    """Every tree drafted, none of it selected (a strategy may do that): each row verifies only its root, accepts
    nothing and emits the target's token; both caches stay exact. (With an EAGLE head this once read an empty path.)"""
    from tetris_hf.strategies import TetrisSelection
    from test_eagle_loop import load_pair, prompts_for

    target, head = load_pair(tmp_path, "llama", "eagle3")
    assistant = head if drafter == "eagle" else noisy_copy(target, 0.2, seed=5)
    monkeypatch.setattr(TetrisSelection, "select_tree", lambda self, tree, plan: torch.zeros_like(tree.valid))
    prompts = prompts_for(3, seed=3)
    references = target_alone(target, prompts, EOS)
    input_ids, mask = left_pad(prompts)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=assistant, custom_generate="tetris",
                          do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=PAD,
                          return_dict_in_generate=True, tetris_tree_width=2)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    assert out.tetris_stats.verified_tokens == 0 and out.tetris_stats.drafted_tokens > 0


def test_eagle_sampled_trees_follow_the_target_distribution(tmp_path):
    """The second token is the first drafted one (siblings tried in turn): its law is the target's, under a partial
    budget."""
    from test_eagle_loop import PROMPT, SAMPLED_ROWS, chi_square, load_pair, second_token_law

    target, head = load_pair(tmp_path, "llama", "eagle3")
    with torch.no_grad():  # peaked enough that the head's drafts are sometimes accepted
        target.lm_head.weight.mul_(3.0)
    torch.manual_seed(0)
    out = target.generate(torch.tensor([PROMPT] * SAMPLED_ROWS), assistant_model=head, custom_generate="tetris",
                          do_sample=True, top_k=0, max_new_tokens=4, pad_token_id=PAD, eos_token_id=None,
                          num_assistant_tokens=1, tetris_extra_tokens=1, tetris_budget=SAMPLED_ROWS,
                          tetris_tree_width=3, return_dict_in_generate=True)
    stats = out.tetris_stats
    assert 0 < stats.accepted_tokens < stats.verified_tokens < stats.drafted_tokens
    assert chi_square(out.sequences[:, len(PROMPT) + 1], second_token_law(target, PROMPT)) > 1e-3
