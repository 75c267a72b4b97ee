"""``tetris_compile=None`` (the default): a call starts eager and compiles once its eager steps have taken long enough
for the compile to pay back, where the choice (measured once per model and machine, when a call first gets that far,
cached in memory and on disk) says compiled steps are faster; rows stay exact either way; calls that cannot compile on
eager shapes stay eager without measuring; a failing compile stays eager and says why."""

import json

import pytest

import tetris_hf.compile_choice as compile_choice_module
from tetris_hf.compile_choice import (ENVIRONMENT, VERSION, CompileChoice, CompileLater, choice_cache_dir,
                                      clear_memory_cache, compile_choice, compile_later, payback_seconds)
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
        return {"eager_seconds": 1.0, "compiled_seconds": 0.5 if compile else 1.0, "compile_seconds": 60.0,
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


def compiled_now(stream) -> bool:
    """Whether ``stream``'s target forwards run compiled now."""
    return stream.loop.core.target_slots.eager_shapes_forward is not None


@pytest.mark.parametrize("payback", [0.0, float("inf")])
def test_a_default_stream_starts_eager_and_compiles_once_its_eager_steps_paid(measured_here, monkeypatch,
                                                                                  fresh_dynamo, payback):
    """A stream left at the default, with a cached choice to compile: it starts eager (nothing compiled, nothing
    measured); with the payback reached at its first step it compiles there, one graph serving every later step and
    prompt; with a payback never reached it stays eager (no graph); every row equals the target alone either way."""
    from torch._dynamo.utils import counters

    target = tiny_llama(seed=0)
    asked = forced(monkeypatch, True)
    compile_choice(target, None, TetrisOptions())  # (cached: what an earlier process measured)
    monkeypatch.setattr(compile_choice_module, "payback_seconds", lambda choice: payback)
    stream = RequestStream(target, max_batch_size=3, prefill_chunk=8, eos_token_id=None, **LOOKUP)
    assert stream.options.tetris_compile is None and stream.loop.core.compile_later is not None
    assert not compiled_now(stream) and counters["stats"]["unique_graphs"] == 0
    check_exact(target, stream, requests(target, 8, seed=73))
    assert compiled_now(stream) == (payback == 0.0) and len(asked) == 1
    assert counters["stats"]["unique_graphs"] == (1 if payback == 0.0 else 0)


@pytest.mark.parametrize("due_at", [3, 7])
def test_a_stream_that_switches_mid_way_keeps_its_rows_and_cache_exact(measured_here, monkeypatch, fresh_dynamo,
                                                                       due_at):
    """The switch made with rows in flight and the cache already written eagerly (here at the 3rd or 7th counted step
    or prompt read, by count rather than by clock): later steps run the compiled graph over what eager steps wrote;
    one graph, every row equals the target alone."""
    from torch._dynamo.utils import counters

    target = tiny_llama(seed=0)
    forced(monkeypatch, True)
    compile_choice(target, None, TetrisOptions())
    counted = []

    def count(self, seconds):
        counted.append(seconds)
        return len(counted) >= due_at

    monkeypatch.setattr(CompileLater, "count", count)
    stream = RequestStream(target, max_batch_size=3, prefill_chunk=8, eos_token_id=None, **LOOKUP)
    check_exact(target, stream, requests(target, 10, seed=77))
    assert len(counted) == due_at and compiled_now(stream)
    assert counters["stats"]["unique_graphs"] == 1


def test_a_call_with_no_choice_measures_when_due_and_the_measurements_graph_serves_it(measured_here, monkeypatch,
                                                                                        fresh_dynamo):
    """No choice cached: the stream starts eager without measuring; when its eager steps reach
    ``UNMEASURED_PAYBACK_SECONDS`` it measures (for real: a tiny model, compiled and timed), writes the choice, and
    follows it: compiled, the measurement's one graph serving the call's later steps; rows exact."""
    from torch._dynamo.utils import counters

    target = tiny_llama(seed=0)
    stream = RequestStream(target, max_batch_size=3, prefill_chunk=8, eos_token_id=None, **LOOKUP)
    later = stream.loop.core.compile_later
    assert later.choice is None and later.payback_seconds == compile_choice_module.UNMEASURED_PAYBACK_SECONDS
    later.payback_seconds = 0.0  # (due at the first step)
    check_exact(target, stream, requests(target, 8, seed=76))
    (file,) = choice_cache_dir().glob("*.json")
    choice = json.loads(file.read_text())
    assert compiled_now(stream) == choice["compile"] and stream.loop.core.compile_later is None
    assert counters["stats"]["unique_graphs"] == 1  # (the measurement's, whichever way it chose)


def test_generate_at_the_default_compiles_once_paid_and_stays_exact(measured_here, monkeypatch, fresh_dynamo):
    """``generate()`` left at the default, prompt lookup, a cached choice to compile and a payback its prompt read
    reaches: its steps run compiled (one graph); rows equal the target alone."""
    from torch._dynamo.utils import counters

    target = tiny_llama(seed=4)
    forced(monkeypatch, True)
    compile_choice(target, None, TetrisOptions())
    monkeypatch.setattr(compile_choice_module, "payback_seconds", lambda choice: 0.0)
    prompts = random_prompts(3, target.config.vocab_size, seed=4)
    eos = pick_eos(target, prompts)
    input_ids, mask = left_pad(prompts)
    generate_checked(target, None, input_ids, mask, target_alone(target, prompts, eos), eos, **LOOKUP)
    assert counters["stats"]["unique_graphs"] == 1


def test_the_payback_is_the_compile_over_the_saving_and_counting_reaches_it():
    """A choice whose compiled steps take 0.92x eager's and whose compile took 56 s pays back after 700 s of eager
    steps: a call that ends sooner never compiled; one that ends right at the compile took 1.08x eager's time."""
    choice = CompileChoice(True, "measured", compiled_over_eager=0.92, compile_seconds=56.0)
    assert payback_seconds(choice) == pytest.approx(700.0)
    later = CompileLater(tiny_llama(seed=0), payback_seconds(choice), choice)
    assert not later.count(699.0) and later.count(2.0)
    assert (later.payback_seconds + choice.compile_seconds) / later.payback_seconds == pytest.approx(1.08)


def test_a_model_measured_not_to_pay_runs_eager_for_good_without_measuring_again(measured_here, monkeypatch):
    target = tiny_llama(seed=0)
    asked = forced(monkeypatch, False)
    assert not compile_choice(target, None, TetrisOptions()).compile and len(asked) == 1
    assert compile_later(target, None, TetrisOptions()) is None and len(asked) == 1
    for given in (True, False):  # (and a call that sets tetris_compile is never deferred)
        assert compile_later(target, None, TetrisOptions(tetris_compile=given)) is None


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
    assert compile_later(target, draft, pop_options(dict(options))) is None
    assert not choice_cache_dir().exists()


def test_a_failing_compile_stays_eager_says_why_and_is_tried_again_next_process(measured_here, monkeypatch, caplog):
    """A compiler that fails (say, none installed) when the call measures: the call goes on eager, the error in a
    warning and in the choice's reason, remembered in this process only (so that a compiler installed later is
    tried); rows exact."""
    target = tiny_llama(seed=0)

    def broken(model):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compile_choice_module, "measure_compiled_steps", broken)
    monkeypatch.setattr(compile_choice_module, "UNMEASURED_PAYBACK_SECONDS", 0.0)
    stream = RequestStream(target, max_batch_size=2, eos_token_id=None, **LOOKUP)
    with caplog.at_level("WARNING", logger="tetris_hf.compile_choice"):
        check_exact(target, stream, requests(target, 4, seed=74))
    assert not compiled_now(stream) and stream.loop.core.compile_later is None
    assert "no C++ compiler found" in caplog.text
    assert "no C++ compiler found" in compile_choice(target, None, TetrisOptions()).why
    assert not choice_cache_dir().exists()


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


def test_stream_bench_runs_a_default_stream_as_it_comes_without_an_untimed_compile_run(measured_here, monkeypatch,
                                                                                          fresh_dynamo):
    """``tetris-hf stream-bench`` leaves the stream's ``tetris_compile`` at its default: with a cached choice to
    compile, a short run stays eager (no graph, no untimed run: the stream compiles only once its steps paid); outputs
    equal plain decoding's."""
    from torch._dynamo.utils import counters

    from tetris_hf.tools import stream_bench

    target = tiny_llama(seed=0)
    prompts = random_prompts(5, target.config.vocab_size, seed=9)
    forced(monkeypatch, True)
    compile_choice(target, None, TetrisOptions())
    config = stream_bench.StreamBenchConfig(max_new_tokens=8, max_batch_sizes=(3,), systems=("generate-chunks",),
                                            strategies=("fixed",), lookup=True)
    report = stream_bench.run_stream_bench(target, None, prompts, {63}, 0, config, log=lambda line: None)
    assert "stream-fixed" not in report["startup"].get(3, {})
    assert all(row["equal"] == "5/5" for row in report["runs"][3])
    assert counters["stats"]["unique_graphs"] == 0


def test_the_measurements_graph_serves_the_calls_steps(measured_here, fresh_dynamo):
    """The measurement's compile is the call's own: its graph (8 rows of buffers) serves a stream of 3 rows, which
    compiles nothing more (the buffers' rows are not a constant of the graph)."""
    from torch._dynamo.utils import counters

    target = tiny_llama(seed=0)
    assert compile_choice_module.measure_compiled_steps(target)["graphs"] == 1
    stream = RequestStream(target, max_batch_size=3, prefill_chunk=8, eos_token_id=None, tetris_compile=True, **LOOKUP)
    check_exact(target, stream, requests(target, 6, seed=75))
    assert counters["stats"]["unique_graphs"] == 1

