"""semoe's GGUF import and export against llama.cpp's own converter, quantizer and engine.

For each --arch, a small checkpoint (bench/peer_checkpoints.py's architecture at --shape, 256 wide so that
every k-quant type holds its rows) is converted by llama.cpp's convert_hf_to_gguf.py and quantized by
llama-quantize. Then:

    f32       the converter's float32 file imported: its logits against the HuggingFace directory's import
              (max |diff|; 0 when every layout change of the converter is undone exactly)
    TYPE      llama-quantize's file imported as users import it (blocks kept) and again widened to float32
              (`--dtype float32`): every kept tensor, decoded by `gguf.quants.dequantize`, against the widened
              import's (tensors that differ: 0 expected), and the logits of the kept blocks through the
              reference product against the widened ones
    export    the HuggingFace import exported (`store export --format gguf`): llama.cpp's logits on it against
              llama.cpp's on its own float32 conversion (max |diff|, and whether every argmax agrees)

    python bench/bench_gguf_layout.py --workdir DIR [--arch mixtral,qwen3_moe,...] [--types q4_k_m,q8_0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import numpy as np  # noqa: E402

import llama_peer as peer  # noqa: E402
from peer_checkpoints import parse_shape, prepare_arch  # noqa: E402

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss")
TOKENS = [1, 5, 9, 33, 100, 200, 300, 17]


def _logits(store: str, **kw) -> np.ndarray:
    import torch

    from semoe.checkpoints.model_io import load_store

    with torch.no_grad():
        return load_store(store, **kw)(torch.tensor([TOKENS])).logits[0].numpy()


def check_arch(root: str, arch: str, shape: dict, types: list[str]) -> dict:
    from semoe.checkpoints.gguf_export import export_gguf
    from semoe.checkpoints.hf_convert import import_checkpoint
    from storage.quant import QuantSpec, dequantize
    from storage.store import Store

    workdir = os.path.join(root, arch)
    os.makedirs(workdir, exist_ok=True)
    prepare_arch(workdir, arch, shape, bits=("f32",))
    env = peer.ensure_env()
    f32, hf_store = os.path.join(workdir, "llama-f32.gguf"), os.path.join(workdir, "store")
    out = {"arch": arch}
    scratch = os.path.join(workdir, "scratch")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    try:
        want = _logits(hf_store)
        got = _logits(import_checkpoint(f32, os.path.join(scratch, "f32")).root)
        out["f32_max_diff"] = float(np.abs(got - want).max())
        for qtype in types:
            path = os.path.join(workdir, f"llama-{qtype}.gguf")
            if not os.path.exists(path):
                peer.quantize(f32, path, qtype, env)
            kept = Store.open(import_checkpoint(path, os.path.join(scratch, f"{qtype}-kept")).root)
            wide = Store.open(import_checkpoint(path, os.path.join(scratch, f"{qtype}-wide"), dtype="float32").root)
            differ, blocks = [], 0
            for t in kept.manifest.tensors:
                if (t.quant or {}).get("scheme") != "ggml":
                    continue
                blocks += 1
                codes = kept.read_tensor(t.name) if t.group == "dense" else kept.read_expert(t.layer, t.expert)[t.name]
                mine = dequantize(codes, codes[:0], QuantSpec.from_json(t.quant))
                theirs = wide.read_dense(t.name) if t.group == "dense" else wide.read_expert(t.layer, t.expert)[t.name]
                if not np.array_equal(mine.numpy(), theirs.numpy()):
                    differ.append(t.name)
            ref = _logits(kept.root, dense="float", kernel="reference")
            out[qtype] = {"tensors_as_blocks": blocks, "tensors_differing": len(differ), "first_differing": differ[:3],
                          "reference_vs_widened_max_diff": float(np.abs(ref - _logits(wide.root)).max()),
                          "llama_vs_semoe_max_diff": float(np.abs(peer.logits(path, TOKENS, env=env)
                                                                  - _logits(kept.root)).max())}
            shutil.rmtree(os.path.join(scratch, f"{qtype}-kept"))
            shutil.rmtree(os.path.join(scratch, f"{qtype}-wide"))
        exported = os.path.join(scratch, "export.gguf")
        export_gguf(Store.open(hf_store), exported)
        a, b = peer.logits(f32, TOKENS, env=env), peer.logits(exported, TOKENS, env=env)
        out["export"] = {"llama_max_diff": float(np.abs(a - b).max()), "scale": float(np.abs(a).max()),
                         "argmax_equal": bool((a.argmax(-1) == b.argmax(-1)).all())}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--arch", default=",".join(ARCHS))
    ap.add_argument("--shape", default="hidden=256,layers=2,experts=8,expert_width=256",
                    help="peer_checkpoints' --shape for every architecture (default %(default)s)")
    ap.add_argument("--types", default="q4_k_m,q8_0,q6_k", help="llama-quantize's types (default %(default)s)")
    args = ap.parse_args()
    shape = parse_shape(args.shape)
    fails = 0
    for arch in args.arch.split(","):
        try:
            r = check_arch(args.workdir, arch, shape, args.types.split(","))
        except Exception as e:  # the next architecture still runs; this one counts as failed
            print(json.dumps({"arch": arch, "error": f"{type(e).__name__}: {e}"}), flush=True)
            fails += 1
            continue
        print(json.dumps(r), flush=True)
        fails += r["f32_max_diff"] != 0 or any(r[t]["tensors_differing"] for t in args.types.split(","))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
