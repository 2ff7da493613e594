"""Decoding on CPU in a process without torch: a store's model through the compiled kernels, its
experts read from storage as the router picks them, into a cache of fixed slots.

Why: where memory is shorter than the model, every byte a process holds besides its expert cache
is expert data it must read again. torch's runtime alone holds about 0.15 GiB of anonymous memory
once imported (its operator tables and Python modules), which no eviction gives back: on the 3 GB
bench model that is half of the memory at 4-bit and 50%, and more than all of it at 4-bit and 25%.
This runner decodes with the same kernels as the engine's one-call step (semoe/kernels/
decode_step.c, in parts: `decode_attend`, then the chosen experts, `decode_ffn`; `decode_head`),
over buffers of its own (numpy, ctypes), and imports no torch, so that memory goes to the cache.

What it holds: the dense weights (attention, routers, norms, lm_head), float32 or bfloat16 as
stored, or int8 quantized at load with the arithmetic of `storage.quant` (`dense="auto"`: int8
beside int8/int4 experts, as the engine); the token embedding stays on storage, one row read per
token; the experts' chunks, as stored (float32, bfloat16, int8 or int4 codes), in `cache_bytes` of
slots, evicted by the engine's next-use policy, missing ones read with O_DIRECT (a chunk's pieces
in parallel) and checked against the manifest's crc32c.

What it takes: the models the one-call step takes (`DecodePlan`'s whole step): grouped-query
attention without q/k norms, clipping, sinks or partial/interleaved rotary (sliding windows and
YaRN included); softmax-top-k routers over SwiGLU experts without shared experts, or dense
SwiGLU layers; greedy decoding, one sequence. Anything else is refused with one line naming it
(`NotOnFastPath`); the engine (`inference.engine`) runs every model.

Its logits are the one-call step's: the same kernels on the same weights, except the rotary tables
(numpy's cos/sin against torch's, to float32 rounding) and the prompt, which goes through the step
token by token rather than as one batch.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import time
from dataclasses import dataclass, field

import numpy as np

from semoe import kernel_abi
from semoe.decode import rope
from semoe.decode.support import NotOnFastPath, one_call_refusal
from semoe.hf_config import config_from_json
from semoe.hf_names import hf_name
from semoe.tokenizer import TOKENIZER_FILES, HFTokenizer, checked_vocab, default_stop_ids
from storage.crc import crc32c
from storage.errors import BadInputError, CorruptTensorError
from storage.formats import INT8_MAX, QUANTIZE_ROWS
from storage.fileio import ALIGN, ChunkReader, ChunkReaderConfig, ReadMode, ReadRequest
from storage.policies import NextUsePolicy
from storage.procmem import peak_rss_bytes

MANIFEST = "manifest.json"
DENSE_CHOICES = ("auto", "float", "int8")
_KIND = {"F32": kernel_abi.W_F32, "BF16": kernel_abi.W_BF16, "int8": kernel_abi.W_INT8, "int4": kernel_abi.W_INT4}
# an expert's parts by the HuggingFace names' last part: gate, up, down
_PARTS = {"gate": ("w1.weight", "gate_proj.weight"), "up": ("w3.weight", "up_proj.weight"),
          "down": ("w2.weight", "down_proj.weight")}


@dataclass(kw_only=True)
class LeanConfig:
    """How the lean runner holds a model."""

    cache_bytes: int  # the expert cache's slots, in bytes (at least top_k chunks); 0: top_k chunks
    dense: str = "auto"  # one of DENSE_CHOICES
    threads: int = 0  # compute threads; 0: every core this process may run on
    read_mode: ReadMode | str = ReadMode.DIRECT
    read_threads: int = 4

    def __post_init__(self) -> None:
        if self.dense not in DENSE_CHOICES:
            raise BadInputError(f"dense must be one of {', '.join(DENSE_CHOICES)}, got {self.dense!r}")
        self.read_mode = ReadMode(self.read_mode)
        if self.threads <= 0:
            self.threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class LeanResult:
    """A generation: the new tokens, their log-probabilities, time to the first token and decode speed
    (from the first new token on), and the runner's counters."""

    tokens: list[int]
    logprobs: list[float]
    ttft_s: float
    decode_tok_s: float
    stats: dict = field(default_factory=dict)


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def quantize_int8_rows(w_OI: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes (O, I) and float32 scales (O,) of float32 rows: `storage.quant`'s int8 scheme, the
    same float32 operations in the same order (tests compare the bits with it)."""
    scale = np.maximum(-w_OI.min(axis=1), w_OI.max(axis=1)) / np.float32(INT8_MAX)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    codes = np.clip(np.rint(w_OI / scale[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return codes, scale


def expert_bytes(path: str) -> int:
    """Bytes of a store's expert chunks (what every expert takes in the cache)."""
    return sum(c["bytes"] for c in _Store(path).chunks.values())


class _Store:
    """A store's manifest and files, read without the `storage.store` machinery (which imports torch)."""

    def __init__(self, root: str) -> None:
        self.root = root
        path = os.path.join(root, MANIFEST)
        try:
            with open(path, "rb") as f:
                m = json.loads(f.read())
        except FileNotFoundError:
            raise BadInputError(f"{root}: not a store (no {MANIFEST}); the lean runner reads stores only "
                                f"(`semoe store import` makes one)") from None
        except ValueError as e:
            raise BadInputError(f"{path}: not readable JSON ({e})") from None
        if m.get("format") != "semoe-store":
            raise BadInputError(f"{path}: format {m.get('format')!r}, expected 'semoe-store'")
        self.tensors = {t["name"]: t for t in m["tensors"] if t.get("kind", "weight") == "weight"}
        self.chunks = {(c["layer"], c["expert"]): c for c in m["chunks"] if c.get("kind", "weight") == "weight"}
        self.files = {f["name"]: f for f in m["files"]}

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def read_file(self, name: str) -> bytes:
        entry = self.files[name]
        with open(self.path(entry["file"]), "rb") as f:
            data = f.read()
        if crc32c(data) != entry["crc32c"]:
            raise CorruptTensorError(f"{self.path(entry['file'])}: crc32c mismatch for side file {name}",
                                     path=self.path(entry["file"]))
        return data

    def tensor(self, name: str) -> dict:
        try:
            return self.tensors[name]
        except KeyError:
            raise BadInputError(f"{self.root}: the store holds no tensor {name}") from None

    def rows(self, name: str, block: int = QUANTIZE_ROWS):
        """A dense 2-d tensor as float32 blocks of its rows, read in turn (never whole in memory), its
        crc32c checked at the end."""
        t = self.tensor(name)
        if t.get("quant"):
            raise NotOnFastPath(f"{self.root}: dense tensor {name} is stored {t['quant'].get('scheme')}; the lean "
                                  f"runner reads float dense weights")
        O, I = t["shape"]
        item = {"F32": 4, "BF16": 2}.get(t["dtype"])
        if item is None:
            raise NotOnFastPath(f"{self.root}: dense tensor {name} is {t['dtype']}; the lean runner reads F32 or BF16")
        path, crc = self.path(t["file"]), 0
        with open(path, "rb", buffering=0) as f:
            for r in range(0, O, block):
                n = min(block, O - r)
                raw = os.pread(f.fileno(), n * I * item, t["offset"] + r * I * item)
                if len(raw) != n * I * item:
                    raise CorruptTensorError(f"{path}: shorter than the manifest records for {name}", tensor=name,
                                             path=path)
                crc = crc32c(raw, crc)
                a = np.frombuffer(raw, dtype=np.float32 if item == 4 else np.uint16).reshape(n, I)
                yield a if item == 4 else _bf16_to_f32(a)
        if crc != t["crc32c"]:
            raise CorruptTensorError(f"{path}: crc32c mismatch for {name}", tensor=name, path=path)


class _ExpertSlots:
    """The expert cache: `n` slots of one chunk's bytes in one anonymous mapping (page-aligned, for
    O_DIRECT), filled by reads of the missing chunks and evicted by next use."""

    def __init__(self, store: _Store, n: int, slot_bytes: int, reader: ChunkReader) -> None:
        self.store, self.n, self.slot_bytes, self.reader = store, n, slot_bytes, reader
        self.mem = mmap.mmap(-1, n * slot_bytes)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        self.view = memoryview(self.mem)
        self.free = list(range(n - 1, -1, -1))
        self.where: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot
        self.policy = NextUsePolicy()
        self.hits = self.misses = self.read_bytes = 0
        self.read_s = 0.0

    def ensure(self, layer: int, experts: list[int]) -> list[int]:
        """The slots of these experts of `layer`, reading the missing ones (all at once)."""
        keys = [(layer, e) for e in experts]
        missing = [k for k in dict.fromkeys(keys) if k not in self.where]
        for k in keys:
            if k in self.where:
                self.hits += 1
        reqs = []
        for k in missing:
            if not self.free:
                victim = self.policy.victim([c for c in self.where if c not in keys])
                self.policy.on_remove(victim)
                self.free.append(self.where.pop(victim))
            slot = self.free.pop()
            chunk = self.store.chunks[k]
            tensors = [self.store.tensors[name] for name, _ in chunk["tensors"]]
            buf = self.view[slot * self.slot_bytes:slot * self.slot_bytes + chunk["bytes"]]
            reqs.append((k, slot, chunk, tensors, ReadRequest(path=self.store.path(chunk["file"]), buf=buf,
                                                              nbytes=chunk["bytes"],
                                                              checks=[(t["offset"], t["bytes"]) for t in tensors])))
        if reqs:
            t0 = time.perf_counter()
            try:
                crcs = self.reader.read_many([r[-1] for r in reqs])
            except BaseException:
                self.free.extend(slot for _, slot, *_ in reqs)
                raise
            self.read_s += time.perf_counter() - t0
            for (k, slot, chunk, tensors, req), got in zip(reqs, crcs):
                bad = [t["name"] for t, c in zip(tensors, got) if c != t["crc32c"]]
                if bad:
                    self.free.append(slot)
                    raise CorruptTensorError(f"{req.path}: crc32c mismatch for {bad[0]}", tensor=bad[0], path=req.path)
                self.where[k] = slot
                self.policy.on_insert(k)
                self.misses += 1
                self.read_bytes += chunk["bytes"]
        for k in keys:
            self.policy.on_access(k)
        return [self.where[k] for k in keys]


class LeanModel:
    """A store's model held for lean decoding (see the module docstring); `close` frees it."""

    def __init__(self, path: str, config: LeanConfig) -> None:
        lib = kernel_abi.library()
        if lib is None:
            raise NotOnFastPath(f"--lean computes with semoe's compiled CPU kernels alone, which are "
                                  f"{kernel_abi.status()}; run without --lean")
        self.lib, self.settings = lib, config
        self.store = store = _Store(path)
        if "config.json" not in store.files:
            raise BadInputError(f"{path}: the store holds no model (no config.json)")
        self.config = c = config_from_json(json.loads(store.read_file("config.json")))
        self._check(c)
        self.held: list = []  # what the Net's pointers point into
        self.tokenizer = None
        if "tokenizer.json" in store.files:
            files = {n: store.read_file(n) for n in TOKENIZER_FILES if n in store.files}
            self.tokenizer = checked_vocab(HFTokenizer(files=files, where=f"{path} (store)"), c.vocab_size)
        L, E, K = c.num_layers, c.num_experts, max(c.top_k, 1)
        moe_layers = sorted({lay for lay, _ in store.chunks})
        kinds = {t["quant"]["scheme"] if t.get("quant", {}).get("scheme") else t["dtype"]
                 for ch in store.chunks.values() for t in (store.tensors[n] for n, _ in ch["tensors"])
                 if "scales_of" not in t.get("quant", {})}
        dense = config.dense
        if dense == "auto":
            dense = "int8" if kinds & {"int8", "int4"} else "float"
        self.dense = dense
        layers = (kernel_abi.LayerC * L)()
        self.experts_of: dict[int, ctypes.Array] = {}
        F = 0
        for lay in range(L):
            lc = layers[lay]
            lc.attn_norm, lc.attn_eps = self._vector(f"layers.{lay}.attn_norm.weight"), c.rms_norm_eps
            lc.ffn_norm, lc.ffn_eps = self._vector(f"layers.{lay}.ffn_norm.weight"), c.rms_norm_eps
            lc.n_qkv = 1
            lc.window = c.window(lay) or 0
            lc.qkv[0] = self._linear([f"layers.{lay}.attn.{p}_proj" for p in "qkv"], dense)
            lc.o = self._linear([f"layers.{lay}.attn.o_proj"], dense)
            if lay in moe_layers:
                lc.E = E
                lc.router = self._linear([f"layers.{lay}.ffn.router"], "float", bias=False)
                arr = (kernel_abi.Expert * E)()
                self.experts_of[lay] = arr
                lc.experts = arr
                F = max(F, self._chunk_parts(lay, 0)[0][2])
            else:
                ex = kernel_abi.Expert(*(self._linear([f"layers.{lay}.ffn.{p}_proj"], dense, bias=False)
                                         for p in ("gate", "up", "down")))
                arr = (kernel_abi.Expert * 1)(ex)
                self.held.append(arr)
                lc.E, lc.experts = 0, arr
                F = max(F, ex.gate.O)
        head = "embed.weight" if c.tie_embeddings else "lm_head.weight"
        self.head = self._linear([head.removesuffix(".weight")], dense, bias=False, name=hf_name(c, head))
        self.norm = self._vector("norm.weight")
        self.net = kernel_abi.Net(L, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, F, E if moe_layers else 0,
                                  K, int(bool(c.norm_topk_prob)), c.head_dim ** -0.5, c.rms_norm_eps, self.norm, layers,
                                  self.head)
        self.layers = layers
        # the expert cache: every layer's experts present, of one layout
        for lay in moe_layers:
            missing = [e for e in range(E) if (lay, e) not in store.chunks]
            if missing:
                raise BadInputError(f"{path}: layer {lay} has no chunk for expert {missing[0]} (of {E})")
        self._parts = {lay: self._chunk_parts(lay, 0) for lay in moe_layers}
        for (lay, e) in store.chunks:
            if self._chunk_parts(lay, e) != self._parts[lay]:
                raise NotOnFastPath(f"{path}: layer {lay}'s expert {e} is laid out unlike its expert 0")
        sizes = {ch["bytes"] for ch in store.chunks.values()}
        self.slot_bytes = -(-max(sizes) // ALIGN) * ALIGN if sizes else ALIGN
        slots = config.cache_bytes // self.slot_bytes if config.cache_bytes else K
        if moe_layers and slots < K:
            raise BadInputError(f"--cpu-cache: {config.cache_bytes} bytes hold {slots} of this model's expert chunks "
                                f"({self.slot_bytes} bytes each); decoding needs at least top_k = {K}, "
                                f"{K * self.slot_bytes} bytes")
        self._structs: dict[tuple[int, int], kernel_abi.Expert] = {}
        self._pointed: dict[int, dict[int, int]] = {lay: {} for lay in moe_layers}  # layer -> expert -> slot
        # rotary frequencies (plain or YaRN) and the scale of cos and sin, as the model's modules take them
        self.inv_freq, self.rope_scale = rope.inv_freq(c)
        # the embedding stays on storage: one row a token
        emb = store.tensor(hf_name(c, "embed.weight"))
        if emb["dtype"] not in ("F32", "BF16") or emb.get("quant"):
            raise NotOnFastPath(f"{path}: the token embedding is {emb['dtype']}; the lean runner reads F32 or BF16")
        self._emb = emb
        self._emb_fd = os.open(store.path(emb["file"]), os.O_RDONLY)
        self.reader = ChunkReader(ChunkReaderConfig(mode=config.read_mode, threads=config.read_threads))
        self.cache = _ExpertSlots(store, max(slots, 1), self.slot_bytes, self.reader)

    @staticmethod
    def _check(c) -> None:
        """Refuse, in one line, what the one-call step does not take (`semoe.decode.support`)."""
        why = one_call_refusal(c)
        if why:
            raise NotOnFastPath(f"the lean runner does not take {why} ({c.arch}); decode it with the engine "
                                f"(without --lean)")

    def _vector(self, param: str) -> int:
        """A float32 copy of a 1-d parameter (a norm's weight), held; its address."""
        a = self._read_1d(hf_name(self.config, param))
        self.held.append(a)
        return a.ctypes.data

    def _read_1d(self, name: str) -> np.ndarray:
        t = self.store.tensor(name)
        if len(t["shape"]) != 1 or t["dtype"] not in ("F32", "BF16") or t.get("quant"):
            raise NotOnFastPath(f"{self.store.root}: {name} is {t['dtype']} {t['shape']}; expected a float vector")
        path = self.store.path(t["file"])
        raw = np.fromfile(path, dtype=np.uint8, count=t["bytes"], offset=t["offset"])
        if len(raw) != t["bytes"] or crc32c(raw) != t["crc32c"]:
            raise CorruptTensorError(f"{path}: crc32c mismatch for {name}", tensor=name, path=path)
        a = raw.view(np.float32) if t["dtype"] == "F32" else _bf16_to_f32(raw.view(np.uint16))
        return np.ascontiguousarray(a, dtype=np.float32)

    def _linear(self, modules: list[str], dense: str, *, bias: bool = True, name: str | None = None
                ) -> kernel_abi.Lin:
        """One product over the rows of these linear modules stacked (q, k and v: one), as the engine's
        dense weights: int8 quantized here, or float as stored."""
        c = self.config
        names = [name] if name else [hf_name(c, f"{m}.weight") for m in modules]
        shapes = [self.store.tensor(n)["shape"] for n in names]
        I = shapes[0][1]
        if any(s[1] != I for s in shapes):
            raise NotOnFastPath(f"{names}: products of different input sizes")
        O = sum(s[0] for s in shapes)
        if dense == "int8":
            codes, scales = np.empty((O, I), np.int8), np.empty(O, np.float32)
            r = 0
            for n in names:
                for block in self.store.rows(n):
                    codes[r:r + len(block)], scales[r:r + len(block)] = quantize_int8_rows(block)
                    r += len(block)
            self.held += [codes, scales]
            lin = kernel_abi.Lin(kernel_abi.W_INT8, O, I, 0, codes.ctypes.data, scales.ctypes.data, None)
        else:
            dtypes = {self.store.tensor(n)["dtype"] for n in names}
            if dtypes == {"BF16"}:
                w = np.empty((O, I), np.uint16)
                r = 0
                for n in names:
                    t = self.store.tensor(n)
                    raw = np.fromfile(self.store.path(t["file"]), np.uint16, count=t["bytes"] // 2, offset=t["offset"])
                    if raw.nbytes != t["bytes"] or crc32c(raw) != t["crc32c"]:
                        raise CorruptTensorError(f"{self.store.path(t['file'])}: crc32c mismatch for {n}", tensor=n)
                    w[r:r + t["shape"][0]] = raw.reshape(t["shape"])
                    r += t["shape"][0]
                kind = kernel_abi.W_BF16
            else:  # float32, filled block by block (the weight is never in memory twice)
                w = np.empty((O, I), np.float32)
                r = 0
                for n in names:
                    for block in self.store.rows(n):
                        w[r:r + len(block)] = block
                        r += len(block)
                kind = kernel_abi.W_F32
            self.held.append(w)
            lin = kernel_abi.Lin(kind, O, I, 0, w.ctypes.data, None, None)
        if bias:
            bnames = [hf_name(c, f"{m}.bias") for m in modules]
            have = [n in self.store.tensors for n in bnames]
            if any(have):
                parts = [self._read_1d(n) if h else np.zeros(s[0], np.float32)
                         for n, h, s in zip(bnames, have, shapes)]
                b = np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)
                self.held.append(b)
                lin.bias = b.ctypes.data
        return lin

    def _chunk_parts(self, layer: int, expert: int) -> list[tuple]:
        """(kind, group, O, I, codes offset, scales offset or -1) of gate, up and down within the
        layer's expert chunks (every expert of a layer has the same layout)."""
        chunk = self.store.chunks[(layer, expert)]
        tensors = [self.store.tensors[n] for n, _ in chunk["tensors"]]
        scales = {t["quant"]["scales_of"]: t for t in tensors if "scales_of" in t.get("quant", {})}
        out = []
        for part, suffixes in _PARTS.items():
            t = next((t for t in tensors if t["name"].endswith(suffixes) and "scales_of" not in t.get("quant", {})),
                     None)
            if t is None:
                raise NotOnFastPath(f"{self.store.root}: layer {layer}'s experts have no {part} weight "
                                      f"({' or '.join(suffixes)})")
            q = t.get("quant") or {}
            scheme = q.get("scheme") or t["dtype"]
            if scheme not in _KIND or q.get("transposed"):
                raise NotOnFastPath(f"{self.store.root}: expert weight {t['name']} is {scheme}; the lean runner "
                                      f"takes F32, BF16, int8 and int4")
            O, I = q["shape"] if q else t["shape"]
            s = scales.get(t["name"])
            out.append((_KIND[scheme], q.get("group_size") or 0 if scheme == "int4" else 0, O, I, t["offset"],
                        s["offset"] if s else -1))
        if out[0][:4] != out[1][:4]:
            raise NotOnFastPath(f"{self.store.root}: layer {layer}'s gate and up weights differ in kind or shape")
        return out

    def _point(self, layer: int, expert: int, slot: int) -> None:
        """Point the layer's entry for `expert` at the chunk in `slot` (a struct made once per layer
        and slot)."""
        if self._pointed[layer].get(expert) == slot:
            return
        ex = self._structs.get((layer, slot))
        if ex is None:
            base = self.cache.base + slot * self.slot_bytes
            ex = self._structs[(layer, slot)] = kernel_abi.Expert(*(
                kernel_abi.Lin(kind, O, I, g, base + off, base + soff if soff >= 0 else None, None)
                for kind, g, O, I, off, soff in self._parts[layer]))
        self.experts_of[layer][expert] = ex
        self._pointed[layer][expert] = slot

    def rope(self, pos: int, cos: np.ndarray, sin: np.ndarray) -> None:
        """The rotary tables (head_dim) of position `pos` into cos and sin: `semoe.attention.rope_tables`'
        float32 operations, with numpy's cos and sin (torch's may differ in the last bit)."""
        f = np.float32(pos) * self.inv_freq
        both = np.concatenate((f, f))
        np.cos(both, out=cos)
        np.sin(both, out=sin)
        if self.rope_scale != 1.0:  # YaRN's attention factor
            cos *= np.float32(self.rope_scale)
            sin *= np.float32(self.rope_scale)

    def _embed(self, token: int, x: np.ndarray) -> None:
        e = self._emb
        V, D = e["shape"]
        if not 0 <= token < V:
            raise BadInputError(f"token id {token} is outside the vocabulary (0..{V - 1})")
        item = 4 if e["dtype"] == "F32" else 2
        raw = os.pread(self._emb_fd, D * item, e["offset"] + token * D * item)
        row = np.frombuffer(raw, np.float32 if item == 4 else np.uint16)
        x[:] = row if item == 4 else _bf16_to_f32(row)

    def sequence(self, capacity: int) -> "LeanSequence":
        """A new sequence of up to `capacity` positions (its KV cache and the step's buffers)."""
        return LeanSequence(self, capacity)

    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> LeanResult:
        """Greedy decoding after `prompt` (its tokens through the step one by one)."""
        if not prompt:
            raise BadInputError("the prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise BadInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        cache = self.cache
        reads0, bytes0 = cache.misses, cache.read_bytes
        tokens, logprobs = [], []
        t0 = time.perf_counter()
        t_first = None
        with self.sequence(len(prompt) + max_new_tokens) as seq:
            for token in prompt[:-1]:
                seq.step(token, logits=False)
            token = prompt[-1]
            for _ in range(max_new_tokens):
                logits = seq.step(token)
                token = int(np.argmax(logits))
                m = float(logits.max())
                logprobs.append(float(logits[token]) - m - math.log(float(np.exp(logits - m).sum())))
                tokens.append(token)
                if t_first is None:
                    t_first = time.perf_counter()
                if token in stop_ids:
                    break
        end = time.perf_counter()
        n = len(tokens)
        stats = {"expert_reads": cache.misses - reads0, "ssd_bytes": cache.read_bytes - bytes0,
                 "ssd_bytes_per_token": (cache.read_bytes - bytes0) / max(1, len(prompt) + n - 1),
                 "cache_hits": cache.hits, "cache_misses": cache.misses, "cache_slots": cache.n,
                 "cache_bytes": cache.n * self.slot_bytes, "read_s": cache.read_s, "dense": self.dense,
                 "peak_rss_bytes": peak_rss_bytes()}
        return LeanResult(tokens, logprobs, (t_first or end) - t0,
                          (n - 1) / (end - t_first) if n > 1 and t_first is not None and end > t_first else 0.0, stats)

    def stop_ids(self) -> tuple[int, ...]:
        """The ids generation stops at by default, as the engine's (`default_stop_ids`)."""
        return default_stop_ids(self.config.eos_token_id, self.tokenizer)

    def close(self) -> None:
        self.reader.close()
        os.close(self._emb_fd)
        self.cache.view.release()
        self.experts_of.clear()
        self.held.clear()

    def __enter__(self) -> "LeanModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LeanSequence:
    """One sequence's decoding state: its KV cache (capacity positions) and the step's buffers.
    `step(token)` runs the model on the next position and gives the logits (a view, valid until the
    next step); `close` frees the buffers."""

    def __init__(self, model: LeanModel, capacity: int) -> None:
        c = model.config
        if not 0 < capacity <= c.max_position:
            raise BadInputError(f"a sequence of {capacity} positions: the model takes 1 to {c.max_position}")
        self.model, self.capacity, self.length = model, capacity, 0
        L, G, Dh, K = c.num_layers, c.num_kv_heads, c.head_dim, max(c.top_k, 1)
        self.kc, self.vc = np.zeros((L, G, capacity, Dh), np.float32), np.zeros((L, G, capacity, Dh), np.float32)
        self.x, self.logits = np.empty(c.hidden_size, np.float32), np.empty(model.head.O, np.float32)
        self.ids, self.w = np.empty(K, np.int64), np.empty(K, np.float32)
        self.cos, self.sin = np.empty(Dh, np.float32), np.empty(Dh, np.float32)
        P = ctypes.c_void_p
        self._p = [P(a.ctypes.data) for a in (self.x, self.logits, self.ids, self.w, self.cos, self.sin)]
        self._kv = [(P(self.kc[lay].ctypes.data), P(self.vc[lay].ctypes.data)) for lay in range(L)]
        self._net = ctypes.byref(model.net)
        self._work = model.lib.decode_work(self._net, capacity)

    def step(self, token: int, *, logits: bool = True) -> np.ndarray | None:
        """The model on `token` at the next position; its logits (V,) unless `logits` is False (a
        prompt's tokens before its last need none: the output product is skipped)."""
        m, pos = self.model, self.length
        if pos >= self.capacity:
            raise BadInputError(f"the sequence is full ({self.capacity} positions)")
        if self._work is None:
            raise BadInputError("the sequence is closed")
        lib, net, work, T = m.lib, self._net, self._work, m.settings.threads
        xp, lp, idp, wp, cp, sp = self._p
        m._embed(token, self.x)
        m.rope(pos, self.cos, self.sin)
        for lay, (kp, vp) in enumerate(self._kv):
            lib.decode_attend(net, work, lay, xp, kp, vp, self.capacity, pos, cp, sp, idp, wp, T)
            if lay in m._parts:
                chosen = self.ids.tolist()
                for e, slot in zip(chosen, m.cache.ensure(lay, chosen)):
                    m._point(lay, e, slot)
            lib.decode_ffn(net, work, lay, xp, T)
        self.length = pos + 1
        if not logits:
            return None
        lib.decode_head(net, work, xp, lp, T)
        return self.logits

    def close(self) -> None:
        if self._work is not None:
            self.model.lib.decode_work_free(self._work)
            self._work = None

    def __enter__(self) -> "LeanSequence":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
