"""The vLLM side of ``tetris-hf stream-bench --systems vllm``: run by the vLLM venv's python, never imported by tetris-hf.

vLLM ships its own transformers, so it lives in a venv of its own (``scripts/setup_vllm.sh``) and this file is its
only code: it imports the standard library, vLLM and its sibling ``allocator.py`` (standard library only, found as the
script's folder leads ``sys.path``), nothing of tetris_hf's package. The host
(:mod:`tetris_hf.tools.vllm_system`) starts ``VLLM_PYTHON vllm_worker.py`` and speaks JSON lines with it:

    host -> worker (stdin, one line)   {"model": DIR, "dtype": "float32", "max_num_seqs": 16, "max_model_len": 4096,
                                         "speculative_config": null | {"method": "ngram", ...}}
    worker -> host (protocol fd)       {"event": "ready", "startup_seconds": s, "vllm_version": "0.32.0", ...}
    host -> worker, any number of      {"op": "generate", "prompts": [[token ids], ...], "max_tokens": 128,
                                         "stop_token_ids": [2], "profile": false}
    worker -> host                     {"event": "generated", "seconds": s, "outputs": [{"tokens": [...],
                                         "first_token": s, "finished": s}, ...], "occupancy": [[s, rows], ...],
                                         "steps": n, "row_steps": n, "spec": {...} | null, "profile": [...] | null}
    host -> worker                     {"op": "exit"}
    worker -> host, on any failure     {"event": "error", "message": "..."}

Times are seconds from the start of that ``generate``. The protocol goes to a duplicate of the original stdout; vLLM's
own logs (written to stdout) go to stderr, so they never mix with it. ``startup_seconds`` is the engine's construction
(loading the weights and compiling the model with inductor), paid once and never counted in a run's throughput.

A run adds every prompt at once (a backlog, as ``stream-bench`` serves it) and calls ``LLMEngine.step()`` until
nothing is left, as ``LLM.generate`` does, noting when each request's first and last tokens came out.
``"profile": true`` runs that loop under ``torch.profiler`` and returns every op's self CPU time
(``[[name, self_us, calls], ...]``) for the host to sort into kinds.
"""

import json
import os
import sys
import time
import traceback

from allocator import loaded_allocator  # (tetris_hf/tools/allocator.py, beside this file: standard library only)


def _speculation_counters(llm) -> dict | None:
    """vLLM's own speculative-decoding counters (cumulative): drafts, draft tokens, accepted tokens, accepted per
    position. ``None`` where the engine keeps no such metric."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # metrics off or not offered by this version
        return None
    counters = {}
    for metric in metrics:
        name = metric.name
        if name == "vllm:spec_decode_num_drafts":
            counters["num_drafts"] = metric.value
        elif name == "vllm:spec_decode_num_draft_tokens":
            counters["num_draft_tokens"] = metric.value
        elif name == "vllm:spec_decode_num_accepted_tokens":
            counters["num_accepted_tokens"] = metric.value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            counters["accepted_per_position"] = list(getattr(metric, "values", []))
    return counters or None


def _generate(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]), detokenize=False,
                            stop_token_ids=list(request.get("stop_token_ids") or []))
    engine = llm.llm_engine
    before = _speculation_counters(llm)
    prompts = request["prompts"]
    profiler = None
    if request.get("profile"):
        import torch

        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), TokensPrompt(prompt_token_ids=list(prompt)), params)
    first = [None] * len(prompts)
    finished = [None] * len(prompts)
    tokens = [[] for _ in prompts]
    occupancy, steps, row_steps = [], 0, 0
    if profiler is not None:
        profiler.__enter__()
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter() - start
            if outputs:
                steps += 1
                row_steps += len(outputs)
                occupancy.append([now, len(outputs)])
            for output in outputs:
                index = int(output.request_id)
                tokens[index] = list(output.outputs[0].token_ids)
                if first[index] is None and tokens[index]:
                    first[index] = now
                if output.finished:
                    finished[index] = now
    finally:
        if profiler is not None:
            profiler.__exit__(None, None, None)
    seconds = time.perf_counter() - start
    after = _speculation_counters(llm)
    spec = None
    if before is not None and after is not None and "num_drafts" in after:
        spec = {key: (after[key] - before.get(key, 0) if not isinstance(after[key], list)
                      else [a - b for a, b in zip(after[key], before.get(key) or [0] * len(after[key]))])
                for key in after}
    table = None
    if profiler is not None:
        table = [[event.key, event.self_cpu_time_total, event.count] for event in profiler.key_averages()]
    return {"event": "generated", "seconds": seconds,
            "outputs": [{"tokens": tokens[i], "first_token": first[i] if first[i] is not None else seconds,
                         "finished": finished[i] if finished[i] is not None else seconds} for i in range(len(prompts))],
            "occupancy": occupancy, "steps": steps, "row_steps": row_steps, "spec": spec, "profile": table}


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout (vLLM's logs, prints) goes to stderr
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        config = json.loads(sys.stdin.readline())
        start = time.perf_counter()
        import vllm
        from vllm import LLM

        llm = LLM(model=config["model"], dtype=config.get("dtype", "float32"),
                  max_num_seqs=int(config["max_num_seqs"]), max_model_len=int(config["max_model_len"]),
                  enable_prefix_caching=False, speculative_config=config.get("speculative_config"),
                  disable_log_stats=False, seed=int(config.get("seed", 0)))
        send({"event": "ready", "startup_seconds": time.perf_counter() - start, "vllm_version": vllm.__version__,
              "torch_threads": __import__("torch").get_num_threads(),
              "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "allocator": loaded_allocator()})
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("op") == "exit":
                break
            if request.get("op") != "generate":
                send({"event": "error", "message": f"unknown op {request.get('op')!r}"})
                continue
            send(_generate(llm, request))
    except Exception as error:  # the host shows the message and the log's tail
        traceback.print_exc()
        send({"event": "error", "message": f"{type(error).__name__}: {error}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
