"""This process's memory and the machine's, from /proc (sysconf and getrusage where it is missing),
without torch: the readers `semoe env`, the engine's memory guard and the torch-free decoder share."""

from __future__ import annotations

import ctypes
import logging
import os
import resource

from storage.errors import StorageError

log = logging.getLogger(__name__)


def parse_meminfo(text: str) -> dict[str, int]:
    """Fields of /proc/meminfo in bytes (the file gives kB)."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def ram_info(meminfo_path: str = "/proc/meminfo") -> dict:
    """{"ram_total_bytes", "ram_available_bytes", "ram_reason"}: /proc/meminfo, else sysconf."""
    try:
        with open(meminfo_path) as f:
            fields = parse_meminfo(f.read())
        return {"ram_total_bytes": fields["MemTotal"], "ram_available_bytes": fields["MemAvailable"],
                "ram_reason": None}
    except (OSError, KeyError) as e:
        log.debug("%s unreadable (%s); asking sysconf", meminfo_path, e)
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return {"ram_total_bytes": os.sysconf("SC_PHYS_PAGES") * page,
                "ram_available_bytes": os.sysconf("SC_AVPHYS_PAGES") * page, "ram_reason": None}
    except (ValueError, OSError, AttributeError) as e:
        return {"ram_total_bytes": None, "ram_available_bytes": None,
                "ram_reason": f"neither {meminfo_path} nor sysconf gives the memory size: {e}"}


def available_ram_bytes() -> int:
    """RAM the kernel can hand out without swapping now (MemAvailable; free pages without /proc)."""
    info = ram_info()
    if info["ram_available_bytes"] is None:
        raise StorageError(info["ram_reason"])
    return info["ram_available_bytes"]


def status_bytes(field: str) -> int | None:
    """A kB field of /proc/self/status (VmHWM, RssAnon, RssFile, ...) in bytes; None without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    Read from /proc/self/status (VmHWM), which belongs to the process's own address space:
    getrusage's ru_maxrss also counts the parent's memory at fork when a process is started by
    fork + exec, so a small child of a large parent would report the parent's peak.
    """
    peak = status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def major_faults() -> int:
    """Page faults of this process, all threads, that had to read from storage: a page of its
    code or of a mapped file was not in memory (evicted under pressure, or never read yet)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere).
    Loading frees many buffers of a few MB whose pages glibc keeps in its heap once its adaptive
    mmap threshold has risen past them: after loading the bench model's dense weights that was
    250 MB resident and unused, and after the torch-free runner's tokenizer and manifest 20 MB, which
    a run with memory short cannot spare."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def compute_threads() -> int:
    """Compute threads for the compiled kernels: OMP_NUM_THREADS where it is set to a positive number
    (the first of a nested list), as torch's own ops take it, else every core this process may run on.
    Processes sharing a machine set it: each taking every core oversubscribes the machine, and the
    kernels' OpenMP barriers then spin against the other processes' threads."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        return int(first)
    return usable_cores()


def usable_cores() -> int:
    """The cores this process may run on (its affinity), at least 1."""
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) or 1
