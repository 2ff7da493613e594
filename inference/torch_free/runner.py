"""Decoding on CPU in a process without torch: a store's model through the compiled kernels, its
experts read from storage as the router picks them, into a cache of fixed slots.

Why: where memory is shorter than the model, every byte a process holds besides its expert cache
is expert data it must read again. torch's runtime alone holds about 0.15 GiB of anonymous memory
once imported (its operator tables and Python modules), which no eviction gives back: on the 3 GB
bench model that is half of the memory at 4-bit and 50%, and more than all of it at 4-bit and 25%.
This runner decodes with the same kernels as the engine's one-call step (semoe/kernels/decode_step.c, in
parts: `decode_attend`, then the chosen experts, `decode_ffn` (or, where some are cached and others are
being read, `decode_experts` of the cached ones meanwhile, of the rest once read, and `decode_ffn_done`);
`decode_head`), over buffers of its own (numpy, ctypes), and imports no torch, so that memory goes to the cache.

What it holds: the dense weights (attention, routers, norms, lm_head), float32 or bfloat16 as
stored (FP8 ones dequantized to bfloat16, as the engine loads them), or int8 (`dense="auto"`: beside
compact experts, `storage.formats.auto_dense`): stored so, mapped from the store's files, or quantized here
(GGUF's blocks mapped as stored, whatever `dense` but "float"); the token embedding stays on storage, one
row read per token; the experts' chunks, as stored (float32, bfloat16, int8, int4, FP8, MXFP4 or GGUF's
blocks, each computed as it is), in `cache_bytes` of slots, evicted by the engine's next-use policy,
missing ones read with O_DIRECT (a chunk's pieces in parallel) and checked against the manifest's crc32c.

What it takes: the models the one-call step takes (`DecodePlan`'s whole step: every architecture semoe
loads, `semoe.decode.support.ARCHITECTURES`, with the parts its table lists); one sequence, greedy or
sampled. Anything else is refused with one line naming it (`NotOnFastPath`); the engine
(`inference.engine`) runs every model.

It is a front-end of the same core as the engine: the store is read through `storage.reader`
(the torch-free part of `storage.store.Store`), experts are cached in `storage.cache.ExpertCache`
keyed by `ExpertKey`, what it takes is `semoe.decode.support`'s table, its `Net` is assembled by
`loader.build_net`, as the engine's plan assembles its own, and its generation loop is the
engine's (`semoe.decode.loop`). What stays here is what only a process without torch needs: reading
the weights into numpy, the slots, the rotary tables, the sequence's buffers.

Its logits are the one-call step's: the same kernels on the same weights, but for the rotary tables (numpy's
cos/sin against torch's, to float32 rounding) and the prompt, which runs token by token, not as one batch.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from inference.torch_free import mixers, mtp
from inference.torch_free import speculative as spec
from inference.torch_free.prompt_prefill import prefill
from inference.torch_free.embedding_rows import EmbeddingRows
from inference.torch_free.expert_slots import ExpertSlots
from inference.memory_guard import CPU_CACHE_AUTO, cpu_cache_size
from semoe.kernels import loader
from semoe.decode import loop
from semoe.model import rope
from semoe.decode.loop import SamplingConfig
from semoe.decode.support import NotOnFastPath, one_call_refusal
from semoe.model.hf_names import hf_name, text_name
from semoe.checkpoints.hf_config import store_model_config
from semoe.checkpoints.tokenizer import Tokenizer, default_stop_ids, store_tokenizer
from storage.errors import BadInputError
from storage.formats import QUANTIZE_ROWS, auto_dense, int8_rows_spec
from storage.chunk_io import ALIGN, ChunkReader, ChunkReaderConfig, ReadMode
from storage.keys import ExpertKey
from storage.manifest import TensorEntry
from storage.numpy_codecs import bf16_to_f32, float_rows, fp8_bf16_rows, int8_rows, quantize_int8_rows
from storage.process_memory import compute_threads, peak_rss_bytes, release_free_heap
from storage.reader import StoreReader
DENSE_CHOICES = ("auto", "float", "int8")
KV_CACHE_CHOICES = ("f32", "f16")
# the kernels' weight kind of each way an expert's weights are stored (a quant scheme, or a float dtype)
EXPERT_KINDS = {"F32": loader.W_F32, "BF16": loader.W_BF16, "int8": loader.W_INT8, "int4": loader.W_INT4,
                "mxfp4": loader.W_MXFP4, "fp8": loader.W_FP8, "ggml": loader.W_GGML}
_IO_KIND = {"F32": loader.W_F32_IO, "BF16": loader.W_BF16_IO}  # float weights stored (I, O)
# an expert's parts by the HuggingFace names' last part: SwiGLU's gate, up, down; gpt-oss's gate_up
# and down (float, or MXFP4 blocks), then their biases; Llama-4's gate_up (its halves) and down
_PARTS = {"gate": ("w1.weight", "gate_proj.weight"), "up": ("w3.weight", "up_proj.weight"),
          "down": ("w2.weight", "down_proj.weight")}
_CLAMPED_PARTS = {"gate_up": ("gate_up_proj", "gate_up_proj_blocks"), "down": ("down_proj", "down_proj_blocks")}
_CLAMPED_BIASES = ("gate_up_proj_bias", "down_proj_bias")


@dataclass(kw_only=True)
class LeanConfig:
    """How the lean runner holds a model."""

    # the expert cache's slots, in bytes (at least top_k chunks); 0: top_k chunks; None: every expert
    # where the memory left once the dense weights are held allows, else that memory (as the engine's
    # `--cpu-cache auto`: `inference.memory_guard.auto_cpu_cache_bytes`), at least top_k chunks
    cache_bytes: int | None
    # what the caller takes once the model is held, which an auto cache (cache_bytes None) leaves free
    # beside its reserve: a sequence's KV cache and buffers (`inference.torch_free.sequence_memory.sequence_bytes`)
    keep_bytes: int = 0
    dense: str = "auto"  # one of DENSE_CHOICES
    # the KV cache's values: "f32", or "f16" (half the bytes, as llama.cpp's default cache: each key and
    # value rounded to float16 as written; grouped-query attention only, latent attention's is compact)
    kv_cache: str = "f32"
    threads: int = 0  # compute threads; 0: OMP_NUM_THREADS where set, else every core this process may run on
    read_mode: ReadMode | str = ReadMode.DIRECT
    read_threads: int | None = None  # the reader's own choice by mode (`ChunkReaderConfig`)

    def __post_init__(self) -> None:
        if self.dense not in DENSE_CHOICES:
            raise BadInputError(f"dense must be one of {', '.join(DENSE_CHOICES)}, got {self.dense!r}")
        if self.kv_cache not in KV_CACHE_CHOICES:
            raise BadInputError(f"--kv-cache must be one of {', '.join(KV_CACHE_CHOICES)}, got {self.kv_cache!r}")
        self.read_mode = ReadMode(self.read_mode)
        if self.threads <= 0:
            self.threads = compute_threads()


@dataclass
class LeanResult:
    """A generation: the new tokens, their log-probabilities, time to the first token and decode speed
    (from the first new token on), and the runner's counters."""

    tokens: list[int]
    logprobs: list[float]
    ttft_s: float
    decode_tok_s: float
    stats: dict = field(default_factory=dict)


def dense_load_bytes(store: StoreReader) -> int:
    """Bytes of dense weights `LeanModel` reads at load (its `progress` total), from the manifest alone:
    every 2-d dense tensor of the model (a multimodal checkpoint's vision tower is not read) but the
    token embedding, which stays on storage unless it is the head too."""
    m, c = store.manifest, store_model_config(store)
    # a model without an lm_head ties it to the embedding
    emb = hf_name(c, "embed.weight") if m.has_tensor(hf_name(c, "lm_head.weight")) else None
    return sum(t.bytes for t in m.dense()
               if len(t.shape) == 2 and t.name != emb and (not c.weights_prefix or t.name == hf_name(c, "lm_head.weight")
                                                           or t.name.startswith(text_name(c, "model."))))


class LeanModel:
    """A store's model held for lean decoding (see the module docstring); `close` frees it."""

    def __init__(self, store: str | StoreReader, config: LeanConfig,
                 progress: Callable[[int], None] | None = None, tokenizer: Tokenizer | None = None) -> None:
        """`progress(n)`: n more bytes of dense weights read (a progress bar's update); `tokenizer`: the
        store's, where the caller read it already (`store_tokenizer`)."""
        lib = loader.library()
        if lib is None:
            raise NotOnFastPath(f"--lean computes with semoe's compiled CPU kernels alone, which are "
                                  f"{loader.status()}; run without --lean")
        self.lib, self.settings = lib, config
        self._progress = progress or (lambda n: None)
        self.store = store = store if isinstance(store, StoreReader) else StoreReader.open(store)
        path, m = store.root, store.manifest
        self.config = c = store_model_config(store)
        self._check(c)
        if config.kv_cache == "f16" and c.attention == "mla":
            raise BadInputError(f"--kv-cache f16: {path} has latent attention ({c.arch}), whose cache of compressed "
                                f"latents the runner keeps in float32; drop the flag")
        self.held: list = []  # what the Net's pointers point into
        self.mapped_bytes = 0  # of dense weights mapped from the store's files (`_mapped`)
        self.tokenizer = tokenizer if tokenizer is not None else store_tokenizer(store, c.vocab_size, c.arch)
        L, E, K = c.num_layers, c.num_experts, max(c.top_k, 1)
        # experts whose gate and up are one gate_up (I, O): gpt-oss's clamped pairs, Llama-4's halves
        self._fused = c.expert_mlp in ("clamped_swiglu", "fused_swiglu")
        chunks = [ch for ch in m.chunks if ch.kind == "weight"]
        moe_layers = sorted(m.expert_layers())
        kinds = {(t.quant or {}).get("scheme") or t.dtype for ch in chunks for t in m.chunk_tensors(ch)
                 if "scales_of" not in (t.quant or {})}
        dense = config.dense
        if dense == "auto":
            dense = auto_dense(kinds, on_cpu=True)
        self.dense = dense
        self.experts_of: dict[int, ctypes.Array] = {}  # layer -> its experts, pointed at slots as chosen
        self._moe_layers = set(moe_layers)
        self.parts = parts = [self._layer(lay, dense) for lay in range(L)]  # (a drafting Net's too: `mtp`)
        head = "embed.weight" if c.tie_embeddings else "lm_head.weight"
        self.head = self._linear([head.removesuffix(".weight")], dense, bias=False, name=hf_name(c, head))
        self.net, self.layers = loader.build_net(c, parts, self._vector("norm.weight", norm=True), c.rms_norm_eps,
                                                 self.head, kv16=config.kv_cache == "f16",
                                                 hc_head=mixers.hyper(self, "hc_head.hc_") if c.hc_mult > 1 else None)
        # the expert cache: every layer's experts present, of one layout
        for lay in moe_layers:
            missing = [e for e in range(E) if not m.has_chunk(lay, e)]
            if missing:
                raise BadInputError(f"{path}: layer {lay} has no chunk for expert {missing[0]} (of {E})")
        self._parts = {lay: self._chunk_parts(lay, 0) for lay in moe_layers}
        self._mtp = None  # its multi-token-prediction layer's Net, made when first drafted from (`drafter`)
        self.moe = frozenset(lay for lay in moe_layers if lay < L)  # the model's MoE layers (past them: drafting's)
        for ch in chunks:
            if self._chunk_parts(ch.layer, ch.expert) != self._parts[ch.layer]:
                raise NotOnFastPath(f"{path}: layer {ch.layer}'s expert {ch.expert} is laid out unlike its expert 0")
        sizes = {ch.bytes for ch in chunks}
        self.slot_bytes = -(-max(sizes) // ALIGN) * ALIGN if sizes else ALIGN
        if config.cache_bytes is None:
            release_free_heap()  # what loading freed counts as available
        # auto leaves room for the mapped dense weights' pages and the sequence too
        slots = cpu_cache_size(CPU_CACHE_AUTO if config.cache_bytes is None else config.cache_bytes,
                               expert_bytes=len(chunks) * self.slot_bytes, least_bytes=K * self.slot_bytes,
                               keep_bytes=config.keep_bytes + self.mapped_bytes) // self.slot_bytes
        # the experts' biases (gpt-oss) as float32, a slot's beside it: converted as its chunk is read
        # where they are stored bfloat16, pointed at in the slot where float32
        n_bias = max((sum(n for _, dt, n in b) for _, b in self._parts.values()), default=0)
        self._bias = np.zeros((max(slots, 1), n_bias), np.float32)
        self._structs: dict[tuple[int, int], loader.Expert] = {}
        self._pointed: dict[int, dict[int, int]] = {lay: {} for lay in moe_layers}  # layer -> expert -> slot
        self.computed_while_reading = 0  # decoding's MoE layers that computed cached experts while reading others
        # rotary frequencies (plain or YaRN) and the scale of cos and sin, as the model's modules take them
        self.inv_freq, self.rope_scale = rope.inv_freq(c)
        # the embedding stays on storage: one row a token
        emb = self._tensor(hf_name(c, "embed.weight"))
        self._emb = EmbeddingRows(path, emb, store.path(emb.file))
        self.reader = ChunkReader(ChunkReaderConfig(mode=config.read_mode, threads=config.read_threads))
        self.cache = ExpertSlots(store, max(slots, 1), self.slot_bytes, self.reader, self._loaded)
        release_free_heap()  # what loading freed, given back: decoding may run with memory short

    def _layer(self, lay: int, dense: str) -> loader.LayerParts:
        """Layer `lay`'s parts as the Net takes them (a multi-token-prediction layer's too, past the last):
        its weights read (products as `dense` says), its experts' array made (pointed at slots as chosen)."""
        c, E = self.config, self.config.num_experts
        shared = shared_gate = correction = None
        hashed = c.hash_layers is not None and lay in c.hash_layers
        if lay in self._moe_layers:
            arr = self.experts_of[lay] = (loader.Expert * E)()
            router = self._linear([f"layers.{lay}.ffn.router"], "float", bias=c.router_bias)
            F = self._chunk_parts(lay, 0)[0][0][2] // (2 if self._fused else 1)
            if c.score_correction_bias and not hashed:
                correction = self._vector(f"layers.{lay}.ffn.router.e_score_correction_bias")
            if c.shared_expert_size:  # dense weights, as the engine's (int8 beside compact experts)
                shared = (loader.Expert * 1)(loader.Expert(*(
                    self._linear([f"layers.{lay}.ffn.shared.{p}_proj"], dense, bias=False)
                    for p in ("gate", "up", "down"))))
                self.held.append(shared)
                if c.shared_expert_gate:  # a router-like row: float, as the engine keeps it
                    shared_gate = self._linear([f"layers.{lay}.ffn.shared_gate"], "float", bias=False)
        else:
            ex = loader.Expert(*(self._linear([f"layers.{lay}.ffn.{p}_proj"], dense, bias=False)
                                     for p in ("gate", "up", "down")))
            arr, router, F = (loader.Expert * 1)(ex), None, ex.gate.O
            self.held.append(arr)
        o = f"layers.{lay}.attn.{'out_proj' if c.is_linear(lay) else 'o_proj'}"
        if c.attention == "compressed":  # its grouped output inside `Compressed`
            attn, o = dict(qkv=[], **mixers.compressed(self, lay, dense)), None
        elif c.is_linear(lay):
            attn = dict(qkv=[], dn=mixers.deltanet(self, lay, dense))
        elif c.attention == "mla":
            attn = dict(qkv=[], mla=mixers.latent(self, lay, dense))
        else:
            qkv = [f"layers.{lay}.attn.{p}_proj" for p in "qkv"]  # three products where stored compact (mapped)
            mapped = dense != "float" and any(self._stored_compact(hf_name(c, f"{m}.weight")) for m in qkv)
            weighted = c.qk_norm not in ("none", "unit_after_rope")  # Llama-4's norms have no weights
            attn = dict(
                qkv=[self._linear([m], dense) for m in qkv] if mapped else [self._linear(qkv, dense)],
                q_norm=self._vector(f"layers.{lay}.attn.q_norm.weight", norm=True) if weighted else None,
                k_norm=self._vector(f"layers.{lay}.attn.k_norm.weight", norm=True) if weighted else None,
                sinks=self._vector(f"layers.{lay}.attn.sinks") if c.attention_sinks else None)
        return loader.layer_parts(
            c, lay, attn_norm=self._vector(f"layers.{lay}.attn_norm.weight", norm=True),
            ffn_norm=self._vector(f"layers.{lay}.ffn_norm.weight", norm=True),
            o=self._linear([o], dense) if o else loader.Lin(),
            experts=arr, ffn_width=F,
            router=router, correction=correction, shared=shared, shared_gate=shared_gate, **attn)

    @staticmethod
    def _check(c) -> None:
        """Refuse, in one line, what the one-call step does not take (`semoe.decode.support`)."""
        why = one_call_refusal(c)
        if why:
            named = why if c.arch in why else f"{why} ({c.arch})"
            raise NotOnFastPath(f"the lean runner does not take {named}; decode it with the engine (without --lean)")

    def _vector(self, param: str, norm: bool = False) -> int:
        """A float32 copy of a 1-d parameter, held; its address. `norm`: a block's RMSNorm weight, which
        a zero-centred model (`norm_plus_one`) scales by as 1 + w, made here once."""
        a = self._read_1d(hf_name(self.config, param))
        if norm and self.config.norm_plus_one:
            a = a + np.float32(1)
        self.held.append(a)
        return a.ctypes.data

    def _tensor(self, name: str) -> TensorEntry:
        try:
            return self.store.manifest.tensor(name)
        except KeyError:
            raise BadInputError(f"{self.store.root}: the store holds no tensor {name}") from None

    def _read_1d(self, name: str) -> np.ndarray:
        t = self._tensor(name)
        # a vector, or one row of a table (ERNIE's correction bias, (1, E))
        if len([n for n in t.shape if n != 1]) > 1 or t.dtype not in ("F32", "BF16") or t.quant:
            raise NotOnFastPath(f"{self.store.root}: {name} is {t.dtype} {t.shape}; expected a float vector")
        return np.ascontiguousarray(float_rows(self.store.read_bytes(name), t.dtype), dtype=np.float32)

    def _rows(self, name: str):
        """A dense 2-d tensor as float32 blocks of its rows, read in turn (never whole in memory), its
        crc32c checked at the end; FP8 ones as the engine holds them (`_bf16_rows`)."""
        t = self._tensor(name)
        q = t.quant or {}
        if int8_rows_spec(q):  # stored int8 (`semoe store quantize`)
            r, s = 0, self._scales(q["scales"])
            for raw in self.store.dense_row_bytes(name, QUANTIZE_ROWS):
                self._progress(raw.nbytes)
                yield int8_rows(raw.view(np.int8), s[r:r + len(raw)], q["dtype"])
                r += len(raw)
            return
        if t.dtype != "F32" or t.quant:
            for rows in self._bf16_rows(name):
                yield bf16_to_f32(rows)
            return
        for raw in self.store.dense_row_bytes(name, QUANTIZE_ROWS):
            self._progress(raw.nbytes)
            yield raw.view(np.float32)

    def _stored_int8(self, name: str) -> bool:
        return int8_rows_spec(self._tensor(name).quant)

    def _stored_compact(self, name: str) -> bool:  # int8 codes, or GGUF's blocks: mapped as they are
        return self._stored_int8(name) or (self._tensor(name).quant or {}).get("scheme") == "ggml"

    def _mapped(self, name: str, dtype: type = np.int8) -> np.ndarray:
        """A stored int8 dense weight's codes (or GGUF's rows of blocks: `dtype` uint8) mapped read-only from
        the store's file, checked against its crc32c first (read through once, not kept). The page cache holds
        them while memory allows and gives them back under pressure, to be read again as used (as llama.cpp
        maps its weights): no anonymous memory, and decoding goes on, slower, where memory cannot hold them."""
        t = self._tensor(name)
        for raw in self.store.dense_row_bytes(name, QUANTIZE_ROWS):
            self._progress(raw.nbytes)
        self.mapped_bytes += t.bytes
        return np.memmap(self.store.path(t.file), dtype, "r", t.offset, tuple(t.shape))

    def _scales(self, name: str) -> np.ndarray:
        """A compact dense weight's float32 scales, read whole."""
        t = self._tensor(name)
        if t.dtype != "F32":
            raise NotOnFastPath(f"{self.store.root}: {name} is {t.dtype}; scales are read F32")
        return self.store.read_bytes(name).view(np.float32).reshape(t.shape)

    def _bf16_rows(self, name: str):
        """A BF16 or FP8 dense 2-d tensor as blocks of bfloat16 rows (uint16): BF16 as stored, FP8
        dequantized as the engine loads it (`fp8_bf16_rows`)."""
        t = self._tensor(name)
        q = t.quant or {}
        if q.get("scheme") != "fp8" and (q or t.dtype != "BF16"):
            raise NotOnFastPath(f"{self.store.root}: dense tensor {name} is stored {q.get('scheme') or t.dtype}; "
                                f"the lean runner reads F32, BF16 or FP8 dense weights")
        if q:
            s, r = self._scales(q["scales"]), 0
            for raw in self.store.dense_row_bytes(name, QUANTIZE_ROWS):
                self._progress(raw.nbytes)
                yield fp8_bf16_rows(raw, s, r, tuple(q["block"]))
                r += len(raw)
        else:
            for raw in self.store.dense_row_bytes(name, QUANTIZE_ROWS):
                self._progress(raw.nbytes)
                yield raw.view(np.uint16)

    def _linear(self, modules: list[str], dense: str, *, bias: bool = True, name: str | None = None
                ) -> loader.Lin:
        """One product over the rows of these linear modules stacked (q, k and v: one), as the engine's
        dense weights: int8 quantized here, or float as stored."""
        c = self.config
        names = [name] if name else [hf_name(c, f"{m}.weight") for m in modules]
        entries = [self._tensor(n) for n in names]
        blocks = {(t.quant or {}).get("ggml_type") for t in entries}  # GGUF's rows of blocks, as stored
        shapes = [t.quant["shape"] if None not in blocks else t.shape for t in entries]
        I, O = shapes[0][1], sum(s[0] for s in shapes)
        if any(s[1] != I for s in shapes):
            raise NotOnFastPath(f"{names}: products of different input sizes")
        if dense != "float" and len(blocks) == 1 and None not in blocks:
            rows = [self._mapped(n, np.uint8) for n in names]
            rows = rows[0] if len(rows) == 1 else np.concatenate(rows)
            self.held.append(rows)
            lin = loader.Lin(loader.W_GGML, O, I, loader.lin_group(entries[0].quant), rows.ctypes.data, None, None)
        elif dense == "int8":
            if len(names) == 1 and self._stored_int8(names[0]):  # stored int8: mapped where they are
                codes, scales = self._mapped(names[0]), self._scales(entries[0].quant["scales"])
            elif any(self._stored_int8(n) for n in names):
                raise NotOnFastPath(f"{names}: stored int8 weights are mapped one by one, never stacked")
            else:  # float weights (q, k and v stacked): quantized here
                codes, scales = np.empty((O, I), np.int8), np.empty(O, np.float32)
                r = 0
                for n in names:
                    for block in self._rows(n):
                        codes[r:r + len(block)], scales[r:r + len(block)] = quantize_int8_rows(block)
                        r += len(block)
            self.held += [codes, scales]
            lin = loader.Lin(loader.W_INT8, O, I, 0, codes.ctypes.data, scales.ctypes.data, None)
        else:  # bfloat16 where all are (FP8 dequantized to it, as the engine's), else float32
            bf16 = all(t.dtype == "BF16" or (t.quant or {}).get("scheme") == "fp8" for t in entries)
            w = np.empty((O, I), np.uint16 if bf16 else np.float32)  # filled in turn: never in memory twice
            r = 0
            for n, t in zip(names, entries):
                for block in (self._bf16_rows(n) if bf16 else self._rows(n)):
                    w[r:r + len(block)] = block
                    r += len(block)
            self.held.append(w)
            lin = loader.Lin(loader.W_BF16 if bf16 else loader.W_F32, O, I, 0, w.ctypes.data, None, None)
        if bias:
            bnames = [hf_name(c, f"{m}.bias") for m in modules]
            have = [self.store.manifest.has_tensor(n) for n in bnames]
            if any(have):
                parts = [self._read_1d(n) if h else np.zeros(t.shape[0], np.float32)
                         for n, h, t in zip(bnames, have, entries)]
                b = np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)
                self.held.append(b)
                lin.bias = b.ctypes.data
        return lin

    def _chunk_parts(self, layer: int, expert: int) -> tuple[list[tuple], list[tuple]]:
        """Where an expert's weights lie in the layer's chunks (every expert of a layer has the same
        layout): (kind, group, O, I, codes offset, scales offset or -1) of gate, up and down (gpt-oss,
        Llama-4: gate_up, none (O = 0), down), and (offset, dtype, values) of its biases (gpt-oss's two)."""
        m, fused = self.store.manifest, self._fused
        clamped = self.config.expert_mlp == "clamped_swiglu"
        tensors = m.chunk_tensors(m.chunk(layer, expert))
        scales = {t.quant["scales_of"]: t for t in tensors if "scales_of" in (t.quant or {})}
        out = []
        for part, suffixes in (_CLAMPED_PARTS if fused else _PARTS).items():
            t = next((t for t in tensors if t.name.endswith(suffixes) and "scales_of" not in (t.quant or {})), None)
            if t is None:
                raise NotOnFastPath(f"{self.store.root}: layer {layer}'s experts have no {part} weight "
                                    f"({' or '.join(suffixes)})")
            q = t.quant or {}
            scheme = q.get("scheme") or t.dtype
            # gpt-oss's and Llama-4's weights are (I, O): compact codes out-major all the same, float ones as stored
            if scheme not in EXPERT_KINDS or bool(q.get("transposed")) != (fused and bool(q)):
                raise NotOnFastPath(f"{self.store.root}: expert weight {t.name} is {scheme}; the lean runner "
                                    f"takes F32, BF16, int8, int4, FP8, MXFP4 and GGUF's blocks")
            s = scales.get(t.name)
            if scheme == "fp8" and (len(set(q["block"])) != 1 or s is None or s.dtype != "F32"):
                raise NotOnFastPath(f"{self.store.root}: expert weight {t.name} is fp8 with scales per {q['block']} "
                                    f"block; the kernel takes F32 scales per square tile")
            if q:
                (O, I), kind = (q["shape"][::-1] if fused else q["shape"]), EXPERT_KINDS[scheme]
            else:
                (O, I), kind = (t.shape[::-1], _IO_KIND[scheme]) if fused else (t.shape, EXPERT_KINDS[scheme])
            group = loader.lin_group(q)
            out.append((kind, group, O, I, t.offset, s.offset if s else -1))
        biases = []
        if fused:
            out.insert(1, (0, 0, 0, 0, -1, -1))  # no up: gate and up both in gate_up
        if clamped:
            for suffix in _CLAMPED_BIASES:
                t = next((t for t in tensors if t.name.endswith(suffix)), None)
                if t is None or t.dtype not in ("F32", "BF16") or len(t.shape) != 1:
                    raise NotOnFastPath(f"{self.store.root}: layer {layer}'s experts have no float {suffix}")
                biases.append((t.offset, t.dtype, t.shape[0]))
        elif not fused and out[0][:4] != out[1][:4]:
            raise NotOnFastPath(f"{self.store.root}: layer {layer}'s gate and up weights differ in kind or shape")
        return out, biases

    def _loaded(self, key: ExpertKey, slot: int) -> None:
        """An expert's chunk is in `slot`: its bfloat16 biases as float32 beside the slot."""
        at = 0
        for off, dtype, n in self._parts[key.layer][1]:
            if dtype == "BF16":
                raw = np.frombuffer(self.cache.mem, np.uint16, n, slot * self.slot_bytes + off)
                self._bias[slot, at:at + n] = bf16_to_f32(raw)
            at += n

    def _point(self, layer: int, expert: int, slot: int) -> None:
        """Point the layer's entry for `expert` at the chunk in `slot` (a struct made once per layer
        and slot)."""
        if self._pointed[layer].get(expert) == slot:
            return
        ex = self._structs.get((layer, slot))
        if ex is None:
            base = self.cache.base + slot * self.slot_bytes
            lins, biases = self._parts[layer]
            ex = self._structs[(layer, slot)] = loader.Expert(*(
                loader.Lin(kind, O, I, g, base + off if off >= 0 else None, base + soff if soff >= 0 else None,
                               None) for kind, g, O, I, off, soff in lins))
            at = 0
            for lin, (off, dtype, n) in zip((ex.gate, ex.down), biases):
                lin.bias = base + off if dtype == "F32" else self._bias[slot, at:].ctypes.data
                at += n
        self.experts_of[layer][expert] = ex
        self._pointed[layer][expert] = slot

    def rope(self, pos: int, cos: np.ndarray, sin: np.ndarray) -> None:
        """The rotary tables (rope_dim) of position `pos` into cos and sin (`semoe.model.rope.cos_sin`)."""
        rope.cos_sin(pos, self.inv_freq, self.rope_scale, cos, sin)

    def _embed(self, token: int, x: np.ndarray) -> None:
        self._emb.read(token, x)

    def inputs(self, tokens: list[int], positions: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The prompt pass's inputs for rows of `tokens` at `positions`: their embeddings x (T, D; with
        hyper-connections (T, N D), the embedding first) and rotary tables cos, sin (T, rope_dim)."""
        c, T = self.config, len(tokens)
        x = np.empty((T, c.hidden_size * c.hc_mult), np.float32)  # with hyper-connections, room for the streams
        cos, sin = np.empty((T, c.rope_dim), np.float32), np.empty((T, c.rope_dim), np.float32)
        for t, (token, pos) in enumerate(zip(tokens, positions)):
            self._embed(token, x[t, :c.hidden_size])
            self.rope(pos, cos[t], sin[t])
        return x, cos, sin

    def sequence(self, capacity: int) -> "LeanSequence":
        """A new sequence of up to `capacity` positions (its KV cache and the step's buffers)."""
        return LeanSequence(self, capacity)

    def generate(self, prompt: list[int], cfg: SamplingConfig, on_token: Callable[[int, float], None] | None = None,
                 on_prompt_layer: Callable[[int, int], None] | None = None, speculative: int = 0,
                 draft: Callable[[list[int], int], list[int]] | None = None, paying: bool = False) -> LeanResult:
        """Decoding after `prompt` (its tokens through the model a layer at a time, `lean_prefill`), each
        token chosen as `cfg` says and handed to `on_token(id, logprob)`: the engine's loop
        (`semoe.decode.loop`), its draws from numpy's generator seeded with cfg.seed; `on_prompt_layer(done,
        layers)` after each layer of the prompt's pass. `speculative` k > 0: up to k tokens drafted a step
        (`draft(tokens so far, n)`; default `mtp.default_draft`'s) and verified in one pass
        (`inference.torch_free.speculative`), greedy, drafting only while it pays with `paying` (`loop.Paying`);
        the stats then count passes and drafts."""
        if not prompt:
            raise BadInputError("the prompt is empty: give at least one token")
        cache = self.cache
        reads0, bytes0, overlapped0 = cache.misses, cache.read_bytes, self.computed_while_reading
        rng = np.random.default_rng(cfg.seed)
        with self.sequence(len(prompt) + cfg.max_new_tokens) as seq:
            first = functools.partial(prefill, seq, prompt, on_prompt_layer)
            if speculative:
                lookup = draft or mtp.default_draft(self, seq, prompt)
                lookup = loop.Paying(lookup) if paying else lookup
                out = loop.run_speculative(first, functools.partial(spec.verify, seq),
                                           functools.partial(spec.keep, seq), lookup, speculative,
                                           lambda logits: loop.choose(logits, cfg, rng), cfg, on_token)
            else:
                out = loop.run(first, seq.step, lambda logits: loop.choose(logits, cfg, rng), cfg, on_token)
        stats = {"expert_reads": cache.misses - reads0, "ssd_bytes": cache.read_bytes - bytes0,
                 "ssd_bytes_per_token": (cache.read_bytes - bytes0) / max(1, len(prompt) + len(out.tokens) - 1),
                 "cache_hits": cache.hits, "cache_misses": cache.misses, "cache_slots": cache.n,
                 "cache_bytes": cache.n * self.slot_bytes, "read_s": cache.read_s, "dense": self.dense,
                 "computed_while_reading": self.computed_while_reading - overlapped0,
                 "kv_cache": self.settings.kv_cache,
                 "peak_rss_bytes": peak_rss_bytes()}
        if speculative:
            stats.update(speculative=speculative, passes=out.passes, drafted=out.drafted, accepted=out.accepted,
                         drafter=type(lookup.draft if paying else lookup).__name__, plain_passes=lookup.passes["plain"]
                         if paying else 0)
        return LeanResult(out.tokens, out.logprobs, out.ttft_s, out.decode_tok_s, stats)

    def stop_ids(self) -> tuple[int, ...]:
        """The ids generation stops at by default, as the engine's (`default_stop_ids`)."""
        return default_stop_ids(self.config.eos_token_id, self.tokenizer)

    def close(self) -> None:
        self.reader.close()
        self._emb.close()
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
        self.undo = None  # the last speculative pass's (`inference.torch_free.speculative.verify`)
        # with `keep_rows` (a drafter's), the last rows run: (first position, their residual rows)
        self.keep_rows, self.rows = False, None
        L, K = c.num_layers, max(c.top_k, 1)
        # the model's layout (`MoEConfig.kv_shapes`) of one sequence a layer, as the Net's kv16 says, or a
        # layer's own state
        self.caches = mixers.sequence_caches(c, capacity, np.float16 if model.settings.kv_cache == "f16"
                                             else np.float32)
        # x: the residual, or with hyper-connections its streams
        self.x, self.logits = np.empty(c.hidden_size * c.hc_mult, np.float32), np.empty(model.head.O, np.float32)
        self.ids, self.w = np.empty(K, np.int64), np.empty(K, np.float32)
        self.cos, self.sin = np.empty(c.rope_dim, np.float32), np.empty(c.rope_dim, np.float32)
        P = ctypes.c_void_p
        self._p = [P(a.ctypes.data) for a in (self.x, self.logits, self.ids, self.w, self.cos, self.sin)]
        self._kv = [(P(k.ctypes.data), P(v.ctypes.data)) for k, v in self.caches]
        self.addresses = ([k.value for k, _ in self._kv], [v.value for _, v in self._kv])  # a pass's `sequences`
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
        m._embed(token, self.x[:m.config.hidden_size])
        m.rope(pos, self.cos, self.sin)
        for lay, (kp, vp) in enumerate(self._kv):
            lib.decode_attend(net, work, lay, xp, kp, vp, self.capacity, pos, cp, sp, idp, wp, T, token)
            if lay in m._parts:
                self._experts(lay)
            else:
                lib.decode_ffn(net, work, lay, xp, T)
        self.length = pos + 1
        if not logits:
            return None
        lib.decode_head(net, work, xp, lp, T)
        return self.logits

    def _experts(self, lay: int) -> None:
        """MoE layer `lay`'s feed-forward on the step's x: its chosen experts read where missing, and
        where some are cached and others are being read, the cached ones computed meanwhile
        (`decode_experts`, then the rest, then `decode_ffn_done`: `decode_ffn`'s bits)."""
        m, lib, net, work, T = self.model, self.model.lib, self._net, self._work, self.model.settings.threads
        chosen = self.ids.tolist()
        pending = m.cache.begin(lay, chosen)
        early = [k for k, e in enumerate(chosen) if ExpertKey(lay, e) in pending.where] if pending.loads else []
        try:
            for k in early:
                m._point(lay, chosen[k], pending.where[ExpertKey(lay, chosen[k])])
            if early:
                lib.decode_experts(net, work, lay, (ctypes.c_int64 * len(early))(*early), len(early), T)
        finally:
            slots = m.cache.end(pending)  # the reads done (and the pins let go) whatever the compute did
        for e, slot in zip(chosen, slots):
            m._point(lay, e, slot)
        if not early:
            lib.decode_ffn(net, work, lay, self._p[0], T)
            return
        late = [k for k in range(len(chosen)) if k not in early]
        lib.decode_experts(net, work, lay, (ctypes.c_int64 * len(late))(*late), len(late), T)
        lib.decode_ffn_done(net, work, lay, self._p[0], T)
        m.computed_while_reading += 1

    def close(self) -> None:
        if self._work is not None:
            self.model.lib.decode_work_free(self._work)
            self._work = None

    def __enter__(self) -> "LeanSequence":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
