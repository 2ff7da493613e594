"""Checkpoint interop: HuggingFace directories and stores into a `MoEGPT`, and a model into a store.

Tensors keep their HuggingFace names everywhere outside the model (in stores too), so a store
imported from a HuggingFace checkpoint and one saved from a model trained here read the same way.
One table of renaming rules maps between those names and the model's parameter names.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from semoe.model.compact_linear import compact_dense_linears, resolve_dense, stack_projections
from semoe.model.config import MoEConfig
from semoe.checkpoints.hf_config import config_from_json, store_model_config
from semoe.model.expert_layout import chunk_layout_of, hf_expert_names, packed_layer
from semoe.model.hf_names import SEMOE_MODEL_TYPE, hf_name
from semoe.model.moe_gpt import MoEGPT
from semoe.model.experts import ResidentExperts
from storage.errors import BadInputError
from storage.dtypes import torch_dtype
from storage.process_memory import release_free_heap
from storage.formats import int8_rows_spec
from storage.formats import QUANTIZE_ROWS
from storage.quant import QuantSpec, dequantize_ggml
from semoe.checkpoints.hf_convert import ExpertPart, open_checkpoint
from storage.reader import is_store
from storage.store import ExpertTensor, Store



def hf_config(config: MoEConfig) -> dict:
    """A config.json for the model: the source config for imported models, semoe's own otherwise."""
    if config.arch != "gpt_moe" and config.extra:
        return dict(config.extra)
    fields = {k: v for k, v in config.__dict__.items() if k != "extra"}
    if not fields["weights_prefix"]:  # a model trained here has none; left out, older readers read the store
        del fields["weights_prefix"]
    fields["moe_layers"] = list(config.moe_layers) if config.moe_layers is not None else None
    return {"model_type": SEMOE_MODEL_TYPE, "architectures": ["SemoeGPTForCausalLM"], "semoe": fields}


def _dense_params(model: MoEGPT) -> Iterator[tuple[str, nn.Parameter]]:
    tied = model.config.tie_embeddings
    for name, p in model.named_parameters():
        if ".experts." in name or (tied and name == "lm_head.weight"):
            continue
        yield name, p


def _load(model: MoEGPT, dense: Callable[[str], torch.Tensor],
          expert: Callable[[int, int], dict[str, torch.Tensor]], source: str, *, adopt: bool = False) -> None:
    """Fill every parameter from `dense(hf_name)` and `expert(layer, index)`; check shapes and dtypes.
    `adopt`: `dense` returns a new buffer each call, which a parameter of its dtype and device takes
    as its storage instead of a copy (loading then never holds a dense weight twice: the largest, an
    embedding or lm_head, is 131 MB on the float32 bench model, and memory-limited runs count it)."""
    c = model.config
    with torch.no_grad():
        for name, p in _dense_params(model):
            key = hf_name(c, name)
            t = dense(key)
            if tuple(t.shape) != tuple(p.shape):
                raise BadInputError(f"{source}: tensor {key} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            if adopt and t.dtype == p.dtype and t.device == p.device:
                p.data = t
            else:
                p.copy_(t)
        for ffn in model.moe_layers():
            experts = ffn.experts
            if not isinstance(experts, ResidentExperts):
                continue
            for e in range(c.num_experts):
                tensors = expert(ffn.layer, e)
                for key, dst in zip(hf_expert_names(c, ffn.layer, e), experts.tensors()):
                    if key not in tensors:
                        raise BadInputError(f"{source}: tensor {key} is missing")
                    t = tensors[key]
                    if tuple(t.shape) != tuple(dst.shape[1:]):
                        raise BadInputError(f"{source}: tensor {key} has shape {tuple(t.shape)}, "
                                            f"expected {tuple(dst.shape[1:])}")
                    dst[e].copy_(t)


# torch.nn.init's initialisers that hand themselves to a torch-function mode: the ones the model's
# layers call with random draws (nn.Linear's kaiming_uniform_ and uniform_, the model's normal_);
# zeros_ and ones_ are plain fills, cheap on the meta device
_INITS = frozenset({nn.init.uniform_, nn.init.normal_, nn.init.constant_, nn.init.kaiming_uniform_})


class _SkipInit(TorchFunctionMode):
    """Layers' random initialisation skipped while a model is built on the meta device: there it runs
    through torch's reference decompositions, which import torch._dynamo (77 MB resident, and
    seconds of start-up) to produce values that loading overwrites anyway. A torch-function mode is
    this thread's alone and ends with the block: nothing of torch is patched, so other threads, and
    this one afterwards, initialise as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def _empty_model(config: MoEConfig, device: torch.device | str, dtype: torch.dtype, *,
                 with_experts: bool = True) -> MoEGPT:
    """A model with uninitialised storage (no time spent on random init of weights about to be loaded);
    without experts, no memory is taken for them either. The dtype is set while the model is still
    on the meta device, so its storage is allocated once, at that dtype: never float32 first."""
    with torch.device("meta"), _SkipInit():
        model = MoEGPT(config)
    if not with_experts:
        for ffn in model.moe_layers():
            ffn.use_experts(_NoExperts())
    model = model.to(dtype)
    # each meta tensor replaced by an empty one (Module.to_empty goes through torch's reference
    # empty_like on meta tensors, which imports the symbolic-shapes machinery: 40 MB resident)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                        requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model


def load_hf(path: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
            progress: Callable[[int], None] | None = None) -> MoEGPT:
    """A model from a HuggingFace directory (config.json + safetensors, sharded or not); `progress` is
    called with the bytes of each tensor read."""
    ck = open_checkpoint(path, dequantize=True)
    try:
        config = config_from_json(ck.config)
    except ValueError as e:
        raise BadInputError(f"{os.path.join(path, 'config.json')}: {str(e).removeprefix('config.json: ')}") from None
    model = _empty_model(config, device, dtype)

    def dense(key: str) -> torch.Tensor:
        ref = ck.tensors.get(key)
        if ref is None:
            raise BadInputError(f"{path}: tensor {key} is missing")
        t = _ref_tensor(ref)
        if progress is not None:
            progress(ref.nbytes)
        return t

    def expert(layer: int, e: int) -> dict[str, torch.Tensor]:
        parts = ck.experts.get(layer, {}).get(e, [])
        tensors = {p.ref.name: _part_tensor(p, e) for p in parts}
        if progress is not None:
            progress(sum(p.slice_bytes() for p in parts))
        return tensors

    _load(model, dense, expert, path)
    return model.eval()


def _ref_tensor(ref) -> torch.Tensor:
    return torch.from_numpy(ref.read()).view(torch_dtype(ref.dtype)).view(ref.shape)


def _part_tensor(part: ExpertPart, expert: int) -> torch.Tensor:
    """One expert's tensor: the whole tensor, or its slice of a fused (E, ...) one (only that slice is read)."""
    if not part.stacked:
        return _ref_tensor(part.ref)
    n = part.slice_bytes()
    buf = np.empty(n, dtype=np.uint8)
    part.ref.read_into(memoryview(buf), offset=expert * n, nbytes=n)
    return torch.from_numpy(buf).view(torch_dtype(part.ref.dtype)).view(part.slice_shape())


def load_store(source: str | Store, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               with_experts: bool = True, kernel: str = "auto", dense: str = "auto",
               embedding_in_store: bool = False, progress: Callable[[int], None] | None = None) -> MoEGPT:
    """A model from a store; `with_experts=False` leaves experts to a provider (offload engine).

    Compact (quantized) experts stay compact: each MoE layer then holds them as `PackedExperts`,
    placed as an offload ring slot holds them, so resident and offloaded compute alike. Compact
    dense weights are dequantized. `kernel="reference"` computes compact experts by the plain
    dequantize-then-multiply reference. `dense` (`semoe.model.compact_linear.DENSE_CHOICES`): the weights
    outside the experts float, or int8 or int4 (quantized here); `auto` is int8 on CPU beside int8,
    int4 or MXFP4 experts (`resolve_dense`). `embedding_in_store`: leave the token embedding in the store and
    read the rows each step needs (`StoredEmbedding`), as offloaded engines do. `source`: the store,
    open (as a loader that hands it on opens it once) or by path. `progress` is called with the bytes
    of each read from the store."""
    store = source if isinstance(source, Store) else Store.open(source)
    previous, store.on_read = store.on_read, progress
    try:
        return _load_store(store, device=device, dtype=dtype, with_experts=with_experts, kernel=kernel, dense=dense,
                           embedding_in_store=embedding_in_store)
    finally:
        store.on_read = previous


def _load_store(store: Store, *, device: torch.device | str, dtype: torch.dtype, with_experts: bool, kernel: str,
                dense: str, embedding_in_store: bool) -> MoEGPT:
    """`load_store`'s work on an open store."""
    path = store.root
    config = store_model_config(store)
    compact = with_experts and store.is_compact()
    model = _empty_model(config, device, dtype, with_experts=with_experts and not compact)

    def present(key: str) -> str:
        if not store.manifest.has_tensor(key):
            raise BadInputError(f"{path}: tensor {key} is missing")
        return key

    def dense_tensor(key: str) -> torch.Tensor:
        return store.read_dense(present(key))

    def expert(layer: int, e: int) -> dict[str, torch.Tensor]:
        if not with_experts:
            return {}
        if not store.manifest.has_chunk(layer, e):
            raise BadInputError(f"{path}: expert {e} of layer {layer} is missing")
        return store.read_expert(layer, e)

    if embedding_in_store:
        rows = stored_embedding(store, config, dtype, device)
        if rows is not None:
            model.embed = rows
    scheme = resolve_dense(dense, device=device, expert_schemes=store.expert_schemes())
    if scheme != "float":  # quantized as read, a block of rows at a time: no float weight is ever whole

        def key_of(name: str) -> str:
            return hf_name(config, "embed.weight" if config.tie_embeddings and name == "lm_head" else f"{name}.weight")

        def weight_rows(name: str) -> Iterator[torch.Tensor]:
            return store.read_dense_rows(present(key_of(name)), QUANTIZE_ROWS)

        def stored_int8(name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
            spec = store.manifest.tensor(present(key_of(name))).quant
            if not int8_rows_spec(spec):
                return None
            return store.read_tensor(key_of(name)), store.read_tensor(spec["scales"])

        def stored_blocks(name: str) -> tuple[torch.Tensor, QuantSpec] | None:
            spec = store.manifest.tensor(present(key_of(name))).quant or {}
            return (store.read_tensor(key_of(name)), QuantSpec.from_json(spec)) if spec.get("scheme") == "ggml" else None

        compact_dense_linears(model, scheme, kernel=kernel, weight_rows=weight_rows, stored_int8=stored_int8,
                              stored_blocks=stored_blocks)
    _load(model, dense_tensor, expert, path, adopt=True)
    if compact:
        for ffn in model.moe_layers():
            layouts, raws = {}, {}
            for e in range(config.num_experts):
                if not store.manifest.has_chunk(ffn.layer, e):
                    raise BadInputError(f"{path}: expert {e} of layer {ffn.layer} is missing")
                layouts[e] = chunk_layout_of(store.manifest, config, ffn.layer, e, path)
                raws[e] = store.read_chunk(ffn.layer, e)
            ffn.use_experts(packed_layer(config, ffn.layer, raws, layouts, device=device, dtype=dtype, kernel=kernel))
    if scheme != "float":
        stack_projections(model)
    release_free_heap()
    return model.eval()


class StoredEmbedding(nn.Module):
    """A token embedding left in the store: each forward reads the rows its ids need (one read per
    distinct id, through the page cache) instead of holding vocab x hidden in memory. For offloaded
    models, whose point is a small footprint: DeepSeek-V3's table is 1.85 GB, the float32 bench
    model's 131 MB. The rows are the stored bytes, so the output equals the resident table's; the
    store's checksum covers the whole tensor, which `store verify` checks, not each row read here.
    `weight` is an empty (0, hidden) tensor that says the dtype and device."""

    def __init__(self, file: str, offset: int, shape: tuple[int, int], stored: torch.dtype, dtype: torch.dtype,
                 device: torch.device | str, ggml_type: str | None = None, row_bytes: int | None = None) -> None:
        super().__init__()
        self.file, self.offset, self.shape, self.stored = file, offset, tuple(shape), stored
        # GGUF's blocks (an imported file's, `store quantize --kquant`'s): each row decoded as read
        self.ggml_type = ggml_type
        self.row_bytes = row_bytes or shape[1] * torch.empty((), dtype=stored).element_size()
        self.register_buffer("weight", torch.empty(0, shape[1], dtype=dtype, device=device), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        wanted = ids.reshape(-1).tolist()  # the one host sync: the ids pick the rows to read
        rows_of: dict[int, int] = {}
        for t in wanted:
            if not 0 <= t < self.shape[0]:
                raise IndexError(f"token ids must be in 0..{self.shape[0] - 1}, got {t}")
            rows_of.setdefault(t, len(rows_of))
        rows = np.empty((len(rows_of), self.row_bytes), dtype=np.uint8)
        fd = os.open(self.file, os.O_RDONLY)
        try:
            for t, i in rows_of.items():
                n = os.preadv(fd, [memoryview(rows[i])], self.offset + t * self.row_bytes)
                if n != self.row_bytes:
                    raise BadInputError(f"{self.file}: embedding row {t} is cut short ({n} of {self.row_bytes} bytes)")
        finally:
            os.close(fd)
        device = self.weight.device
        if self.ggml_type is not None:
            table = dequantize_ggml(torch.from_numpy(rows), self.ggml_type).to(device)
        else:
            table = torch.as_tensor(rows, device=device).view(self.stored)  # no copy on CPU
        index = torch.tensor([rows_of[t] for t in wanted], dtype=torch.long, device=device)
        return table.to(self.weight.dtype)[index].view(*ids.shape, self.shape[1])


def stored_embedding(store: Store, config: MoEConfig, dtype: torch.dtype, device: torch.device | str
                     ) -> StoredEmbedding | None:
    """The model's embedding left in `store`, where it can be (a plain tensor, not tied to the lm_head)."""
    key = hf_name(config, "embed.weight")
    if config.tie_embeddings or not store.manifest.has_tensor(key):
        return None
    e = store.manifest.tensor(key)
    if (e.quant or {}).get("scheme") == "ggml":
        q = e.quant
        return StoredEmbedding(store.path(e.file), e.offset, tuple(q["shape"]), torch.uint8, dtype, device,
                               ggml_type=q["ggml_type"], row_bytes=e.shape[1])
    if e.quant is not None or len(e.shape) != 2:
        return None
    return StoredEmbedding(store.path(e.file), e.offset, tuple(e.shape), torch_dtype(e.dtype), dtype, device)


class _NoExperts:
    """Placeholder provider until the caller installs its own."""

    def stream(self, layer: int, experts: list[int], x_ND=None):
        raise RuntimeError(f"layer {layer}: no expert provider installed")


def save_store(model: MoEGPT, path: str, *, side_files: dict[str, bytes] | None = None) -> Store:
    """Write a model (dense tensors and one chunk per expert) into a new store at `path`."""
    c = model.config
    store = Store.create(path)
    with store.writer() as w:
        w.put_file("config.json", json.dumps(hf_config(c), indent=2).encode())
        for name, data in (side_files or {}).items():
            w.put_file(name, data)
        for name, p in _dense_params(model):
            w.put_dense(hf_name(c, name), p.detach())
        for ffn in model.moe_layers():
            ex = ffn.experts
            if not isinstance(ex, ResidentExperts):
                raise ValueError(f"layer {ffn.layer}: experts are not resident; save them through their provider")
            for e in range(c.num_experts):
                names = hf_expert_names(c, ffn.layer, e)
                w.put_expert(ffn.layer, e, [ExpertTensor(name=n, tensor=t[e].detach(), stacked=ex.mlp.stacked)
                                            for n, t in zip(names, ex.tensors())], num_experts=c.num_experts)
        w.set_model({"source": "semoe", "architecture": hf_config(c)["architectures"][0], "model_type": c.arch,
                     "num_layers": c.num_layers, "config": hf_config(c)})
        w.commit()
    return store


def load_model(path: str | Store, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               dense: str = "auto", progress: Callable[[int], None] | None = None) -> MoEGPT:
    """A model, everything resident, from a HuggingFace directory or a store (by path, or open);
    `dense` as `load_store`'s (`auto` keeps a HuggingFace directory's dense weights as
    shipped: its import makes the store `auto` chooses from); `progress` called with the bytes of each read."""
    if isinstance(path, Store):
        return load_store(path, device=device, dtype=dtype, dense=dense, progress=progress)
    if not os.path.isdir(path):
        raise BadInputError(f"{path}: no such directory (expected a HuggingFace checkpoint or a store)")
    if is_store(path):
        return load_store(path, device=device, dtype=dtype, dense=dense, progress=progress)
    model = load_hf(path, device=device, dtype=dtype, progress=progress)
    scheme = resolve_dense(dense, device=device, expert_schemes=set())
    if scheme != "float":
        compact_dense_linears(model, scheme)
        stack_projections(model)
    return model


def load_model_tokenizer(source: str | Store, config: MoEConfig):
    """The model's tokenizer: its tokenizer.json (from the directory, or the side files of the store,
    given open or by path), the byte tokenizer for models trained here, or None when a checkpoint has
    neither."""
    from semoe.checkpoints.tokenizer import load_tokenizer, store_tokenizer, trained_here_tokenizer

    if isinstance(source, str) and is_store(source):
        source = Store.open(source)
    if isinstance(source, Store):
        return store_tokenizer(source, config.vocab_size, config.arch)
    if os.path.isfile(os.path.join(source, "tokenizer.json")):
        return load_tokenizer(source, vocab_size=config.vocab_size)
    return trained_here_tokenizer(config.arch, config.vocab_size)
