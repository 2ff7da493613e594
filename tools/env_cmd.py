"""`semoe env`: what this machine offers semoe, for bug reports and before a long run.

Python, torch, CUDA, cuDNN and NCCL versions; GPUs with their memory and the links between them
as NVML reports them; pinned memory; and the I/O side from `storage.host_probes` (O_DIRECT and cold
read GB/s of the file system that holds the store, /dev/shm, cores, RAM). Every probe reports its
value or, where it could not, the reason; nothing here needs a GPU to run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import platform
import sys

from mpress.topology import nvml_text, read_nvlinks
from tools.cli_output import UsageError, emit_json
from tools.size_flags import format_size, parse_size

log = logging.getLogger(__name__)

# nvmlGpuTopologyLevel_t -> the labels of `nvidia-smi topo -m`, nearest first
TOPOLOGY_LABELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
TOPOLOGY_LEGEND = (
    "X    = the GPU itself",
    "NV#  = # NVLinks between the two (through NVSwitches: the fewer of the two GPUs' links)",
    "PIX  = PCIe, at most one switch between them",
    "PXB  = PCIe, several switches, no host bridge",
    "PHB  = PCIe through a host bridge (the CPU)",
    "NODE = PCIe host bridges within one NUMA node",
    "SYS  = across NUMA nodes (the SMP interconnect)",
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `semoe env`."""
    p = sub.add_parser("env", help="report versions, GPUs, links and storage I/O of this machine",
                       description="Report Python, torch, CUDA, cuDNN and NCCL versions; GPUs (memory, compute "
                                   "capability, PCI bus id) and the links between them read through NVML; whether "
                                   "pinned memory and O_DIRECT work; the cold read GB/s of the file system holding "
                                   "the store; /dev/shm, CPU cores and RAM. Probes that cannot run say why.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--store", metavar="PATH", help="probe the file system of this store by reading its expert "
                                                       "chunk files (nothing is written)")
    where.add_argument("--path", metavar="DIR", help="probe the file system holding DIR with a scratch file written "
                                                     "there and removed afterwards (default: the current directory)")
    p.add_argument("--probe-bytes", default="64MiB", metavar="SIZE",
                   help="bytes to write and read back, or to read of the store's chunks (default 64MiB)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    nbytes = parse_size(args.probe_bytes, flag="--probe-bytes")
    if args.store is not None:
        io = _probe_store(args.store, nbytes)
    else:
        path = "." if args.path is None else args.path
        if not os.path.isdir(path):
            raise UsageError(f"--path: {path}: no such directory")
        from storage.host_probes import probe_directory

        io = probe_directory(path, nbytes)
    info = gather(io)
    if args.json:
        emit_json(info)
    else:
        print(format_report(info))
    return 0


def _probe_store(path: str, nbytes: int) -> dict:
    from storage.host_probes import probe_store
    from storage.errors import StorageError
    from storage.store import Store

    if not os.path.isdir(path):
        raise UsageError(f"--store: {path}: no such directory")
    try:
        store = Store.open(path)
    except StorageError as e:
        raise UsageError(f"--store: {str(e).splitlines()[0]}") from None
    return probe_store(store, nbytes)


def gather(io: dict) -> dict:
    """The whole report as one JSON-ready dict, `io` being storage.host_probes's probe of a path."""
    from semoe.kernels import torch_ops, loader
    from storage import host_probes, process_memory

    torch_fields = torch_info()
    nvml = nvml_info()
    gpus, source = (nvml["gpus"], "nvml") if nvml["gpus"] else (torch_gpus(), "torch")
    return {
        **python_info(), **torch_fields,
        "nvml_driver": nvml["driver"], "nvml_reason": nvml["reason"],
        "gpus": gpus, "gpus_source": source if gpus else None, "topology": nvml["topology"],
        **host_probes.probe_pinned_memory(torch_fields["cuda_available"]),
        **io,
        **host_probes.shm_info(), **host_probes.cpu_info(), **process_memory.ram_info(),
        "cpu_kernels": torch_ops.isa(), "cpu_kernels_status": loader.status(),
        "cpu_kernels_installed": sorted(loader.installed()),
    }


# --- versions -----------------------------------------------------------------------------------

def python_info() -> dict:
    """Interpreter, platform and the installed semoe's version."""
    try:
        semoe = importlib.metadata.version("semoe")
    except importlib.metadata.PackageNotFoundError:
        semoe = None
    return {"python": platform.python_version(), "python_implementation": platform.python_implementation(),
            "python_executable": sys.executable, "platform": platform_text(), "semoe": semoe}


def platform_text() -> str:
    """Kernel, release, machine and C library, e.g. "Linux-5.15.0-x86_64-with-glibc2.35", as
    `platform.platform()` gives them but without the `uname -p` child process it starts."""
    u = os.uname() if hasattr(os, "uname") else None
    parts = [u.sysname, u.release, u.machine] if u else [platform.system(), platform.release(), platform.machine()]
    lib, version = platform.libc_ver()
    return "-".join(p for p in parts if p) + (f"-with-{lib}{version}" if lib else "")


def cudnn_version_text(version: int | None) -> str | None:
    """torch's integer cuDNN version as text: 90100 -> "9.1.0" (cuDNN 9+), 8902 -> "8.9.2"."""
    if not version:
        return None
    major_unit = 10000 if version >= 90000 else 1000
    major, rest = divmod(version, major_unit)
    return f"{major}.{rest // 100}.{rest % 100}"


def torch_info() -> dict:
    """torch's version, the CUDA/cuDNN/NCCL it was built with, and whether CUDA is usable here."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        reason = None
    elif torch.version.cuda is None:
        reason = f"torch {torch.__version__} is built without CUDA"
    else:
        reason = "no CUDA device visible (no driver, or CUDA_VISIBLE_DEVICES hides them)"
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None
    except (AttributeError, RuntimeError, TypeError):
        nccl = None
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cudnn": cudnn_version_text(torch.backends.cudnn.version()), "nccl": nccl,
            "cuda_available": cuda, "cuda_reason": reason,
            "cuda_device_count": torch.cuda.device_count() if cuda else 0,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def torch_gpus() -> list[dict]:
    """The GPUs torch sees, for when NVML cannot be read; [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        bus = (f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
               if hasattr(p, "pci_domain_id") else None)
        gpus.append({"index": i, "name": p.name, "total_bytes": total, "free_bytes": free,
                     "compute_capability": f"{p.major}.{p.minor}", "pci_bus_id": bus, "nvlinks": None})
    return gpus


# --- NVML ---------------------------------------------------------------------------------------

def nvml_info() -> dict:
    """{"driver", "reason", "gpus", "topology"} read through NVML (every GPU of the machine, in
    nvidia-smi's order, whatever CUDA_VISIBLE_DEVICES says); never raises."""
    def unavailable(reason: str) -> dict:
        return {"driver": None, "reason": reason, "gpus": [], "topology": []}

    try:
        import pynvml
    except ImportError:
        return unavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return unavailable(f"nvmlInit failed (no NVIDIA driver?): {e}")
    try:
        driver = nvml_text(pynvml.nvmlSystemGetDriverVersion())
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        links = read_nvlinks(pynvml, handles)
        gpus = [_nvml_gpu(pynvml, i, h, links.active[i]) for i, h in enumerate(handles)]
        topology = topology_matrix(links.pairs, read_ancestors(pynvml, handles))
    except pynvml.NVMLError as e:
        log.debug("NVML query failed", exc_info=True)
        return unavailable(f"NVML query failed: {e}")
    finally:
        pynvml.nvmlShutdown()
    return {"driver": driver, "reason": None, "gpus": gpus, "topology": topology}


def _optional(nvml, fn, *args):
    """fn(*args), or None where this GPU or driver does not support the query."""
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _nvml_gpu(nvml, index: int, handle, nvlinks: int) -> dict:
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    cc = _optional(nvml, nvml.nvmlDeviceGetCudaComputeCapability, handle)
    return {"index": index, "name": nvml_text(nvml.nvmlDeviceGetName(handle)), "total_bytes": int(mem.total),
            "free_bytes": int(mem.free), "compute_capability": cc and f"{cc[0]}.{cc[1]}",
            "pci_bus_id": nvml_text(nvml.nvmlDeviceGetPciInfo(handle).busId), "nvlinks": nvlinks}


def read_ancestors(nvml, handles: list) -> list[list[int | None]]:
    """NVML's closest common PCIe ancestor level of every pair; None where NVML cannot tell."""
    n = len(handles)
    out: list[list[int | None]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            out[i][j] = out[j][i] = _optional(nvml, nvml.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
    return out


def topology_matrix(nvlinks: list[list[int]], ancestors: list[list[int | None]]) -> list[list[str]]:
    """`nvidia-smi topo -m`'s labels: X on the diagonal, NV<k> for k NVLinks, else the PCIe path."""
    n = len(nvlinks)
    return [["X" if i == j else f"NV{nvlinks[i][j]}" if nvlinks[i][j]
             else TOPOLOGY_LABELS.get(ancestors[i][j], "?") for j in range(n)] for i in range(n)]


def format_topology(matrix: list[list[str]]) -> list[str]:
    """The matrix as aligned text rows under a GPU0 GPU1 ... header."""
    names = [f"GPU{i}" for i in range(len(matrix))]
    width = max(len(c) for c in names + [x for row in matrix for x in row]) + 2
    lines = [" " * width + "".join(h.ljust(width) for h in names).rstrip()]
    lines += [name.ljust(width) + "".join(c.ljust(width) for c in row).rstrip() for name, row in zip(names, matrix)]
    return lines


# --- the readable report ------------------------------------------------------------------------

def _yes(value: bool | None, reason: str | None, *, untried: str = "not tried") -> str:
    text = {True: "yes", False: "no", None: untried}[value]
    return f"{text}: {reason}" if reason else text


def _bytes(n: int | None) -> str:
    return "?" if n is None else format_size(n)


def format_report(info: dict) -> str:
    """The report as aligned `name  value` lines, GPUs and their topology included."""
    rows = [
        ("python", f"{info['python']} ({info['python_implementation']}) {info['python_executable']}"),
        ("platform", info["platform"]),
        ("semoe", info["semoe"] or "not installed (run from a checkout)"),
        ("torch", f"{info['torch']} (CUDA {info['torch_cuda'] or 'none'}, cuDNN {info['cudnn'] or 'none'}, "
                  f"NCCL {info['nccl'] or 'none'})"),
        ("CUDA available", _yes(info["cuda_available"], info["cuda_reason"])
         + (f", {info['cuda_device_count']} device(s)" if info["cuda_available"] else "")),
        ("NVML", f"driver {info['nvml_driver']}" if info["nvml_driver"] else f"unavailable: {info['nvml_reason']}"),
    ]
    for g in info["gpus"]:
        links = f", {g['nvlinks']} NVLinks" if g.get("nvlinks") else ""
        rows.append((f"GPU {g['index']}", f"{g['name']}, {_bytes(g['total_bytes'])} total, "
                                          f"{_bytes(g['free_bytes'])} free, compute {g['compute_capability']}, "
                                          f"PCI {g['pci_bus_id']}{links}"))
    if not info["gpus"]:
        rows.append(("GPUs", "none"))
    rows += [
        ("pinned memory", _yes(info["pinned_memory"], info["pinned_memory_reason"])),
        ("CPU cores", f"{info['cpu_cores']} usable of {info['cpu_count']}"),
        ("CPU kernels", f"{info['cpu_kernels_status']} of the builds {', '.join(info['cpu_kernels_installed'])}"
         if info["cpu_kernels"] else f"{info['cpu_kernels_status']}: decoding falls back to torch's slower ops"),
        ("RAM", f"{_bytes(info['ram_total_bytes'])} total, {_bytes(info['ram_available_bytes'])} available"
         if info["ram_reason"] is None else info["ram_reason"]),
        ("/dev/shm", f"{_bytes(info['shm_total_bytes'])} total, {_bytes(info['shm_free_bytes'])} free"
         if info["shm_reason"] is None else info["shm_reason"]),
        ("probed path", f"{info['probe_path']} ({info['filesystem'] or '?'} on {info['mount_point'] or '?'})"),
        ("O_DIRECT", _yes(info["o_direct"], info["o_direct_reason"])),
        ("cold read", f"{info['read_gbps']:.2f} GB/s reading {_bytes(info['read_bytes'])} from {info['read_files']} "
                      f"{info['read_source']} ({info['read_mode']})"
         if info["read_gbps"] is not None else f"not measured: {info['read_reason']}"),
    ]
    width = max(len(name) for name, _ in rows) + 2
    lines = [name.ljust(width) + value for name, value in rows]
    if len(info["topology"]) > 1:
        lines.append("topology")
        lines += ["  " + line for line in format_topology(info["topology"])]
        lines += ["  " + line for line in TOPOLOGY_LEGEND]
    return "\n".join(lines)
