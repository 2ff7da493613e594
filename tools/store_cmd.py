"""`semoe store ...`: import, export, inspect, verify, collect garbage, benchmark, simulate caches."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from storage.errors import BadInputError
from storage.formats import CAST_CHOICES, INT4_DEFAULT_GROUP, INT4_GROUP_SIZES, KQUANT_TARGET_BITS
from tools.cli_output import emit_json
from tools.size_flags import format_size
from tools.progress import byte_bar


def _open(path: str) -> "Store":  # noqa: F821
    """The store at `path` (storage.store imports torch and tensorstore: loaded when a command runs, not
    when the command line is parsed)."""
    from storage.store import Store

    return Store.open(path)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `semoe store` and its subcommands."""
    p = sub.add_parser("store", help="manage expert checkpoints on SSD",
                       description="Manage tensor stores: zarr v3 arrays on SSD with a manifest and atomic commits.")
    ss = p.add_subparsers(dest="store_command", metavar="SUBCOMMAND")
    ss.required = True

    q = ss.add_parser("import", help="import a HuggingFace safetensors checkpoint into a new store",
                      description="Import a HuggingFace checkpoint (safetensors, single file or sharded with "
                                  "model.safetensors.index.json, plus config.json and tokenizer files) into a new "
                                  "store. Expert tensors (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4.5, "
                                  "fused 3-D experts as in gpt-oss) get one chunk file per expert; the rest is "
                                  "dense. FP8 block-scale (DeepSeek-V3) and MXFP4 (gpt-oss) checkpoints are kept "
                                  "as they ship (codes and scales, exported bit-exact; dense ones are dequantized "
                                  "when a model loads); multi-token-prediction layers are kept for drafting "
                                  "(--no-mtp leaves them out). A GGUF file (llama.cpp's; one part of a split "
                                  "file names the whole) imports as the directory it was converted from: "
                                  "config and tokenizer from its metadata, F32/F16/BF16 tensors as stored, "
                                  "quantized experts (Q8_0, Q4_K, Q6_K, IQ4_XS, ...) kept as their blocks, which "
                                  "the kernels compute on, other quantized tensors decoded to bfloat16 "
                                  "(--dtype float32: every tensor decoded, the file's values exactly). "
                                  "Streams tensor by tensor; on failure nothing is left behind.")
    q.add_argument("hf_dir", metavar="SOURCE", help="HuggingFace checkpoint directory, or a .gguf file")
    q.add_argument("store", metavar="STORE", help="new store directory (must be absent or empty)")
    q.add_argument("--dtype", choices=CAST_CHOICES, default="keep",
                   help="cast floating-point tensors (default: keep, bit-exact)")
    q.add_argument("--quantize", choices=("int8", "int4"), metavar="int8|int4",
                   help="store the experts' weights compact, as `semoe store quantize` does (lossy)")
    _add_group_size(q)
    _add_dense(q)
    q.add_argument("--no-mtp", action="store_true",
                   help="leave out the multi-token-prediction layers (DeepSeek-V3, GLM-4.5, Qwen3-Next...), which "
                        "speculative decoding drafts with (`--speculative`); they take disk, not memory")
    q.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    q.set_defaults(handler=cmd_import)

    q = ss.add_parser("quantize", help="copy a store with its experts' weights in int8 or int4",
                      description="Write a new store OUT with the routed experts' 2-D weights quantized: int8 "
                                  "(symmetric, one scale per output row: a quarter of float32's bytes, plus the "
                                  "scales) or int4 (groups of --group-size weights along the input, a scale and "
                                  "a zero point each). The dense linear weights (attention, lm_head, dense and "
                                  "shared feed-forwards) are stored int8, one scale per output row, as decoding "
                                  "on CPU holds them beside compact experts (--dense float: copied as they "
                                  "are); routers, norms, the token embedding and biases are copied as they are. "
                                  "A weight whose shape the scheme cannot hold stays as it is and is listed. "
                                  "Codes and scales live in the expert's chunk (one read), and stay compact in "
                                  "the CPU cache, the device ring and the kernels. A quantized store is for "
                                  "inference: `store export` writes it dequantized (lossy), `train --init-from` "
                                  "dequantizes it. A store quantized with --dense float gets its dense weights "
                                  "made int8 and its experts copied as they are. On failure nothing is left.")
    q.add_argument("store", metavar="STORE", help="the float store to read")
    q.add_argument("out", metavar="OUT", help="new store directory (must be absent or empty)")
    q.add_argument("--bits", type=int, required=True, metavar="8|4", help="8: int8; 4: int4")
    _add_group_size(q)
    _add_dense(q)
    q.add_argument("--kquant", action="store_true",
                   help="with --bits 4: semoe's 4-bit mix in GGUF's k-quant blocks, fitted by semoe's own search: "
                        "experts Q4_K; attention, dense and shared feed-forwards, lm_head and token embedding "
                        "stepped up to Q8_0 or Q6_K, in the order that buys the most, within --target-bits. The "
                        "kernels compute on the blocks; `store export --format gguf` writes them as they are")
    q.add_argument("--target-bits", type=float, default=KQUANT_TARGET_BITS, metavar="B",
                   help=f"--kquant: bits a weight the whole stays within (default {KQUANT_TARGET_BITS}, about "
                        f"Q4_K_M's on MoE models; 4.5 keeps every weight Q4_K)")
    q.add_argument("--calibrate", metavar="FILE",
                   help="with --kquant: a text file (or directory of .txt/.md/.py files) the float model reads "
                        "first; each weight's fit then weighs its input columns by their mean squared "
                        "activation there, as llama.cpp's importance matrix does")
    q.add_argument("--calibrate-tokens", type=int, default=8192, metavar="N",
                   help="tokens of --calibrate's text read at most, in windows of 512 (default 8192)")
    q.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    q.set_defaults(handler=cmd_quantize)

    q = ss.add_parser("export", help="export a store back to a HuggingFace directory, or as a GGUF file",
                      description="Write the store's weights as a HuggingFace directory that transformers loads, "
                                  "with the original shard layout; bit-exact with the imported checkpoint. "
                                  "--format gguf writes one GGUF file llama.cpp loads instead, laid out as its "
                                  "converter lays out the checkpoint: float tensors in their dtype, experts "
                                  "imported from a GGUF file as their blocks, byte for byte, other compact "
                                  "weights dequantized; the tokenizer (byte-level BPE) and chat template in "
                                  "its metadata.")
    q.add_argument("store", metavar="STORE")
    q.add_argument("out_dir", metavar="OUT",
                   help="output directory (must be absent or empty), or with --format gguf the file (absent)")
    q.add_argument("--format", choices=("hf", "gguf"), default="hf",
                   help="hf: a HuggingFace directory (default); gguf: one GGUF file")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=cmd_export)

    q = ss.add_parser("ls", help="list the tensors of a store",
                      description="List every tensor: name, group (dense/expert), layer, expert, kind, dtype, shape, "
                                  "bytes, version.")
    q.add_argument("store", metavar="STORE")
    q.add_argument("--json", action="store_true", help="one JSON object with a 'tensors' list")
    q.set_defaults(handler=cmd_ls)

    q = ss.add_parser("info", help="summarise a store",
                      description="Architecture, layers, experts per layer, bytes dense / experts, dtypes, "
                                  "committed version.")
    q.add_argument("store", metavar="STORE")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=cmd_info)

    q = ss.add_parser("verify", help="check every file and checksum",
                      description="Check that every file is present with the recorded size and every tensor "
                                  "matches its crc32c. Exit 0 when all match, 1 naming every bad or missing tensor.")
    q.add_argument("store", metavar="STORE")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=cmd_verify)

    q = ss.add_parser("gc", help="remove files no retained version references",
                      description="Remove files that no retained version references (needs the write lock).")
    q.add_argument("store", metavar="STORE")
    q.add_argument("--keep", type=int, default=1, help="how many newest versions stay readable (default 1)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=cmd_gc)

    q = ss.add_parser("bench", help="hot-path read throughput vs a plain read of the same bytes",
                      description="Read every expert chunk through the hot path (preadv into aligned buffers from "
                                  "a thread pool, checksums verified), with a plain sequential read of the same "
                                  "files into the same buffers (and, --cold, O_DIRECT reads of 1 MiB as dd's), "
                                  "and with tensorstore, in one run. Reports medians.")
    q.add_argument("store", metavar="STORE")
    q.add_argument("--cold", action="store_true",
                   help="drop the files from the page cache before each pass; the hot path uses O_DIRECT")
    q.add_argument("--repeats", type=int, default=3, help="passes per reader (default 3)")
    q.add_argument("--threads", type=int, default=None,
                   help="hot-path reader threads (default: one per core for cached reads, at least 4 for --cold)")
    q.add_argument("--no-tensorstore", action="store_true", help="skip the tensorstore reader")
    q.add_argument("--json", action="store_true", help="JSON with store_gbps, raw_gbps, ratio, ...")
    q.set_defaults(handler=cmd_bench)

    q = ss.add_parser("cache-sim", help="replay an expert-access trace through cache policies",
                      description="Replay a JSONL trace (one object per token and layer: "
                                  '{"layer": L, "experts": [e, ...]}) through the CPU cache with capacity counted '
                                  "in experts.")
    q.add_argument("--trace", required=True, metavar="FILE")
    q.add_argument("--capacity", type=int, metavar="N", help="cache capacity in experts (optional with --plot)")
    q.add_argument("--policy", default="all", help="lfu-aging|lfu|lru|belady|next-use|all (default all)")
    q.add_argument("--plot", metavar="FILE.png",
                   help="draw hit rate against capacity (from the largest record to every expert in the trace) "
                        "for each policy, with Belady as the ceiling; without --capacity, print that sweep")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=cmd_cache_sim)


def _add_group_size(q: argparse.ArgumentParser) -> None:
    q.add_argument("--group-size", type=int, default=INT4_DEFAULT_GROUP, metavar="N",
                   help=f"int4: weights per scale along the input, one of {', '.join(map(str, INT4_GROUP_SIZES))} "
                        f"(default {INT4_DEFAULT_GROUP})")


def _add_dense(q: argparse.ArgumentParser) -> None:
    q.add_argument("--dense", choices=("int8", "float"), default="int8",
                   help="the dense linear weights beside the quantized experts: int8 (default; what decoding on "
                        "CPU computes with) or float, as they are (what a GPU computes with: it dequantizes int8 "
                        "ones at load)")


def cmd_import(args: argparse.Namespace) -> int:
    from semoe.checkpoints.hf_convert import import_checkpoint, open_checkpoint
    from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store

    quant = QuantizeConfig(bits=8 if args.quantize == "int8" else 4, group_size=args.group_size,
                           dense=args.dense) if args.quantize else None
    _check_target(args.store)
    mtp = not args.no_mtp
    ck = open_checkpoint(args.hf_dir, dtype=args.dtype, mtp=mtp)
    total = sum(r.nbytes for r in ck.tensors.values())
    if quant is None:
        with byte_bar(total, "import") as bar:
            store = import_checkpoint(args.hf_dir, args.store, dtype=args.dtype, progress=bar.update, mtp=mtp)
    else:  # import beside the target, then quantize into it
        staging = tempfile.mkdtemp(prefix=".import-", dir=os.path.dirname(os.path.abspath(args.store)))
        try:
            with byte_bar(total, "import") as bar:
                import_checkpoint(args.hf_dir, os.path.join(staging, "store"), dtype=args.dtype, progress=bar.update,
                                  mtp=mtp)
            with byte_bar(total, "quantize") as bar:
                _quantized(quantize_store(os.path.join(staging, "store"), args.store, quant, progress=bar.update))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        store = _open(args.store)
    info = store.describe()
    if args.json:
        emit_json(info)
    else:
        print(f"imported {args.hf_dir} -> {store.root}: version {info['version']}, {info['tensors']} tensors, "
              f"{len(info['experts_per_layer'])} MoE layers, {format_size(info['expert_bytes'])} experts, "
              f"{format_size(info['dense_bytes'])} dense")
        for label, text in _import_notes(info):
            print(f"{label}: {text}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store

    cfg = QuantizeConfig(bits=args.bits, group_size=args.group_size, dense=args.dense, kquant=args.kquant,
                         target_bits=args.target_bits)
    _check_target(args.out)
    source = _open(args.store)
    total = sum(t.bytes for t in source.manifest.tensors if t.kind == "weight")
    if args.calibrate is not None:
        from semoe.evaluation.calibrate import collect_importance
        from tools.progress import count_bar

        if not args.kquant:
            raise BadInputError("--calibrate weighs the fit of --kquant's blocks; add --kquant")
        if not os.path.exists(args.calibrate):
            raise BadInputError(f"--calibrate {args.calibrate}: no such file or directory")
        if args.calibrate_tokens < 2:
            raise BadInputError(f"--calibrate-tokens must be at least 2, got {args.calibrate_tokens}")
        ids = _calibration_ids(source, args.calibrate, args.calibrate_tokens)
        with count_bar(len(ids), "calibrate", "tok") as bar:
            cfg.importance = collect_importance(args.store, ids, progress=bar.update)
    with byte_bar(total, "quantize") as bar:
        report = quantize_store(args.store, args.out, cfg, progress=bar.update)
    _quantized(report)
    if args.json:
        emit_json({"store": source.root, "out": os.path.abspath(args.out), **report.to_json()})
        return 0
    print(f"quantized {source.root} -> {args.out}: {report.quantized} expert weights in {report.scheme}, expert "
          f"bytes {format_size(report.bytes_before)} -> {format_size(report.bytes_after)} "
          f"({report.bytes_after / max(report.bytes_before, 1):.3f}x)"
          + (f"; {report.dense_quantized} dense weights in {'GGUF blocks' if args.kquant else 'int8'}, "
             f"{format_size(report.dense_bytes_before)} -> "
             f"{format_size(report.dense_bytes_after)}" if report.dense_quantized else ""))
    return 0


def _calibration_ids(source, text: str, limit: int) -> list[int]:
    """--calibrate's text (a file, or a directory's *.txt/*.md/*.py files) as the store's tokenizer reads it."""
    from semoe.checkpoints.hf_config import store_model_config
    from semoe.checkpoints.model_io import load_model_tokenizer
    from semoe.evaluation.perplexity import gather_tokens
    from semoe.train.data import eval_documents

    tok = load_model_tokenizer(source, store_model_config(source, source.root))
    if tok is None:
        raise BadInputError(f"{source.root}: no tokenizer (tokenizer.json) to read --calibrate's text with")
    ids = gather_tokens(eval_documents(text), tok.encode, eos_id=tok.eos_id, limit=limit)
    if len(ids) < 2:
        raise BadInputError(f"--calibrate {text}: {len(ids)} token(s); need some text to calibrate on")
    return ids


def _quantized(report) -> None:
    """List the weights a quantization left as they were (on stderr: stdout may be JSON)."""
    for name, why in report.kept.items():
        print(f"kept as it is: {name}: {why}", file=sys.stderr)


def _check_target(path: str) -> None:
    """A new store's directory must be absent or empty: refuse before any work."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise BadInputError(f"{path}: target directory is not empty")


def cmd_export(args: argparse.Namespace) -> int:
    from semoe.checkpoints.hf_convert import export_checkpoint

    store = _open(args.store)
    total = sum(t.bytes for t in store.manifest.tensors if t.kind == "weight")
    if args.format == "gguf":
        from semoe.checkpoints.gguf_export import export_gguf

        with byte_bar(total, "export") as bar:
            n = export_gguf(store, args.out_dir, progress=bar.update)
        if args.json:
            emit_json({"store": store.root, "version": store.version, "out": os.path.abspath(args.out_dir),
                       "tensors": n, "bytes": os.path.getsize(args.out_dir)})
        else:
            print(f"exported {store.root} (version {store.version}) -> {args.out_dir}: {n} tensors, "
                  f"{format_size(os.path.getsize(args.out_dir))}")
        return 0
    with byte_bar(total, "export") as bar:
        dequantized = export_checkpoint(store, args.out_dir, progress=bar.update)
    if dequantized:
        print(f"semoe: note: {args.store} holds {dequantized} weights quantized by `semoe store quantize`; they "
              f"are written dequantized to their source dtype: lossy, not the checkpoint they came from",
              file=sys.stderr)
    if args.json:
        emit_json({"store": store.root, "version": store.version, "out_dir": os.path.abspath(args.out_dir),
                   "bytes": total, "dequantized": dequantized})
    else:
        print(f"exported {store.root} (version {store.version}) -> {args.out_dir}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    store = _open(args.store)
    rows = [{"name": t.name, "group": t.group, "layer": t.layer, "expert": t.expert, "kind": t.kind,
             "dtype": t.dtype, "shape": t.shape, "bytes": t.bytes, "version": t.version, "file": t.file,
             "scheme": _scheme_of(t)} for t in store.manifest.tensors]
    if args.json:
        emit_json({"store": store.root, "version": store.version, "tensors": rows})
        return 0
    for r in rows:
        where = f"L{r['layer']}/E{r['expert']}" if r["group"] == "expert" else "dense"
        print(f"{where:10} {r['kind']:7} {r['dtype']:7} {r['scheme'] or '-':12} {str(tuple(r['shape'])):20} "
              f"{r['bytes']:>12}  {r['name']}")
    return 0


def _scheme_of(t) -> str | None:
    """A tensor's part in a compact weight: its scheme for codes, "<scheme> scales" for scales."""
    if not t.quant:
        return None
    return t.quant.get("scheme") or "scales"


def cmd_info(args: argparse.Namespace) -> int:
    info = _open(args.store).describe()
    if args.json:
        emit_json(info)
        return 0
    per_layer = sorted(set(info["experts_per_layer"].values()))
    print(f"store         {info['path']}")
    print(f"version       {info['version']} ({info['created']})")
    print(f"architecture  {info['architecture']} ({info['model_type']})")
    print(f"layers        {info['layers']}, of which MoE {info['moe_layers']}, experts per layer {per_layer}")
    print(f"bytes         dense {format_size(info['dense_bytes'])}, experts {format_size(info['expert_bytes'])}")
    print(f"dtypes        {', '.join(info['dtypes'])}; kinds {', '.join(info['kinds'])}")
    for label, text in _import_notes(info):
        print(f"{label:13} {text}")
    for name, q in info["schemes"].items():
        print(f"{'scheme ' + name:13} {q['tensors']} weights, {format_size(q['bytes'])}, "
              f"{q['bits_per_weight']:.2f} bits per weight")
    return 0


def _import_notes(info: dict) -> list[tuple[str, str]]:
    """What the import changed or kept (dequantized or compact weights, skipped layers), as (label, text)."""
    notes = []
    if g := info.get("gguf"):
        notes.append(("source", f"GGUF file {g['file']} ({', '.join(g['types'])} tensors)"))
    if d := info.get("dequantized"):
        notes.append(("dequantized", f"at import from {d['format']} to {d['to']} ({d['tensors']} tensors)"))
    if q := info.get("quantization"):
        how = ("as the file ships it" if q["format"] == "gguf" else "as the checkpoint ships it") \
            if q.get("source") == "checkpoint" else "by semoe store quantize"
        notes.append(("quantized", f"{q['format']} {how} ({q['tensors']} tensors)"))
        if mix := q.get("mix"):  # --kquant's types, and its calibration
            cal = q.get("calibration")
            notes.append(("mix", ", ".join(f"{k} {t}" for k, t in mix.items()) + f" within {q['target_bits']} bits a "
                          f"weight" + (f"; calibrated on {cal['tokens']} tokens" if cal else "")))
    if s := info.get("skipped"):
        notes.append(("skipped", f"{s['reason']} {s['layers']} at import ({s['tensors']} tensors, "
                                 f"{format_size(s['bytes'])})"))
    if k := info.get("mtp"):
        notes.append(("mtp", f"multi-token prediction layers {k['layers']} kept for drafting ({k['tensors']} "
                             f"tensors, {format_size(k['bytes'])})"))
    return notes


def cmd_verify(args: argparse.Namespace) -> int:
    store = _open(args.store)
    total = sum(t.bytes for t in store.manifest.tensors)
    with byte_bar(total, "verify") as bar:
        problems = store.verify(progress=bar.update)
    if args.json:
        emit_json({"store": store.root, "version": store.version, "ok": not problems,
                   "tensors": len(store.manifest.tensors),
                   "problems": [{"tensor": p.tensor, "file": p.file, "problem": p.what} for p in problems]})
    else:
        for p in problems:
            print(f"BAD {p}", file=sys.stderr)
        print(f"{store.root}: version {store.version}, {len(store.manifest.tensors)} tensors, "
              + ("all checksums match" if not problems else f"{len(problems)} bad or missing"))
    return 1 if problems else 0


def cmd_gc(args: argparse.Namespace) -> int:
    store = _open(args.store)
    r = store.gc(keep=args.keep)
    if args.json:
        emit_json({"store": store.root, "version": store.version, "removed_files": r.files,
                   "removed_bytes": r.bytes, "versions_dropped": r.versions_dropped})
    else:
        print(f"{store.root}: removed {r.files} files ({format_size(r.bytes)}); kept the newest {args.keep} version(s)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from storage.read_throughput import run_bench

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    store = _open(args.store)
    r = run_bench(store, cold=args.cold, repeats=args.repeats, threads=args.threads,
                  with_tensorstore=not args.no_tensorstore,
                  progress=lambda s: print(f"bench: {s}", file=sys.stderr) if sys.stderr.isatty() else None)
    if args.json:
        emit_json(r.to_json())
    else:
        ts = f", tensorstore {r.tensorstore_gbps:.2f} GB/s (x{r.vs_tensorstore:.2f})" if r.tensorstore_gbps else ""
        print(f"{'cold' if r.cold else 'warm'} read of {format_size(r.bytes)} in {r.files} chunk files: hot path "
              f"{r.store_gbps:.2f} GB/s, plain read {r.raw_gbps:.2f} GB/s"
              + (f" (O_DIRECT {r.raw_direct_gbps:.2f} GB/s; as dd, into one 1 MiB buffer, "
                 f"{r.raw_direct_one_buffer_gbps:.2f})" if r.raw_direct_gbps else "")
              + f", ratio to the faster {r.ratio:.2f}{ts}")
    return 0


def cmd_cache_sim(args: argparse.Namespace) -> int:
    from storage.policies import POLICY_NAMES
    from storage.cache_sim import read_trace, simulate_all

    policies = POLICY_NAMES if args.policy == "all" else (args.policy,)
    for p in policies:
        if p not in POLICY_NAMES:
            raise ValueError(f"--policy must be one of {', '.join(POLICY_NAMES)} or all, got {args.policy!r}")
    if args.capacity is None and args.plot is None:
        raise ValueError("--capacity is required (or --plot FILE.png for a sweep of capacities)")
    if args.capacity is not None and args.capacity < 1:
        raise ValueError(f"--capacity must be >= 1 expert, got {args.capacity}")
    trace = read_trace(args.trace)
    if args.plot is not None:
        _plot_cache_sim(trace, policies, args)
        if args.capacity is None:
            return 0
    results = simulate_all(trace, args.capacity, policies)
    if args.json:
        emit_json({name: r.to_json() for name, r in results.items()})
    else:
        for name, r in results.items():
            print(f"{name:10} hits {r.hits:>9} misses {r.misses:>9} hit rate {r.hit_rate:.4f}")
    return 0



def _plot_cache_sim(trace: list, policies: tuple[str, ...], args: argparse.Namespace) -> None:
    """`--plot`: sweep the capacities, draw them, and print the sweep when no --capacity was given."""
    from storage.cache_sim import capacity_points, hit_rate_curves, hit_rate_png

    capacities = capacity_points(trace)
    drawn = (*(p for p in policies if p != "belady"), "belady")  # Belady always: the ceiling
    curves = hit_rate_curves(trace, capacities, drawn)
    hit_rate_png(capacities, curves, args.plot, title=f"{os.path.basename(args.trace)}: {len(trace)} records")
    print(f"wrote {args.plot} ({len(capacities)} capacities, {capacities[0]} to {capacities[-1]} experts)",
          file=sys.stderr)
    if args.capacity is not None:
        return
    if args.json:
        emit_json({"capacities": capacities, "policies": {n: [r.to_json() for r in rs] for n, rs in curves.items()}})
    else:
        print("capacity " + " ".join(f"{n:>10}" for n in curves))
        for i, c in enumerate(capacities):
            print(f"{c:>8} " + " ".join(f"{rs[i].hit_rate:>10.4f}" for rs in curves.values()))
