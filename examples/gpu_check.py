"""GPU check of tetris_hf on bf16, 4-bit (nf4) and 8-bit targets: greedy exactness, then a timing table.

    python examples/gpu_check.py                                  # random 1B-shaped Llama pair, no Hub needed
    python examples/gpu_check.py --shape 8b                       # random 8B-shaped target (saves ~16 GB to --workdir)
    python examples/gpu_check.py --target PATH --draft PATH       # real models sharing one tokenizer
    python examples/gpu_check.py --precisions bf16 nf4 --batch-sizes 1 4 16 64 --new-tokens 64 --json out.json
    python examples/gpu_check.py --device cpu --shape tiny --batch-sizes 1 4   # smoke-test the script on a CPU

Needs a CUDA GPU, torch, transformers, accelerate and bitsandbytes (``pip install bitsandbytes==0.50.2``); on a
machine without CUDA it exits with status 2 and says so. Nothing is downloaded unless --target/--draft name Hub ids.

Models. By default the target is a randomly initialised Llama with the shape of Llama-3.2-1B (``--shape 1b``) or
Llama-3.1-8B (``--shape 8b``), built from a config and saved once in bf16 to ``--workdir`` (quantized loading goes
through ``from_pretrained``). The draft is the target's first ``--draft-layers`` decoder layers with its embedding,
final norm and head, in bf16. Random networks agree by chance only, so the target's later layers write to the
residual stream scaled by ``--residual-scale`` (default 0.05): the draft then agrees with the target on roughly half
the tokens, as a trained draft would, while the target still runs every layer at full cost.

What it does, for each target precision (bf16, nf4 with bf16 compute, int8; the draft is always bf16):

1. Exactness: greedy TETRIS on a left-padded batch (``--check-batch`` rows, ``--check-tokens`` new tokens) against the
   same quantized target's plain greedy ``generate`` on the same batch. Rows must be identical. GPU kernels round
   differently for different shapes (a K+1-token verification forward is not a 1-token decoding forward), so where a
   row diverges the script re-scores the common prefix with the target and prints the gap between the two candidate
   tokens' logits, in units of that position's logit standard deviation: a divergence at a gap under
   ``--tie-tolerance`` is a numerical near-tie (plain batched vs plain one-row decoding diverges at such ties too, and
   the script counts those as the noise floor); a larger gap is a bug and makes the script exit with status 1.
2. Placement (bf16 only): the same check with half of the target's layers offloaded to CPU by accelerate
   (``device_map`` + ``max_memory``), and split across two GPUs when there are two.
3. Timing: generated tokens per second for no-SD (plain ``generate``), fixed-k batched SD (``tetris_strategy="fixed"``),
   TETRIS and ``adaptive`` (its cost profile is measured in the warm-up), at each batch size, after one warm-up; and
   their ratios. Printed as a Markdown table (ready for the
   README) and, with ``--json``, written as JSON.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # Llama-3.2-1B and Llama-3.1-8B
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,  # smoke runs
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False),
}
PAD = 0
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="target model path or Hub id (default: a random Llama of --shape)")
    parser.add_argument("--draft", help="draft model path or Hub id (default: the target's first --draft-layers)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--residual-scale", type=float, default=0.05)
    parser.add_argument("--precisions", nargs="+", choices=["bf16", "nf4", "int8"], default=["bf16", "nf4", "int8"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--check-batch", type=int, default=16)
    parser.add_argument("--check-tokens", type=int, default=48)
    parser.add_argument("--tie-tolerance", type=float, default=0.02)
    parser.add_argument("--k", type=int, default=4, help="num_assistant_tokens")
    parser.add_argument("--extra", type=int, default=2, help="tetris_extra_tokens")
    parser.add_argument("--no-placement", action="store_true", help="skip the accelerate placement check")
    parser.add_argument("--workdir", help="where the random target is saved (default: a temporary folder)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only to smoke-test this script")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------- models
def build_random_pair(shape: str, draft_layers: int, residual_scale: float, folder: Path, seed: int, device: str):
    """Save a random bf16 target of ``shape`` to ``folder``; return the bf16 draft (its first layers) on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, pad_token_id=PAD, bos_token_id=1,
                         eos_token_id=None)
    with torch.device(device):
        target = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # later layers write little to the residual stream: the early exit agrees often
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
    target.generation_config.pad_token_id = PAD
    target.generation_config.eos_token_id = None
    target.save_pretrained(folder)
    draft_config = copy.deepcopy(config)
    draft_config.num_hidden_layers = draft_layers
    with torch.device(device):
        draft = LlamaForCausalLM(draft_config).to(torch.bfloat16).eval()
    kept = {name: tensor for name, tensor in target.state_dict().items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < draft_layers}
    draft.load_state_dict(kept)
    draft.generation_config.pad_token_id = PAD
    del target
    free_memory()
    return draft


def load_target(source: str, precision: str, device: str, **placement):
    """The target in ``precision`` on ``device`` (or as ``placement`` says)."""
    from transformers import AutoModelForCausalLM

    from tetris_hf.quantization import quantization_config

    kwargs = dict(dtype=torch.bfloat16, device_map=placement.pop("device_map", device), **placement)
    if precision != "bf16":
        kwargs["quantization_config"] = quantization_config(load_in_4bit=precision == "nf4",
                                                            load_in_8bit=precision == "int8", device=device)
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs).eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = PAD
    return model


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: str):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------- inputs
class Prompts:
    """Left-padded prompt batches: the tokenizer's on the built-in prompts, else random token ids."""

    def __init__(self, source: str | None, vocab_size: int, seed: int, device: str):
        self.device = device
        self.tokenizer = None
        if source is not None:
            try:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
                if self.tokenizer.pad_token is None:
                    self.tokenizer.pad_token = self.tokenizer.eos_token
            except (OSError, ValueError):
                self.tokenizer = None
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tokenizer is not None:
            texts = [PROMPTS[i % len(PROMPTS)] for i in range(size)]
            encoded = self.tokenizer(texts, return_tensors="pt", padding=True)
            return encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device)
        lengths = torch.randint(16, 65, (size,), generator=self.generator).tolist()
        width = max(lengths)
        input_ids = torch.full((size, width), PAD, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, length in enumerate(lengths):
            input_ids[row, width - length :] = torch.randint(3, self.vocab_size, (length,), generator=self.generator)
            mask[row, width - length :] = 1
        return input_ids.to(self.device), mask.to(self.device)


def new_token_counts(sequences: torch.Tensor, width: int, eos_ids: set[int]) -> list[int]:
    """Generated tokens per row: up to and including the first EOS (what follows it is padding), else all."""
    counts = []
    for row in sequences[:, width:].tolist():
        stops = [i for i, token in enumerate(row) if token in eos_ids]
        counts.append(stops[0] + 1 if stops else len(row))
    return counts


def eos_set(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, list) else [eos])


# -------------------------------------------------------------------------------------------------------- exactness
def run(target, draft, input_ids, mask, new_tokens, mode, k, extra):
    """One greedy generate call; ``mode``: ``"plain"`` or a ``tetris_strategy`` (``"fixed"``, ``"tetris"``,
    ``"adaptive"``)."""
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    if mode == "plain":
        return target.generate(input_ids, **kwargs), None
    out = target.generate(input_ids, assistant_model=draft, custom_generate="tetris", tetris_strategy=mode,
                          num_assistant_tokens=k, tetris_extra_tokens=extra, return_dict_in_generate=True, **kwargs)
    return out.sequences, out.tetris_stats


@torch.no_grad()
def tie_gap(target, prompt: torch.Tensor, common: torch.Tensor, token_a: int, token_b: int) -> float:
    """|logit(a) - logit(b)| / std(logits) of the target after ``prompt + common`` (one row, no padding)."""
    ids = torch.cat([prompt, common])[None]
    logits = target(ids, logits_to_keep=1).logits[0, -1].float()
    return abs(float(logits[token_a] - logits[token_b])) / float(logits.std())


def compare_rows(target, reference, candidate, input_ids, mask, tolerance) -> dict:
    """Rows of ``candidate`` identical to ``reference``; for the others, the logit gap where they first diverge."""
    width = input_ids.shape[1]
    identical, gaps = 0, []
    for row in range(input_ids.shape[0]):
        a, b = reference[row, width:], candidate[row, width:]
        length = min(a.shape[0], b.shape[0])
        differ = (a[:length] != b[:length]).nonzero()
        if differ.numel() == 0:
            identical += 1
            continue
        at = int(differ[0])
        prompt = input_ids[row][mask[row].bool()]
        gaps.append(tie_gap(target, prompt, a[:at], int(a[at]), int(b[at])))
    real = [gap for gap in gaps if gap > tolerance]
    return {"rows": input_ids.shape[0], "identical": identical, "gaps": [round(gap, 4) for gap in gaps],
            "real_differences": len(real)}


def check_exactness(target, draft, prompts, args, label, rows=None, noise_floor=True) -> dict:
    input_ids, mask = prompts.batch(rows or args.check_batch)
    plain, _ = run(target, draft, input_ids, mask, args.check_tokens, "plain", args.k, args.extra)
    result = {"label": label}
    for mode in ("tetris", "fixed"):
        sequences, stats = run(target, draft, input_ids, mask, args.check_tokens, mode, args.k, args.extra)
        result[mode] = compare_rows(target, plain, sequences, input_ids, mask, args.tie_tolerance)
        result[mode]["acceptance_rate"] = round(stats.acceptance_rate, 3)
    if noise_floor:  # the same plain target, one row at a time instead of batched
        result["noise_floor"] = _one_row_at_a_time(target, plain, input_ids, mask, args)
    for key in ("tetris", "fixed", "noise_floor"):
        if key not in result:
            continue
        r = result[key]
        verdict = "OK" if r["real_differences"] == 0 else "FAIL"
        if key == "noise_floor":
            verdict = "(reference: plain batched vs plain one row)"
        accepted = f"  acceptance {r['acceptance_rate']:.2f}" if "acceptance_rate" in r else ""
        print(f"  [{label}] {key:<11} identical rows {r['identical']}/{r['rows']}  "
              f"divergence gaps (logit std units) {r['gaps']}{accepted}  {verdict}", flush=True)
    return result


def _one_row_at_a_time(target, plain, input_ids, mask, args) -> dict:
    """Plain batched greedy vs the same target on each row alone: how often GPU rounding alone flips a token."""
    one_by_one = torch.full_like(plain, PAD)
    width = input_ids.shape[1]
    for row in range(input_ids.shape[0]):
        prompt = input_ids[row][mask[row].bool()][None]
        alone = target.generate(prompt, max_new_tokens=args.check_tokens, do_sample=False)[0, prompt.shape[1]:]
        one_by_one[row, width : width + alone.shape[0]] = alone
    one_by_one[:, :width] = input_ids
    return compare_rows(target, plain, one_by_one, input_ids, mask, args.tie_tolerance)


# ----------------------------------------------------------------------------------------------------------- timing
TIMED_MODES = ("plain", "fixed", "tetris", "adaptive")


def time_cell(target, draft, prompts, batch_size, args) -> dict:
    input_ids, mask = prompts.batch(batch_size)
    eos = eos_set(target)
    cell = {"batch": batch_size}
    for mode in TIMED_MODES:
        run(target, draft, input_ids, mask, 8, mode, args.k, args.extra)  # warm-up (adaptive: its cost profile)
        synchronize(args.device)
        started = time.perf_counter()
        sequences, stats = run(target, draft, input_ids, mask, args.new_tokens, mode, args.k, args.extra)
        synchronize(args.device)
        seconds = time.perf_counter() - started
        tokens = sum(new_token_counts(sequences, input_ids.shape[1], eos))
        cell[mode] = {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1)}
        if stats is not None:
            cell[mode]["acceptance_rate"] = round(stats.acceptance_rate, 3)
            cell[mode]["verification_success_rate"] = round(stats.verification_success_rate, 3)
    return cell


def print_table(timings: dict) -> None:
    print("\n| target | batch | no-SD tok/s | fixed tok/s | TETRIS tok/s | adaptive tok/s | fixed / no-SD "
          "| TETRIS / no-SD | adaptive / no-SD | TETRIS / fixed | TETRIS VSR |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for precision, cells in timings.items():
        for cell in cells:
            plain, fixed, tetris, adaptive = (cell[mode]["tokens_per_s"] for mode in TIMED_MODES)
            print(f"| {precision} | {cell['batch']} | {plain:.0f} | {fixed:.0f} | {tetris:.0f} | {adaptive:.0f} "
                  f"| {fixed / plain:.2f} | {tetris / plain:.2f} | {adaptive / plain:.2f} | {tetris / fixed:.2f} "
                  f"| {cell['tetris']['verification_success_rate']:.2f} |")


# ------------------------------------------------------------------------------------------------------------- main
def placement_checks(source, draft, prompts, args) -> list[dict]:
    """bf16 target with half its layers offloaded to CPU (and split over two GPUs when there are two).

    (With ``--device cpu`` the offload goes to disk: accelerate's only other place on a CPU-only machine.)"""
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(source).num_hidden_layers
    first, other = (0, "cpu") if torch.device(args.device).type == "cuda" else ("cpu", "disk")
    offload = {"model.embed_tokens": first, "model.rotary_emb": first, "model.norm": first, "lm_head": first}
    offload.update({f"model.layers.{i}": first if i < layers // 2 else other for i in range(layers)})
    offload_folder = tempfile.mkdtemp(prefix="tetris-gpu-check-offload-")
    placements = {f"bf16 half the layers offloaded to {other}": dict(device_map=offload, offload_folder=offload_folder)}
    if torch.device(args.device).type == "cuda" and torch.cuda.device_count() >= 2:
        split = dict(offload)
        split.update({f"model.layers.{i}": 0 if i < layers // 2 else 1 for i in range(layers)})
        split["model.norm"] = split["lm_head"] = 1
        placements["bf16 layers split over cuda:0 and cuda:1"] = dict(device_map=split)
    results = []
    for label, placement in placements.items():
        try:
            target = load_target(source, "bf16", args.device, **placement)
            # offloaded weights cross the bus on every forward: fewer rows, no one-row-at-a-time noise floor
            results.append(check_exactness(target, draft, prompts, args, label, rows=4, noise_floor=False))
        except Exception as error:  # report and go on: the timing table is still worth having
            print(f"  [{label}] FAILED: {type(error).__name__}: {error}", flush=True)
            results.append({"label": label, "error": f"{type(error).__name__}: {error}"})
        finally:
            target = None
            free_memory()
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
              f"(torch {torch.__version__}). The CPU paths are covered by the test suite (pytest tests/).",
              file=sys.stderr)
        return 2
    import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
    from transformers import AutoModelForCausalLM

    from tetris_hf.quantization import QuantizationUnavailableError

    on_gpu = torch.device(args.device).type == "cuda"
    hardware = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if on_gpu else "CPU (smoke run)"
    print(f"device: {hardware}, torch {torch.__version__}", flush=True)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tetris-gpu-check-"))
    started = time.perf_counter()
    if args.target is None:
        source = str(workdir / f"random-llama-{args.shape}")
        draft = build_random_pair(args.shape, args.draft_layers, args.residual_scale, Path(source), args.seed,
                                  args.device)
        print(f"random {args.shape}-shaped target saved to {source}; draft = its first {args.draft_layers} layers "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    else:
        if args.draft is None:
            raise SystemExit("--target needs --draft (a small model with the same tokenizer)")
        source = args.target
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.bfloat16, device_map=args.device).eval()
    prompts = Prompts(args.target, draft.config.vocab_size, args.seed, args.device)

    results = {"device": hardware, "args": vars(args), "exactness": [], "timing": {}}
    for precision in args.precisions:
        print(f"\n== target {precision} ==", flush=True)
        try:
            target = load_target(source, precision, args.device)
        except QuantizationUnavailableError as error:
            print(f"  skipped: {error}", flush=True)
            results["exactness"].append({"label": precision, "error": str(error)})
            continue
        print(f"  loaded; {target.get_memory_footprint() / 2**30:.2f} GiB", flush=True)
        results["exactness"].append(check_exactness(target, draft, prompts, args, precision))
        results["timing"][precision] = []
        for batch_size in args.batch_sizes:
            cell = time_cell(target, draft, prompts, batch_size, args)
            results["timing"][precision].append(cell)
            print(f"  batch {batch_size}: " + ", ".join(
                f"{mode} {cell[mode]['tokens_per_s']:.0f} tok/s" for mode in TIMED_MODES), flush=True)
        target = None
        free_memory()
    if not args.no_placement:
        print("\n== placement (accelerate) ==", flush=True)
        results["exactness"] += placement_checks(source, draft, prompts, args)

    print_table(results["timing"])
    # failures: a divergence that is not a near-tie, or a placement that raised (an unavailable quantization backend
    # is reported as skipped, not failed)
    failed = [f"{r['label']}/{mode}" for r in results["exactness"] for mode in ("tetris", "fixed")
              if mode in r and r[mode]["real_differences"]]
    failed += [r["label"] for r in results["exactness"] if "error" in r and r["label"] not in args.precisions]
    print(f"\nexactness: {'OK' if not failed else 'FAILED: ' + ', '.join(failed)}  "
          f"(total {time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
