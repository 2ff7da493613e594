"""Which build of the compiled kernels a CPU gets, the check of the structs Python mirrors, and the
kernels' allocation failures, in this process (the builds themselves: test_cpu_kernel_builds.py)."""

from __future__ import annotations

import ctypes
import json

import pytest

from semoe.kernels import loader, variants

ALL = frozenset().union(*(v.cpu_flags for v in variants.VARIANTS))
AVX2 = frozenset({"avx2", "fma", "f16c", "sse4_2"})


@pytest.mark.parametrize("flags, want", [
    (frozenset(), "portable"),
    (AVX2, "avx2"),
    (ALL, "avx512-vnni"),
    (ALL - {"avx512vbmi"}, "avx2"),  # VNNI without VBMI (Cascade Lake): the AVX-512 build needs both
    (ALL - {"fma"}, "portable"),
    (ALL - {"f16c"}, "portable"),  # the FP8 kernel widens through half precision
])
def test_the_best_build_the_cpu_runs_is_chosen(flags, want):
    builds = {v.name: f"/lib/{v.module}.so" for v in variants.VARIANTS}
    assert loader.choose(flags, builds, machine="x86_64")[0] == want
    # a build that was not installed is passed over for the next one the CPU runs
    rest = {k: p for k, p in builds.items() if k != want}
    assert loader.choose(flags, rest, machine="x86_64") != (want, builds[want])


def test_other_machines_take_the_portable_build_only():
    assert [v.name for v in variants.buildable("aarch64")] == ["portable"]
    assert variants.cflags(variants.BY_NAME["avx2"], "aarch64") == []
    builds = {v.name: v.module for v in variants.VARIANTS}
    assert loader.choose(ALL, builds, machine="aarch64") == ("portable", builds["portable"])


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma avx512f\n\nprocessor\t: 1\n")
    assert variants.cpu_flags(str(info)) == {"fpu", "sse", "avx2", "fma", "avx512f"}
    assert variants.cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader's choice made anew (its caches cleared before and after), with every library it
    loads recorded."""
    loaded = []
    real = ctypes.CDLL

    def record(path, *args, **kwargs):
        loaded.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(loader.ctypes, "CDLL", record)
    monkeypatch.delenv("SEMOE_CPU_KERNELS", raising=False)
    loader.chosen.cache_clear()
    loader.library.cache_clear()
    yield loaded
    loader.chosen.cache_clear()
    loader.library.cache_clear()


def test_a_build_measured_faster_here_is_chosen_once_per_machine(fresh_loader, monkeypatch, tmp_path):
    """Of the vector builds the CPU runs, the loader takes one measured faster than the best its flags
    allow by more than MEASURED_MARGIN (on a CPU whose wider vectors do not pay, say), else the best by
    flags; measured once, the choice kept in the cache file and read back without measuring again,
    and said by `status`. The timings are given here: which build is faster is this machine's to say."""
    builds = loader.installed()
    if not {"avx2", "avx512-vnni"} <= set(builds):
        pytest.skip(f"the install built {sorted(builds)}: the AVX2 and AVX-512 builds are x86-64's, with a compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(variants, "cpu_flags", lambda *a: ALL)
    timings = {builds["avx512-vnni"]: 1.0, builds["avx2"]: 0.9}
    calls = []
    monkeypatch.setattr(loader, "measure", lambda paths: calls.append(paths) or ([timings[p] for p in paths], 0.97))
    assert loader.chosen() == ("avx2", builds["avx2"])
    assert calls == [[builds["avx512-vnni"], builds["avx2"]]]  # the portable build is never measured
    assert loader.status().endswith(", measured faster here than avx512-vnni)")
    saved = json.loads((tmp_path / "semoe" / "kernel-choice.json").read_text())
    (entry,) = saved.values()
    assert entry["choice"] == "avx2" and entry["seconds"] == {"avx512-vnni": 1.0, "avx2": 0.9}
    assert entry["cpu_share"] == 0.97
    loader.chosen.cache_clear()
    loader.library.cache_clear()
    assert loader.chosen() == ("avx2", builds["avx2"]) and len(calls) == 1  # read back, not measured
    # within the margin the best by flags stays (measured anew where the file is gone)
    (tmp_path / "semoe" / "kernel-choice.json").unlink()
    timings[builds["avx2"]] = 0.97
    loader.chosen.cache_clear()
    loader.library.cache_clear()
    assert loader.chosen() == ("avx512-vnni", builds["avx512-vnni"]) and len(calls) == 2
    assert ", measured" not in loader.status()


def test_a_choice_measured_while_other_work_took_the_cores_is_not_kept(fresh_loader, monkeypatch, tmp_path):
    """Timed with less than QUIET_SHARE of the cores (a heavy job beside it), the timings are not
    trusted: the process takes the best build by flags, no file is written, and the next process
    measures again, then keeps its choice."""
    builds = loader.installed()
    if not {"avx2", "avx512-vnni"} <= set(builds):
        pytest.skip(f"the install built {sorted(builds)}: the AVX2 and AVX-512 builds are x86-64's, with a compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(variants, "cpu_flags", lambda *a: ALL)
    shares, calls = [0.55, 0.95], []
    monkeypatch.setattr(loader, "measure", lambda paths: calls.append(paths) or (
        [{builds["avx512-vnni"]: 1.0, builds["avx2"]: 0.9}[p] for p in paths], shares[len(calls) - 1]))
    assert loader.chosen() == ("avx512-vnni", builds["avx512-vnni"])  # avx2 timed faster, under load
    assert not (tmp_path / "semoe" / "kernel-choice.json").exists()
    loader.chosen.cache_clear()
    loader.library.cache_clear()
    assert loader.chosen() == ("avx2", builds["avx2"]) and len(calls) == 2  # measured again
    (entry,) = json.loads((tmp_path / "semoe" / "kernel-choice.json").read_text()).values()
    assert entry["cpu_share"] == 0.95


def test_the_measured_workload_runs_every_build_it_is_given():
    builds = loader.installed()
    seconds, share = loader.measure(list(builds.values()), rounds=2)
    assert len(seconds) == len(builds) and all(0 < t < 10 for t in seconds)
    assert 0 < share < 1.5  # CPU time over wall time times cores: a share, whatever else runs


def test_a_build_the_cpu_cannot_run_is_never_loaded(fresh_loader, monkeypatch):
    builds = loader.installed()
    if not {"avx2", "avx512-vnni"} <= set(builds):
        pytest.skip(f"the install built {sorted(builds)}: the AVX2 and AVX-512 builds are x86-64's, with a compiler")
    monkeypatch.setattr(variants, "cpu_flags", lambda *a: AVX2)  # a CPU without AVX-512
    lib = loader.library()
    assert fresh_loader == [builds["avx2"]]
    assert loader.ISAS[lib.kernels_isa()] == "avx2"
    assert loader.status().startswith("avx2 (")


def test_a_build_made_for_another_path_than_its_name_is_refused(fresh_loader, monkeypatch):
    """A portable build compiled with vector flags (CFLAGS=-march=native at install, say) would die
    on an older CPU: the loader checks the path a build says it took against its name."""
    builds = loader.installed()
    if "avx2" not in builds:
        pytest.skip(f"the install built {sorted(builds)}: the AVX2 build is x86-64's, with a compiler")
    monkeypatch.setattr(loader, "installed", lambda: {"portable": builds["avx2"]})
    monkeypatch.setattr(variants, "cpu_flags", lambda *a: AVX2)
    with pytest.raises(loader.KernelABIError, match="installed as the portable kernels but built for avx2"):
        loader.library()


def test_no_build_the_cpu_runs_leaves_the_kernels_off(fresh_loader, monkeypatch):
    monkeypatch.setattr(loader, "installed", lambda: {"avx512-vnni": "/nowhere/_kernels_avx512_vnni.so"})
    monkeypatch.setattr(variants, "cpu_flags", lambda *a: AVX2)
    assert loader.library() is None and fresh_loader == []
    assert loader.status() == "off: this CPU runs none of the installed builds (avx512-vnni)"


def test_off_by_the_environment(fresh_loader, monkeypatch):
    monkeypatch.setenv("SEMOE_CPU_KERNELS", "off")
    assert loader.library() is None and fresh_loader == []
    assert loader.status() == "off (SEMOE_CPU_KERNELS=off)"


needs_kernels = pytest.mark.skipif(loader.library() is None,
                                   reason=f"semoe's compiled CPU kernels are {loader.status()}")


@needs_kernels
def test_a_struct_changed_on_the_python_side_only_fails_at_load_in_one_line():
    class Lin(ctypes.Structure):  # decode_abi.h's Lin without its bias
        _fields_ = [(name, kind) for name, kind in loader.Lin._fields_ if name != "bias"]

    lib, (_, path) = loader.library(), loader.chosen()
    loader.check_layout(lib, path)  # the real mirrors agree
    with pytest.raises(loader.KernelABIError) as err:
        loader.check_layout(lib, path, {**loader.STRUCTS, "Lin": Lin})
    msg = str(err.value)
    assert "\n" not in msg and path in msg and "struct Lin is 56 bytes" in msg and "but 48 bytes" in msg


@needs_kernels
def test_a_library_without_the_layout_report_is_refused():
    class Old:  # a library built before semoe_abi_layout existed
        def __getattr__(self, name):
            raise AttributeError(name)

    with pytest.raises(loader.KernelABIError, match="old.so: no semoe_abi_layout"):
        loader.check_layout(Old(), "old.so")


@needs_kernels
def test_a_library_missing_an_entry_point_is_refused_naming_it(monkeypatch):
    """A build from older sources (installed before a kernel was added) is refused in one line that
    names the missing entry point and says to reinstall, not with ctypes' own AttributeError."""
    lib, (_, path) = loader.library(), loader.chosen()

    class Older:  # the real library but for one entry point
        def __getattr__(self, name):
            if name == "decode_ffn_done":
                raise AttributeError(f"{path}: undefined symbol: decode_ffn_done")
            return getattr(lib, name)

    monkeypatch.setattr(loader.ctypes, "CDLL", lambda p: Older())
    with pytest.raises(loader.KernelABIError) as err:
        loader.load(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}: decode_ffn_done, built from older sources")
    assert "reinstall" in msg


def _overcommits_everything() -> bool:
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "1"
    except OSError:
        return True


@needs_kernels
@pytest.mark.skipif(_overcommits_everything(), reason="vm.overcommit_memory=1 grants any allocation")
def test_an_allocation_that_fails_is_a_memory_error_naming_it():
    """decode_work for a cache of 2^40 positions asks for 8 TiB of scores: malloc refuses, and the
    call says so instead of handing back a step that later reads as closed."""
    lib = loader.library()
    net = loader.Net(L=1, D=8, H=2, G=1, Dh=4, F=16, E=4, top_k=2)
    with pytest.raises(MemoryError, match="decode_work"):
        lib.decode_work(ctypes.byref(net), 1 << 40)
    work = lib.decode_work(ctypes.byref(net), 16)  # a size that fits still works
    lib.decode_work_free(work)
