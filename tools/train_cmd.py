"""`semoe train`: train the MoE GPT with expert states on SSD, in CPU memory or on the device."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import sys

from tools.cli_output import UsageError, emit_json
from tools.size_flags import parse_size

# TrainConfig fields settable by flag (flag default None: "not given", so a resumed run keeps its own)
_TRAIN_FLAGS = ("data", "steps", "seed", "batch_size", "seq_len", "micro_batches", "lr", "warmup_steps",
                "weight_decay", "grad_clip", "expert_states", "device", "checkpoint_every", "read_mode",
                "dense_states", "precision")
_MODEL_FLAGS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
                "ffn": "ffn_size", "expert_ffn": "moe_ffn_size", "experts": "num_experts", "top_k": "top_k",
                "capacity_factor": "capacity_factor"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a MoE GPT (expert states on SSD behind an LFU CPU cache)",
        description="Train a MoE GPT from scratch on text, or continue a run with --resume. Every checkpoint "
                    "is one atomic commit of OUT/store, which `semoe generate --model OUT/store` serves. "
                    "With --expert-states ssd (the default) every expert's weight and Adam moments live in "
                    "the store; only the --cpu-cache budget of them is held in memory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR", help="run directory (store, token shards, spill)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="spawn N ranks on this machine (gloo on CPU; on GPU nccl, one GPU per rank); under "
                        "torchrun leave it out")
    p.add_argument("--pipeline", type=int, default=None, metavar="N",
                   help="pipeline parallelism: spawn N ranks, each running one stage (a contiguous run of "
                        "layers) and owning every expert of its layers; not combined with --nproc")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default=None,
                   help="with --pipeline: the micro-batch schedule [1f1b]")
    p.add_argument("--stage-memory", metavar="SIZE", default=None,
                   help="with --pipeline: memory per stage for its blocks' dense states and saved activations; "
                        "each stage is profiled, MPress plans recompute / host swap / D2D swap to fit, and the "
                        "plan runs (same losses and gradients as without it)")
    p.add_argument("--init-from", metavar="STORE", default=None,
                   help="start from the weights of a model store (`semoe store import` of a HuggingFace model, or "
                        "another run's store) instead of random weights; its config and tokenizer are used")
    p.add_argument("--config", metavar="NAME|FILE",
                   help="named model config (tiny, gpt-moe-small) or a JSON file {\"model\": {...}, \"train\": {...}} "
                        "[default: gpt-moe-small]")
    m = p.add_argument_group("model shape (override the config)", "--capacity-factor 0 turns token dropping off")
    for flag, kind in (("layers", int), ("hidden", int), ("heads", int), ("kv-heads", int), ("ffn", int),
                       ("expert-ffn", int), ("experts", int), ("top-k", int), ("capacity-factor", float)):
        m.add_argument(f"--{flag}", type=kind, default=None)
    t = p.add_argument_group("training")
    t.add_argument("--data", default=None, metavar="PATH",
                   help="text file, directory of text files, or token shards [default: the embedded corpus]")
    t.add_argument("--steps", type=int, default=None, help="train until this step [200]")
    t.add_argument("--seed", type=int, default=None, help="seed of data order and initial weights [0]")
    t.add_argument("--batch-size", type=int, default=None, help="sequences per step over all ranks [8]")
    t.add_argument("--seq-len", type=int, default=None, help="tokens per sequence [128]")
    t.add_argument("--micro-batches", type=int, default=None, help="per rank, gradients accumulated [1]")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate [2e-3]")
    t.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps [10]")
    t.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay [0.1]")
    t.add_argument("--grad-clip", type=float, default=None, help="clip the global gradient norm; 0: off [1.0]")
    t.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints [50]")
    t.add_argument("--precision", choices=("auto", "bf16", "fp32"), default=None,
                   help="auto: on CUDA bf16 autocast with TF32 matmuls (weights, gradients and AdamW states stay "
                        "float32), on CPU float32; fp32: float32 throughout [auto]")
    s = p.add_argument_group("memory")
    s.add_argument("--expert-states", choices=("ssd", "cpu", "device"), default=None,
                   help="where expert weights and Adam moments live [ssd]")
    s.add_argument("--cpu-cache", metavar="SIZE", default=None,
                   help="ssd: CPU cache for expert states per rank, bytes (2GiB) or a percentage of the "
                        "rank's expert-state bytes (25%%) [25%%]")
    s.add_argument("--grad-memory", metavar="SIZE", default=None,
                   help="ssd: host memory for expert gradients during a step, bytes or a percentage of the "
                        "rank's expert-state bytes; an expert with few rows keeps its gradient as the far "
                        "smaller products it is made of; the rest spill to OUT/spill [same as --cpu-cache]")
    s.add_argument("--dense-states", choices=("replicated", "zero1", "fsdp"), default=None,
                   help="with --nproc > 1, where dense parameters, gradients and AdamW moments live: every rank "
                        "holds all of them (replicated); each rank keeps the moments of its share only (zero1, "
                        "ZeRO stage 1); or all three are sharded over the ranks with FSDP2, each block gathered "
                        "one block ahead of use (fsdp, about 1/N of the dense memory per rank). The same numbers "
                        "up to float32 summation order; a run may resume in another mode [zero1]")
    s.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N; with several ranks on CUDA, rank r runs on cuda:r [cpu]")
    s.add_argument("--read-mode", choices=("direct", "drop", "cached"), default=None,
                   help="how expert reads treat the page cache (direct: bypass it) [direct]")
    s.add_argument("--no-verify", action="store_true", help="resume without checking every checksum first")
    o = p.add_argument_group("output")
    o.add_argument("--log-json", metavar="FILE", help="append one JSON object per step to FILE")
    o.add_argument("--json", action="store_true", help="print a summary JSON object on stdout at the end")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    p.set_defaults(handler=run)


def _model_config(args: argparse.Namespace, file_cfg: dict):
    from semoe.model.config import MoEConfig, named_config

    overrides = {field: getattr(args, flag) for flag, field in _MODEL_FLAGS.items() if getattr(args, flag) is not None}
    if overrides.get("capacity_factor") == 0:
        overrides["capacity_factor"] = None  # no token dropping
    spec = file_cfg.get("model")
    if isinstance(spec, dict) and "name" not in spec:
        return MoEConfig(**{**spec, **overrides})
    name = (spec or {}).get("name", "gpt-moe-small") if isinstance(spec, dict) else "gpt-moe-small"
    if args.config and not args.config.endswith(".json"):
        name = args.config
    base = dict(spec or {}) if isinstance(spec, dict) else {}
    base.pop("name", None)
    return named_config(name, **{**base, **overrides})


def build_configs(args: argparse.Namespace):
    """(TrainConfig, MoEConfig or None when resuming without model flags, RunStore): the store of
    the run resumed or of `--init-from`, opened once here for everything the command asks of it
    (None for a new run from scratch)."""
    from semoe.train.run_store import PIPELINE_FILE, TRAINER_FILE, RunStore
    from semoe.train.config import TrainConfig, expert_state_bytes

    file_cfg: dict = {}
    if args.config and args.config.endswith(".json"):
        try:
            with open(args.config, encoding="utf-8") as f:
                file_cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise UsageError(f"--config {args.config}: not valid JSON ({e.msg} at line {e.lineno})") from None
        except OSError as e:
            raise UsageError(f"--config {args.config}: {e.strerror}") from None
        if not isinstance(file_cfg, dict):
            raise UsageError(f"--config {args.config}: expected a JSON object with \"model\" and \"train\"")
    store = os.path.join(args.out, "store")
    exists = RunStore.exists(store)
    if exists and not args.resume:
        raise UsageError(f"--out {args.out}: holds a run already; pass --resume to continue it or choose a new --out")
    if args.resume and not exists:
        raise UsageError(f"--resume: {store} has no checkpoint to resume from")
    train = dict(file_cfg.get("train", {}))
    model_cfg = source = None
    if args.init_from is not None:
        if args.resume:
            raise UsageError("--init-from starts a new run; --resume continues one: give one of them")
        if any(getattr(args, f) is not None for f in _MODEL_FLAGS) or args.config:
            raise UsageError("--init-from takes the model's config from the store; drop the model flags and --config")
        if not RunStore.exists(args.init_from):
            raise UsageError(f"--init-from {args.init_from}: not a store (run `semoe store import` on a "
                             "HuggingFace directory first)")
        train["init_from"] = args.init_from
        source = RunStore.open(args.init_from)
    elif args.resume:
        source = RunStore.open(store)
        train = source.resume_settings(PIPELINE_FILE if args.pipeline is not None else TRAINER_FILE, train)
        if any(getattr(args, f) is not None for f in _MODEL_FLAGS) or args.config:
            model_cfg = _model_config(args, file_cfg)
    else:
        model_cfg = _model_config(args, file_cfg)
    if "dense_optimizer" in train:  # a run saved before --dense-states, or an older --config file
        from semoe.train.dense_states import LEGACY_DENSE_OPTIMIZER

        old = train.pop("dense_optimizer")
        if old not in LEGACY_DENSE_OPTIMIZER:
            raise UsageError(f"dense_optimizer must be sharded or replicated, got {old!r}")
        train.setdefault("dense_states", LEGACY_DENSE_OPTIMIZER[old])
    train.update({k: getattr(args, k) for k in _TRAIN_FLAGS if getattr(args, k, None) is not None})
    train["out"], train["log_json"] = args.out, args.log_json
    train["verify"] = not args.no_verify
    for flag, value, key in (("--cpu-cache", args.cpu_cache, "cpu_cache_bytes"),
                             ("--grad-memory", args.grad_memory, "grad_budget_bytes")):
        if value is None:
            continue
        percent_of = None
        if value.strip().endswith("%"):
            cfg = model_cfg or source.model_config()
            percent_of = expert_state_bytes(cfg) // (args.pipeline or args.nproc or
                                                     int(os.environ.get("WORLD_SIZE", "1")))
        train[key] = parse_size(value, flag=flag, percent_of=percent_of)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(train) - known)
    if unknown:
        raise UsageError(f"--config: unknown training settings {', '.join(unknown)}")
    if "betas" in train:
        train["betas"] = tuple(train["betas"])
    return TrainConfig(**train), model_cfg, source


def process_group_backend(device: str) -> str:
    """The ranks' process-group backend: on CUDA, NCCL for device tensors with gloo beside it for
    host ones (pickled objects, counters); on CPU gloo alone."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, local_rank: int, local_ranks: int, *, flag: str = "--nproc") -> str:
    """The device of rank `local_rank` of the `local_ranks` ranks on this machine: cpu as given; on
    CUDA one GPU per rank (rank r on cuda:r, the index of `device` ignored), a lone rank on the GPU
    named. UsageError, naming `flag` or --device, when the GPUs are not there."""
    import torch

    from semoe.train.config import parse_device

    dev = parse_device(device)
    if dev.type == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine")
    count = torch.cuda.device_count()
    if local_ranks > 1:
        if local_ranks > count:
            raise UsageError(f"{flag} {local_ranks} needs one GPU per rank, but this machine has {count}; "
                             f"give {flag} {count} or less, or --device cpu")
        return f"cuda:{local_rank}"
    index = dev.index or 0
    if index >= count:
        raise UsageError(f"--device {device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return f"cuda:{index}"


def claim_rank_device(device: str, local_rank: int, local_ranks: int, *, flag: str = "--nproc") -> str:
    """`rank_device`, made this process's current CUDA device (NCCL, and every tensor made for
    plain `cuda`, use the current one)."""
    chosen = rank_device(device, local_rank, local_ranks, flag=flag)
    if chosen != "cpu":
        import torch

        torch.cuda.set_device(torch.device(chosen))
    return chosen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(logs, cfg) -> dict:
    return {"store": cfg.store, "steps": logs[-1].step if logs else None,
            "first_loss": logs[0].loss if logs else None, "final_loss": logs[-1].loss if logs else None,
            "tokens_per_s": sum(x.tokens_per_s for x in logs) / len(logs) if logs else None,
            "cpu_hit_rate": logs[-1].cpu_hit_rate if logs else None,
            "peak_rss_bytes": max((x.peak_rss_bytes for x in logs), default=None)}


def _report(rank: int, message: str, report_dir: str | None) -> None:
    """A rank's one error line: to stderr (under torchrun), or to the launcher, which prints each
    distinct message once however many ranks hit it."""
    if report_dir is None:
        print(f"semoe: error: rank {rank}: {message}", file=sys.stderr, flush=True)
        return
    from storage.durable import write_atomic

    write_atomic(os.path.join(report_dir, f"rank{rank}"), message.encode())


def _print_reports(report_dir: str) -> None:
    """The ranks' error lines, one per distinct message, naming the ranks that reported it."""
    by_message: dict[str, list[int]] = {}
    for name in sorted(os.listdir(report_dir), key=lambda n: int(n[4:]) if n[4:].isdigit() else -1):
        if name.startswith("rank") and name[4:].isdigit():
            with open(os.path.join(report_dir, name), encoding="utf-8", errors="replace") as f:
                by_message.setdefault(f.read(), []).append(int(name[4:]))
    for message, ranks in by_message.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        print(f"semoe: error: {who}: {message}", file=sys.stderr, flush=True)


def _worker(rank: int, world: int, port: int, cfg, model_cfg, quiet: bool, verbose: int, pipeline=None,
            report_dir: str | None = None) -> None:
    import logging

    import torch
    import torch.distributed as dist

    from semoe.train.trainer import run_rank
    from storage.errors import StorageError

    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), stream=sys.stderr,
                        format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of one machine talk over loopback
    # the launcher has checked that there is a GPU per rank
    cfg = dataclasses.replace(cfg, device=claim_rank_device(cfg.device, rank, world))
    dist.init_process_group(process_group_backend(cfg.device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    code = 0
    try:
        if pipeline is not None:
            from semoe.train.pipeline import run_pipeline_rank

            logs = run_pipeline_rank(cfg, model_cfg, pipeline, quiet=quiet)
        else:
            logs = run_rank(cfg, model_cfg, quiet=quiet)
        if rank == 0:
            from storage.durable import write_atomic

            write_atomic(os.path.join(cfg.out, "last_run.json"), json.dumps(_summary(logs, cfg)).encode())
    except (StorageError, UsageError, ValueError) as e:
        _report(rank, str(e).splitlines()[0], report_dir)
        code = getattr(e, "exit_code", 2)  # as a single-process run exits: 2 bad input, 1 a failed run
    except OSError as e:
        _report(rank, f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}", report_dir)
        code = 1
    except Exception as e:  # anything else still ends as one line; -v shows the traceback
        logging.getLogger("semoe").debug("rank %d failed", rank, exc_info=True)
        cause = e.__cause__ or e
        _report(rank, f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}", report_dir)
        code = 1
    if not code:
        dist.destroy_process_group()
    # A failing rank's peers are stuck in a collective: the launcher tears them down. A finished
    # one exits without the interpreter's finaliser, during which a gloo thread still freeing a
    # collective's tensors can abort the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _drop_unstarted_pipeline_store(store: str) -> None:
    """A pipeline run that failed before its first step leaves only its step-0 checkpoint, which
    cannot be resumed and would block the next attempt: remove it (a later checkpoint is kept)."""
    import shutil

    from semoe.train.run_store import PIPELINE_FILE, RunStore

    if not RunStore.exists(store):
        shutil.rmtree(store, ignore_errors=True)  # not even created completely
        return
    try:
        step = RunStore.open(store).saved_step(PIPELINE_FILE)
    except Exception:  # unreadable: keep it for the user to look at
        return
    if step == 0:
        shutil.rmtree(store, ignore_errors=True)


def _pipeline_config(args: argparse.Namespace):
    """The PipelineConfig of `--pipeline N --schedule S`, or None without --pipeline."""
    if args.pipeline is None:
        if args.schedule is not None or args.stage_memory is not None:
            raise UsageError("--schedule and --stage-memory apply to pipeline runs only: add --pipeline N")
        return None
    if args.pipeline < 1:
        raise UsageError(f"--pipeline must be >= 1, got {args.pipeline}")
    if args.nproc is not None and args.nproc > 1:
        raise UsageError("--pipeline and --nproc > 1 cannot be combined (expert parallelism and pipeline "
                         "parallelism are not used together): give one of them")
    from semoe.train.pipeline import PipelineConfig

    schedule = args.schedule
    stage_memory = parse_size(args.stage_memory, flag="--stage-memory") if args.stage_memory else None
    return PipelineConfig(schedule=schedule or "1f1b", stage_memory_bytes=stage_memory)


def parallel_refusal(config, flag: str) -> None:
    """UsageError naming `flag` for a model the multi-rank trainers do not split yet: DeepSeek-V4's residual
    streams (a stage's boundary carries one stream) and hash routing (an expert-parallel layer routes rows
    without their token ids)."""
    if config.hc_mult > 1 or config.hash_layers:
        raise UsageError(f"{flag} does not take {config.arch}'s hyper-connection streams and hash routing yet; "
                         "train it on one rank")


def run(args: argparse.Namespace) -> int:
    pipeline = _pipeline_config(args)
    cfg, model_cfg, source = build_configs(args)
    if pipeline is not None and args.schedule is None and args.resume:  # a resumed run keeps its schedule
        pipeline = dataclasses.replace(pipeline, schedule=source.saved_schedule() or pipeline.schedule)
    if pipeline is not None:  # checked here, before N ranks start and each reports it
        from semoe.train.pipeline import check_pipeline

        # a new run from a store, or the run being resumed
        check_pipeline(model_cfg or source.model_config(), args.pipeline, cfg, pipeline)
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    nproc = args.pipeline if pipeline is not None else args.nproc
    spawn = pipeline is not None or bool(nproc and nproc > 1)
    if spawn:  # checked before N ranks start and each reports it
        flag = "--pipeline" if pipeline is not None else "--nproc"
        rank_device(cfg.device, 0, nproc, flag=flag)
        parallel_refusal(model_cfg or source.model_config(), flag)
    os.makedirs(args.out, exist_ok=True)
    if spawn:
        import shutil
        import tempfile

        import torch.multiprocessing as mp

        report_dir = tempfile.mkdtemp(prefix="semoe-train-errors-")
        # tearing down the peers of a failed rank is expected here, not worth a warning of its own
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        try:
            ctx = mp.start_processes(_worker, args=(nproc, _free_port(), cfg, model_cfg, args.quiet, args.verbose,
                                                    pipeline, report_dir),
                                     nprocs=nproc, join=False, start_method="spawn")
            while not ctx.join(grace_period=5):  # ranks failing together get to report before teardown
                pass
        except mp.ProcessExitedException as e:
            _print_reports(report_dir)
            if pipeline is not None:
                _drop_unstarted_pipeline_store(cfg.store)
            return e.exit_code if e.exit_code and e.exit_code > 0 else 1
        finally:
            shutil.rmtree(report_dir, ignore_errors=True)
        if args.json:
            with open(os.path.join(args.out, "last_run.json"), encoding="utf-8") as f:
                emit_json(json.load(f))
        return 0
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:  # under torchrun
        import torch.distributed as dist

        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        cfg = dataclasses.replace(cfg, device=claim_rank_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")),
                                                                local_ranks, flag="torchrun --nproc-per-node"))
        dist.init_process_group(process_group_backend(cfg.device))
    else:
        cfg = dataclasses.replace(cfg, device=claim_rank_device(cfg.device, 0, 1))
    from semoe.train.trainer import run_rank

    logs = run_rank(cfg, model_cfg, quiet=args.quiet, source=source)  # this process's one open of the store
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        emit_json(_summary(logs, cfg))
    return 0
