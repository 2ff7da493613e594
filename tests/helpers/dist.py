"""Real torch.distributed process groups for tests: 2 gloo ranks on 127.0.0.1.

`run_ranks(worker, *args)` starts the ranks with `torch.multiprocessing.spawn`, which re-raises a
failing rank's exception (with its traceback) in the test; the process group's timeout turns a
hang into a failure.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
TIMEOUT = timedelta(seconds=20)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, worker: Callable[..., None], port: int, world: int, args: tuple) -> None:
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on loopback
    # CPU tensors, so gloo; the library code under test picks nccl for CUDA tensors itself.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    worker(rank, *args)
    dist.destroy_process_group()
    # A gloo thread may still be freeing a finished collective's tensors, which needs the GIL, while
    # the interpreter finalises; torch then aborts a process whose checks all passed. A failing
    # worker raised before this point, and spawn has its traceback for the parent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker: Callable[..., None], *args, world: int = WORLD) -> None:
    """Run `worker(rank, *args)` on `world` gloo ranks; raise here if any rank fails.

    Children import `worker` by its module name, so the repository root must be importable (the
    tests run from it; tests/conftest.py puts it on sys.path)."""
    mp.spawn(_entry, args=(worker, free_port(), world, args), nprocs=world, join=True)
