"""semoe's fit of GGUF's blocks (`storage.kquants`) against llama.cpp's own quantizer, on the same weights.

llama.cpp's quantizer is called in its own library (`ggml_quantize_chunk` of the peer's libggml-base, through
ctypes), with and without an importance matrix; both results are decoded by the `gguf` package and scored by
the same measure, the squared error weighed by each input column's importance, sum_l a_l (w_l - w^_l)^2 (a_l
= 1 without a matrix): the expected squared error of the product. Weights: every expert and dense matrix of
--layer of the store given (a 3 GB bench checkpoint: drawn weights), and a heavy-tailed draw (Student-t, 3
degrees of freedom) standing in for a trained model's outliers. The importance: a log-normal draw per column
(a hundredfold spread, as activations of trained models have), the same for both.

    python bench/bench_kquant_fit.py --store /work/bw/qwen3/store [--layer 0]

Prints, per type and weights, the ratio semoe / llama.cpp of the weighted error (below 1: semoe's fit is closer).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from storage import kquants  # noqa: E402

GGML_IDS = {"Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


def ggml_lib():
    import llama_peer as peer

    env = peer.ensure_env()
    found = glob.glob(os.path.join(os.path.dirname(env.python), "..", "lib", "python*", "site-packages", "llama_cpp",
                                   "lib", "libggml-base.so"))
    if not found:
        raise SystemExit(f"no libggml-base.so in the peer environment {env.env_dir}")
    lib = ctypes.CDLL(found[0])
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p]
    return lib


def ggml_rows(lib, w: torch.Tensor, t: str, importance: torch.Tensor | None) -> torch.Tensor:
    x = np.ascontiguousarray(w.numpy(), dtype=np.float32)
    O, I = x.shape
    out = np.zeros((O, I // kquants.BLOCK_WEIGHTS[t] * kquants.BLOCK_BYTES[t]), np.uint8)
    im = None if importance is None else np.ascontiguousarray(importance.numpy(), dtype=np.float32)
    lib.ggml_quantize_chunk(GGML_IDS[t], x.ctypes.data, out.ctypes.data, 0, O, I, None if im is None else im.ctypes.data)
    return torch.from_numpy(out)


def weights(store_path: str | None, layer: int) -> dict[str, torch.Tensor]:
    out = {}
    if store_path:
        from storage.store import Store

        s = Store.open(store_path)
        for t in s.manifest.tensors:
            if t.layer == layer or (t.group == "dense" and f"layers.{layer}." in t.name):
                if len(t.shape) == 2 and t.shape[1] % 256 == 0 and not t.quant and t.kind == "weight" \
                        and (t.group != "expert" or t.expert == 0) and "gate.weight" not in t.name.split("mlp.")[-1]:
                    v = s.read_expert(t.layer, t.expert)[t.name] if t.group == "expert" else s.read_dense(t.name)
                    out[t.name.split("layers.")[-1]] = v.float()
    heavy = torch.distributions.StudentT(3.0).sample((512, 2048)).clamp(-40, 40) * 0.02
    out["student-t(3) 512x2048"] = heavy
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", help="a float store whose weights to fit (default: the drawn weights alone)")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    lib = ggml_lib()
    rows = []
    for name, w in weights(args.store, args.layer).items():
        imp = torch.exp(torch.randn(w.shape[1], generator=torch.Generator().manual_seed(1)) * 1.2)
        for t in ("Q4_K", "Q6_K", "Q8_0"):
            for label, a in (("plain", None), ("importance", imp)):
                ours = kquants.weighted_error(w, kquants.quantize_rows(w, t, a), t, a)
                theirs = kquants.weighted_error(w, ggml_rows(lib, w, t, a), t, a)
                rows.append({"weights": name, "shape": list(w.shape), "type": t, "fit": label, "semoe_over_ggml": ours / theirs})
                if not args.json:
                    print(f"{name:40s} {t} {label:10s} semoe/llama.cpp weighted error {ours / theirs:.3f}", flush=True)
    if args.json:
        print(json.dumps(rows))
    else:
        for t in ("Q4_K", "Q6_K", "Q8_0"):
            r = [x["semoe_over_ggml"] for x in rows if x["type"] == t]
            print(f"{t}: semoe/llama.cpp weighted error over {len(r)} fits: max {max(r):.3f}, geometric mean "
                  f"{float(np.exp(np.mean(np.log(r)))):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
