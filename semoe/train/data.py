"""Training data: text files to memory-mapped token shards, and deterministic batches drawn from them.

On disk a shard set is a directory of `shard-00000.bin`, ... (raw little-endian token ids, uint16 or
uint32) plus `shards.json` (dtype, vocabulary, tokenizer, tokens and crc32c per shard). Documents
are concatenated, each followed by the tokenizer's EOS. A set is written into a hidden sibling
directory and renamed into place, so a reader sees a whole set or nothing.

`BatchSampler.batch(step)` is a pure function of (seed, step): resuming after a crash needs only
the step number. The default corpus is the running Python's standard library, which exists on
every machine and is the same for the same Python version.

Shape legend: B batch size, T sequence length.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import shutil
import sysconfig
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c
import numpy as np
import torch

from semoe.checkpoints.tokenizer import ByteTokenizer, Tokenizer
from storage.durable import fsync_path
from storage.errors import BadInputError

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (source bytes read so far, source bytes to read in all)

SHARDS_FILE = "shards.json"
FORMAT = "semoe-token-shards"
FORMAT_VERSION = 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
TEXT_SUFFIXES = (".txt", ".md", ".py")
# Test suites are huge and repetitive; config-*/ and _sysconfigdata* differ between machines.
_SKIPPED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                                  "turtledemo", "__pycache__"})
_PIECE_BYTES = 1 << 20  # files are tokenized in pieces of whole lines, so memory stays flat
_HASH_BUCKETS = 10_000


# ---------------------------------------------------------------------------------------------
# Corpus: which files, and which of them are held out


def stdlib_root() -> str:
    """Directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def default_corpus_files() -> list[str]:
    """The standard library's own `*.py` files (no tests, IDLE, lib2to3, turtledemo), sorted."""
    root = stdlib_root()
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_STDLIB_DIRS and not d.startswith("config-")]
        out.extend(os.path.join(dirpath, f) for f in files
                   if f.endswith(".py") and not f.startswith("_sysconfigdata"))
    return sorted(out, key=lambda p: _relpath(p, root))


def text_files(directory: str) -> list[str]:
    """`*.txt`, `*.md` and `*.py` files below `directory` (hidden directories skipped), sorted."""
    out = []
    for dirpath, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out.extend(os.path.join(dirpath, f) for f in files if f.endswith(TEXT_SUFFIXES))
    return sorted(out, key=lambda p: _relpath(p, directory))


def _relpath(path: str, root: str) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def split_files(files: Sequence[str], val_fraction: float = 0.05, seed: int = 0, *,
                root: str | None = None) -> tuple[list[str], list[str]]:
    """Split into (train, val) by a crc32 of each path relative to `root` (default: the common directory).

    The split depends only on relative paths and `seed`, not on order or machine. When hashing
    leaves a side empty, the file with the extreme hash moves over, so both sides are non-empty.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    if len(files) < 2:
        raise BadInputError(f"{files[0] if files else 'corpus'}: {len(files)} file(s); need at least 2 to "
                            "split into train and val")
    if root is None:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    rel = [_relpath(os.path.abspath(f), root) for f in files]
    # (bucket, relative path, path): ties between buckets break by name, never by input order
    scored = sorted((zlib.crc32(r.encode("utf-8"), seed & 0xFFFFFFFF) % _HASH_BUCKETS, r, f)
                    for r, f in zip(rel, files))
    cut = sum(1 for s in scored if s[0] < val_fraction * _HASH_BUCKETS)
    cut = min(max(cut, 1), len(scored) - 1)
    val = {f for _, _, f in scored[:cut]}
    return [f for f in files if f not in val], [f for f in files if f in val]


# ---------------------------------------------------------------------------------------------
# Writing shards


@dataclass(frozen=True)
class _Source:
    """A file, or the lines [first_line, end_line) of one, read as one document."""

    path: str
    first_line: int = 0
    end_line: int | None = None  # None: to the end of the file


def _pieces(src: _Source) -> Iterator[bytes]:
    """Raw bytes of `src` in pieces of whole lines (a newline byte never sits inside a UTF-8 character)."""
    buf: list[bytes] = []
    size = 0
    with open(src.path, "rb") as f:
        for i, line in enumerate(f):
            if i < src.first_line:
                continue
            if src.end_line is not None and i >= src.end_line:
                break
            buf.append(line)
            size += len(line)
            if size >= _PIECE_BYTES:
                yield b"".join(buf)
                buf, size = [], 0
    if buf:
        yield b"".join(buf)


def shard_dtype(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class _Meter:
    """Running byte count behind a `Progress` callback."""

    def __init__(self, total: int, fn: Progress | None) -> None:
        self.total, self.done, self.fn = total, 0, fn

    def add(self, n: int) -> None:
        self.done += n
        if self.fn is not None:
            self.fn(self.done, self.total)


class _ShardWriter:
    """Appends token arrays to shard files of `shard_tokens` tokens each, with a running crc32c."""

    def __init__(self, directory: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._f: Any = None
        self._n = 0
        self._crc = 0

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self._f is None:
                self._f = open(os.path.join(self.directory, f"shard-{len(self.shards):05d}.bin"), "wb")
                self._n, self._crc = 0, 0
            take = min(len(ids), self.shard_tokens - self._n)
            data = ids[:take].astype(self.dtype).tobytes()
            self._f.write(data)
            self._crc = _crc32c.crc32c(data, value=self._crc)
            self._n += take
            ids = ids[take:]
            if self._n == self.shard_tokens:
                self.finish()

    def finish(self) -> None:
        """Close the open shard (fsynced) and record it."""
        if self._f is None:
            return
        f, self._f = self._f, None
        try:
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()
        self.shards.append({"file": os.path.basename(f.name), "tokens": self._n, "crc32c": self._crc})

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    if type(tokenizer) is ByteTokenizer:  # skips a Python list of one int per byte; subclasses may differ
        return np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8)
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def _check_target(out_dir: str) -> None:
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise BadInputError(f"{out_dir}: expected an absent or empty directory to write shards into")


@contextlib.contextmanager
def _staged(out_dir: str) -> Iterator[str]:
    """A hidden sibling of `out_dir` to write into; renamed onto `out_dir` on success, removed on failure."""
    _check_target(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would otherwise become the final directory's mode
        yield tmp
        _check_target(out_dir)  # refuse to replace what someone wrote meanwhile
        os.replace(tmp, out_dir)  # POSIX rename replaces an empty directory atomically
        fsync_path(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_set(sources: Sequence[_Source], directory: str, tokenizer: Tokenizer, *, shard_tokens: int,
               dtype: str | None, meter: _Meter, source: str) -> None:
    """Tokenize `sources` into shards plus shards.json inside `directory` (which exists and is empty)."""
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    dtype = dtype or shard_dtype(tokenizer.vocab_size)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if tokenizer.vocab_size > np.iinfo(DTYPES[dtype]).max + 1:
        raise ValueError(f"dtype {dtype} cannot hold vocab_size {tokenizer.vocab_size}")
    if tokenizer.eos_id is None:
        raise BadInputError(f"{tokenizer!r}: no EOS token, and shards separate documents with it")
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    writer = _ShardWriter(directory, DTYPES[dtype], shard_tokens)
    try:
        for src in sources:
            for raw in _pieces(src):
                ids = _encode(tokenizer, raw.decode("utf-8", errors="replace"))
                if len(ids) and int(ids.max()) >= tokenizer.vocab_size:
                    raise ValueError(f"{tokenizer!r} gave id {int(ids.max())} >= its vocab_size "
                                     f"{tokenizer.vocab_size} on {src.path}")
                writer.write(ids)
                meter.add(len(raw))
            writer.write(eos)
        writer.finish()
    finally:
        writer.abort()
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype, "vocab_size": tokenizer.vocab_size,
            "tokenizer": tokenizer.kind, "tokenizer_fingerprint": tokenizer.fingerprint,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "source": source,
            "num_files": len({s.path for s in sources}), "num_documents": len(sources),
            "num_tokens": sum(s["tokens"] for s in writer.shards), "shards": writer.shards}
    with open(os.path.join(directory, SHARDS_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(directory)
    log.info("%s: %d tokens in %d shard(s) from %d document(s)", source or directory, meta["num_tokens"],
             len(writer.shards), len(sources))


def build_shards(files: Sequence[str], out_dir: str, tokenizer: Tokenizer, *, shard_tokens: int = 1 << 24,
                 dtype: str | None = None, progress: Progress | None = None, source: str = "") -> ShardSet:
    """Tokenize `files` (one document each, EOS after each) into a new shard set at `out_dir`.

    `out_dir` must be absent or empty; it appears whole or not at all. `dtype` defaults to the
    narrowest that holds the vocabulary. Bytes that are not UTF-8 become U+FFFD.
    """
    if not files:
        raise BadInputError(f"{out_dir}: no files to tokenize")
    meter = _Meter(sum(os.path.getsize(f) for f in files), progress)
    with _staged(out_dir) as tmp:
        _write_set([_Source(f) for f in files], tmp, tokenizer, shard_tokens=shard_tokens, dtype=dtype,
                   meter=meter, source=source)
    return ShardSet.open(out_dir)


# ---------------------------------------------------------------------------------------------
# Reading shards


class ShardSet:
    """A shard set (or a token range of one) as one long read-only array of token ids."""

    def __init__(self, directory: str, meta: dict[str, Any], arrays: list[np.ndarray], *, start: int = 0,
                 stop: int | None = None) -> None:
        self.directory = directory
        self.meta = meta
        self._arrays = arrays
        self._offsets = np.cumsum([0] + [len(a) for a in arrays]).tolist()  # start of each shard
        self._start = start
        self._stop = self._offsets[-1] if stop is None else stop

    @classmethod
    def open(cls, directory: str) -> ShardSet:
        """Memory-map the shards of `directory`, checking each file's size against `shards.json`."""
        path = os.path.join(directory, SHARDS_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
        except FileNotFoundError as e:
            raise BadInputError(f"{directory}: no {SHARDS_FILE}; expected a directory of token shards") from e
        except (OSError, ValueError) as e:
            raise BadInputError(f"{path}: not readable JSON ({e})") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("dtype") not in DTYPES:
            raise BadInputError(f"{path}: not a {FORMAT} file with dtype one of {', '.join(DTYPES)}")
        dtype = DTYPES[meta["dtype"]]
        arrays = []
        for shard in meta.get("shards", []):
            if not (isinstance(shard, dict) and isinstance(shard.get("file"), str)
                    and os.path.basename(shard["file"]) == shard["file"] and isinstance(shard.get("tokens"), int)
                    and isinstance(shard.get("crc32c"), int)):
                raise BadInputError(f"{path}: bad shard entry {shard!r}; expected file, tokens and crc32c")
            shard_path = os.path.join(directory, shard["file"])
            expected = shard["tokens"] * dtype.itemsize
            size = os.path.getsize(shard_path) if os.path.isfile(shard_path) else None
            if size != expected:
                raise BadInputError(f"{shard_path}: {'missing' if size is None else f'{size} bytes'}, expected "
                                    f"{expected} bytes ({shard['tokens']} {meta['dtype']} tokens)")
            arrays.append(np.memmap(shard_path, dtype=dtype, mode="r"))
        if sum(len(a) for a in arrays) != meta.get("num_tokens"):
            raise BadInputError(f"{path}: num_tokens {meta.get('num_tokens')} is not the sum of its shards")
        return cls(directory, meta, arrays)

    @property
    def num_tokens(self) -> int:
        return self._stop - self._start

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def dtype(self) -> np.dtype:
        return DTYPES[self.meta["dtype"]]

    def tokens(self, start: int, length: int) -> np.ndarray:
        """A copy of tokens [start, start + length), crossing shard boundaries as needed."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {self.num_tokens})")
        pos = start + self._start
        out = np.empty(length, dtype=self.dtype)
        i = bisect.bisect_right(self._offsets, pos) - 1
        done = 0
        while done < length:
            within = pos + done - self._offsets[i]
            take = min(length - done, len(self._arrays[i]) - within)
            out[done:done + take] = self._arrays[i][within:within + take]
            done += take
            i += 1
        return out

    def slice(self, start: int, stop: int) -> ShardSet:
        """The tokens [start, stop) of this set as a set of its own (no copy)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"slice [{start}, {stop}) outside [0, {self.num_tokens}]")
        return ShardSet(self.directory, self.meta, self._arrays, start=self._start + start,
                        stop=self._start + stop)

    def verify(self) -> None:
        """Recompute every shard's crc32c (reads all of it); raise BadInputError on a mismatch."""
        for shard, arr in zip(self.meta["shards"], self._arrays):
            if _crc32c.crc32c(memoryview(arr).cast("B")) != shard["crc32c"]:
                raise BadInputError(f"{os.path.join(self.directory, shard['file'])}: crc32c mismatch; the "
                                    "shard is corrupt")

    def __repr__(self) -> str:
        return f"ShardSet({self.directory!r}, num_tokens={self.num_tokens})"


# ---------------------------------------------------------------------------------------------
# Batches


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wraps modulo 2**64): a fixed bijection, unlike library RNG streams."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class BatchSampler:
    """Random windows of a shard set: `batch(step)` depends only on (seed, step).

    Window starts come from a splitmix64 hash of (seed, step, row) rather than a library RNG, whose
    streams may change between versions; so a run resumed at step s sees exactly the batches it
    would have seen, on any machine.
    """

    def __init__(self, shards: ShardSet, batch_size: int, seq_len: int, seed: int = 0) -> None:
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(seed, int) or not 0 <= seed < 1 << 64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        if shards.num_tokens < seq_len + 1:
            raise BadInputError(f"{shards.directory}: {shards.num_tokens} tokens, fewer than seq_len + 1 = "
                                f"{seq_len + 1}")
        self.shards, self.batch_size, self.seq_len, self.seed = shards, batch_size, seq_len, seed

    def starts(self, step: int) -> np.ndarray:
        """Start offsets (B,) of the windows of batch `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        with np.errstate(over="ignore"):
            key = _mix64(_mix64(np.array([self.seed], dtype=np.uint64)) ^ np.uint64(step))
            rows = _mix64(key + np.arange(self.batch_size, dtype=np.uint64))
        return (rows % np.uint64(self.shards.num_tokens - self.seq_len)).astype(np.int64)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_BT, targets_BT) int64; targets are the inputs shifted left by one token."""
        windows = np.stack([self.shards.tokens(int(s), self.seq_len + 1) for s in self.starts(step)])
        windows_BT1 = torch.from_numpy(windows.astype(np.int64))
        return windows_BT1[:, :-1].contiguous(), windows_BT1[:, 1:].contiguous()


# ---------------------------------------------------------------------------------------------
# From a command-line spec to (train, val)


def _count_lines(path: str) -> int:
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(_PIECE_BYTES):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def _split_lines(path: str, val_fraction: float) -> tuple[list[_Source], list[_Source]]:
    """One file cannot be split by name: its last lines are held out instead."""
    n = _count_lines(path)
    if n < 2:
        raise BadInputError(f"{path}: {n} line(s); need at least 2 to split into train and val")
    cut = n - min(max(1, round(n * val_fraction)), n - 1)
    return [_Source(path, 0, cut)], [_Source(path, cut, None)]


def _plan(spec: str | None, val_fraction: float, seed: int) -> tuple[str, list[_Source], list[_Source]]:
    """(source label, train sources, val sources) for a corpus spec."""
    if spec is None:
        files = default_corpus_files()
        train, val = split_files(files, val_fraction, seed, root=stdlib_root())
        return f"python-stdlib-{sysconfig.get_python_version()}", [_Source(f) for f in train], \
            [_Source(f) for f in val]
    label = os.path.abspath(spec)
    if os.path.isfile(spec):
        return (label, *_split_lines(spec, val_fraction))
    if os.path.isdir(spec):
        files = text_files(spec)
        if not files:
            raise BadInputError(f"{spec}: no {', '.join('*' + s for s in TEXT_SUFFIXES)} files and no "
                                f"{SHARDS_FILE}")
        if len(files) == 1:
            return (label, *_split_lines(files[0], val_fraction))
        train, val = split_files(files, val_fraction, seed, root=spec)
        return label, [_Source(f) for f in train], [_Source(f) for f in val]
    raise BadInputError(f"{spec}: no such file or directory; expected a text file, a directory of text files "
                        "or a directory of shards")


def eval_documents(spec: str | None = None, *, val_fraction: float = 0.05,
                   seed: int = 0) -> list[Iterator[str]]:
    """Documents to evaluate on, each a lazy iterator of text pieces of whole lines (as shards tokenize them).

    `spec` None: the default corpus's validation split (the files `prepare_data` holds out); a text
    file: that file, whole; a directory: its `*.txt`, `*.md` and `*.py` files, whole.
    """
    if spec is None:
        sources = _plan(None, val_fraction, seed)[2]
    elif os.path.isfile(spec):
        sources = [_Source(spec)]
    elif os.path.isdir(spec):
        files = text_files(spec)
        if not files:
            raise BadInputError(f"{spec}: no {', '.join('*' + s for s in TEXT_SUFFIXES)} files to evaluate on")
        sources = [_Source(f) for f in files]
    else:
        raise BadInputError(f"{spec}: no such file or directory; expected a text file or a directory of text files")
    return [(raw.decode("utf-8", errors="replace") for raw in _pieces(src)) for src in sources]


def _check_matches(sets: Sequence[ShardSet], tokenizer: Tokenizer, source: str | None) -> None:
    for s in sets:
        where = os.path.join(s.directory, SHARDS_FILE)
        if s.meta.get("tokenizer_fingerprint") != tokenizer.fingerprint or s.vocab_size != tokenizer.vocab_size:
            raise BadInputError(f"{where}: built with tokenizer {s.meta.get('tokenizer_fingerprint')} (vocab "
                                f"{s.vocab_size}), not {tokenizer.fingerprint} (vocab {tokenizer.vocab_size})")
        if source is not None and s.meta.get("source") != source:
            raise BadInputError(f"{where}: shards of {s.meta.get('source')!r}, not of {source!r}; use another "
                                "output directory")


def _open_pair(directory: str) -> tuple[ShardSet, ShardSet] | None:
    """The train/ and val/ sets under `directory`, or None when it holds no such pair."""
    if all(os.path.isfile(os.path.join(directory, p, SHARDS_FILE)) for p in ("train", "val")):
        return ShardSet.open(os.path.join(directory, "train")), ShardSet.open(os.path.join(directory, "val"))
    return None


def prepare_data(spec: str | None, out_dir: str, tokenizer: Tokenizer, *, val_fraction: float = 0.05,
                 seed: int = 0, shard_tokens: int = 1 << 24,
                 progress: Progress | None = None) -> tuple[ShardSet, ShardSet]:
    """(train, val) shard sets for a corpus spec, building them under `out_dir` when needed.

    `spec`: None for the standard library; a text file (its last lines become val); a directory of
    text files (split by path hash); or a directory holding `train/` and `val/` shard sets, or one
    `shards.json` (its last `val_fraction` of tokens become val), used as is. Sets built earlier
    under `out_dir` from the same spec and tokenizer are reused.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    if spec is not None and os.path.isdir(spec):
        pair = _open_pair(spec)
        if pair is not None:
            _check_matches(pair, tokenizer, None)
            return pair
        if os.path.isfile(os.path.join(spec, SHARDS_FILE)):
            whole = ShardSet.open(spec)
            _check_matches([whole], tokenizer, None)
            cut = whole.num_tokens - min(max(1, round(whole.num_tokens * val_fraction)), whole.num_tokens - 1)
            return whole.slice(0, cut), whole.slice(cut, whole.num_tokens)
    source, train_src, val_src = _plan(spec, val_fraction, seed)
    if os.path.isdir(out_dir) and (pair := _open_pair(out_dir)) is not None:
        _check_matches(pair, tokenizer, source)
        log.info("%s: reusing shards of %s", out_dir, source)
        return pair
    files = sorted({s.path for s in train_src + val_src})
    meter = _Meter(sum(os.path.getsize(f) for f in files), progress)
    with _staged(out_dir) as tmp:
        for part, sources in (("train", train_src), ("val", val_src)):
            os.mkdir(os.path.join(tmp, part))
            _write_set(sources, os.path.join(tmp, part), tokenizer, shard_tokens=shard_tokens, dtype=None,
                       meter=meter, source=source)
        fsync_path(tmp)
    pair = _open_pair(out_dir)
    if pair is None:  # cannot happen unless out_dir was removed right after the rename
        raise BadInputError(f"{out_dir}: shards vanished after being written")
    return pair
