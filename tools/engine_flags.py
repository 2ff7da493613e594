"""Flags shared by `semoe generate`, `semoe serve` and `semoe eval`: device, dtype, the offload budgets and
the routing trace."""

from __future__ import annotations

import argparse

from tools.cli_output import UsageError
from tools.size_flags import parse_size


def resolve_device(name: str) -> "torch.device":  # noqa: F821
    """`auto` is cuda when available, else cpu; an unavailable cuda is a usage error."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise UsageError(f"--device {name}: this machine has {n} GPU(s), cuda:0 to cuda:{n - 1}")
    return dev


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """`--device`, `--dtype` and `--dense`: where the model runs and in what precision."""
    p.add_argument("--device", default="auto", help="auto|cpu|cuda|cuda:N (default auto: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--dense", default="auto", choices=("auto", "float", "int8", "int4"),
                   help="the weights outside the experts (attention, lm_head, dense and shared feed-forwards): "
                        "float as stored, or quantized at load as `store quantize` does experts (int4 in groups "
                        "of up to 128; the lm_head and weights int4 cannot hold in int8). Default auto: int8 on "
                        "CPU when the store's experts are int8, int4 or MXFP4, since decoding reads every dense weight "
                        "for each token; float otherwise")


def add_routing_trace_flag(p: argparse.ArgumentParser) -> None:
    """`--routing-trace FILE`: append the model's expert routing as JSONL for `semoe store cache-sim`."""
    p.add_argument("--routing-trace", metavar="FILE",
                   help="append the experts each MoE layer uses, one JSON record per forward call and layer, "
                        "to FILE (replay it with `semoe store cache-sim --trace FILE`)")


def add_budget_flags(p: argparse.ArgumentParser) -> None:
    """The offload budget flags; any of them keeps the experts in the store."""
    g = p.add_argument_group("offload budgets",
                             "Sizes are bytes with a unit (512MiB, 2GiB) or a percentage of the model's expert "
                             "bytes (25%). Any of these flags offloads the experts: SSD -> CPU cache -> device.")
    g.add_argument("--cpu-cache", metavar="SIZE",
                   help="CPU cache for expert weights, or auto: the memory available once the dense weights are "
                        "loaded, less a reserve of 48 MiB or a sixteenth and serve's --kv-memory (every expert "
                        "where they fit), raised as memory frees up and lowered if the process starts reading its "
                        "own code back from disk")
    g.add_argument("--device-memory", metavar="SIZE", help="device memory for the expert ring (sets its slots)")
    g.add_argument("--resident", action="store_true",
                   help="keep every expert in memory even where the model does not fit what is available. "
                        "Without this or a budget flag the choice is made from the model's bytes and the memory "
                        "available (resident where it fits, else --cpu-cache auto) and said on stderr")
    g.add_argument("--ring-slots", type=int, metavar="K", help="expert slots in the device ring")
    from inference.offload.hybrid_placement import EXPERTS_ON

    g.add_argument("--experts-on", default="auto", choices=EXPERTS_ON,
                   help="where offloaded routed experts run: hybrid (each where it costs less, from rates measured "
                        "at load: the device's cache of experts, the CPU's kernels over the CPU cache and the store, "
                        "or copied to the device when its rows make that cheaper), cpu (every one on the CPU), "
                        "device (every one streamed to the device's ring of slots). Default auto: hybrid on a GPU, "
                        "the ring on CPU")
    g.add_argument("--cache-policy", default="next-use", metavar="NAME",
                   help="which expert the CPU cache evicts: next-use (default: the one whose next use is "
                        "expected furthest away, from its layer's place in the cycle and its aged use "
                        "rate), lfu-aging, lfu or lru")


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that only the engine takes (the runner's model refuses them), with the value
    where only some values are the engine's; `generate`'s and `serve`'s (serve has no --profile)."""
    return [flag for flag, on in (("--profile", getattr(args, "profile", False)),
                                  ("--routing-trace", args.routing_trace is not None),
                                  ("--device-memory", args.device_memory is not None),
                                  ("--ring-slots", args.ring_slots is not None),
                                  (f"--dtype {args.dtype}", args.dtype not in (None, "float32")),
                                  (f"--device {args.device}", args.device not in ("auto", "cpu")),
                                  (f"--dense {args.dense}", args.dense not in ("auto", "float", "int8")),
                                  (f"--cache-policy {args.cache_policy}", args.cache_policy != "next-use"),
                                  (f"--experts-on {getattr(args, 'experts_on', 'auto')}",
                                   getattr(args, "experts_on", "auto") != "auto")) if on]


def refuse_for_lean(args: argparse.Namespace, how: str) -> None:
    """`--lean`'s one check of the other flags, for `generate` and `serve` alike: a flag only the
    engine takes, --resident, or a --model that is not a store is refused in one line. `how`: what
    the command does with --lean, in a phrase ("serves in float32 on CPU")."""
    from storage.reader import is_store

    refused = engine_flags(args)
    if refused:
        raise UsageError(f"--lean {how}: {refused[0]} is the engine's (drop --lean)")
    if args.resident:
        raise UsageError("--resident is the engine's: --lean reads experts from the store as they are chosen")
    if not is_store(args.model):
        raise UsageError(f"--lean reads a store; {args.model} is not one (semoe store import makes one)")


def lean_by_itself(args: argparse.Namespace, keep_bytes: int = 0,
                   how: str = "decoding in a process without torch (as --lean)", sized_cache: bool = False) -> str | None:
    """Where `semoe generate` (or `serve`) decodes through the runner's model by itself, the line saying
    so on stderr; None where the engine decodes. It does where the model is a store the runner takes
    (`lean_refusal`), no GPU is asked for or present, no flag asks for what only the engine does
    (profiles, routing traces, device budgets, --resident), and either no budget flag is given and the
    store does not fit the memory available less `keep_bytes` (a server's KV memory;
    `inference.placement.choose`, as the engine's own choice between resident and offloaded) or
    `sized_cache` (generate's) and --cpu-cache names the cache: the runner then sizes its cache from it
    (`lean_cache_bytes`), as it decodes offloaded CPU steps in less time than the engine. `how`: the
    line's words for the path. Decided before torch is imported: its runtime would hold memory the expert
    cache then cannot have."""
    from inference.placement import choose, gpu_present, lean_refusal
    from storage.reader import is_store

    named = args.cpu_cache is not None
    if args.resident or (named and not sized_cache) or engine_flags(args) or not is_store(args.model):
        return None
    if args.device == "auto" and gpu_present():
        return None
    placement = choose(args.model, keep_bytes=keep_bytes)
    args.model_bytes = placement.model  # counted at float32: the engine's float32 load reuses them
    if (placement.cpu_cache is None and not named) or lean_refusal(args.model) is not None:
        return None
    engine = "--resident or an engine flag such as --cache-policy" if sized_cache else "--resident or a budget flag"
    return placement.describe_lean(how, cache=f"--cpu-cache {args.cpu_cache.strip()}" if named else None,
                                   engine=engine)


def lean_cache_bytes(args: argparse.Namespace, store) -> int | None:
    """The runner's expert cache from --cpu-cache (a percentage of `store`'s expert bytes); None for
    auto or no flag: every expert where the memory left allows."""
    if args.cpu_cache is None or args.cpu_cache.strip() == "auto":
        return None
    return parse_size(args.cpu_cache, flag="--cpu-cache", percent_of=store.manifest.expert_bytes())


def open_model(args: argparse.Namespace) -> "Store | None":  # noqa: F821
    """The store `--model` names, opened once for the sizing and the load (`engine_config_from_args`,
    `load_engine`); None where it is a HuggingFace directory."""
    from storage.reader import is_store

    if not is_store(args.model):
        return None
    from storage.store import Store

    return Store.open(args.model)


def expert_bytes(path: str, store=None) -> int:
    """Bytes of the model's expert weights as stored: a store's expert chunk files (of `store` where the
    caller opened it), or the sum of a HuggingFace checkpoint's expert tensors (headers only)."""
    from storage.reader import is_store

    if store is not None:
        return store.manifest.expert_bytes()
    if is_store(path):
        from storage.reader import StoreReader

        return StoreReader.open(path).manifest.expert_bytes()
    from semoe.checkpoints.hf_convert import open_checkpoint

    ck = open_checkpoint(path)
    return sum(part.slice_bytes() for by_expert in ck.experts.values() for parts in by_expert.values()
               for part in parts)


def engine_config_from_args(args: argparse.Namespace, *, keep_bytes: int = 0, store=None
                            ) -> "EngineConfig":  # noqa: F821
    """EngineConfig from `--device`, `--dtype` and the budget flags; percentages are of the expert bytes
    of `--model` (`store`, where the caller opened it: `open_model`). Where no budget flag nor --resident is given, the experts' place is chosen from the
    model's bytes and the memory available less `keep_bytes` (a server's KV memory); `args.placement`
    says where they go, in a phrase (`placement_line`)."""
    from inference.engine_config import EngineConfig
    from inference.memory_guard import CPU_CACHE_AUTO

    sizes = {"--cpu-cache": args.cpu_cache, "--device-memory": args.device_memory}
    total = None
    if any(v is not None and v.strip().endswith("%") for v in sizes.values()):
        total = expert_bytes(args.model, store)
        if total == 0:
            raise UsageError(f"--model {args.model}: the model has no expert weights to take a percentage of")
    if args.device_memory is not None and args.device_memory.strip() == CPU_CACHE_AUTO:
        raise UsageError("--device-memory takes a size (512MiB, 2GiB, 25%); auto is for --cpu-cache")
    cpu, dev = (CPU_CACHE_AUTO if v is not None and v.strip() == CPU_CACHE_AUTO else
                parse_size(v, flag=flag, percent_of=total) if v is not None else None for flag, v in sizes.items())
    if args.ring_slots is not None and args.ring_slots < 1:
        raise UsageError(f"--ring-slots must be >= 1, got {args.ring_slots}")
    if args.cache_policy not in ONLINE_POLICIES:
        raise UsageError(f"--cache-policy must be one of {', '.join(ONLINE_POLICIES)}, got {args.cache_policy!r}")
    budgets = [flag for flag, v in (("--cpu-cache", args.cpu_cache), ("--device-memory", args.device_memory),
                                    ("--ring-slots", args.ring_slots)) if v is not None]
    if args.resident and budgets:
        raise UsageError(f"--resident keeps every expert in memory: {budgets[0]} offloads them (drop one)")
    config = EngineConfig(device=str(resolve_device(args.device)), dtype=args.dtype, cpu_cache_bytes=cpu,
                          device_memory_bytes=dev, ring_slots=args.ring_slots, cache_policy=args.cache_policy,
                          dense=args.dense, keep_bytes=keep_bytes, experts_on=getattr(args, "experts_on", "auto"))
    from inference.placement import model_bytes

    # the choice and the load's progress; counted once where `generate`'s own choice of front-end
    # counted them already at float32 (`lean_by_itself`)
    itemsize, known = torch_itemsize(config.dtype), getattr(args, "model_bytes", None)
    args.model_bytes = known if known is not None and itemsize == 4 else \
        model_bytes(args.model, itemsize, None if store is None else store.manifest)
    args.placement = placement_phrase(args, config, budgets)
    return config


def torch_itemsize(dtype: str) -> int:
    """Bytes of one element of the compute dtype named `dtype`."""
    import torch

    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def load_engine(args: argparse.Namespace, config: "EngineConfig", store=None) -> "Engine":  # noqa: F821
    """The engine of `--model` (`store`, where the caller opened it), with a progress bar on stderr while
    its weights load (a terminal only)."""
    from inference.engine import Engine
    from tools.progress import byte_bar

    mb = args.model_bytes  # engine_config_from_args's
    with byte_bar(mb.stored - (mb.stored_experts if config.offloaded else 0), "loading weights") as bar:
        return Engine.load(args.model if store is None else store, config, progress=bar.update)


def say_placement(args: argparse.Namespace, engine) -> None:
    """The one line `generate` and `serve` print on stderr once the request is known good (a bad flag
    stays a one-line error): where the experts went and how a decoding step runs."""
    import sys

    print(f"semoe: {args.placement}; decoding through {engine.decode_path()}", file=sys.stderr, flush=True)


def placement_phrase(args: argparse.Namespace, config: "EngineConfig", budgets: list[str]) -> str:  # noqa: F821
    """Where the experts go, said in a phrase; with no budget flag and no --resident, chosen here from the
    model's bytes and the memory available (`inference.placement`), and set on `config`."""
    if budgets:
        return f"experts offloaded to the store as {', '.join(budgets)} set"
    if args.resident:
        return "every expert resident (--resident)"
    from inference.placement import choose

    placement = choose(args.model, device=config.device, compute_itemsize=torch_itemsize(config.dtype),
                       keep_bytes=config.keep_bytes, mb=args.model_bytes)
    config.cpu_cache_bytes = placement.cpu_cache
    return placement.describe()


ONLINE_POLICIES = ("next-use", "lfu-aging", "lfu", "lru")  # belady needs the future: simulation only
