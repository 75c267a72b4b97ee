"""``tetris_compile=None`` (the default): measured once per model and machine, cached in memory and on disk, and
followed by ``generate()`` and the request stream, whose rows stay exact either way; ruled out without measuring
where a call cannot compile on eager shapes; a failing compile stays eager and says why."""

import json

import pytest

import tetris_hf.compile_choice as compile_choice_module
from tetris_hf.compile_choice import ENVIRONMENT, VERSION, choice_cache_dir, clear_memory_cache, compile_choice
from tetris_hf.options import TetrisOptions, pop_options
from tetris_hf.stream import RequestStream
from test_compile_stream import fresh_dynamo  # noqa: F401  (a fixture)
from test_greedy_exactness import generate_checked, pick_eos, target_alone
from test_stream import check_exact, requests
from tiny_models import left_pad, noisy_copy, random_prompts, tiny_llama

LOOKUP = dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=2)


@pytest.fixture
def measured_here(monkeypatch, tmp_path):
    """``tetris_compile=None`` as a user meets it: the variable the suite sets unset, an empty cache folder, no
    choice remembered in this process."""
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    monkeypatch.setenv("TETRIS_HF_CACHE", str(tmp_path))
    clear_memory_cache()
    yield tmp_path
    clear_memory_cache()


def forced(monkeypatch, compile: bool) -> list:
    """Make every measurement choose ``compile`` without compiling; returns the list of models it was asked for."""
    asked = []

    def measure(model):
        asked.append(model)
        return {"eager_seconds": 1.0, "compiled_seconds": 0.5 if compile else 1.0, "compile_seconds": 0.0,
                "graphs": 0, "version": VERSION}

    monkeypatch.setattr(compile_choice_module, "measure_compiled_steps", measure)
    return asked


def test_the_choice_is_measured_once_then_read_from_memory_and_disk(measured_here, monkeypatch, fresh_dynamo):
    """The first use compiles and times both kinds of step (a real measurement on a tiny model); the choice is
    written to the cache folder; later uses read it from memory, then (a new process, as far as the choice knows)
    from disk, without measuring again; a choice of another measurement version is measured anew."""
    target = tiny_llama(seed=0)
    first = compile_choice(target, None, TetrisOptions())
    measured = first.measured
    assert measured["graphs"] == 1 and measured["eager_seconds"] > 0 and measured["compiled_seconds"] > 0
    assert first.compile == (first.compiled_over_eager <= compile_choice_module.PAYS_BELOW)
    assert f"{first.compiled_over_eager:.4f}x" in first.why
    files = list(choice_cache_dir().glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["compile"] == first.compile

    asked = forced(monkeypatch, not first.compile)  # (a measurement now would choose the other way)
    assert compile_choice(target, None, TetrisOptions()) == first
    clear_memory_cache()
    assert compile_choice(target, None, TetrisOptions()) == first and not asked
    data = json.loads(files[0].read_text())
    data["measured"]["version"] = VERSION - 1
    files[0].write_text(json.dumps(data))
    clear_memory_cache()
    assert compile_choice(target, None, TetrisOptions()).compile != first.compile and len(asked) == 1


@pytest.mark.parametrize("pays", [True, False])
def test_the_stream_follows_the_choice_and_stays_exact(measured_here, monkeypatch, fresh_dynamo, pays):
    """A stream left at the default compiles its target's forwards when the choice says they pay, else runs eager;
    every row equals the target alone either way."""
    target = tiny_llama(seed=0)
    forced(monkeypatch, pays)
    stream = RequestStream(target, max_batch_size=3, prefill_chunk=8, eos_token_id=None, **LOOKUP)
    assert stream.options.tetris_compile is pays
    assert (stream.loop.core.target_slots.eager_shapes_forward is not None) == pays
    check_exact(target, stream, requests(target, 8, seed=73))


def test_generate_follows_the_choice_and_stays_exact(measured_here, monkeypatch, fresh_dynamo):
    """``generate()`` left at the default, prompt lookup, the choice to compile: rows equal the target alone, and the
    target's forwards ran compiled (graphs were made)."""
    from torch._dynamo.utils import counters

    target = tiny_llama(seed=4)
    forced(monkeypatch, True)
    monkeypatch.setattr(compile_choice_module, "MIN_TOKENS", 1)  # (the call is small)
    prompts = random_prompts(3, target.config.vocab_size, seed=4)
    eos = pick_eos(target, prompts)
    input_ids, mask = left_pad(prompts)
    generate_checked(target, None, input_ids, mask, target_alone(target, prompts, eos), eos, **LOOKUP)
    assert counters["stats"]["unique_graphs"] > 0


@pytest.mark.parametrize("case", ["draft model", "unpacked", "variable"])
def test_calls_that_cannot_compile_on_eager_shapes_stay_eager_without_measuring(measured_here, monkeypatch, case):
    """A draft model, unpacked blocks, or ``$TETRIS_HF_COMPILE=0``: eager, the reason said, nothing measured, nothing
    written."""
    target = tiny_llama(seed=0)
    asked = forced(monkeypatch, True)
    draft = noisy_copy(target, 0.3) if case == "draft model" else None
    options = {"unpacked": dict(tetris_pack=False)}.get(case, {})
    if case == "variable":
        monkeypatch.setenv(ENVIRONMENT, "0")
    choice = compile_choice(target, draft, pop_options(dict(options)))
    assert not choice.compile and choice.why and not asked
    assert not choice_cache_dir().exists()


def test_a_failing_compile_stays_eager_says_why_and_is_tried_again_next_process(measured_here, monkeypatch, caplog):
    """A compiler that fails (say, none installed): the choice is eager with the error in its reason and a warning;
    it is remembered in this process only, so that a compiler installed later is tried; the stream runs exact."""
    target = tiny_llama(seed=0)

    def broken(model):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compile_choice_module, "measure_compiled_steps", broken)
    with caplog.at_level("WARNING", logger="tetris_hf.compile_choice"):
        stream = RequestStream(target, max_batch_size=2, eos_token_id=None, **LOOKUP)
    assert stream.options.tetris_compile is False
    assert "no C++ compiler found" in caplog.text
    assert "no C++ compiler found" in compile_choice(target, None, TetrisOptions()).why
    assert not choice_cache_dir().exists()
    check_exact(target, stream, requests(target, 4, seed=74))


def test_an_unreadable_cached_choice_is_measured_again(measured_here, monkeypatch):
    target = tiny_llama(seed=0)
    asked = forced(monkeypatch, True)
    assert compile_choice(target, None, TetrisOptions()).compile and len(asked) == 1
    (file,) = choice_cache_dir().glob("*.json")
    file.write_text("{not json")
    clear_memory_cache()
    assert compile_choice(target, None, TetrisOptions()).compile and len(asked) == 2


def test_the_option_takes_true_false_or_none():
    assert TetrisOptions().tetris_compile is None
    for value in (True, False, None):
        assert TetrisOptions(tetris_compile=value).tetris_compile is value
    for value in ("yes", 1, 0.0):
        with pytest.raises(TypeError, match="tetris_compile"):
            TetrisOptions(tetris_compile=value)


def test_stream_bench_runs_a_default_stream_that_compiles_once_untimed(measured_here, monkeypatch, fresh_dynamo):
    """``tetris-hf stream-bench`` leaves the stream's ``tetris_compile`` at its default: a stream that then compiles
    gets the untimed first run a compiled system gets (its seconds reported apart), one that stays eager none; outputs
    equal plain decoding's."""
    from tetris_hf.tools import stream_bench

    target = tiny_llama(seed=0)
    prompts = random_prompts(5, target.config.vocab_size, seed=9)
    for pays in (True, False):
        forced(monkeypatch, pays)
        clear_memory_cache()
        for file in choice_cache_dir().glob("*.json"):
            file.unlink()
        config = stream_bench.StreamBenchConfig(max_new_tokens=8, max_batch_sizes=(3,), systems=("generate-chunks",),
                                                strategies=("fixed",), lookup=True)
        report = stream_bench.run_stream_bench(target, None, prompts, {63}, 0, config, log=lambda line: None)
        assert ("stream-fixed" in report["startup"].get(3, {})) == pays
        assert all(row["equal"] == "5/5" for row in report["runs"][3])


def test_the_measurements_graph_serves_the_calls_steps(measured_here, fresh_dynamo):
    """The measurement's compile is the call's own: its graph (8 rows of buffers) serves a stream of 3 rows, which
    compiles nothing more (the buffers' rows are not a constant of the graph)."""
    from torch._dynamo.utils import counters

    target = tiny_llama(seed=0)
    assert compile_choice_module.measure_compiled_steps(target)["graphs"] == 1
    stream = RequestStream(target, max_batch_size=3, prefill_chunk=8, eos_token_id=None, tetris_compile=True, **LOOKUP)
    check_exact(target, stream, requests(target, 6, seed=75))
    assert counters["stats"]["unique_graphs"] == 1


def test_a_generate_call_too_small_to_pay_for_a_compile_stays_eager_without_measuring(measured_here, monkeypatch):
    """Rows x max_new_tokens below ``MIN_TOKENS``: eager, nothing measured; at or above it the choice is asked."""
    target = tiny_llama(seed=4)
    asked = forced(monkeypatch, True)
    prompts = random_prompts(2, target.config.vocab_size, seed=4)
    input_ids, mask = left_pad(prompts)
    monkeypatch.setattr(compile_choice_module, "MIN_TOKENS", 2 * 6 + 1)
    for new, compiles in ((6, False), (7, True)):
        out = target.generate(input_ids, attention_mask=mask, custom_generate="tetris", max_new_tokens=new,
                              pad_token_id=0, return_dict_in_generate=True, **LOOKUP)
        assert out.sequences.shape[1] <= input_ids.shape[1] + new
        assert len(asked) == int(compiles)
