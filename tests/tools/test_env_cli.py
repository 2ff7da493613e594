"""`semoe env`: the real command on a temporary directory and a store, and its GPU branch through a
fake NVML, so the report of a multi-GPU machine is checked on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from storage import host_probes, process_memory
from tools import env_cmd
from helpers.fake_nvml import fake_pynvml as shared_fake_pynvml
from helpers.procs import ROOT, child_env

GiB = 1 << 30


def semoe_env(*args: str) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run([sys.executable, "-m", "tools.cli", "env", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.mark.slow  # starts processes
def test_json_has_every_field_and_leaves_no_scratch_file(tmp_path):
    res = semoe_env("--json", "--path", str(tmp_path), "--probe-bytes", "4MiB")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    for key in ("python", "platform", "torch"):
        assert isinstance(info[key], str) and info[key]
    for key in ("torch_cuda", "cudnn", "nccl"):
        assert info[key] is None or isinstance(info[key], str)
    assert info["cuda_available"] is False and isinstance(info["cuda_reason"], str)  # no GPU on the test machine
    assert info["gpus"] == [] and info["topology"] == []
    assert isinstance(info["nvml_reason"], str) or isinstance(info["nvml_driver"], str)
    assert info["pinned_memory"] is None and info["pinned_memory_reason"] == "no CUDA"
    assert isinstance(info["o_direct"], bool)
    assert info["o_direct_reason"] is None if info["o_direct"] else isinstance(info["o_direct_reason"], str)
    assert info["probe_path"] == str(tmp_path)
    assert info["read_gbps"] > 0 and info["read_reason"] is None
    assert info["read_bytes"] == 4 << 20 and info["read_files"] == 1 and info["read_source"] == "scratch file"
    assert info["read_mode"] == ("direct" if info["o_direct"] else "drop")
    assert info["shm_total_bytes"] > 0 and 0 <= info["shm_free_bytes"] <= info["shm_total_bytes"]
    assert isinstance(info["cpu_cores"], int) and info["cpu_cores"] >= 1
    assert info["cpu_kernels"] in ("portable", "avx2", "avx512-vnni", None)
    assert info["cpu_kernels_status"].startswith(info["cpu_kernels"] or "off")
    assert set(info["cpu_kernels_installed"]) <= {"portable", "avx2", "avx512-vnni"}
    assert 0 < info["ram_available_bytes"] <= info["ram_total_bytes"]
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # starts processes
def test_text_report_names_each_probe(tmp_path):
    res = semoe_env("--path", str(tmp_path), "--probe-bytes", "1MiB")
    assert res.returncode == 0, res.stderr
    for label in ("python", "torch", "CUDA available  no", "NVML", "GPUs            none", "pinned memory",
                  "CPU cores", "CPU kernels", "RAM", "/dev/shm", "O_DIRECT", "cold read"):
        assert label in res.stdout
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("flag", ["--path", "--store"])
def test_missing_directory_exits_2_naming_the_flag(tmp_path, flag):
    missing = tmp_path / "absent"
    res = semoe_env(flag, str(missing), "--json")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [f"semoe: error: {flag}: {missing}: no such directory"]


@pytest.mark.slow  # starts processes
def test_store_is_probed_on_its_own_chunk_files(hf_mixtral_sharded_bf16, tmp_path):
    from semoe.checkpoints.hf_convert import import_checkpoint

    store = import_checkpoint(str(hf_mixtral_sharded_bf16), str(tmp_path / "store"))
    before = sorted(os.listdir(store.root))
    res = semoe_env("--json", "--store", store.root)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["read_source"] == "store chunks" and info["read_reason"] is None and info["read_gbps"] > 0
    assert info["read_files"] == 2 * 4 and info["read_bytes"] == sum(
        c.bytes for c in store.manifest.chunks if c.kind == "weight")
    assert sorted(os.listdir(store.root)) == before


def test_scratch_file_is_removed_when_the_read_fails(tmp_path, monkeypatch):
    def broken(requests, mode):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(host_probes, "cold_read", broken)
    out = host_probes.probe_directory(str(tmp_path), 1 << 16)
    assert out["read_gbps"] is None and "Input/output error" in out["read_reason"]
    assert os.listdir(tmp_path) == []


# --- pure helpers ---------------------------------------------------------------------------------

def test_parse_meminfo_gives_bytes():
    text = "MemTotal:       16384 kB\nMemAvailable:    8192 kB\nHugePages_Total:       0\n"
    fields = process_memory.parse_meminfo(text)
    assert fields == {"MemTotal": 16384 << 10, "MemAvailable": 8192 << 10, "HugePages_Total": 0}


def test_filesystem_of_picks_the_longest_mount_point():
    mounts = ("/dev/vda / ext4 rw 0 0\n"
              "tmpfs /dev/shm tmpfs rw 0 0\n"
              "/dev/nvme0n1 /mnt/fast\\040ssd xfs rw 0 0\n")
    assert host_probes.filesystem_of("/dev/shm/x", mounts) == ("/dev/shm", "tmpfs")
    assert host_probes.filesystem_of("/mnt/fast ssd/store", mounts) == ("/mnt/fast ssd", "xfs")
    assert host_probes.filesystem_of("/mnt/fastssd", mounts) == ("/", "ext4")


def test_cudnn_version_text():
    assert env_cmd.cudnn_version_text(90100) == "9.1.0"
    assert env_cmd.cudnn_version_text(8902) == "8.9.2"
    assert env_cmd.cudnn_version_text(None) is None


# --- the GPU branch, through a fake NVML ------------------------------------------------------------

def bus(i: int) -> str:
    return f"00000000:{0x18 + 0x20 * i:02X}:00.0"


def fake_pynvml(links: list[list[str]], *, ancestor: int = 40, init_error: str | None = None):
    """helpers.fake_nvml's pynvml with len(links) H100s; GPU i's NVLink k ends at the bus id
    links[i][k] (another GPU, written with a 4-digit domain in lower case as NVML does, or an NVSwitch)."""
    return shared_fake_pynvml([bus(i) for i in range(len(links))], links, ancestor=ancestor, init_error=init_error,
                              name=b"NVIDIA H100 80GB HBM3", free=lambda h: (79 - h) * GiB)


def peer(i: int) -> str:
    return bus(i)[4:].lower()


def test_two_gpus_with_direct_nvlinks(monkeypatch):
    nvml = fake_pynvml([[peer(1)] * 4, [peer(0)] * 4])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    out = env_cmd.nvml_info()
    assert out["driver"] == "550.54.15" and out["reason"] is None
    assert out["gpus"] == [
        {"index": i, "name": "NVIDIA H100 80GB HBM3", "total_bytes": 80 * GiB, "free_bytes": (79 - i) * GiB,
         "compute_capability": "9.0", "pci_bus_id": bus(i), "nvlinks": 4} for i in range(2)]
    assert out["topology"] == [["X", "NV4"], ["NV4", "X"]]
    assert env_cmd.format_topology(out["topology"]) == ["      GPU0  GPU1", "GPU0  X     NV4", "GPU1  NV4   X"]
    assert nvml.calls == ["init", "shutdown"]


def test_gpus_behind_nvswitches_and_gpus_on_pcie(monkeypatch):
    switches = ["0000:c0:00.0", "0000:c1:00.0"]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([switches * 9, switches * 8]))
    assert env_cmd.nvml_info()["topology"] == [["X", "NV16"], ["NV16", "X"]]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([[], [], []], ancestor=50))
    out = env_cmd.nvml_info()
    assert out["topology"] == [["X", "SYS", "SYS"], ["SYS", "X", "SYS"], ["SYS", "SYS", "X"]]
    assert [g["nvlinks"] for g in out["gpus"]] == [0, 0, 0]


def test_nvml_absent_or_failing_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    out = env_cmd.nvml_info()
    assert out["gpus"] == [] and "nvidia-ml-py" in out["reason"]
    nvml = fake_pynvml([[]], init_error="Driver Not Loaded")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    out = env_cmd.nvml_info()
    assert out["gpus"] == [] and out["topology"] == [] and "Driver Not Loaded" in out["reason"]
    assert nvml.calls == ["init"]


def test_report_of_a_two_gpu_machine(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([[peer(1)] * 18, [peer(0)] * 18]))
    info = env_cmd.gather(host_probes.probe_directory(str(tmp_path), 1 << 16))
    assert info["gpus_source"] == "nvml" and len(info["gpus"]) == 2
    json.dumps(info)  # JSON-ready
    lines = env_cmd.format_report(info).splitlines()
    gpu_lines = [line for line in lines if line.startswith("GPU ")]
    assert gpu_lines[1].endswith("NVIDIA H100 80GB HBM3, 80.0 GiB total, 78.0 GiB free, compute 9.0, "
                                 f"PCI {bus(1)}, 18 NVLinks")
    at = lines.index("topology")
    assert lines[at + 1:at + 4] == ["        GPU0  GPU1", "  GPU0  X     NV18", "  GPU1  NV18  X"]
    assert any(line.strip().startswith("NV#") for line in lines[at + 4:])
    assert os.listdir(tmp_path) == []
