"""Small random checkpoints of every architecture the compiled kernels take, as stores in every format
(the `arch_stores` fixture of tests/conftest.py)."""

from __future__ import annotations

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss",
         "minimax_m2", "dots1", "kimi_k25", "ernie4_5_moe", "hunyuan_v1_moe", "llama4",
         "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe", "deepseek_v4")

# shapes int4's row blocks (64 outputs) and groups (32 inputs) take, for experts and dense weights alike (and
# DeepSeek-V4's groups of its output projection)
WIDER = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=64,
             intermediate_size_mlp=64, o_lora_rank=64)
CASES = [(a, f) for a in ARCHS for f in ("f32", "int8", "int4")] + [("deepseek_v3", "fp8"), ("gpt_oss", "mxfp4")]


def store_maker(tmp_path_factory):
    """(arch, format) -> a store of a small random transformers checkpoint of `arch`, made once: f32 as
    imported, int8/int4 quantized by semoe, fp8 (DeepSeek-V3) and mxfp4 (gpt-oss) in the published
    layouts."""
    from helpers.hf_models import make_hf_checkpoint
    from helpers.quantized_checkpoints import write_fp8_checkpoint, write_mxfp4_checkpoint
    from semoe.checkpoints.hf_convert import import_checkpoint
    from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store

    made: dict[tuple[str, str], str] = {}

    def get(arch: str, fmt: str) -> str:
        if (arch, fmt) not in made:
            root = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            hf = make_hf_checkpoint(arch, root / "hf", seed=5, **WIDER)  # fields an arch lacks are ignored
            if fmt in ("int8", "int4"):
                quantize_store(get(arch, "f32"), str(root / "store"), QuantizeConfig(bits=int(fmt[3:]), group_size=32))
            else:
                if fmt == "fp8":
                    write_fp8_checkpoint(hf, root / "fp8", (32, 32), mtp=False)
                elif fmt == "mxfp4":
                    write_mxfp4_checkpoint(hf, root / "mxfp4")
                import_checkpoint(str(root / ("hf" if fmt == "f32" else fmt)), str(root / "store"))
            made[arch, fmt] = str(root / "store")
        return made[arch, fmt]

    return get
