"""Install semoe: the packages storage, mpress, semoe, inference, tools and the `semoe` command."""

from setuptools import Extension, setup

# decode's CPU kernels (semoe/kernels/*.c), built for the machine that installs them; loaded with
# ctypes by semoe/cpu_kernels.py, which falls back to torch's ops where they are missing
KERNELS = Extension("semoe._kernels",
                    sources=["semoe/kernels/gemv.c", "semoe/kernels/gemv_float.c", "semoe/kernels/decode_step.c"],
                    depends=["semoe/kernels/kernels.h"],
                    extra_compile_args=["-O3", "-march=native", "-fopenmp"], extra_link_args=["-fopenmp"])

setup(
    name="semoe",
    version="0.1.0",
    description="Train and serve Mixture-of-Experts GPT models larger than GPU memory",
    python_requires=">=3.10",
    packages=["storage", "mpress", "semoe", "inference", "tools"],
    ext_modules=[KERNELS],
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
        "matplotlib>=3.7",  # the planner's memory-timeline plot
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "transformers>=4.45",
            "openai>=1.40",  # the official client against the server
            "zarr>=3.0",
        ],
    },
    entry_points={"console_scripts": ["semoe=tools.cli:main"]},
)
