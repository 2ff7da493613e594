"""GGUF files of tiny HuggingFace checkpoints, written with the `gguf` package in the exporter's layout
(`semoe.checkpoints.gguf_export`: llama.cpp's converter's names from the package's own `TensorNameMap`,
experts stacked per layer, Mixtral's query and key rows permuted, DeepSeek's kv_b split into k_b and v_b,
gpt-oss's gate and up separated; that layout was checked against llama.cpp's own converter in the bench
environment: docs/benchmarks.md, "GGUF files"), and a byte-level BPE tokenizer the file carries."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch

from helpers.hf_models import load_safetensors_dir

from semoe.checkpoints import gguf_export

TOKENIZER_TEXT = ("the cat sat on the mat and the dog ran to the big red house; one two three four five six "
                  "seven eight nine ten. The quick brown fox jumps over the lazy dog! def main(): return 0\n") * 8
SPECIAL = ("<unk>", "<s>", "</s>")
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}assistant:"


def bpe_tokenizer(vocab_size: int):
    """A byte-level BPE of exactly `vocab_size` tokens (ids 0-2: <unk> <s> </s>), trained on a short text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TOKENIZER_TEXT], trainer=trainer)
    assert tok.get_vocab_size() == vocab_size, f"{tok.get_vocab_size()} tokens trained, {vocab_size} wanted"
    return tok


def add_bpe_tokenizer(hf_dir: pathlib.Path, vocab_size: int) -> None:
    """The BPE as the HuggingFace directory's tokenizer (what the GGUF's is compared with)."""
    bpe_tokenizer(vocab_size).save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
         "add_bos_token": False, "chat_template": CHAT_TEMPLATE}))


def gguf_tensors(model_type: str, cfg: dict, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """llama.cpp's tensors (names and float32 values) of a HuggingFace state dict, laid out by the exporter
    (`gguf_export.plan`: the converter's names, stacking, permutations and splits)."""
    return {o.name: np.ascontiguousarray(o.make(*(state[n].float().numpy() for n in o.sources)))
            for o in gguf_export.plan(model_type, cfg, list(state))}


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """`rows` rows of `cols` weights of ggml type `name` as raw blocks (rows, bytes of a row): random codes and
    sub-scales, the half scales such that weights stay under about 0.1, as a model's do (a type the package
    cannot quantize: K-quants, IQ4)."""
    import gguf

    t = gguf.GGMLQuantizationType[name]
    per, nbytes = gguf.GGML_QUANT_SIZES[t]
    b = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)

    def half(at: int, lo: float, hi: float) -> None:
        b[:, :, at:at + 2] = rng.uniform(lo, hi, b.shape[:2]).astype(np.float16)[..., None].view(np.uint8)

    if name == "MXFP4":
        b[:, :, 0] = rng.integers(116, 121, b.shape[:2])  # 2^-11 .. 2^-7 times codes of up to 12
    elif name == "Q6_K":
        half(208, 2e-6, 2e-5)  # times int8 sub-scales and codes of up to 32
    elif name in ("Q4_K", "Q5_K"):
        half(0, 2e-5, 1e-4)  # times 6-bit sub-scales and codes of up to 31
        half(2, 0.0, 5e-5)
    elif name == "IQ4_XS":
        half(0, 5e-6, 2e-5)  # times sub-scales of up to 32 and values of up to 127
    else:
        half(0, 2e-4, 2e-3)
        if name in ("Q4_1", "Q5_1"):
            half(2, -0.02, 0.02)
    return b.reshape(rows, -1)


def write_gguf(hf_dir: pathlib.Path, out: pathlib.Path, *, qtype: str = "F32", split: int = 0,
               whole_kv_b: bool = False, types: dict[str, str] | None = None) -> pathlib.Path:
    """`hf_dir` (a tiny checkpoint with `add_bpe_tokenizer`'s tokenizer) as a GGUF file at `out`: weight matrices
    of two or more dimensions whose rows fit `qtype`'s blocks in `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1, MXFP4: what the package quantizes; K-quants and IQ4: random blocks of the type, `random_blocks`,
    not the weights), the rest float32; `split` > 0: that many tensors a file, written as
    NAME-0000k-of-0000N.gguf beside `out` (the first's path is returned). `whole_kv_b`: DeepSeek's kv_b_proj as
    older converters wrote it, one `attn_kv_b` as the checkpoint holds it, not split into `attn_k_b` and `attn_v_b`.
    `types`: another type for the tensors whose name holds a key (`{"ffn_up_exps": "Q4_0"}`), as mixes write."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch_name = gguf_export.ARCHS[model_type][1]
    state = load_safetensors_dir(hf_dir)
    tensors = gguf_tensors(model_type, cfg, state)
    if whole_kv_b:
        for name in [n for n in state if n.endswith("self_attn.kv_b_proj.weight")]:
            i = name.split("layers.")[1].split(".")[0]
            del tensors[f"blk.{i}.attn_k_b.weight"], tensors[f"blk.{i}.attn_v_b.weight"]
            tensors[f"blk.{i}.attn_kv_b.weight"] = state[name].float().numpy()
    files = {n: (hf_dir / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")}
    items = sorted(tensors.items())
    chunks = [items[i:i + split] for i in range(0, len(items), split)] if split else [items]
    paths = [out] if not split else [out.with_name(f"{out.stem}-{k + 1:05d}-of-{len(chunks):05d}.gguf")
                                     for k in range(len(chunks))]
    rng = np.random.default_rng(0)
    default = qtype
    for k, (path, chunk) in enumerate(zip(paths, chunks)):
        w = gguf.GGUFWriter(str(path), arch_name)
        if k == 0:
            w.add_name("tiny " + model_type)
            gguf_export.metadata(w, model_type, cfg)
            gguf_export.tokenizer(w, files, cfg["vocab_size"])
        if split:
            w.add_uint16("split.no", k)
            w.add_uint16("split.count", len(chunks))
            w.add_int32("split.tensors.count", len(items))
        for name, a in chunk:
            qtype = next((t for key, t in (types or {}).items() if key in name), default)
            kind = gguf.GGMLQuantizationType[qtype]
            block = gguf.GGML_QUANT_SIZES[kind][0]
            if a.ndim >= 2 and qtype != "F32" and a.shape[-1] % block == 0 and "ffn_gate_inp" not in name \
                    and name.endswith(".weight"):  # biases (gpt-oss's experts' are 2-D) stay float, as llama-quantize's
                if qtype.endswith("_K") or qtype.startswith("IQ"):
                    if "_exps" not in name:  # only the experts: random blocks elsewhere would swamp the model
                        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
                        continue
                    rows = random_blocks(qtype, int(np.prod(a.shape[:-1])), a.shape[-1], rng)
                    q = rows.reshape(*a.shape[:-1], rows.shape[-1])
                else:
                    q = gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), kind)
                w.add_tensor(name, q, raw_dtype=kind)
            else:
                w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return paths[0]


def dequantized_state(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32, by the package's own dequantization (the reference)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32) for t in r.tensors}


def runner_gives_the_engines_tokens(store: str) -> None:
    """The engine decodes in one call of the kernels; the torch-free runner's 8 greedy tokens are the engine's,
    log-probs within 1e-4 (the same kernels,
    the rotary tables numpy's against torch's); and `semoe generate`'s own choice, asked before the runner
    loads, does not refuse it the store (with memory short it then takes the runner, not the engine)."""
    from inference.engine import Engine
    from inference.placement import lean_refusal
    from inference.engine_config import EngineConfig
    from inference.torch_free.runner import LeanConfig, LeanModel
    from semoe.decode.loop import SamplingConfig

    engine = Engine.load(store, EngineConfig())
    try:
        assert engine.decode_path() == "semoe's CPU kernels, the whole step in one call"
        plain = engine.generate([1, 5, 9, 33, 100], SamplingConfig(max_new_tokens=8))
    finally:
        engine.close()
    assert lean_refusal(store) is None
    with LeanModel(store, LeanConfig(cache_bytes=None)) as lean:
        free = lean.generate([1, 5, 9, 33, 100], SamplingConfig(max_new_tokens=8))
    assert free.tokens == plain.tokens
    np.testing.assert_allclose(free.logprobs, plain.logprobs, rtol=0, atol=1e-4)
