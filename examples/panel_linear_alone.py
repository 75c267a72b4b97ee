"""The panel linear kernel alone, as a step calls it: every layer's weight in turn (cold, as in a forward), against
oneDNN's kernel on its reordered copy (what ``use_onednn_linears`` multiplied with before) and on the weight itself.

    OMP_NUM_THREADS=2 python examples/panel_linear_alone.py --rows 1,16,80,256,1024

The shapes are SmolLM2-135M's (``--shapes``, ``OUTxIN`` a product: q and o 576x576, k and v 192x576, gate and up
1536x576, down 576x1536, the LM head 49152x576), ``--layers`` weights of each (4 of the LM head), so that a pass reads
them from memory as a forward does. Prints, per shape and row count, each kernel's microseconds a product (the best of
``--repeats`` passes after one untimed pass) and the GB/s of weight it read. Every kernel's output is checked against
float64 first. Measurements: docs/benchmarks.md, "A linear kernel for few rows".
"""

from __future__ import annotations

import argparse
import time

import torch

from tetris_hf.cpu_kernels import panel_linear, panel_weight, panels_available

SHAPES = "576x576,192x576,1536x576,576x1536,49152x576"


def kernels(weights):
    """Each kernel's name, its copies of ``weights`` and a function ``(x, copy, outputs) -> y``."""
    pointwise = torch.ops.mkldnn._linear_pointwise
    return [
        ("panels", [panel_weight(w) for w in weights], lambda x, copy, outputs: panel_linear(x, copy, None, outputs)),
        ("oneDNN reordered", [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights],
         lambda x, copy, outputs: pointwise(x, copy, None, "none", [], "")),
        ("oneDNN on the weight", weights, lambda x, copy, outputs: pointwise(x, copy, None, "none", [], "")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,80,256,1024", help="rows a product multiplies (comma list)")
    parser.add_argument("--shapes", default=SHAPES, help="OUTxIN weights (comma list)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not panels_available():
        raise SystemExit("the panel kernel cannot run here (no C compiler, or TETRIS_HF_CPU_KERNELS=0)")
    generator = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads; us a product (GB/s of weight read)", flush=True)
    for shape in args.shapes.split(","):
        outputs, inputs = map(int, shape.split("x"))
        layers = args.layers if outputs * inputs < 10_000_000 else 4
        weights = [torch.randn(outputs, inputs, generator=generator) / inputs ** 0.5 for _ in range(layers)]
        ways = kernels(weights)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, inputs, generator=generator)
            expected = x.double() @ weights[0].double().T
            times = {}
            for name, copies, multiply in ways:
                error = (multiply(x, copies[0], outputs).double() - expected).abs().max().item()
                if error > 1e-3:
                    raise SystemExit(f"{name} at {shape}, {rows} rows: off by {error:.2e} from float64")
                times[name] = []
            for _ in range(args.repeats + 1):
                for name, copies, multiply in ways:
                    started = time.perf_counter()
                    for copy in copies:
                        multiply(x, copy, outputs)
                    times[name].append((time.perf_counter() - started) / layers)
            gigabytes = outputs * inputs * 4 / 1e9
            cells = [f"{name} {1e6 * min(seconds[1:]):8.1f} ({gigabytes / min(seconds[1:]):4.1f})"
                     for name, seconds in times.items()]
            print(f"{shape:>10} {rows:5d} rows: " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
