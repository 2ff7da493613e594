"""Topologies: the DGX-1 link table, built-in machines, NVML (through a fake pynvml) and the
measured CPU topology."""

from __future__ import annotations

import math
import sys
import types

import pytest
from helpers.fake_nvml import fake_pynvml as shared_fake_pynvml

from mpress.topology import (A100_FLOPS, GiB, NVLINK2_BW, Topology, builtin, cuda_pci_address, dgx1, format_pci,
                             from_nvml, measure_cpu, nvml_indices, nvswitch, parse_pci, pcie)


def is_symmetric(matrix: list[list[float]]) -> bool:
    return all(matrix[i][j] == matrix[j][i] for i in range(len(matrix)) for j in range(len(matrix)))


def test_dgx1_has_six_nvlinks_per_gpu_in_the_hybrid_cube_mesh():
    topo = dgx1()
    bw = topo.link_bw
    assert topo.devices == 8 and is_symmetric(bw)
    assert all(bw[i][i] == 0 for i in range(8))
    assert all(sum(row) == 6 * NVLINK2_BW == 150e9 for row in bw)
    pairs = [bw[i][j] for i in range(8) for j in range(i + 1, 8)]
    # 28 pairs: 8 with two links, 8 with one, 12 without (every GPU: 2 doubled, 2 single peers)
    assert pairs.count(50e9) == 8 and pairs.count(25e9) == 8 and pairs.count(0.0) == 12
    for i in range(8):
        assert bw[i][i ^ 4] > 0  # the cross links pair i with i + 4
        quad = range(4) if i < 4 else range(4, 8)
        assert all(bw[i][j] > 0 for j in quad if j != i)  # quads fully connected
        assert all(bw[i][j] == 0 for j in range(8) if j // 4 != i // 4 and j != i ^ 4)
    assert (bw[0][1], bw[0][2], bw[0][3], bw[0][4]) == (25e9, 25e9, 50e9, 50e9)
    assert (bw[1][2], bw[1][3], bw[1][5]) == (50e9, 25e9, 50e9)
    assert (bw[2][3], bw[2][6], bw[3][7]) == (50e9, 25e9, 25e9)
    assert topo.peer_bw(0, 5) == topo.pcie_peer_bw == 10e9
    assert topo.peer_bw(0, 3) == 50e9
    assert topo.device_memory_bytes == [32 * GiB] * 8 and topo.host_bw == [12e9] * 8
    assert topo.flops == pytest.approx(125e12 * 0.4)


def test_builtin_dgx1_takes_the_first_gpus():
    full = dgx1(gpu_memory_bytes=16 * GiB)
    for gpus in range(1, 9):
        topo = builtin("dgx1", gpus, gpu_memory_bytes=16 * GiB)
        assert topo.link_bw == [row[:gpus] for row in full.link_bw[:gpus]]
        assert topo.device_memory_bytes == [16 * GiB] * gpus
    assert builtin("dgx1", 4).device_memory_bytes == [32 * GiB] * 4


def test_subset_renumbers_in_the_order_given():
    sub = dgx1().subset([4, 0, 5])
    assert sub.link_bw == [[0, 50e9, 25e9], [50e9, 0, 0], [25e9, 0, 0]]
    with pytest.raises(ValueError, match="outside"):
        dgx1().subset([0, 8])
    with pytest.raises(ValueError, match="distinct"):
        dgx1().subset([1, 1])


@pytest.mark.parametrize("name, gpus, match", [
    ("dgx1", 9, "dgx1.*8 GPUs.*gpus=9"), ("dgx1", 0, "'dgx1'.*gpus"), ("pcie", -1, "'pcie'.*gpus"),
    ("nvswitch", True, "gpus"), ("tpu-pod", 4, "unknown topology 'tpu-pod'"),
])
def test_builtin_rejects_bad_names_and_counts(name, gpus, match):
    with pytest.raises(ValueError, match=match):
        builtin(name, gpus)


@pytest.mark.parametrize("name, link, host, flops", [
    ("nvswitch", 300e9, 25e9, 312e12 * 0.45), ("nvswitch-a100", 300e9, 25e9, 312e12 * 0.45),
    ("nvswitch-h100", 450e9, 50e9, 989e12 * 0.45),
])
def test_nvswitch_links_every_pair_equally(name, link, host, flops):
    topo = builtin(name, 6)
    assert topo.devices == 6
    assert all(topo.link_bw[i][j] == (0 if i == j else link) for i in range(6) for j in range(6))
    assert topo.host_bw == [host] * 6 and topo.device_memory_bytes == [80 * GiB] * 6
    assert topo.flops == pytest.approx(flops)
    assert nvswitch(2, "h100", gpu_memory_bytes=141 * GiB).device_memory_bytes == [141 * GiB] * 2
    with pytest.raises(ValueError, match="kind"):
        nvswitch(8, "b200")


def test_pcie_has_no_direct_links():
    topo = pcie(4)
    assert all(v == 0 for row in topo.link_bw for v in row)
    assert topo.peer_bw(0, 3) == 12e9 and topo.host_bw == [12e9] * 4
    assert topo.device_memory_bytes == [16 * GiB] * 4
    with pytest.raises(ValueError, match="gpu_memory_bytes"):
        pcie(4, gpu_memory_bytes=0)


# --- NVML, through a fake pynvml -------------------------------------------------------------------------

def gpu_bus(i: int) -> str:
    return f"00000000:{0x10 * (i + 1):02X}:00.0"


def fake_pynvml(links: list[list[tuple[str, int]]], *, init_error: bool = False, **kw):
    """helpers.fake_nvml's pynvml with GPU i at gpu_bus(i) and NVLinks links[i] = [(remote bus id, active), ...]."""
    return shared_fake_pynvml([gpu_bus(i) for i in range(len(links))], links,
                              init_error="Driver Not Loaded" if init_error else None, **kw)


def peer(i: int) -> str:
    return gpu_bus(i)[4:].lower()  # "0000:10:00.0"


def test_from_nvml_counts_links_per_pair(monkeypatch):
    # GPU0 =2= GPU1, GPU0 -1- GPU2, GPU2 -1- GPU3; GPU3 also has an inactive link to GPU1
    links = [
        [(peer(1), 1), (peer(1), 1), (peer(2), 1)],
        [(peer(0), 1), (peer(0), 1), (peer(3), 0)],
        [(peer(0), 1), (peer(3), 1)],
        [(peer(2), 1), (peer(1), 0)],
    ]
    nvml = fake_pynvml(links, version=2, pcie=(3, 16), name="Tesla V100-SXM2-32GB", memory=32 * GiB)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    topo = from_nvml()
    assert topo.link_bw == [[0, 50e9, 25e9, 0], [50e9, 0, 0, 0], [25e9, 0, 0, 25e9], [0, 0, 25e9, 0]]
    assert topo.host_bw == [pytest.approx(0.985e9 * 16 * 0.8)] * 4
    assert topo.pcie_peer_bw == pytest.approx(0.985e9 * 16 * 0.8)
    assert topo.device_memory_bytes == [32 * GiB] * 4
    assert topo.flops == pytest.approx(125e12 * 0.4)
    assert nvml.calls == ["init", "shutdown"]


def test_from_nvml_gives_switch_attached_gpus_their_fabric_bandwidth(monkeypatch):
    switches = [f"0000:c{k}:00.0" for k in range(6)]
    links = [[(switches[k // 2], 1) for k in range(12)] for _ in range(4)]  # A100: 12 links to 6 switches
    links[3] = links[3][:10]  # one GPU with two links down
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(links, version=4))
    topo = from_nvml()
    assert is_symmetric(topo.link_bw)
    assert topo.link_bw[0][1] == topo.link_bw[1][2] == 300e9
    assert topo.link_bw[0][3] == topo.link_bw[3][2] == 250e9
    assert topo.host_bw == [pytest.approx(1.969e9 * 16 * 0.8)] * 4
    assert topo.flops == A100_FLOPS


def test_from_nvml_without_nvlink_has_no_direct_links(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([[], []], name="Tesla T4"))
    topo = from_nvml()
    assert topo.link_bw == [[0, 0], [0, 0]] and topo.peer_bw(0, 1) == topo.host_bw[0]


def test_from_nvml_errors_are_runtime_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with pytest.raises(RuntimeError, match="nvidia-ml-py"):
        from_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([[]], init_error=True))
    with pytest.raises(RuntimeError, match="NVML is unavailable.*Driver Not Loaded"):
        from_nvml()
    nvml = fake_pynvml([])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with pytest.raises(RuntimeError, match="no GPUs"):
        from_nvml()
    assert nvml.calls == ["init", "shutdown"]


# --- ranks to NVML GPUs by PCI address ------------------------------------------------------------------

NVML_BUSES = [parse_pci(gpu_bus(i)) for i in range(4)]  # NVML numbers the GPUs in PCI order


def test_pci_bus_ids_compare_as_numbers():
    assert parse_pci("00000000:41:00.0") == parse_pci(b"0000:41:00.0") == (0, 0x41, 0)
    assert format_pci((0, 0x41, 0)) == "00000000:41:00.0"
    with pytest.raises(ValueError, match="not a PCI bus id: 'GPU-1234'"):
        parse_pci("GPU-1234")


@pytest.mark.parametrize("visible, order", [
    ("0,1,2,3", [0, 1, 2, 3]),  # ranks 0..3 on CUDA ordinals 0..3, which are NVML's
    ("2,0", [2, 0]),  # CUDA_VISIBLE_DEVICES=2,0: rank 0's cuda:0 is NVML's GPU 2
    ("3,1,2", [3, 1, 2]),
])
def test_ranks_are_matched_to_nvml_gpus_by_pci_address(visible, order):
    # what each rank's cuda_pci_address reports under that CUDA_VISIBLE_DEVICES
    rank_buses = [NVML_BUSES[int(i)] for i in visible.split(",")]
    assert nvml_indices(rank_buses, NVML_BUSES) == order


def test_unmatched_or_shared_gpus_are_one_clear_error():
    with pytest.raises(ValueError, match=r"GPUs \['00000000:99:00.0'\] are not among"):
        nvml_indices([(0, 0x99, 0)], NVML_BUSES)
    with pytest.raises(ValueError, match=r"GPUs \['00000000:20:00.0'\] each run more than one rank"):
        nvml_indices([NVML_BUSES[1], NVML_BUSES[1]], NVML_BUSES)


def test_from_nvml_keeps_the_ranks_gpus_in_rank_order(monkeypatch):
    # GPU0 =2= GPU1 only; GPU2 and GPU3 have no NVLink
    links = [[(peer(1), 1), (peer(1), 1)], [(peer(0), 1), (peer(0), 1)], [], []]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(links, version=2))
    topo = from_nvml([NVML_BUSES[2], NVML_BUSES[1], NVML_BUSES[0]])  # CUDA_VISIBLE_DEVICES=2,1,0
    assert topo.devices == 3
    assert topo.link_bw == [[0, 0, 0], [0, 0, 50e9], [0, 50e9, 0]]  # ranks 1 and 2 hold the linked pair


def test_a_cuda_ordinal_is_named_by_its_pci_address(monkeypatch):
    import torch

    props = {0: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x41, pci_device_id=0),
             1: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x0A, pci_device_id=0)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", props.__getitem__)
    assert cuda_pci_address(0) == (0, 0x41, 0) and cuda_pci_address(1) == (0, 0x0A, 0)


# --- CPU -------------------------------------------------------------------------------------------------

def test_measure_cpu_gives_positive_finite_uniform_figures():
    topo = measure_cpu(3, 2 * GiB, nbytes=1 << 20, repeats=2, flops_seconds=0.02)
    assert isinstance(topo, Topology) and topo.name == "cpu" and topo.devices == 3
    bw = topo.link_bw[0][1]
    assert math.isfinite(bw) and bw > 1e6  # any machine copies more than 1 MB/s
    assert all(topo.link_bw[i][j] == (0 if i == j else bw) for i in range(3) for j in range(3))
    assert topo.host_bw == [bw] * 3 and topo.pcie_peer_bw == bw
    assert topo.device_memory_bytes == [2 * GiB] * 3
    assert math.isfinite(topo.flops) and topo.flops > 1e6


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices=0), "devices"), (dict(device_memory_bytes=0), "device_memory_bytes"),
    (dict(nbytes=0), "nbytes"), (dict(repeats=0), "repeats"), (dict(flops_seconds=-1.0), "flops_seconds"),
])
def test_measure_cpu_rejects_bad_arguments(kwargs, match):
    args = dict(devices=2, device_memory_bytes=GiB, nbytes=1024, repeats=1, flops_seconds=0.01) | kwargs
    with pytest.raises(ValueError, match=match):
        measure_cpu(**args)
