"""What ``adaptive`` learnt about a pair, saved to a file and loaded in another process (or onto new model objects)."""

import pytest
import torch

import tetris_hf
from tetris_hf.cost_model import CostProfile
from tetris_hf.pair_memory import pair_memory
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, tiny_llama


def pair(seed: int = 0):
    target = tiny_llama(vocab_size=64, seed=seed)
    return target, noisy_copy(target, 0.1, seed=seed)


def adaptive_steps(target, draft, prompts, profile, **options) -> list[int]:
    """Tokens drafted per step of one greedy ``adaptive`` call; checks the rows equal the target alone."""
    input_ids, mask = left_pad(prompts)
    drafted = []
    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                          tetris_strategy="adaptive", tetris_cost_profile=profile, max_new_tokens=24,
                          pad_token_id=PAD, tetris_step_callback=lambda record, loop: drafted.append(record.num_drafted),
                          **options)
    plain = target.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, plain)
    return drafted


CHEAP_VERIFY = CostProfile({(r, t): 10.0 + 0.01 * t for r in (1, 4, 16) for t in (1, 2, 4, 8)},
                           {r: 0.1 for r in (1, 4, 16)})  # drafting pays wherever drafts are accepted


def test_a_saved_memory_starts_new_model_objects_where_the_old_ones_stopped(tmp_path):
    target, draft = pair()
    prompts = random_prompts(3, 64, seed=1)
    cold = adaptive_steps(target, draft, prompts, CHEAP_VERIFY)
    assert cold[1] == 1  # nothing learnt: the first drafting step is a probe of one token
    learnt = pair_memory(target, draft)
    path = tetris_hf.save_pair_memory(target, draft, tmp_path / "pair.pt")

    again_target, again_draft = pair()  # the same weights, new objects: nothing in this process's memory for them
    assert pair_memory(again_target, again_draft).pool is None
    loaded = tetris_hf.load_pair_memory(again_target, again_draft, path)
    assert loaded is pair_memory(again_target, again_draft)
    assert torch.allclose(loaded.pool, learnt.pool, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(loaded.calibrator.accepted, learnt.calibrator.accepted)
    assert (loaded.plain_streak, loaded.probe_interval) == (learnt.plain_streak, learnt.probe_interval)
    assert (loaded.guarded, loaded.guarded_rows) == (learnt.guarded, learnt.guarded_rows)
    assert learnt.realized[False].predicted > 0  # (its drafting steps against their plans' predictions)
    assert (loaded.realized, loaded.plain_seconds) == (learnt.realized, learnt.plain_seconds)
    warm = adaptive_steps(again_target, again_draft, prompts, CHEAP_VERIFY)
    assert warm[1] > 1  # it plans from what was learnt at once: no cold probe


def test_compiled_and_eager_calls_learn_apart():
    """A compiled step costs what an eager one does not (its verify block padded): what compiled calls learnt (their
    guard, probe schedule, realized gain) must not decide whether an eager call drafts, nor the other way round."""
    target, draft = pair()
    prompts = random_prompts(3, 64, seed=1)
    adaptive_steps(target, draft, prompts, CHEAP_VERIFY, tetris_compile=True)
    compiled = pair_memory(target, draft, compiled=True)
    assert compiled.pool is not None and compiled.realized[False].predicted > 0
    assert pair_memory(target, draft).pool is None  # the eager calls' memory: nothing learnt yet
    cold = adaptive_steps(target, draft, prompts, CHEAP_VERIFY)
    assert cold[1] == 1  # an eager call starts cold: its first drafting step is a probe of one token
    assert pair_memory(target, draft, compiled=True) is compiled


def test_a_memory_is_refused_by_another_pair_or_kind_and_a_bad_file_names_itself(tmp_path):
    target, draft = pair()
    adaptive_steps(target, draft, random_prompts(2, 64, seed=1), CHEAP_VERIFY)
    path = tetris_hf.save_pair_memory(target, draft, tmp_path / "pair.pt")
    other_target, other_draft = pair(seed=1)  # one architecture, other weights
    with pytest.raises(ValueError, match="another pair"):
        tetris_hf.load_pair_memory(other_target, other_draft, path)
    with pytest.raises(ValueError, match="another pair"):
        tetris_hf.load_pair_memory(target, None, path)  # prompt lookup on the same target
    with pytest.raises(ValueError, match="hybrid=False"):
        tetris_hf.load_pair_memory(target, draft, path, hybrid=True)
    with pytest.raises(ValueError, match="compiled=False"):
        tetris_hf.load_pair_memory(target, draft, path, compiled=True)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a memory")
    with pytest.raises(ValueError, match="junk.pt is not a tetris-hf pair memory"):
        tetris_hf.load_pair_memory(target, draft, junk)
    torch.save({"format": "something else"}, junk)
    with pytest.raises(ValueError, match="junk.pt is not a tetris-hf pair memory"):
        tetris_hf.load_pair_memory(target, draft, junk)
