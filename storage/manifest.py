"""The store's manifest: every tensor, chunk file and side file of one committed version.

A manifest is plain data. It is written as JSON by `storage.store` and replaced atomically; readers
hold one manifest and so see one version, whatever writers do meanwhile.

Legend: a *chunk* is the file holding one expert's tensors of one kind (weight, grad, adam_m,
adam_v) back to back, so that fetching an expert is one contiguous read. A *dense* tensor has a
file of its own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from storage.formats import itemsize
from storage.errors import NotAStoreError

FORMAT_NAME = "semoe-store"
FORMAT_VERSION = 1
KINDS = ("weight", "grad", "adam_m", "adam_v")
GROUPS = ("dense", "expert")


@dataclass(kw_only=True)
class TensorEntry:
    """One tensor: where its bytes are (file, offset, bytes) and their crc32c."""

    name: str
    group: str  # "dense" or "expert"
    kind: str = "weight"
    dtype: str  # safetensors spelling: F32, BF16, ...
    shape: list[int]
    file: str  # relative to the store root
    offset: int = 0
    bytes: int
    crc32c: int
    version: int
    layer: int | None = None  # experts only
    expert: int | None = None  # experts only
    # For a fused 3-D expert tensor (E, ...), each expert's slice is one entry with stacked=True;
    # export stacks them back in expert order.
    stacked: bool = False
    hf_file: str | None = None  # the safetensors shard it came from, so export can match it
    # a compact weight's codes: storage.quant.QuantSpec as a dict; its scales: {"scales_of": codes name}
    quant: dict | None = None

    @property
    def key(self) -> tuple[str, str, int | None]:
        """Unique within a manifest: (name, kind, expert index for stacked slices)."""
        return (self.name, self.kind, self.expert if self.stacked else None)

    def check(self) -> None:
        """Raise ValueError when the entry is inconsistent with itself."""
        if self.group not in GROUPS:
            raise ValueError(f"tensor {self.name}: group must be one of {GROUPS}, got {self.group!r}")
        if self.kind not in KINDS:
            raise ValueError(f"tensor {self.name}: kind must be one of {KINDS}, got {self.kind!r}")
        n = itemsize(self.dtype)
        for d in self.shape:
            n *= d
        if n != self.bytes:
            raise ValueError(f"tensor {self.name}: {self.bytes} bytes recorded, shape and dtype give {n}")
        if self.group == "expert" and (self.layer is None or self.expert is None):
            raise ValueError(f"tensor {self.name}: expert tensors need layer and expert")


@dataclass(kw_only=True)
class ChunkEntry:
    """One expert's chunk file of one kind: the tensors in it, in file order."""

    layer: int
    expert: int
    kind: str
    file: str
    bytes: int  # file size, padded for O_DIRECT
    crc32c: int  # of the whole file
    version: int
    tensors: list[tuple[str, int | None]]  # TensorEntry keys without the kind: (name, stack index)

    @property
    def key(self) -> tuple[int, int, str]:
        """(layer, expert, kind)."""
        return (self.layer, self.expert, self.kind)


@dataclass(kw_only=True)
class FileEntry:
    """A side file kept verbatim (config.json, tokenizer files)."""

    name: str
    file: str
    bytes: int
    crc32c: int
    version: int


@dataclass(kw_only=True)
class Manifest:
    """One committed version of a store."""

    version: int = 0
    created: str = ""
    model: dict[str, Any] = field(default_factory=dict)  # architecture, config, hf metadata
    tensors: list[TensorEntry] = field(default_factory=list)
    chunks: list[ChunkEntry] = field(default_factory=list)
    files: list[FileEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._reindex()

    def _reindex(self) -> None:
        self._tensors = {t.key: t for t in self.tensors}
        self._chunks = {c.key: c for c in self.chunks}
        self._files = {f.name: f for f in self.files}

    # -- lookups -----------------------------------------------------------------------------
    def tensor(self, name: str, kind: str = "weight", stack_index: int | None = None) -> TensorEntry:
        """The entry of one tensor; KeyError names it when absent."""
        try:
            return self._tensors[(name, kind, stack_index)]
        except KeyError:
            raise KeyError(f"no tensor {name!r} of kind {kind!r} in store version {self.version}") from None

    def has_tensor(self, name: str, kind: str = "weight", stack_index: int | None = None) -> bool:
        """Whether the manifest lists this tensor."""
        return (name, kind, stack_index) in self._tensors

    def chunk(self, layer: int, expert: int, kind: str = "weight") -> ChunkEntry:
        """The chunk of one expert; KeyError names it when absent."""
        try:
            return self._chunks[(layer, expert, kind)]
        except KeyError:
            raise KeyError(f"no expert {expert} of layer {layer} ({kind}) in store version {self.version}") from None

    def has_chunk(self, layer: int, expert: int, kind: str = "weight") -> bool:
        """Whether the manifest lists this expert chunk."""
        return (layer, expert, kind) in self._chunks

    def chunk_tensors(self, chunk: ChunkEntry) -> list[TensorEntry]:
        """The tensor entries of a chunk, in file order."""
        return [self._tensors[(n, chunk.kind, s)] for n, s in chunk.tensors]

    def file(self, name: str) -> FileEntry:
        """A side file's entry."""
        return self._files[name]

    def has_file(self, name: str) -> bool:
        """Whether a side file of that name is kept."""
        return name in self._files

    def expert_layers(self, kind: str = "weight") -> dict[int, int]:
        """layer -> number of experts, for layers that have expert chunks of this kind."""
        out: dict[int, int] = {}
        for c in self.chunks:
            if c.kind == kind:
                out[c.layer] = max(out.get(c.layer, 0), c.expert + 1)
        return dict(sorted(out.items()))

    def expert_bytes(self, kind: str = "weight") -> int:
        """What the experts of this kind take in memory: their chunk files, each tensor padded to a block."""
        return sum(c.bytes for c in self.chunks if c.kind == kind)

    def dense(self, kind: str = "weight") -> list[TensorEntry]:
        """Dense tensor entries of a kind, in manifest order."""
        return [t for t in self.tensors if t.group == "dense" and t.kind == kind]

    def referenced_files(self) -> set[str]:
        """Every store-relative path this version needs."""
        out = {t.file for t in self.tensors}
        out.update(c.file for c in self.chunks)
        out.update(f.file for f in self.files)
        return out

    # -- updates (used by the writer on a private copy) --------------------------------------
    def upsert(self, tensors: Iterable[TensorEntry] = (), chunks: Iterable[ChunkEntry] = (),
               files: Iterable[FileEntry] = ()) -> None:
        """Insert or replace entries by key, keeping first-insertion order (constant time per entry)."""
        if not hasattr(self, "_pos"):
            self._pos = ({t.key: i for i, t in enumerate(self.tensors)},
                         {c.key: i for i, c in enumerate(self.chunks)},
                         {f.name: i for i, f in enumerate(self.files)})
        for items, seq, index, pos in ((tensors, self.tensors, self._tensors, self._pos[0]),
                                       (chunks, self.chunks, self._chunks, self._pos[1]),
                                       (files, self.files, self._files, self._pos[2])):
            for item in items:
                k = item.name if isinstance(item, FileEntry) else item.key
                if k in pos:
                    seq[pos[k]] = item
                else:
                    pos[k] = len(seq)
                    seq.append(item)
                index[k] = item

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> str:
        """Serialise; stable key order so that equal manifests give equal text."""
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "version": self.version,
            "created": self.created,
            "model": self.model,
            # `quant` only where set: a store without compact weights reads as before
            "tensors": [{k: v for k, v in asdict(t).items() if k != "quant" or v is not None} for t in self.tensors],
            "chunks": [asdict(c) for c in self.chunks],
            "files": [asdict(f) for f in self.files],
        }
        return json.dumps(doc, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str) -> "Manifest":
        """Parse and check a manifest; NotAStoreError names `source` when it is not one."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise NotAStoreError(f"{source}: manifest is not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise NotAStoreError(f"{source}: not a semoe store manifest")
        if doc.get("format_version") != FORMAT_VERSION:
            raise NotAStoreError(
                f"{source}: store format version {doc.get('format_version')} is not supported "
                f"(this semoe reads version {FORMAT_VERSION})")
        try:
            m = cls(
                version=int(doc["version"]),
                created=str(doc.get("created", "")),
                model=dict(doc.get("model", {})),
                tensors=[TensorEntry(**t) for t in doc["tensors"]],
                chunks=[ChunkEntry(**{**c, "tensors": [tuple(x) for x in c["tensors"]]}) for c in doc["chunks"]],
                files=[FileEntry(**f) for f in doc["files"]],
            )
            for t in m.tensors:
                t.check()
        except (KeyError, TypeError, ValueError) as e:
            raise NotAStoreError(f"{source}: malformed manifest ({e})") from None
        return m
