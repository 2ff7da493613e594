"""One fake pynvml module for the tests of NVML's two readers: the planner's topology
(`mpress.topology.from_nvml`) and `semoe env` (`tools.env_cmd.nvml_info`), which share the NVLink
walker (`mpress.topology.read_nvlinks`)."""

from __future__ import annotations

import types
from collections.abc import Callable

GiB = 1 << 30


class FakeNVMLError(Exception):
    pass


def fake_pynvml(gpus: list[str], links: list[list[str | tuple[str, int]]], *, version: int = 4,
                pcie: tuple[int, int] = (4, 16), name: str | bytes = "NVIDIA A100-SXM4-80GB",
                memory: int = 80 * GiB, free: Callable[[int], int] | None = None, init_error: str | None = None,
                ancestor: int = 40, driver: str = "550.54.15", capability: tuple[int, int] = (9, 0)):
    """A pynvml with one GPU per bus id in `gpus` ("00000000:18:00.0"); GPU i's NVLink k ends at
    links[i][k]: a bus id (active) or (bus id, active), where the bus id is another GPU's written as
    NVML writes a link's far end (4-digit domain, lower case), or anything else: an NVSwitch. Every
    link has NVLink `version`, every GPU PCIe (gen, width) `pcie` (no maximum reported), `memory`
    bytes (`free(i)` free), and every pair the common PCIe ancestor `ancestor`. `nvml.calls` records
    init and shutdown; `init_error` makes init fail."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = FakeNVMLError
    nvml.NVML_NVLINK_MAX_LINKS = 18
    nvml.NVML_FEATURE_ENABLED = 1
    nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
    nvml.calls = []
    own = {g[4:].upper() for g in gpus}

    def init():
        nvml.calls.append("init")
        if init_error:
            raise FakeNVMLError(init_error)

    def link(h: int, k: int) -> tuple[str, int]:
        if k >= len(links[h]):
            raise FakeNVMLError("Invalid Argument")
        end = links[h][k]
        return (end, nvml.NVML_FEATURE_ENABLED) if isinstance(end, str) else end

    def not_supported(h):
        raise FakeNVMLError("Not Supported")

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")
    nvml.nvmlSystemGetDriverVersion = lambda: driver
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetName = lambda h: name
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=memory, free=memory if free is None else free(h), used=0)
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: capability
    nvml.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=gpus[h].encode())
    nvml.nvmlDeviceGetNvLinkState = lambda h, k: link(h, k)[1]
    nvml.nvmlDeviceGetNvLinkVersion = lambda h, k: (link(h, k), version)[1]
    nvml.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, k: types.SimpleNamespace(busId=link(h, k)[0])
    nvml.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, k: 0 if link(h, k)[0].upper() in own else 2
    nvml.nvmlDeviceGetMaxPcieLinkGeneration = not_supported  # the readers fall back to the current link
    nvml.nvmlDeviceGetMaxPcieLinkWidth = not_supported
    nvml.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: pcie[0]
    nvml.nvmlDeviceGetCurrPcieLinkWidth = lambda h: pcie[1]
    nvml.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: ancestor
    return nvml
