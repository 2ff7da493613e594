"""semoe against llama.cpp on the same GGUF file: the Q4_K_M and Q8_0 files users download.

WORKDIR's 3 GB-class float32 checkpoint of --arch (bench/peer_checkpoints.py's ARCH_SHAPES) is converted by
llama.cpp's converter and quantized by llama-quantize (Q4_K_M: Q4_K with Q6_K for part of ffn_down and
attention V; Q8_0); semoe imports that very file (`semoe store import llama-TYPE.gguf`: its quantized experts
kept as their blocks, computed on as stored; its quantized dense tensors widened, then int8 on CPU as
`--dense auto` takes them). bench_vs_llamacpp.py then times both engines on it, each run its own process,
medians of --repeats rounds run in turn:

    resident   decode tok/s, every weight in memory; the prompt's time (--prompt-tokens, default 512)
    limited    decode tok/s with a balloon leaving SIZE of the model's bytes (--memory, default 33: a third),
               both engines cold (the page cache dropped before each process)

and reports, for each file, the greedy tokens' agreement between the two engines and, where they part,
llama.cpp's own logits there: its two best apart, and semoe's pick below its pick. Random weights route and
rank tokens unlike trained ones: greedy tokens of a random model sit on near-ties, so their agreement says
little beyond the first difference.

    python bench/bench_gguf.py --workdir /path/qwen3 --arch qwen3_moe [--types q4_k_m,q8_0] [--parts resident]
    python bench/bench_gguf.py --workdir /path/qwen3 --arch qwen3_moe --parts limited --lean --defaults
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="where the checkpoint, the GGUF files and the stores are made")
    ap.add_argument("--arch", default="qwen3_moe", help="the checkpoint's architecture (default %(default)s)")
    ap.add_argument("--shape", default="", help="bench_vs_llamacpp.py's --shape")
    ap.add_argument("--types", default="q4_k_m,q8_0", help="the GGUF types (default %(default)s)")
    ap.add_argument("--parts", default="resident,limited")
    ap.add_argument("--memory", default="33", help="the limited part's SIZE, percent of the model's bytes")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lean", action="store_true",
                    help="in the limited part, run semoe's torch-free decoder (`semoe generate --lean`): at a third "
                         "of a small file the engine's own torch runtime does not fit")
    ap.add_argument("--defaults", action="store_true",
                    help="in the limited part, also run `semoe generate` with no flag, as a user would")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cmd = [sys.executable, os.path.join(HERE, "bench_vs_llamacpp.py"), "--workdir", args.workdir, "--arch", args.arch,
           "--shape", args.shape, "--parts", args.parts, "--resident-bits", args.types, "--limited-bits", args.types,
           "--memory", args.memory, "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
           "--repeats", str(args.repeats), "--cold",
           *(["--lean"] if args.lean else []), *(["--defaults"] if args.defaults else []),
           *(["--json"] if args.json else [])]
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
