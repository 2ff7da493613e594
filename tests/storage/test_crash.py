"""SIGKILL a writing process at random moments: the store must verify and serve its last commit."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from storage.store import Store
from helpers.procs import child_env

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLS = int(os.environ.get("SEMOE_CRASH_KILLS", "24"))


def _check_store(root: str) -> int:
    store = Store.open(root)
    assert store.verify() == [], f"store damaged after kill at version {store.version}"
    v = store.version
    assert store.read_file("version.txt") == str(v).encode()
    assert torch.all(store.read_tensor("embed") == v)
    for e in range(6):
        got = store.read_expert(0, e)
        chunk = store.manifest.chunk(0, e)
        for name in (f"e{e}.w1", f"e{e}.w2"):
            t = got[name]
            want = torch.tensor(float(v)).to(t.dtype).item()  # bfloat16 rounds past 256
            seen = sorted(set(t.float().flatten().tolist()))
            assert seen == [want], f"version {v}: {name} holds {seen[:4]} ({chunk.file}, v{chunk.version})"
    return v


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_sigkill_during_commits_loses_no_committed_version(tmp_path):
    root = str(tmp_path / "store")
    rng = random.Random(1234)
    env = child_env()
    promised = 0
    versions_seen = []
    for _ in range(KILLS):
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "helpers", "crash_writer.py"), root],
                                stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.25))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        for line in out.splitlines():
            if line.startswith("committed "):
                promised = max(promised, int(line.split()[1]))
        v = _check_store(root)
        assert v >= promised, f"version {promised} was reported committed, store is at {v}"
        versions_seen.append(v)
    # the kills landed at different points: the store moved forward between them
    assert versions_seen[-1] > versions_seen[0]
    assert len(set(versions_seen)) > KILLS // 3
