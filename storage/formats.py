"""The store's user-facing format choices and quantization constants, without torch: the element
types `store import --dtype` casts to, int4's group sizes, int8's code range and the rows quantized
at once, and the bytes of each element type the manifest names. `storage.dtypes` and `storage.quant`
(which import torch) take them from here, so that the command line can offer them before anything
heavy loads, and the store's manifest and reader work without torch."""

from storage.errors import BadInputError

CAST_CHOICES = ("keep", "float32", "bfloat16", "float16")  # the names users give on the command line (--dtype)
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_DEFAULT_GROUP = 128
INT8_MAX = 127  # int8 codes lie in [-127, 127], one scale per output row


# GGUF's quantized types the kernels compute on as stored (semoe/kernels/gemv_ggml.c): a GGUF file's
# expert weights of these types are kept in the expert chunks block for block (storage.quant's `ggml`)
GGML_KERNEL_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")

# expert schemes beside which `--dense auto` takes int8 dense weights on CPU (`auto_dense`)
INT8_DENSE_BESIDE = frozenset({"int8", "int4", "mxfp4", "ggml"})


def auto_dense(expert_schemes: set[str] | frozenset[str], on_cpu: bool) -> str:
    """What `--dense auto` takes, for the engine and the torch-free runner alike: int8 on CPU beside
    compact experts (int8, int4, or a checkpoint's own MXFP4), since decoding streams every dense weight
    from memory for each token and float ones would take as long as the experts (gpt-oss-20b's bfloat16
    attention and head are 2.4 GB a token beside 1.3 GB of MXFP4 experts; llama.cpp's own GGUF of it
    keeps them q8_0). Measured on a 2-layer gpt-oss-20b-shaped checkpoint (bench/make_real.py): KL
    6.7e-4 nats a token from bfloat16 dense weights. Else `float`, as stored: on a GPU, and beside float
    or FP8 experts. (int4 dense weights save a few percent more of a token's time beside int4 experts
    but, measured on the bench model, more than double the KL divergence that int4 experts alone cause.)"""
    return "int8" if on_cpu and set(expert_schemes) & INT8_DENSE_BESIDE else "float"


def int8_rows_spec(quant: dict | None) -> bool:
    """Whether a manifest entry's `quant` is int8 codes laid out (O, I), one scale per row: what `semoe
    store quantize` stores dense linear weights as, and what the loaders take as stored."""
    return bool(quant) and quant.get("scheme") == "int8" and not quant.get("transposed")
# Rows quantized at once: bounds the float32 temporaries (a 32000-row lm_head took four copies of
# itself, 0.5 GB, when quantized whole); a multiple of int4's 64-row blocks
QUANTIZE_ROWS = 512

# bytes per element of each element type, in the manifest's (safetensors') spelling
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1}


def itemsize(name: str) -> int:
    """Bytes per element of a manifest dtype name."""
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise BadInputError(f"unsupported dtype {name!r}; supported: {', '.join(ITEMSIZE)}") from None


# `store quantize --kquant`: the bits a weight its mix stays within by default (Q4_K_M averages some 4.9 on MoE models)
KQUANT_TARGET_BITS = 4.9
