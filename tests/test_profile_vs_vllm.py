"""examples/profile_vs_vllm.py's accounting, on hand-made profiler rows (no model, no vLLM): every op lands in one
kind, the kinds and the time outside ops add up to the run's wall time, and the table shows every system."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "profile_vs_vllm.py"


@pytest.fixture(scope="module")
def profile():
    spec = importlib.util.spec_from_file_location("profile_vs_vllm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_op_has_one_kind_and_exact_names_match_whole(profile):
    assert profile.kind_of("_C::onednn_mm") == profile.kind_of("aten::mm") == "matmul / linear"
    # our own products: tetris_hf/cpu_kernels.py's ops (an earlier table counted them among the eager ops)
    assert profile.kind_of("tetris_hf::onednn_linear") == profile.kind_of("tetris_hf::sibling_linears") \
        == "matmul / linear"
    assert profile.kind_of("tetris_hf::prompt_attention") == "attention + KV cache"
    assert profile.kind_of("_C::cpu_attention_with_kv_cache") == "attention + KV cache"
    assert profile.kind_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention + KV cache"
    assert profile.kind_of("## Call CompiledFxGraph None ##") == "fused kernels (inductor)"
    assert profile.kind_of("_C::greedy_argmax") == "sampling / logits"
    assert profile.kind_of("TorchDynamo Cache Lookup") == "compile runtime (guards, wrappers)"
    assert profile.kind_of("aten::view") == profile.kind_of("aten::t") == "views, allocation, sync"
    # exact names are not prefixes: aten::tanh is not aten::t, aten::view_as_real is not aten::view
    assert profile.kind_of("aten::tanh") == profile.kind_of("aten::view_as_real") == profile.OTHER_OPS
    assert profile.kind_of("aten::mul") == profile.kind_of("aten::rms_norm") == profile.OTHER_OPS


def test_kinds_and_host_time_add_up_to_the_wall_time(profile):
    ops = [["aten::mm", 600_000.0, 10], ["aten::mul", 100_000.0, 40], ["aten::view", 50_000.0, 90],
           ["aten::_scaled_dot_product_flash_attention_for_cpu", 150_000.0, 10]]
    result = profile.breakdown(ops, wall_seconds=1.0, steps=4)
    kinds = result["kinds"]
    assert kinds["matmul / linear"]["ms_per_step"] == pytest.approx(150.0)
    assert kinds[profile.HOST]["ms_per_step"] == pytest.approx(25.0)  # 0.1 s outside any op, over 4 steps
    assert sum(cell["share"] for cell in kinds.values()) == pytest.approx(1.0)
    assert result["top"]["matmul / linear"][0][0] == "aten::mm"
    system = {"profile": result, "profiled_tokens": 64, "tokens_per_second": 50.0, "seconds": 1.0,
              "prefill_seconds": 0.5, "outputs": [[1, 2]], "load_average_after": 1.0}
    table = profile.format_table({"a": system, "b": {**system, "startup_seconds": 80.0}}, "a")
    assert "matmul / linear" in table and "150.0 (60%)" in table and "16.00" in table and "1/1" in table
    assert table.splitlines()[0].split()[-2:] == ["a", "b"]
