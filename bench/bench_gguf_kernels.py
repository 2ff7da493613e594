"""The GGUF kernels' speed from memory against semoe's int8 kernel on the same machine, in one run.

Each type's product (`torch_ops.gemv_ggml`: one row of x, decoding's case) runs over `--copies` different weights in turn,
so that none stays in the CPU's cache, and so does the int8 kernel on the same shape; rounds are interleaved
(every type, then again), and each figure is the median over rounds of the best of three passes. The int8 kernel
runs again right before each type, and a type's ratio is the median of its rounds' ratios to that run: this VM's
speed drifts by more than 10% over seconds, which pairing cancels. Prints GB/s of each type's own bytes and
its ratio to the int8 kernel's GB/s:

    python bench/bench_gguf_kernels.py [--types Q4_K,Q8_0] [--shapes 1536x1024,1024x768] [--rounds 5]

The weights are random blocks of each type with scales of a model's size (`tests/helpers/gguf_files.py`): the
kernels' speed does not depend on the values. Each call also pays a few microseconds of Python, the same for
every type.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TYPES = "Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,IQ4_NL,MXFP4,Q4_K,Q5_K,Q6_K,IQ4_XS"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=TYPES, help=f"ggml types, comma-separated [{TYPES}]")
    ap.add_argument("--shapes", default="1536x1024,1024x768,2048x768",
                    help="weights as OUTxIN, comma-separated; IN a multiple of 256 for the super-block types")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported [5]")
    ap.add_argument("--copies", type=int, default=96, help="different weights a pass goes through [96]")
    ap.add_argument("--threads", type=int, default=0, help="threads (0: torch's default)")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import numpy as np
    import torch

    from helpers.gguf_files import random_blocks
    from semoe.kernels import torch_ops

    if args.threads:
        torch.set_num_threads(args.threads)
    types = [t for t in args.types.split(",") if t]
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
        assert all(len(s) == 2 for s in shapes)
    except (ValueError, AssertionError):
        ap.error(f"--shapes: expected OUTxIN[,OUTxIN...], got {args.shapes!r}")
    rng = np.random.default_rng(0)
    cases = {}
    for O, I in shapes:
        x = torch.randn(1, I)
        for name in ["int8", *types]:
            if name == "int8":
                ws = [(torch.randint(-127, 128, (O, I), dtype=torch.int8), torch.rand(O)) for _ in range(args.copies)]
                cases[(name, O, I)] = ((lambda x: lambda w: torch_ops.gemv_i8(x, *w))(x), ws, O * I)
                continue
            if I % (256 if name.endswith("_K") or name == "IQ4_XS" else 32):
                print(f"{name}: {O}x{I} is not whole blocks of the type, skipped", file=sys.stderr)
                continue
            base = torch.from_numpy(np.ascontiguousarray(random_blocks(name, O, I, rng)))
            ws = [base.clone() for _ in range(args.copies)]
            fn = (lambda x, I, name: lambda w: torch_ops.gemv_ggml(x, w, I, name))(x, I, name)
            cases[(name, O, I)] = (fn, ws, base.numel())
    def measure(key) -> float:
        fn, ws, nbytes = cases[key]
        for w in ws:
            fn(w)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for w in ws:
                fn(w)
            best = min(best, (time.perf_counter() - t) / len(ws))
        return nbytes / best / 1e9

    gbs: dict[tuple, list[float]] = {k: [] for k in cases}
    ratio: dict[tuple, list[float]] = {k: [] for k in cases}
    for r in range(args.rounds):
        for key in cases:
            if key[0] == "int8":
                continue
            base = measure(("int8", *key[1:]))  # right before the type, so that the machine's drift cancels
            gbs[("int8", *key[1:])].append(base)
            gbs[key].append(measure(key))
            ratio[key].append(gbs[key][-1] / base)
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    report = {}
    for O, I in shapes:
        base = statistics.median(gbs[("int8", O, I)])
        row = {"int8_gbs": round(base, 2)}
        cells = []
        for name in types:
            if (name, O, I) in gbs:
                v, q = statistics.median(gbs[(name, O, I)]), statistics.median(ratio[(name, O, I)])
                row[name] = {"gbs": round(v, 2), "vs_int8": round(q, 3)}
                cells.append(f"{name} {v:.1f} ({q:.2f}x)")
        report[f"{O}x{I}"] = row
        print(f"{O}x{I}: int8 {base:.1f} GB/s | " + " ".join(cells), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
