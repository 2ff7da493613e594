"""`semoe store ...`: import, export, inspect, verify, collect garbage, benchmark, simulate caches."""

from __future__ import annotations

import argparse
import os
import sys

from storage.dtypes import CAST_CHOICES
from tools.common import emit_json
from tools.sizes import format_size
from tools.progress import byte_bar


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
                                  "dense. FP8 block-scale (DeepSeek-V3) and MXFP4 (gpt-oss) checkpoints are "
                                  "dequantized to bfloat16 (or --dtype); multi-token-prediction layers are skipped. "
                                  "Streams tensor by tensor; on failure nothing is left behind.")
    q.add_argument("hf_dir", metavar="HF_DIR", help="HuggingFace checkpoint directory")
    q.add_argument("store", metavar="STORE", help="new store directory (must be absent or empty)")
    q.add_argument("--dtype", choices=CAST_CHOICES, default="keep",
                   help="cast floating-point tensors (default: keep, bit-exact)")
    q.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    q.set_defaults(handler=cmd_import)

    q = ss.add_parser("export", help="export a store back to a HuggingFace directory",
                      description="Write the store's weights as a HuggingFace directory that transformers loads, "
                                  "with the original shard layout; bit-exact with the imported checkpoint.")
    q.add_argument("store", metavar="STORE")
    q.add_argument("out_dir", metavar="OUT_DIR", help="output directory (must be absent or empty)")
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
                                  "files, and with tensorstore, in one run. Reports medians.")
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
    q.add_argument("--capacity", required=True, type=int, metavar="N", help="cache capacity in experts")
    q.add_argument("--policy", default="all", help="lfu-aging|lfu|lru|belady|next-use|all (default all)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=cmd_cache_sim)


def cmd_import(args: argparse.Namespace) -> int:
    from semoe.hf_import import import_checkpoint, open_checkpoint

    ck = open_checkpoint(args.hf_dir, dtype=args.dtype)
    total = sum(r.nbytes for r in ck.tensors.values())
    with byte_bar(total, "import") as bar:
        store = import_checkpoint(args.hf_dir, args.store, dtype=args.dtype, progress=bar.update)
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


def cmd_export(args: argparse.Namespace) -> int:
    from semoe.hf_import import export_checkpoint
    from storage.store import Store

    store = Store.open(args.store)
    total = sum(t.bytes for t in store.manifest.tensors if t.kind == "weight")
    with byte_bar(total, "export") as bar:
        export_checkpoint(store, args.out_dir, progress=bar.update)
    if args.json:
        emit_json({"store": store.root, "version": store.version, "out_dir": os.path.abspath(args.out_dir),
                   "bytes": total})
    else:
        print(f"exported {store.root} (version {store.version}) -> {args.out_dir}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from storage.store import Store

    store = Store.open(args.store)
    rows = [{"name": t.name, "group": t.group, "layer": t.layer, "expert": t.expert, "kind": t.kind,
             "dtype": t.dtype, "shape": t.shape, "bytes": t.bytes, "version": t.version, "file": t.file}
            for t in store.manifest.tensors]
    if args.json:
        emit_json({"store": store.root, "version": store.version, "tensors": rows})
        return 0
    for r in rows:
        where = f"L{r['layer']}/E{r['expert']}" if r["group"] == "expert" else "dense"
        print(f"{where:10} {r['kind']:7} {r['dtype']:5} {str(tuple(r['shape'])):20} {r['bytes']:>12}  {r['name']}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from storage.store import Store

    info = Store.open(args.store).describe()
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
    return 0


def _import_notes(info: dict) -> list[tuple[str, str]]:
    """What the import changed from the checkpoint (dequantized weights, skipped layers), as (label, text)."""
    notes = []
    if d := info.get("dequantized"):
        notes.append(("dequantized", f"at import from {d['format']} to {d['to']} ({d['tensors']} tensors)"))
    if s := info.get("skipped"):
        notes.append(("skipped", f"{s['reason']} {s['layers']} at import ({s['tensors']} tensors, "
                                 f"{format_size(s['bytes'])})"))
    return notes


def cmd_verify(args: argparse.Namespace) -> int:
    from storage.store import Store

    store = Store.open(args.store)
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
    from storage.store import Store

    store = Store.open(args.store)
    r = store.gc(keep=args.keep)
    if args.json:
        emit_json({"store": store.root, "version": store.version, "removed_files": r.files,
                   "removed_bytes": r.bytes, "versions_dropped": r.versions_dropped})
    else:
        print(f"{store.root}: removed {r.files} files ({format_size(r.bytes)}); kept the newest {args.keep} version(s)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from storage.bench import run_bench
    from storage.store import Store

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    store = Store.open(args.store)
    r = run_bench(store, cold=args.cold, repeats=args.repeats, threads=args.threads,
                  with_tensorstore=not args.no_tensorstore,
                  progress=lambda s: print(f"bench: {s}", file=sys.stderr) if sys.stderr.isatty() else None)
    if args.json:
        emit_json(r.to_json())
    else:
        ts = f", tensorstore {r.tensorstore_gbps:.2f} GB/s (x{r.vs_tensorstore:.2f})" if r.tensorstore_gbps else ""
        print(f"{'cold' if r.cold else 'warm'} read of {format_size(r.bytes)} in {r.files} chunk files: hot path "
              f"{r.store_gbps:.2f} GB/s, plain read {r.raw_gbps:.2f} GB/s, ratio {r.ratio:.2f}{ts}")
    return 0


def cmd_cache_sim(args: argparse.Namespace) -> int:
    from storage.cache_sim import POLICY_NAMES, read_trace, simulate_all

    policies = POLICY_NAMES if args.policy == "all" else (args.policy,)
    for p in policies:
        if p not in POLICY_NAMES:
            raise ValueError(f"--policy must be one of {', '.join(POLICY_NAMES)} or all, got {args.policy!r}")
    if args.capacity < 1:
        raise ValueError(f"--capacity must be >= 1 expert, got {args.capacity}")
    results = simulate_all(read_trace(args.trace), args.capacity, policies)
    if args.json:
        emit_json({name: r.to_json() for name, r in results.items()})
    else:
        for name, r in results.items():
            print(f"{name:10} hits {r.hits:>9} misses {r.misses:>9} hit rate {r.hit_rate:.4f}")
    return 0

