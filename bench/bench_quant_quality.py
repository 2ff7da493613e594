"""semoe's own 4-bit against llama.cpp's Q4_K_M and Q5_K_M on the same checkpoint, at the bytes of the whole model.

For each --arch, WORKDIR/ARCH holds the bench's 3 GB-class float32 checkpoint (bench/peer_checkpoints.py), its
store and llama.cpp's float32 conversion; an --arch of bench/make_real.py's (qwen3-30b-a3b, ...) is that
published config's checkpoint, its first --real-layers layers, in bfloat16 as it ships (llama.cpp's file then
bfloat16 too). Calibration text is cut from the training split of the built-in
corpus (the Python standard library's sources), so it never overlaps the evaluation text, the validation split
`semoe eval` scores by default. Then:

    llama.cpp  Q4_K_M, Q5_K_M              llama-quantize on the float32 file
               Q4_K_M, Q5_K_M + imatrix    with llama-imatrix's matrix over the calibration text
    semoe      k4                          `semoe store quantize --bits 4 --kquant`
               k4 + calibrate              the same with --calibrate over the same text

semoe's stores are exported as GGUF (`semoe store export --format gguf`), so every row of the table is a GGUF
file, and its bytes are that file's size. Each file is imported as users import it (`semoe store import`:
the blocks kept as stored) and scored by `semoe eval --reference` against the float32 store, on the same
tokens: mean KL, its 99.9th percentile, and perplexity. The ratios compare semoe's KL with Q4_K_M's under the
same treatment (without calibration with without, with with), and semoe's bytes with Q4_K_M's; llama.cpp
loads each of semoe's files and decodes a few greedy tokens (printed as `llama.cpp loads it`).

Random weights: these checkpoints are drawn, not trained, and their activations are not a trained model's
(no outlier channels), so an importance matrix has less to find than on a trained model; the table says what
it says for these weights.

    python bench/bench_quant_quality.py --workdir /path --arch qwen3_moe,mixtral,olmoe,qwen2_moe
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

import llama_peer as peer  # noqa: E402
from peer_checkpoints import prepare_arch  # noqa: E402

SEMOE = [sys.executable, "-m", "tools.cli"]
REAL = ("qwen3-30b-a3b", "gpt-oss-20b", "qwen3.5-35b-a3b", "deepseek-v4-flash")  # bench/make_real.py's models


def _semoe(*args: str) -> str:
    r = subprocess.run([*SEMOE, *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"semoe {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return r.stdout


def calibration_text(path: str, nbytes: int) -> str:
    """The first `nbytes` of the training split's files (sorted), never the validation split eval scores."""
    from semoe.train.data import default_corpus_files, split_files, stdlib_root

    if os.path.exists(path):
        return path
    train, _ = split_files(default_corpus_files(), 0.05, 0, root=stdlib_root())
    out, n = [], 0
    for f in sorted(train):
        with open(f, encoding="utf-8", errors="replace") as fh:
            t = fh.read()
        out.append(t)
        n += len(t.encode())
        if n >= nbytes:
            break
    with open(path + ".part", "w", encoding="utf-8") as fh:
        fh.write("".join(out)[:nbytes])
    os.replace(path + ".part", path)
    return path


PROMPT = [1, 5, 9, 33, 100, 7]


def _eval(gguf_file: str, reference: str, workdir: str, max_tokens: int, greedy: int = 0) -> dict:
    """`semoe eval` of the file imported as users import it; with `greedy`, also that many greedy tokens."""
    store = os.path.join(workdir, "eval-store")
    shutil.rmtree(store, ignore_errors=True)
    _semoe("store", "import", gguf_file, store)
    try:
        out = json.loads(_semoe("eval", "--model", store, "--reference", reference, "--max-tokens", str(max_tokens),
                                "--json"))
        if greedy:
            out["tokens"] = json.loads(_semoe("generate", "--model", store, "--prompt-ids", ",".join(map(str, PROMPT)),
                                              "--max-new-tokens", str(greedy), "--greedy", "--json"))["tokens"]
            import torch

            from semoe.checkpoints.model_io import load_store

            with torch.no_grad():  # the prompt's logits, teacher-forced, to set beside llama.cpp's on the file
                out["logits"] = load_store(store)(torch.tensor([PROMPT])).logits[0].numpy()
        return out
    finally:
        shutil.rmtree(store, ignore_errors=True)


def prepare_real(workdir: str, model: str, layers: int) -> str:
    """bench/make_real.py's checkpoint of `model` (its first `layers` layers, bfloat16 as published), its
    store and llama.cpp's bfloat16 conversion (llama-f32.gguf is then that file); the architecture's name."""
    import make_real

    hf = os.path.join(workdir, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        make_real.write(model, hf, layers=layers)
    if not os.path.exists(os.path.join(workdir, "store", "manifest.json")):
        _semoe("store", "import", hf, os.path.join(workdir, "store"))
    out = os.path.join(workdir, "llama-f32.gguf")
    if not os.path.exists(out):
        peer.convert(hf, out, "bf16")
    return f"{model} ({layers} layers)"


def run_arch(root: str, arch: str, calib_tokens: int, max_tokens: int, real_layers: int = 2) -> list[dict]:
    workdir = os.path.join(root, arch)
    os.makedirs(workdir, exist_ok=True)
    if arch in REAL:  # a published config's shapes (bench/make_real.py)
        label = prepare_real(workdir, arch, real_layers)
    else:
        prepare_arch(workdir, arch, bits=("f32",))
        label = arch
    env = peer.ensure_env()
    ref, f32 = os.path.join(workdir, "store"), os.path.join(workdir, "llama-f32.gguf")
    text = calibration_text(os.path.join(root, "calibration.txt"), 4 * calib_tokens)
    imat = os.path.join(workdir, "imatrix.gguf")
    if not os.path.exists(imat):
        peer.imatrix(f32, text, imat, env, chunks=max(1, calib_tokens // 512))
    files = {}
    for qtype in ("q4_k_m", "q5_k_m"):
        for tag, im in (("", None), ("+imatrix", imat)):
            out = os.path.join(workdir, f"llama-{qtype}{'-imat' if im else ''}.gguf")
            if not os.path.exists(out):
                peer.quantize(f32, out, qtype, env, imatrix_file=im)
            files[f"llama.cpp {qtype.upper()}{tag}"] = out
    for tag, extra in (("", []), ("+calibrate", ["--calibrate", text, "--calibrate-tokens", str(calib_tokens)])):
        out = os.path.join(workdir, f"semoe-k4{'-cal' if extra else ''}.gguf")
        if not os.path.exists(out):
            store = os.path.join(workdir, "k4-store")
            shutil.rmtree(store, ignore_errors=True)
            _semoe("store", "quantize", ref, store, "--bits", "4", "--kquant", *extra)
            _semoe("store", "export", store, out, "--format", "gguf")
            shutil.rmtree(store)
        files[f"semoe k4{tag}"] = out
    rows, name = [], label
    for label, path in files.items():
        ours = label.startswith("semoe")
        r = _eval(path, ref, workdir, max_tokens, greedy=16 if ours else 0)
        row = {"arch": name, "file": label, "bytes": os.path.getsize(path), "kl": r["kl_divergence"],
               "kl_p99_9": r["kl_p99_9"], "ppl": r["perplexity"], "top1": r["top_token_agreement"]}
        if ours:  # llama.cpp on semoe's file: its logits and greedy tokens against semoe's on the same file
            row["llama_logits_max_diff"] = float(abs(peer.logits(path, PROMPT, env=env) - r["logits"]).max())
            row["logits_scale"] = float(abs(r["logits"]).max())
            theirs = peer.greedy_decode(path, PROMPT, 16, env=env)[0]
            row["greedy_same_as_llama"] = sum(1 for _ in zip(theirs, r["tokens"]) if _[0] == _[1])
            row["greedy_first_difference"] = next((i for i, (a, b) in enumerate(zip(theirs, r["tokens"])) if a != b),
                                                  None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| arch | file | MiB | mean KL | KL p99.9 | perplexity | vs Q4_K_M: KL | bytes |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = "+imatrix" if r["file"].endswith(("+imatrix", "+calibrate")) else ""
        base = next(b for b in rows if b["arch"] == r["arch"] and b["file"] == f"llama.cpp Q4_K_M{same}")
        lines.append(f"| {r['arch']} | {r['file']} | {r['bytes'] / 2**20:.1f} | {r['kl']:.5f} | {r['kl_p99_9']:.5f} "
                     f"| {r['ppl']:.1f} | {r['kl'] / base['kl']:.2f}x | {r['bytes'] / base['bytes']:.3f}x |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="one directory per architecture is made in it")
    ap.add_argument("--arch", default="qwen3_moe,mixtral,olmoe,qwen2_moe")
    ap.add_argument("--calibrate-tokens", type=int, default=8192, help="calibration tokens (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=2048, help="tokens scored (default %(default)s)")
    ap.add_argument("--real-layers", type=int, default=2,
                    help="layers kept of a real-size model named in --arch (qwen3-30b-a3b, ...; default %(default)s)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = ap.parse_args()
    rows = []
    for arch in args.arch.split(","):
        rows += run_arch(args.workdir, arch, args.calibrate_tokens, args.max_tokens, args.real_layers)
    print(json.dumps(rows) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
