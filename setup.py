"""Install semoe: the packages storage, mpress, semoe, inference, tools and the `semoe` command.

The compiled CPU kernels (semoe/kernels/*.c, loaded with ctypes by semoe/kernels/loader.py) are built once
per instruction set (semoe/kernels/variants.py), so the environment runs on any CPU of its
architecture: the loader takes the best build the CPU runs. None of them is required: with no C
compiler, or one without OpenMP, the install goes on without them, says so in one line, and semoe
computes with torch's ops instead.
"""

import importlib.util
import os
import shutil
import sys
import tempfile

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

HERE = os.path.dirname(os.path.abspath(__file__))


def _variants_module():
    # read without importing the package, which is not installed yet
    spec = importlib.util.spec_from_file_location("_semoe_kernel_variants",
                                                  os.path.join(HERE, "semoe", "kernels", "variants.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


kv = _variants_module()
SOURCES = [f"semoe/kernels/{f}.c" for f in ("gemv", "gemv_fp4", "gemv_float", "attend", "decode_step", "decode_abi",
                                            "prefill", "route", "deltanet", "compressed", "gemv_ggml",
                                            "gemv_ggml_tile")]
DEPENDS = ["semoe/kernels/kernels.h", "semoe/kernels/decode_abi.h", "semoe/kernels/lin.h",
           "semoe/kernels/ggml_blocks.h"]
KERNELS = [Extension(f"semoe.kernels.{v.module}", sources=SOURCES, depends=DEPENDS, optional=True,
                     extra_compile_args=["-O3", "-fopenmp", *kv.cflags(v)], extra_link_args=["-fopenmp"])
           for v in kv.buildable()]
# measured with `semoe generate` on bench_offload's float32 Mixtral-shaped model, 2 cores: 26.8-28.0
# tok/s on the kernels, 11.5-12.1 on torch's ops
OFF_COST = ("decoding on CPU runs on torch's ops instead, about 2.4x slower per token, and `semoe generate --lean` "
            "is unavailable")
_BUILD_ERRORS = (CCompilerError, ExecError, PlatformError, OSError)  # CompileError and LinkError are CCompilerErrors


class BuildKernels(build_ext):
    """Builds each of the kernels' variants the compiler can; where it can build none (no C compiler,
    or one without OpenMP), the install goes on without them and says so in one line."""

    def build_extensions(self) -> None:
        problem = self._openmp_problem()
        if problem:
            self._off(problem)
            return
        built = []
        for ext in list(self.extensions):
            try:
                self.build_extension(ext)
                built.append(ext)
            except _BUILD_ERRORS as e:
                self.extensions.remove(ext)
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                print(f"semoe: the {ext.name} kernels were not built ({first}); the loader takes another build",
                      file=sys.stderr)
        if not built:
            self._off("the compiler built none of them")

    def _off(self, why: str) -> None:
        self.extensions = []
        print(f"semoe: compiled CPU kernels are off ({why}): {OFF_COST}", file=sys.stderr, flush=True)

    def _openmp_problem(self) -> str | None:
        """Why this compiler cannot build the kernels (none on PATH, or no OpenMP); None if it can."""
        cc = self.compiler.compiler_so[0] if getattr(self.compiler, "compiler_so", None) else "cc"
        if shutil.which(cc) is None:
            return f"no C compiler: {cc} is not on PATH"
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "omp_probe.c")
            with open(src, "w") as f:
                f.write("#include <omp.h>\nint semoe_probe(void) { return omp_get_max_threads(); }\n")
            try:
                objs = self.compiler.compile([src], output_dir=tmp, extra_postargs=["-fopenmp"])
                self.compiler.link_shared_object(objs, os.path.join(tmp, "omp_probe.so"), extra_postargs=["-fopenmp"])
            except _BUILD_ERRORS:
                return f"the C compiler {cc} has no OpenMP"
        return None


setup(
    name="semoe",
    version="0.1.0",
    description="Train and serve Mixture-of-Experts GPT models larger than GPU memory",
    python_requires=">=3.10",
    packages=find_packages(include=["storage*", "mpress*", "semoe*", "inference*", "tools*"]),
    ext_modules=KERNELS,
    cmdclass={"build_ext": BuildKernels},
    install_requires=[
        # torch is installed first, pinned, by tools/run.sh; a looser range here keeps pip from
        # replacing it with a multi-GB CUDA build.
        "torch>=2.4",
        "numpy>=1.24",
        "tensorstore>=0.1.60",
        "safetensors>=0.4",
        "crc32c>=2.4",
        "tqdm>=4.60",
        "nvidia-ml-py>=12.0",
        "aiofiles>=23.0",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "prometheus_client>=0.20",
        "jinja2>=3.1",
        "gguf>=0.17",  # reading llama.cpp's GGUF files (memory-mapped) and decoding their quantized blocks
        "transformers>=5.24",  # a GGUF's tokenizer rebuilt from its metadata (and the tests' oracle)
        "tokenizers>=0.20",  # HuggingFace tokenizer.json files
        "matplotlib>=3.7",  # the planner's memory-timeline plot
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "openai>=1.40",  # the official client against the server
            "zarr>=3.0",
            "setuptools>=64",  # the kernels' install tests run setup.py (venvs of Python 3.12+ have none)
        ],
    },
    entry_points={"console_scripts": ["semoe=tools.cli:main"]},
)
