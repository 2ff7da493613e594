"""The tensor store on SSD: zarr v3 arrays plus a manifest, with atomic commits.

Layout of a store directory:

    manifest.json              the committed version (replaced by rename, never edited)
    history/v00000007.json     manifests of recent versions, for `gc --keep`
    arrays/v00000007/...       arrays written by the commit that made version 7
    files/v00000007/...        side files (config.json, tokenizer files) of that commit
    .lock                      held (flock) by the one writer

A commit writes only new files, under the new version's folders, fsyncs them, then replaces
`manifest.json` by rename and fsyncs the directory. A reader holds one manifest and so only ever
sees a committed version; files are removed only by `gc`, which keeps every file a retained
version references.
"""

from __future__ import annotations

import datetime
import fcntl
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from storage import zarr_arrays
from storage.dtypes import dtype_name, torch_dtype
from storage.errors import BadInputError, CorruptTensorError, StorageError, StoreLockedError
from storage.crc_combine import crc32c
from storage.durable import fsync_path, fsync_tree, write_atomic
from storage.chunk_io import ReadMode, write_file
from storage.layout import array_of_chunk, chunk_layout, expert_array_rel, tensor_view, vdir, version_of
from storage.manifest import KINDS, ChunkEntry, FileEntry, Manifest, TensorEntry
from storage.reader import MANIFEST, StoreReader, load_manifest
from storage.quant import QuantSpec, dequantize, has_scales

log = logging.getLogger(__name__)

LOCK = ".lock"


@dataclass(kw_only=True)
class Problem:
    """One thing `verify` found wrong."""

    tensor: str
    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.tensor}: {self.what} ({self.file})"


@dataclass(kw_only=True)
class GcResult:
    """What `gc` removed."""

    files: int = 0
    bytes: int = 0
    versions_dropped: list[int] = field(default_factory=list)


class Store(StoreReader):
    """A store opened at one committed version; reads never see later commits until `refresh`. The
    reads of `StoreReader` as typed torch tensors, plus writes and maintenance."""

    @classmethod
    def create(cls, root: str) -> "Store":
        """Make a new, empty store (version 0) in a directory that is absent or empty."""
        if os.path.exists(root):
            if not os.path.isdir(root):
                raise BadInputError(f"{root}: exists and is not a directory")
            if os.listdir(root):
                raise BadInputError(f"{root}: target directory is not empty")
        os.makedirs(root, exist_ok=True)
        m = Manifest(version=0, created=_now())
        write_atomic(os.path.join(root, MANIFEST), m.to_json().encode())
        return cls(root, m)

    # -- reads --------------------------------------------------------------------------------
    def read_tensor(self, name: str, kind: str = "weight", *, stack_index: int | None = None,
                    verify: bool = True, mode: ReadMode = ReadMode.DROP) -> torch.Tensor:
        """Read one tensor straight from its file into a new CPU tensor."""
        e = self.manifest.tensor(name, kind, stack_index)
        if not e.bytes:  # numpy's empty array has stride 0, which torch cannot view as another type
            return torch.empty(e.shape, dtype=torch_dtype(e.dtype))
        buf = torch.from_numpy(self.read_bytes(name, kind, stack_index=stack_index, verify=verify, mode=mode))
        return buf.view(torch_dtype(e.dtype)).view(e.shape)

    def check_chunk(self, chunk: ChunkEntry, buf: torch.Tensor) -> None:
        """Check every tensor of a chunk read into `buf`; CorruptTensorError names the first bad one."""
        self.check_chunk_bytes(chunk, buf.numpy())

    def chunk_views(self, chunk: ChunkEntry, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of a chunk's tensors in a buffer holding the chunk file.

        Keys are tensor names; a slice of a fused (stacked) tensor keeps its name too, since a
        chunk holds one expert.
        """
        return {e.name: tensor_view(buf, e) for e in self.manifest.chunk_tensors(chunk)}

    def read_chunk(self, layer: int, expert: int, kind: str = "weight", *, verify: bool = True,
                   mode: ReadMode = ReadMode.DROP) -> torch.Tensor:
        """One expert's chunk file as a uint8 tensor (one contiguous read), its tensors checked."""
        return torch.from_numpy(self.read_chunk_bytes(layer, expert, kind, verify=verify, mode=mode))

    def read_expert(self, layer: int, expert: int, kind: str = "weight", *, verify: bool = True,
                    mode: ReadMode = ReadMode.DROP) -> dict[str, torch.Tensor]:
        """Read one expert's tensors (one contiguous read of its chunk file)."""
        buf = self.read_chunk(layer, expert, kind, verify=verify, mode=mode)
        return self.chunk_views(self.manifest.chunk(layer, expert, kind), buf)

    def is_compact(self, kind: str = "weight") -> bool:
        """Whether any expert tensor of this kind is stored compact (quantized)."""
        return bool(self.expert_schemes(kind))

    def expert_schemes(self, kind: str = "weight") -> set[str]:
        """The compact schemes the expert tensors of this kind are stored in (empty when all are plain)."""
        return {t.quant["scheme"] for t in self.manifest.tensors
                if t.group == "expert" and t.kind == kind and t.quant and "scheme" in t.quant}

    def read_dense(self, name: str) -> torch.Tensor:
        """A dense weight as the model uses it: a compact one dequantized to its logical dtype."""
        e = self.manifest.tensor(name)
        if e.quant is None or "scheme" not in e.quant:
            return self.read_tensor(name)
        spec = QuantSpec.from_json(e.quant)
        codes = self.read_tensor(name)
        return dequantize(codes, self.read_tensor(spec.scales) if has_scales(spec) else codes[:0], spec)

    def read_dense_rows(self, name: str, rows: int, *, mode: ReadMode = ReadMode.DROP) -> Iterator[torch.Tensor]:
        """A dense weight `rows` rows at a time (a new buffer each; the last may be shorter), for a
        reader that never holds it whole; its crc32c is checked after the last block (CorruptTensorError
        then, so a caller keeps nothing it built before). A compact or non-2-D weight comes whole."""
        e = self.manifest.tensor(name)
        if (e.quant is not None and "scheme" in e.quant) or len(e.shape) != 2 or not e.bytes:
            yield self.read_dense(name)
            return
        for block in self.dense_row_bytes(name, rows, mode=mode):
            yield torch.from_numpy(block).view(torch_dtype(e.dtype))

    def read_tensor_ts(self, entry: TensorEntry) -> torch.Tensor:
        """Read a tensor through tensorstore (the checked, slower path used by export and verify)."""
        raw = torch.from_numpy(self._ts_bytes(entry, {}).copy()) if entry.bytes else torch.empty(0, dtype=torch.uint8)
        return raw.view(torch_dtype(entry.dtype)).view(entry.shape)

    def _ts_bytes(self, entry: TensorEntry, handles: dict) -> np.ndarray:
        if entry.bytes == 0:  # an empty array has no chunk file at all
            return np.empty(0, dtype=np.uint8)
        array_path, index = array_of_chunk(self.path(entry.file))
        arr = handles.get(array_path)
        if arr is None:
            arr = handles[array_path] = zarr_arrays.open_array(array_path)
        if entry.group == "dense":
            data = arr.read().result()
            return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        row = arr[index[0]].read().result()
        return row[entry.offset:entry.offset + entry.bytes]

    # -- writing ------------------------------------------------------------------------------
    def writer(self) -> "StoreWriter":
        """Start a transaction; at most one per store at a time (others get StoreLockedError)."""
        return StoreWriter(self)

    # -- maintenance --------------------------------------------------------------------------
    def verify(self, progress: Callable[[int], None] | None = None) -> list[Problem]:
        """Check every file's presence and size and every tensor's crc32c, reading via tensorstore."""
        problems: list[Problem] = []
        handles: dict = {}
        for c in self.manifest.chunks:
            p = self._check_size(c.file, c.bytes, f"expert {c.expert} of layer {c.layer} ({c.kind})")
            if p:
                problems.append(p)
        bad_files = {p.file for p in problems}
        for e in self.manifest.tensors:
            if e.file in bad_files or e.bytes == 0:
                continue
            p = self._check_size(e.file, e.offset + e.bytes, e.name, exact=e.group == "dense")
            if p is None:
                try:
                    data = self._ts_bytes(e, handles)
                    if crc32c(np.ascontiguousarray(data)) != e.crc32c:
                        p = Problem(tensor=e.name, file=e.file, what="checksum mismatch")
                except Exception as ex:  # tensorstore raises ValueError for broken metadata
                    p = Problem(tensor=e.name, file=e.file, what=f"unreadable: {str(ex).splitlines()[0]}")
            if p:
                problems.append(p)
            if progress:
                progress(e.bytes)
        for f in self.manifest.files:
            try:
                self.read_file(f.name)
            except (OSError, CorruptTensorError):
                problems.append(Problem(tensor=f.name, file=f.file, what="missing or checksum mismatch"))
        return problems

    def _check_size(self, rel: str, size: int, what: str, exact: bool = True) -> Problem | None:
        try:
            actual = os.path.getsize(self.path(rel))
        except FileNotFoundError:
            return Problem(tensor=what, file=rel, what="file is missing")
        if actual != size if exact else actual < size:
            return Problem(tensor=what, file=rel, what=f"file has {actual} bytes, expected {size}")
        return None

    def gc(self, keep: int = 1) -> GcResult:
        """Remove files no retained version references (the newest `keep` versions are retained)."""
        if keep < 1:
            raise BadInputError(f"--keep must be >= 1, got {keep}")
        with _WriteLock(self.root):
            current = load_manifest(self.root)
            self.manifest = current
            result = GcResult()
            hist_dir = os.path.join(self.root, "history")
            retained = [current]
            for name in sorted(os.listdir(hist_dir)) if os.path.isdir(hist_dir) else []:
                v = version_of(name)
                path = os.path.join(hist_dir, name)
                if v is not None and current.version - keep < v < current.version:
                    with open(path, encoding="utf-8") as f:
                        retained.append(Manifest.from_json(f.read(), source=path))
                elif v != current.version:
                    result.versions_dropped.append(v if v is not None else -1)
                    _remove(path, result)
            referenced: set[str] = set()
            for m in retained:
                referenced |= m.referenced_files()
            for top in ("arrays", "files"):
                self._gc_tree(os.path.join(self.root, top), referenced, result)
            for name in os.listdir(self.root):
                if ".tmp-" in name:
                    _remove(os.path.join(self.root, name), result)
            return result

    def _gc_tree(self, top: str, referenced: set[str], result: GcResult) -> None:
        if not os.path.isdir(top):
            return
        # an array's zarr.json stays while any chunk of that array is referenced
        live_arrays = {array_of_chunk(self.path(r))[0] for r in referenced}
        for dirpath, _dirs, files in os.walk(top, topdown=False):
            for f in files:
                full = os.path.join(dirpath, f)
                rel = os.path.relpath(full, self.root)
                if rel in referenced or (f == "zarr.json" and dirpath in live_arrays):
                    continue
                _remove(full, result)
            if dirpath != top and not os.listdir(dirpath):
                os.rmdir(dirpath)
        fsync_path(top)

    def describe(self) -> dict:
        """Summary used by `semoe store info`."""
        m = self.manifest
        layers = m.expert_layers()
        dense = sum(t.bytes for t in m.tensors if t.group == "dense")
        experts = sum(t.bytes for t in m.tensors if t.group == "expert")
        return {
            "path": self.root,
            "version": m.version,
            "created": m.created,
            "architecture": m.model.get("architecture"),
            "model_type": m.model.get("model_type"),
            "layers": m.model.get("num_layers"),
            "moe_layers": len(layers),
            "experts_per_layer": {str(k): v for k, v in layers.items()},
            "tensors": len(m.tensors),
            "dense_bytes": dense,
            "expert_bytes": experts,
            "dtypes": sorted({t.dtype for t in m.tensors}),
            "kinds": sorted({t.kind for t in m.tensors}),
            "side_files": [f.name for f in m.files],
            # what import changed: {"format", "to", "tensors"}; {"reason", "layers", "tensors", "bytes"}
            "dequantized": m.model.get("dequantized"),
            "skipped": m.model.get("skipped"),
            "mtp": m.model.get("mtp"),  # the multi-token-prediction layers kept: {"layers", "tensors", "bytes"}
            "gguf": m.model.get("gguf"),  # imported from a GGUF file: {"format", "file", "types"}
            # compact weights: {"format", "source", "tensors", ...} as recorded, and per scheme what they take
            "quantization": m.model.get("quantization"),
            "schemes": self.schemes(),
        }

    def schemes(self) -> dict[str, dict]:
        """Per compact scheme: weights (by name), bytes of codes and scales, bits per logical weight."""
        m = self.manifest
        out: dict[str, dict] = {}
        for t in m.tensors:
            if t.kind != "weight" or not t.quant or "scheme" not in t.quant:
                continue
            spec = QuantSpec.from_json(t.quant)
            scales = m.tensor(spec.scales, stack_index=t.expert if t.stacked else None).bytes if has_scales(spec) else 0
            s = out.setdefault(spec.scheme, {"names": set(), "bytes": 0, "weights": 0})
            s["names"].add(t.name)
            s["bytes"] += t.bytes + scales
            s["weights"] += spec.numel
        return {k: {"tensors": len(s["names"]), "bytes": s["bytes"], "bits_per_weight": 8 * s["bytes"] / s["weights"]}
                for k, s in sorted(out.items())}


def _remove(path: str, result: GcResult) -> None:
    try:
        size = os.path.getsize(path)
        os.remove(path)
    except FileNotFoundError:
        return
    result.files += 1
    result.bytes += size


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class _WriteLock:
    """An exclusive flock on the store's lock file, released on close or process death."""

    def __init__(self, root: str) -> None:
        self.fd = os.open(os.path.join(root, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise StoreLockedError(f"{root}: another process is writing this store") from None

    def close(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "_WriteLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(kw_only=True)
class ExpertTensor:
    """One tensor of an expert chunk to write; `stacked` marks a slice of a fused (E, ...) tensor."""

    name: str
    tensor: torch.Tensor
    stacked: bool = False
    hf_file: str | None = None
    quant: dict | None = None  # see TensorEntry.quant


class StoreWriter:
    """One transaction: stage tensors and side files in new files, then `commit` them atomically.

    Leaving the `with` block without commit (or on an exception) removes what was staged.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = _WriteLock(store.root)
        try:
            base = load_manifest(store.root)
            self.manifest = Manifest.from_json(base.to_json(), source="(copy)")
            self.version = base.version + 1
            self._vd = vdir(self.version)
            # leftovers of a writer that died before committing this version number
            for top in ("arrays", "files"):
                shutil.rmtree(os.path.join(store.root, top, self._vd), ignore_errors=True)
        except BaseException:
            self._lock.close()
            raise
        self._expert_arrays: dict[tuple[int, str], tuple[object, str, list]] = {}
        self._staged = False
        self._done = False

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self._done:
            self.abort()

    def _rel(self, *parts: str) -> str:
        return os.path.join(*parts)

    @staticmethod
    def _check_name(name: str) -> None:
        if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
            raise BadInputError(f"tensor or file name {name!r} cannot be stored (no slashes, no leading dot)")

    def set_model(self, model: dict) -> None:
        """Replace the model description (architecture, config, layer counts)."""
        self.manifest.model = dict(model)

    def put_file(self, name: str, data: bytes) -> None:
        """Keep a side file verbatim."""
        self._check_name(name)
        rel = self._rel("files", self._vd, name)
        full = self.store.path(rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
        self._staged = True
        self.manifest.upsert(files=[FileEntry(name=name, file=rel, bytes=len(data), crc32c=crc32c(data),
                                              version=self.version)])

    def put_dense(self, name: str, tensor: torch.Tensor, *, kind: str = "weight",
                  hf_file: str | None = None, quant: dict | None = None) -> None:
        """Write a dense tensor as a typed one-chunk array."""
        self._check_name(name)
        if kind not in KINDS:
            raise BadInputError(f"kind must be one of {KINDS}, got {kind!r}")
        t = tensor.detach().contiguous().cpu()
        rel_array = self._rel("arrays", self._vd, "dense", f"{name}.{kind}")
        chunk = zarr_arrays.write_dense(self.store.path(rel_array), t, {"semoe": {"name": name, "kind": kind}})
        self._staged = True
        raw = zarr_arrays.tensor_bytes(t)
        self.manifest.upsert(tensors=[TensorEntry(
            name=name, group="dense", kind=kind, dtype=dtype_name(t.dtype), shape=list(t.shape),
            file=os.path.relpath(chunk, self.store.root), offset=0, bytes=raw.nbytes, crc32c=crc32c(raw),
            version=self.version, hf_file=hf_file, quant=quant)])

    def put_expert(self, layer: int, expert: int, tensors: list[ExpertTensor], *, num_experts: int,
                   kind: str = "weight") -> None:
        """Write one expert's tensors of one kind as one chunk file."""
        if kind not in KINDS:
            raise BadInputError(f"kind must be one of {KINDS}, got {kind!r}")
        if not 0 <= expert < num_experts:
            raise BadInputError(f"expert index {expert} out of range for {num_experts} experts (layer {layer})")
        ts_list = [t.tensor.detach().contiguous().cpu() for t in tensors]
        for t in tensors:
            self._check_name(t.name)
        shapes = [(t.dtype, tuple(t.shape)) for t in ts_list]
        offsets, size = chunk_layout(shapes)
        buf = np.zeros(size, dtype=np.uint8)
        for off, t in zip(offsets, ts_list):
            raw = zarr_arrays.tensor_bytes(t)
            buf[off:off + raw.nbytes] = raw
        self.put_expert_chunk(layer, expert, tensors, buf, offsets, num_experts=num_experts, kind=kind)

    def put_expert_chunk(self, layer: int, expert: int, tensors: list[ExpertTensor], buf: np.ndarray,
                         offsets: list[int], *, num_experts: int, kind: str = "weight") -> None:
        """Write an already packed chunk (`buf` laid out by `chunk_layout`); `tensors` give metadata."""
        rel = self.expert_array(layer, kind, num_experts=num_experts, chunk_bytes=buf.nbytes,
                                layout=chunk_meta(tensors, offsets))
        entries, chunk = write_expert_chunk(self.store.root, rel, self.version, layer, expert, kind, tensors, buf,
                                            offsets)
        self._staged = True
        self.manifest.upsert(tensors=entries, chunks=[chunk])

    def expert_array(self, layer: int, kind: str, *, num_experts: int, chunk_bytes: int, layout: list[dict]) -> str:
        """The staged (experts, chunk_bytes) array of one layer and kind, created on first use; returns
        its store-relative path. Chunk files under it may be written by other processes too
        (`write_expert_chunk`) and their entries `adopt`ed."""
        if kind not in KINDS:
            raise BadInputError(f"kind must be one of {KINDS}, got {kind!r}")
        key = (layer, kind)
        if key not in self._expert_arrays:
            rel = expert_array_rel(self.version, layer, kind)
            attrs = {"semoe": {"layer": layer, "kind": kind, "layout": layout}}
            zarr_arrays.create_expert_array(self.store.path(rel), num_experts, chunk_bytes, attrs)
            self._expert_arrays[key] = (None, rel, [chunk_bytes, num_experts])
            self._staged = True
        _, rel, (have_bytes, n) = self._expert_arrays[key]
        if chunk_bytes != have_bytes or n != num_experts:
            raise BadInputError(
                f"layer {layer} ({kind}): chunk of {chunk_bytes} bytes / {num_experts} experts "
                f"differs from the layer's other experts ({have_bytes} bytes / {n} experts)")
        return rel

    def adopt(self, tensors: list[TensorEntry], chunks: list[ChunkEntry]) -> None:
        """Take entries of chunk files that another process wrote under this transaction's arrays."""
        for c in chunks:
            if c.version != self.version or not c.file.startswith(self._rel("arrays", self._vd, "")):
                raise StorageError(f"chunk {c.key} was not written for version {self.version} ({c.file})")
        self._staged = True
        self.manifest.upsert(tensors=tensors, chunks=chunks)

    def commit(self) -> int:
        """Make everything staged durable and visible as the next version; returns it."""
        if self._done:
            raise StorageError("transaction already finished")
        root = self.store.root
        for top in ("arrays", "files"):
            staged = os.path.join(root, top, self._vd)
            if os.path.isdir(staged):
                fsync_tree(staged)
                fsync_path(os.path.join(root, top))
        self.manifest.version = self.version
        self.manifest.created = _now()
        text = self.manifest.to_json().encode()
        os.makedirs(os.path.join(root, "history"), exist_ok=True)
        write_atomic(os.path.join(root, "history", f"{self._vd}.json"), text)
        write_atomic(os.path.join(root, MANIFEST), text)  # the commit point
        self._done = True
        self._lock.close()
        self.store.manifest = Manifest.from_json(text.decode(), source=os.path.join(root, MANIFEST))
        log.info("%s: committed version %d", root, self.version)
        return self.version

    def abort(self) -> None:
        """Drop what was staged; the committed version is untouched."""
        if self._done:
            return
        for top in ("arrays", "files"):
            shutil.rmtree(os.path.join(self.store.root, top, self._vd), ignore_errors=True)
        self._done = True
        self._lock.close()


def chunk_meta(tensors: list[ExpertTensor], offsets: list[int]) -> list[dict]:
    """The layout of a chunk as kept in its array's attributes."""
    return [{"name": t.name, "dtype": dtype_name(t.tensor.dtype), "shape": list(t.tensor.shape),
             "offset": o, "stacked": t.stacked} for t, o in zip(tensors, offsets)]


def write_expert_chunk(root: str, rel_array: str, version: int, layer: int, expert: int, kind: str,
                       tensors: list[ExpertTensor], buf: np.ndarray, offsets: list[int], *, direct: bool = False
                       ) -> tuple[list[TensorEntry], ChunkEntry]:
    """Write one packed chunk file of a staged expert array and return its manifest entries.

    The file is the zarr v3 chunk (plain `bytes` codec: the raw bytes), written directly rather than
    through tensorstore; the commit fsyncs it. Rewriting a chunk of the same staged version replaces it.
    `direct`: past the page cache (O_DIRECT) where the buffer's address and length are block-aligned
    and the file system allows it, buffered otherwise; a trainer rewriting its states every step
    would otherwise copy them into page cache that competes with its own memory.
    """
    rel = os.path.join(rel_array, "c", str(expert), "0")
    full = os.path.join(root, rel)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    write_file(full, memoryview(buf).cast("B"), direct=direct)
    entries = []
    for t, item in zip(tensors, chunk_meta(tensors, offsets)):
        nbytes = t.tensor.numel() * t.tensor.element_size()
        entries.append(TensorEntry(
            name=t.name, group="expert", kind=kind, dtype=item["dtype"], shape=item["shape"], file=rel,
            offset=item["offset"], bytes=nbytes, crc32c=crc32c(buf[item["offset"]:item["offset"] + nbytes]),
            version=version, layer=layer, expert=expert, stacked=t.stacked, hf_file=t.hf_file, quant=t.quant))
    chunk = ChunkEntry(layer=layer, expert=expert, kind=kind, file=rel, bytes=buf.nbytes, crc32c=crc32c(buf),
                       version=version, tensors=[(e.name, e.expert if e.stacked else None) for e in entries])
    return entries, chunk


def iter_expert_chunks(m: Manifest, kind: str = "weight") -> Iterable[ChunkEntry]:
    """Chunks of one kind, by layer then expert."""
    return sorted((c for c in m.chunks if c.kind == kind), key=lambda c: (c.layer, c.expert))
