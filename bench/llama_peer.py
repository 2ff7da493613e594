"""llama.cpp as a peer for the benches, in its own virtual environment.

Users run quantized MoE models on CPUs with llama.cpp, so the benches put semoe side by side with
it. llama.cpp never enters semoe's dependencies or test suite: this module builds it once into a
separate venv (default ~/.cache/semoe-bench/llama, or $SEMOE_BENCH_LLAMA_ENV, or the env_dir
argument) and drives it through subprocesses, since the project venv cannot import llama_cpp.

What ensure_env() puts in env_dir (each step is skipped when its output is there; peer.json,
written last, makes later calls instant):

    venv/            python with llama-cpp-python (built from source, CPU, -DGGML_NATIVE=ON),
                     torch==2.13.0 (the wheel on local disk), numpy, sentencepiece, transformers
                     and the gguf-py shipped in the same sdist (the PyPI `gguf` release lags what
                     the converter uses)
    src/             the llama-cpp-python sdist, unpacked; vendor/llama.cpp holds the sources
    build/quantize/  cmake build of vendor/llama.cpp, target llama-quantize only (static)
    build/server-noamx/  the same without AMX (NO_AMX), target llama-server (`ensure_server`, for
                     bench_serve.py; built on first use)
    converter/       convert_hf_to_gguf.py + its conversion/ package, patched (see below)
    peer.json        the version and the paths above

Tokenizer. The bench checkpoints are saved without a tokenizer, which the converter needs.
add_tokenizer() trains a byte-level BPE (tokenizers library, from the project venv) to exactly
vocab_size tokens on the Python standard library's sources. The converter identifies a BPE
pre-tokenizer by hashing how it splits a fixed text and refuses hashes it does not know; ours is
a plain ByteLevel pre-tokenizer, whose split is llama.cpp's "gpt-2". The converter has no
override flag, so the copy in env_dir/converter/ is patched: an unknown hash maps to "gpt-2"
instead of raising (and DeepSeek-V3.2's assertion that the tokenizer adds a BOS, which no
tokenizer.json passes under transformers 5, is dropped). The project's files and the sdist stay
untouched. Two converters read other tokenizers: ERNIE-4.5's only a sentencepiece tokenizer.model
(add_sentencepiece() trains one in the peer venv, which has sentencepiece; ids 0-2 as the BPE's), and
Hunyuan's a remote-code tokenizer's tiktoken ranks and Tencent's config of per-layer lists: its copy
takes the BPE through the gpt-2 path and the transformers config's integers instead.

Work in the peer venv (logits, greedy decoding) runs this same file as a worker:
`<venv>/bin/python llama_peer.py _worker <job.json>`; it needs only numpy and llama_cpp there.

Accuracy. llama.cpp keeps its KV cache in f16 by default (kv_type="f16", what users get). With
kv_type="f32" an f32 GGUF reproduces transformers' float32 logits to float rounding (selfcheck:
max |diff| 1.4e-6 against 5e-4 with the f16 cache), so the converter's q/k permutation and rope
settings are right for Mixtral.

Timing. llama.cpp's threads spin at barriers: with n_threads=2 on a 2-core machine, any other
load (a test run beside the bench) slows decoding several-fold. Time on an idle machine.

Shapes: x_TV is (tokens, vocab).

    python bench/llama_peer.py setup [--env-dir DIR]
    python bench/llama_peer.py add-tokenizer HF_DIR [--sentencepiece]
    python bench/llama_peer.py convert HF_DIR OUT.gguf --outtype f32
    python bench/llama_peer.py quantize F32.gguf OUT.gguf q4_0
    python bench/llama_peer.py selfcheck --workdir /tmp/llama-peer-work/small
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

import numpy as np

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TORCH_REQUIREMENT = "torch==2.13.0"  # the wheel on local disk; any other torch downloads GBs
CONVERTER_REQUIREMENTS = ("numpy", "sentencepiece", "transformers", "protobuf", "safetensors")
CPU_CMAKE_ARGS = ("-DGGML_NATIVE=ON", "-DGGML_BLAS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                  "-DCMAKE_BUILD_TYPE=Release")
CONVERT_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# f32: a quantized file's tensors widened (DeepSeek-V4's MXFP4 experts); q4_k_m, q5_k_m, q6_k, iq4_xs: files users
# download
QUANTIZE_TYPES = ("q4_0", "q8_0", "f32", "q4_k_m", "q5_k_m", "q6_k", "iq4_xs")
# llama.cpp keeps its KV cache in f16 unless told otherwise; "f32" makes an f32 GGUF match transformers'
# float32 logits to float rounding (the f16 cache alone moves them by about 3e-4 of their range)
KV_TYPES = {"f16": 1, "f32": 0}  # name -> ggml_type
# the line in conversion/base.py that refuses an unknown pre-tokenizer hash
_PRETOK_RAISE = 'raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")'


def default_env_dir() -> str:
    """Where the peer venv lives unless a caller says otherwise."""
    return os.environ.get("SEMOE_BENCH_LLAMA_ENV") or os.path.expanduser("~/.cache/semoe-bench/llama")


def _progress(msg: str) -> None:
    print(f"[llama-peer] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerEnv:
    """The built peer: its python, converter and llama-quantize (the record in peer.json)."""

    env_dir: str
    version: str
    python: str
    convert_script: str
    quantize_bin: str
    no_amx: bool = False  # llama-cpp-python built without AMX (`amx_denied`)

    @classmethod
    def load(cls, env_dir: str) -> PeerEnv | None:
        """The recorded env, or None where it is missing, stale or incomplete."""
        try:
            with open(os.path.join(env_dir, "peer.json")) as f:
                env = cls(**json.load(f))
        except (OSError, TypeError, ValueError):
            return None
        paths = (env.python, env.convert_script, env.quantize_bin)
        if env.version != LLAMA_CPP_PYTHON_VERSION or not all(os.path.exists(p) for p in paths):
            return None
        if env.no_amx != amx_denied():  # built for a CPU that runs AMX, on one that does not (or back)
            return None
        return env


def _run(cmd: list[str], log_path: str, env: dict | None = None, cwd: str | None = None) -> None:
    """Runs a build step with its output appended to log_path; raises naming the log on failure."""
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if rc != 0:
        raise RuntimeError(f"{cmd[0]} {' '.join(cmd[1:3])} ... failed with exit {rc}; see {log_path}")


def _has_module(python: str, module: str) -> bool:
    return subprocess.call([python, "-c", f"import {module}"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) == 0


def ensure_env(env_dir: str | None = None, jobs: int = 2) -> PeerEnv:
    """Builds the peer venv, converter and llama-quantize in env_dir once; later calls read peer.json."""
    env_dir = os.path.abspath(env_dir or default_env_dir())
    env = PeerEnv.load(env_dir)
    if env is not None:  # (the converter's copy made again where its patches are older than these)
        _patched_converter(os.path.join(env_dir, "src", f"llama_cpp_python-{env.version}", "vendor", "llama.cpp"),
                           os.path.dirname(env.convert_script))
        return env
    os.makedirs(env_dir, exist_ok=True)
    log = os.path.join(env_dir, "build.log")
    t0 = time.perf_counter()
    version = LLAMA_CPP_PYTHON_VERSION
    python = os.path.join(env_dir, "venv", "bin", "python")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]

    if not os.path.exists(python):
        _progress(f"creating the venv {os.path.dirname(os.path.dirname(python))}")
        _run([sys.executable, "-m", "venv", os.path.join(env_dir, "venv")], log)

    src_root = os.path.join(env_dir, "src")
    sdist = os.path.join(src_root, f"llama_cpp_python-{version}.tar.gz")
    src = os.path.join(src_root, f"llama_cpp_python-{version}")
    llama_src = os.path.join(src, "vendor", "llama.cpp")
    if not os.path.exists(sdist):
        _progress(f"downloading the llama-cpp-python {version} sdist")
        os.makedirs(src_root, exist_ok=True)
        _run([python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={version}", "-d", src_root], log)
    if not os.path.exists(os.path.join(llama_src, "CMakeLists.txt")):
        _progress("unpacking it")
        with tarfile.open(sdist) as tar:
            tar.extractall(src_root, filter="data")

    if not _has_module(python, "torch"):
        _progress(f"installing {TORCH_REQUIREMENT} (local wheel)")
        _run(pip + [TORCH_REQUIREMENT], log)
    if not (_has_module(python, "gguf") and _has_module(python, "transformers")):
        _progress("installing the converter's requirements and gguf-py from the sdist")
        # torch pinned again so that no requirement pulls a different one
        _run(pip + [TORCH_REQUIREMENT, *CONVERTER_REQUIREMENTS, os.path.join(llama_src, "gguf-py")], log)

    no_amx = amx_denied()
    record = os.path.join(env_dir, "peer.json")
    if _has_module(python, "llama_cpp") and os.path.exists(record):
        with open(record) as f:
            if json.load(f).get("no_amx", False) != no_amx:  # built for the other kind of CPU: again
                _run(pip[:3] + ["uninstall", "-y", "llama-cpp-python"], log)
    if not _has_module(python, "llama_cpp"):
        _progress(f"building llama-cpp-python {version} from source (about 12 minutes on 2 cores; log: {log})"
                  + (": without AMX, which this CPU shows but stops with SIGILL" if no_amx else ""))
        # (CMake starts its C and C++ flags from CFLAGS and CXXFLAGS; gcc keeps an explicit -mno-amx-*
        # over what -march=native would enable)
        flags = dict(CFLAGS=NO_AMX, CXXFLAGS=NO_AMX) if no_amx else {}
        build_env = dict(os.environ, CMAKE_ARGS=" ".join(CPU_CMAKE_ARGS + ("-DLLAVA_BUILD=OFF",)),
                         CMAKE_BUILD_PARALLEL_LEVEL=str(jobs), **flags)
        # a kept build dir makes a rerun after a failure incremental
        _run(pip + [TORCH_REQUIREMENT, "-C", f"build-dir={os.path.join(env_dir, 'build', 'pip')}", sdist],
             log, env=build_env)

    quantize_build = os.path.join(env_dir, "build", "quantize")
    quantize_bin = os.path.join(quantize_build, "bin", "llama-quantize")
    if not os.path.exists(quantize_bin):
        _progress(f"building llama-quantize from the same sources (log: {log})")
        _run(["cmake", "-S", llama_src, "-B", quantize_build, *CPU_CMAKE_ARGS, "-DBUILD_SHARED_LIBS=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
              "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"], log)
        _run(["cmake", "--build", quantize_build, "--target", "llama-quantize", f"-j{jobs}"], log)

    convert_script = _patched_converter(llama_src, os.path.join(env_dir, "converter"))
    env = PeerEnv(env_dir=env_dir, version=version, python=python, convert_script=convert_script,
                  quantize_bin=quantize_bin, no_amx=no_amx)
    with open(os.path.join(env_dir, "peer.json"), "w") as f:
        json.dump(dataclasses.asdict(env), f, indent=1)
    _progress(f"peer ready in {time.perf_counter() - t0:.0f} s: {env_dir}")
    return env


# The native build's AMX paths (q8_0, q4_0, MXFP4 weights on a CPU that shows AMX) stopped llama-server
# with SIGILL as its threads started on an AMX Xeon VM, whose kernel does not grant the tile state; f32
# GGUFs ran. The server is built without them: what runs there is what a user of that machine gets.
# llama-cpp-python (the decode benches' peer) too, where `amx_denied` finds the same.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

# a tile configured, zeroed and released: SIGILL where the CPU shows AMX but its tile state is not
# usable (a VM's hypervisor that does not pass it, whatever arch_prctl grants)
_AMX_PROBE = r"""
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64];
    syscall(SYS_arch_prctl, 0x1023, 18); /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1, cfg[16] = 64, cfg[48] = 16; /* palette 1; tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


@functools.lru_cache(maxsize=1)
def amx_denied() -> bool:
    """Whether this CPU shows AMX (/proc/cpuinfo's amx_tile) and a tile instruction stops a process with
    SIGILL all the same: a probe compiled with gcc and run once."""
    import tempfile

    try:
        with open("/proc/cpuinfo") as f:
            if "amx_tile" not in f.read():
                return False
    except OSError:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "probe.c"), os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(_AMX_PROBE)
        if subprocess.call(["gcc", "-O1", "-mamx-tile", src, "-o", exe], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) != 0:
            return False  # no compiler that knows AMX: the build will not use it either
        return subprocess.call([exe], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) != 0


def ensure_server(env: PeerEnv, jobs: int = 2) -> str:
    """llama.cpp's llama-server built once from the peer's sources (build/server-noamx/, static, CPU as
    the rest, without AMX: NO_AMX); its path. bench_serve.py's peer."""
    llama_src = os.path.join(env.env_dir, "src", f"llama_cpp_python-{env.version}", "vendor", "llama.cpp")
    build = os.path.join(env.env_dir, "build", "server-noamx")
    binary = os.path.join(build, "bin", "llama-server")
    if not os.path.exists(binary):
        log = os.path.join(env.env_dir, "build.log")
        _progress(f"building llama-server from the peer's sources (several minutes on 2 cores; log: {log})")
        _run(["cmake", "-S", llama_src, "-B", build, *CPU_CMAKE_ARGS, "-DBUILD_SHARED_LIBS=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", f"-DCMAKE_C_FLAGS={NO_AMX}",
              f"-DCMAKE_CXX_FLAGS={NO_AMX}"], log)
        _run(["cmake", "--build", build, "--target", "llama-server", f"-j{jobs}"], log)
    return binary


def imatrix(src_gguf: str, text_file: str, out: str, env: PeerEnv | None = None, n_threads: int = 2,
            ctx: int = 512, chunks: int | None = None, jobs: int = 2) -> str:
    """llama.cpp's importance matrix of a GGUF over a text file (llama-imatrix, built once beside
    llama-quantize in build/quantize/), in windows of `ctx` tokens; at most `chunks` of them."""
    env = env or ensure_env()
    binary = os.path.join(os.path.dirname(env.quantize_bin), "llama-imatrix")
    if not os.path.exists(binary):
        log = os.path.join(env.env_dir, "build.log")
        _progress(f"building llama-imatrix beside llama-quantize (log: {log})")
        _run(["cmake", "--build", os.path.dirname(os.path.dirname(env.quantize_bin)), "--target", "llama-imatrix",
              f"-j{jobs}"], log)
    part = out + ".part.gguf"  # the tool writes GGUF when the name says so
    _check_call([binary, "-m", src_gguf, "-f", text_file, "-o", part, "-c", str(ctx), "-t", str(n_threads),
                 "--no-ppl", *(["--chunks", str(chunks)] if chunks else [])], f"llama-imatrix on {src_gguf}")
    os.replace(part, out)
    return out


# DeepSeek-V3.2's converter asserts its tokenizer adds a BOS; transformers 5 drops tokenizer_config's
# add_bos_token wherever a tokenizer.json is given, so no checkpoint passes it (the bench prompts are ids)
_DSV32_BOS = ('assert getattr(tokenizer, "add_bos_token", False), "Change value of add_bos_token to true in '
              'tokenizer_config.json file."')
# Hunyuan's converter reads Tencent's remote-code tokenizer (tiktoken ranks) and config (per-layer lists of
# expert widths, top-k and shared experts); transformers' hunyuan_v1_moe has a tokenizer.json and integers:
# one shared expert, experts as wide as `intermediate_size`
# (the dense Hunyuan's converter has the same line deeper in: the newline before it tells them apart)
_HY_VOCAB = "\n        tokenizer = AutoTokenizer.from_pretrained(self.dir_model, trust_remote_code=True)\n"
_HY_VOCAB_NEW = _HY_VOCAB + ('        if not hasattr(tokenizer, "mergeable_ranks"):  # patched by semoe bench/llama_peer.py\n'
                             '            self._set_vocab_gpt2()\n'
                             '            return\n')
_HY_PARAMS = "        hparams = self.hparams\n\n        self.gguf_writer.add_expert_shared_feed_forward_length("
_HY_PARAMS_NEW = ("        hparams = self.hparams\n"
                  "        for key, default in ((\"moe_intermediate_size\", hparams[\"intermediate_size\"]), (\"moe_topk\", 1),\n"
                  "                             (\"num_shared_expert\", 1)):  # patched by semoe bench/llama_peer.py\n"
                  "            v = hparams.get(key, default)\n"
                  "            hparams[key] = v if isinstance(v, list) else [v] * hparams[\"num_hidden_layers\"]\n"
                  "\n        self.gguf_writer.add_expert_shared_feed_forward_length(")
_PATCHES = "3"  # the patches' version, kept in the copy: a copy of an older one is made again


def _patched_converter(llama_src: str, dest: str) -> str:
    """A copy of the converter that maps an unknown BPE pre-tokenizer hash to "gpt-2", takes
    DeepSeek-V3.2 without its BOS assertion, and Hunyuan from transformers' files (`_HY_VOCAB`)."""
    script = os.path.join(dest, "convert_hf_to_gguf.py")
    stamp = os.path.join(dest, "semoe-patches")
    if os.path.exists(script) and os.path.exists(stamp) and open(stamp).read() == _PATCHES:
        return script
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shutil.copy(os.path.join(llama_src, "convert_hf_to_gguf.py"), tmp)
    shutil.copytree(os.path.join(llama_src, "conversion"), os.path.join(tmp, "conversion"))
    base = os.path.join(tmp, "conversion", "base.py")
    with open(base) as f:
        text = f.read()
    if text.count(_PRETOK_RAISE) != 1:
        raise RuntimeError(f"{base}: cannot find the pre-tokenizer check to patch ({_PRETOK_RAISE!r})")
    # a plain ByteLevel pre-tokenizer splits as GPT-2 does (see the module docstring)
    text = text.replace(_PRETOK_RAISE, 'res = "gpt-2"  # patched by semoe bench/llama_peer.py')
    with open(base, "w") as f:
        f.write(text)
    deepseek = os.path.join(tmp, "conversion", "deepseek.py")
    with open(deepseek) as f:
        text = f.read()
    if text.count(_DSV32_BOS) == 1:  # (a later converter may have dropped it)
        with open(deepseek, "w") as f:
            f.write(text.replace(_DSV32_BOS, "pass  # patched by semoe bench/llama_peer.py"))
    hunyuan = os.path.join(tmp, "conversion", "hunyuan.py")
    with open(hunyuan) as f:
        text = f.read()
    for old, new in ((_HY_VOCAB, _HY_VOCAB_NEW), (_HY_PARAMS, _HY_PARAMS_NEW)):
        if text.count(old) != 1:
            raise RuntimeError(f"{hunyuan}: cannot find the line to patch ({old.strip()!r})")
        text = text.replace(old, new)
    with open(hunyuan, "w") as f:
        f.write(text)
    with open(os.path.join(tmp, "semoe-patches"), "w") as f:
        f.write(_PATCHES)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return script


# ---- tokenizer (runs in the project venv) ----

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: Mixtral's and Llama's unk/bos/eos ids
TRAINED_VOCAB = 32768  # tokens learnt from the sources at most; larger vocabularies are topped up


def _stdlib_texts(max_bytes: int):
    """The Python standard library's sources in a fixed order, up to max_bytes: a corpus on every machine."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    total = 0
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                text = f.read()
            yield text
            total += len(text)
            if total >= max_bytes:
                return


def add_tokenizer(hf_dir: str, vocab_size: int | None = None, max_corpus_bytes: int = 48 << 20,
                  extra_special: tuple[str, ...] = ()) -> str:
    """Trains a byte-level BPE of exactly vocab_size tokens (default: config.json's) into hf_dir, once:
    at most TRAINED_VOCAB learnt from the sources, the rest synthetic merges (`_topped_up`);
    `extra_special`: added tokens an architecture's converter looks up by name (after ids 0-2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = os.path.join(hf_dir, "tokenizer.json")
    if os.path.exists(path):
        return path
    if vocab_size is None:
        with open(os.path.join(hf_dir, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
    tok = Tokenizer(models.BPE())
    # a plain ByteLevel pre-tokenizer: GPT-2's regex split, which llama.cpp calls "gpt-2"
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, TRAINED_VOCAB), special_tokens=[*SPECIAL_TOKENS, *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_stdlib_texts(max_corpus_bytes), trainer=trainer)
    if tok.get_vocab_size() < vocab_size:  # more than the sources give (real models' 150k to 200k)
        tok = Tokenizer.from_str(_topped_up(tok.to_str(), vocab_size))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the BPE trained on {max_corpus_bytes} bytes of stdlib sources has "
                           f"{tok.get_vocab_size()} tokens, not vocab_size={vocab_size}")
    tok.save(path)
    unk, bos, eos = SPECIAL_TOKENS
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": unk, "bos_token": bos,
                   "eos_token": eos, "add_bos_token": False, "model_max_length": 1 << 20}, f, indent=1)
    return path


SENTENCEPIECE_PIECES = 8000  # pieces learnt at most; the converter pads the vocabulary to vocab_size


def add_sentencepiece(hf_dir: str, env: PeerEnv | None = None, max_corpus_bytes: int = 8 << 20) -> str:
    """A sentencepiece BPE (byte fallback) as hf_dir/tokenizer.model, once, for converters that read only
    that (ERNIE-4.5's): trained in the peer venv on the standard library's sources, with unk, bos and
    eos at ids 0-2 as the BPE of `add_tokenizer` has them, and at most SENTENCEPIECE_PIECES pieces (the
    converter fills the ids up to vocab_size with unused pads; the benches give prompts as ids)."""
    path = os.path.join(hf_dir, "tokenizer.model")
    if os.path.exists(path):
        return path
    with open(os.path.join(hf_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    env = env or ensure_env()
    _check_call([env.python, os.path.abspath(__file__), "_sentencepiece", path,
                 str(min(vocab_size, SENTENCEPIECE_PIECES)), str(max_corpus_bytes)],
                f"training a sentencepiece tokenizer for {hf_dir}")
    return path


def _train_sentencepiece(path: str, pieces: int, max_corpus_bytes: int) -> None:
    """The peer-venv side of `add_sentencepiece`: writes path.part, then moves it to path."""
    import tempfile

    import sentencepiece

    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "spm")
        lines = (line for text in _stdlib_texts(max_corpus_bytes) for line in text.splitlines() if line.strip())
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=lines, model_prefix=prefix, vocab_size=pieces, model_type="bpe", byte_fallback=True,
            character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
        shutil.copy(prefix + ".model", path + ".part")
    os.replace(path + ".part", path)


def _topped_up(tokenizer_json: str, vocab_size: int) -> str:
    """A trained BPE (tokenizer.json) given merges up to vocab_size tokens: each appends one byte to a
    token drawn from those already there (seeded), so every new token is reachable, merge by merge;
    they come last, so text encodes as before and the ids beyond the trained ones are rare words."""
    import random

    from tokenizers import pre_tokenizers

    spec = json.loads(tokenizer_json)
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    specials = {t["content"] for t in spec.get("added_tokens", [])}
    tokens = [t for t in vocab if t not in specials]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    while len(vocab) < vocab_size:
        a, b = tokens[rng.randrange(len(tokens))], alphabet[rng.randrange(len(alphabet))]
        if a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        tokens.append(a + b)
        merges.append([a, b] if not merges or isinstance(merges[0], list) else f"{a} {b}")
    return json.dumps(spec)


# ---- conversion and quantization (tools of the peer env) ----

def _check_call(cmd: list[str], what: str) -> str:
    """Runs cmd with its output captured; raises naming `what` and the output's tail on failure."""
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        tail = "\n".join(res.stdout.strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed with exit {res.returncode}:\n{tail}")
    return res.stdout


def convert(hf_dir: str, out_gguf: str, outtype: str = "f32", env: PeerEnv | None = None) -> str:
    """Converts a HuggingFace checkpoint (with a tokenizer) to GGUF with llama.cpp's converter."""
    if outtype not in CONVERT_OUTTYPES:
        raise ValueError(f"outtype={outtype!r}: the converter writes one of {CONVERT_OUTTYPES}; "
                         f"use quantize() for {QUANTIZE_TYPES}")
    if not any(os.path.exists(os.path.join(hf_dir, n)) for n in ("tokenizer.json", "tokenizer.model")):
        raise FileNotFoundError(f"{hf_dir} has no tokenizer.json or tokenizer.model; add_tokenizer() makes one")
    env = env or ensure_env()
    part = out_gguf + ".part"  # a killed run leaves no file that looks finished
    _check_call([env.python, env.convert_script, hf_dir, "--outfile", part, "--outtype", outtype,
                 *_mtp_flags(hf_dir)], f"converting {hf_dir} to {outtype}")
    os.replace(part, out_gguf)
    return out_gguf


# model types whose converter counts multi-token-prediction layers it must be told are absent (Qwen3-Next's
# config never says how many it has)
_MTP_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


def _mtp_flags(hf_dir: str) -> list[str]:
    """`--no-mtp` for a checkpoint of `_MTP_TYPES` without `mtp.*` tensors; nothing otherwise."""
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        if json.load(f).get("model_type") not in _MTP_TYPES:
            return []
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            names = list(json.load(f)["weight_map"])
    else:
        from safetensors import safe_open

        with safe_open(os.path.join(hf_dir, "model.safetensors"), "np") as f:
            names = list(f.keys())
    return [] if any(n.startswith("mtp.") for n in names) else ["--no-mtp"]


def quantize(src_gguf: str, out_gguf: str, qtype: str, env: PeerEnv | None = None, n_threads: int = 2,
             imatrix_file: str | None = None) -> str:
    """Quantizes a (preferably f32) GGUF to qtype with llama-quantize (its quantized tensors too: MXFP4 experts
    are taken to the type from their values); `imatrix_file`: llama-imatrix's importance matrix to weigh
    the fit with."""
    if qtype not in QUANTIZE_TYPES:
        raise ValueError(f"qtype={qtype!r}: allowed are {QUANTIZE_TYPES}")
    env = env or ensure_env()
    part = out_gguf + ".part"
    _check_call([env.quantize_bin, "--allow-requantize", *(["--imatrix", imatrix_file] if imatrix_file else []),
                 src_gguf, part, qtype.upper(), str(n_threads)], f"quantizing {src_gguf} to {qtype}")
    os.replace(part, out_gguf)
    return out_gguf


# ---- running llama.cpp (a worker process in the peer venv) ----

def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _in_worker(job: dict, env: PeerEnv | None, result_name: str, load):
    """Runs one job in the peer venv and returns load(its result file); the job's temp dir goes after."""
    import tempfile

    env = env or ensure_env()
    with tempfile.TemporaryDirectory(prefix="llama-peer-") as tmp:
        job = dict(job, out=os.path.join(tmp, result_name))
        with open(os.path.join(tmp, "job.json"), "w") as f:
            json.dump(job, f)
        _check_call([env.python, os.path.abspath(__file__), "_worker", os.path.join(tmp, "job.json")],
                    f"llama.cpp {job['op']} on {job['gguf']}")
        return load(job["out"])


def _check_kv_type(kv_type: str) -> None:
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type={kv_type!r}: allowed are {tuple(KV_TYPES)}")


def logits(gguf_path: str, tokens: list[int], n_threads: int = 2, kv_type: str = "f16",
           env: PeerEnv | None = None) -> np.ndarray:
    """llama.cpp's float32 logits (len(tokens), vocab) for the tokens, teacher-forced, no BOS added."""
    _check_kv_type(kv_type)
    return _in_worker({"op": "logits", "gguf": gguf_path, "tokens": list(tokens), "n_threads": n_threads,
                       "kv_type": kv_type}, env, "logits.npy", np.load)


def greedy_decode(gguf_path: str, prompt_tokens: list[int], n_new: int, n_threads: int = 2, kv_type: str = "f16",
                  env: PeerEnv | None = None) -> tuple[list[int], float]:
    """n_new greedy tokens after the prompt and the decode speed in tokens/s from the first token on
    (the prompt excluded), after one untimed warm-up generation."""
    if n_new < 2:
        raise ValueError(f"n_new={n_new}: decode speed needs at least 2 new tokens")
    _check_kv_type(kv_type)
    res = decode_run(gguf_path, prompt_tokens, n_new, n_threads=n_threads, kv_type=kv_type, env=env)
    return res["tokens"], res["decode_tok_s"]


def decode_run(gguf_path: str, prompt_tokens: list[int], n_new: int, n_threads: int = 2, kv_type: str = "f16",
               env: PeerEnv | None = None, repack: bool = True, first: bool = False) -> dict:
    """greedy_decode's run with its measures: tokens, decode_tok_s, ttft_s (from the start of the timed
    generation to its first token: the prompt's evaluation), read_bytes_per_token (storage reads
    of the llama.cpp process while decoding, page faults included) and peak_rss_bytes. `repack=False`
    is llama.cpp's --no-repack: q4_0 weights are otherwise copied at load into anonymous memory in its
    kernels' interleaved layout, the whole model, which memory held short cannot give. `first`: the
    first generation of the process is timed too, in full (under "first": the model cold, as loaded),
    instead of a short warm-up; the figures at the top are the second's."""
    if n_new < 2:
        raise ValueError(f"n_new={n_new}: decode speed needs at least 2 new tokens")
    _check_kv_type(kv_type)
    return _in_worker({"op": "decode", "gguf": gguf_path, "tokens": list(prompt_tokens), "n_new": n_new,
                       "n_threads": n_threads, "kv_type": kv_type, "repack": repack, "first": first}, env,
                      "decode.json",
                      _read_json)


def tokenize(gguf_path: str, text: str, env: PeerEnv | None = None) -> list[int]:
    """llama.cpp's tokenization of text with the GGUF's vocabulary (no BOS)."""
    return _in_worker({"op": "tokenize", "gguf": gguf_path, "text": text}, env, "tokens.json", _read_json)


def _worker(job_path: str) -> None:
    """The peer-venv side of logits(), greedy_decode() and tokenize()."""
    from llama_cpp import Llama

    with open(job_path) as f:
        job = json.load(f)
    op, tokens = job["op"], job.get("tokens", [])
    if op == "tokenize":
        llm = Llama(model_path=job["gguf"], vocab_only=True, verbose=False)
        with open(job["out"], "w") as f:
            json.dump(llm.tokenize(job["text"].encode(), add_bos=False, special=False), f)
        return
    if not job.get("repack", True):  # llama.cpp's --no-repack: weights stay in the mapped file, not in
        import llama_cpp.llama_cpp as low  # an anonymous copy laid out for its kernels (q4_0's on x86)

        defaults = low.llama_model_default_params

        def no_repack():
            params = defaults()
            params.use_extra_bufts = False
            return params

        low.llama_model_default_params = no_repack
    n_ctx = len(tokens) + job.get("n_new", 0)
    llm = Llama(model_path=job["gguf"], logits_all=op == "logits", n_ctx=n_ctx, n_batch=min(n_ctx, 512),
                n_threads=job["n_threads"], n_threads_batch=job["n_threads"], type_k=KV_TYPES[job["kv_type"]],
                type_v=KV_TYPES[job["kv_type"]], seed=0, verbose=False)
    if op == "logits":
        llm.eval(tokens)
        np.save(job["out"], np.asarray(llm.scores[: len(tokens)], dtype=np.float32))
        return
    if op != "decode":
        raise ValueError(f"unknown worker op {op!r}")

    reads = []  # storage reads at the start and at the first token of the last generation

    def generate(n: int, prompt: list[int] = tokens) -> tuple[list[int], list[float]]:
        llm.reset()
        out, times = [], [time.perf_counter()]  # the start: times[1] - times[0] is the prompt's evaluation
        reads[:] = [_read_bytes()]
        for tok in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            times.append(time.perf_counter())
            if len(out) == 1:
                reads.append(_read_bytes())
            if len(out) == n:
                break
        return out, times

    def measured(new: list[int], times: list[float]) -> dict:
        return {"tokens": new, "decode_tok_s": (len(times) - 2) / (times[-1] - times[1]),
                "ttft_s": times[1] - times[0],
                # storage reads of this process (page faults on the mmapped model included) per decoding
                # step after the first token; the prompt's apart
                "read_bytes_per_token": (_read_bytes() - reads[1]) / max(1, len(new) - 1),
                "prompt_read_bytes": reads[1] - reads[0],
                "process_read_bytes": _read_bytes()}  # since the process started: its load too

    # the first generation: timed in full, or a warm-up (page in the weights, allocate the graph)
    first = None
    if job.get("first"):
        first = measured(*generate(job["n_new"]))
    else:  # on the prompt's first WARM_PROMPT tokens: a long prompt is evaluated once, timed
        generate(min(job["n_new"], 4), tokens[:WARM_PROMPT])
    out = measured(*generate(job["n_new"]))
    import resource

    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if first is not None:
        out["first"] = first
    with open(job["out"], "w") as f:
        json.dump(out, f)


WARM_PROMPT = 512  # the warm-up generation's prompt at most: a long one's evaluation is what is timed


def _read_bytes() -> int:
    """Bytes this process has caused to be read from storage (/proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


# ---- accuracy ----

def _log_softmax(x_TV: np.ndarray) -> np.ndarray:
    x_TV = x_TV - x_TV.max(axis=-1, keepdims=True)
    return x_TV - np.log(np.exp(x_TV).sum(axis=-1, keepdims=True))


def kl_stats(ref_logits: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    """Mean over positions of KL(ref || other) in nats, and how often both put the same token on top."""
    if ref_logits.shape != logits.shape or ref_logits.ndim != 2:
        raise ValueError(f"logits must both be (tokens, vocab); got {ref_logits.shape} and {logits.shape}")
    ref_TV = _log_softmax(ref_logits.astype(np.float64))
    oth_TV = _log_softmax(logits.astype(np.float64))
    kl_T = (np.exp(ref_TV) * (ref_TV - oth_TV)).sum(axis=-1)
    agree_T = ref_logits.argmax(axis=-1) == logits.argmax(axis=-1)
    return {"kl_divergence": float(kl_T.mean()), "top_token_agreement": float(agree_T.mean())}


# ---- the end-to-end check on a small model, and the CLI ----

SMALL_SHAPE = dict(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=4096)


def selfcheck(workdir: str, n_tokens: int = 64, n_new: int = 16, env: PeerEnv | None = None) -> dict:
    """Small random Mixtral: f32 GGUF logits against transformers', then q8_0 and q4_0 against f32."""
    import random

    import torch
    import transformers

    env = env or ensure_env()
    hf = os.path.join(workdir, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        torch.manual_seed(0)
        transformers.MixtralForCausalLM(transformers.MixtralConfig(**SMALL_SHAPE)).float().save_pretrained(hf)
    add_tokenizer(hf)
    ggufs = {}
    for outtype in ("f32", "q8_0"):
        ggufs[outtype] = os.path.join(workdir, f"model-{outtype}.gguf")
        if not os.path.exists(ggufs[outtype]):
            convert(hf, ggufs[outtype], outtype, env)
    for qtype in ("q8_0", "q4_0"):
        ggufs[f"{qtype}-quantize"] = os.path.join(workdir, f"model-{qtype}-quantize.gguf")
        if not os.path.exists(ggufs[f"{qtype}-quantize"]):
            quantize(ggufs["f32"], ggufs[f"{qtype}-quantize"], qtype, env)

    rng = random.Random(0)
    tokens = [rng.randrange(len(SPECIAL_TOKENS), SMALL_SHAPE["vocab_size"]) for _ in range(n_tokens)]
    model = transformers.MixtralForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_TV = model(torch.tensor([tokens])).logits[0].numpy()
        ids = list(tokens)
        for _ in range(n_new):  # by hand: generate() would stop at eos, llama.cpp's loop does not
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        hf_greedy = ids[n_tokens:]
    out: dict = {"tokens": n_tokens}
    peer_TV = {name: logits(path, tokens, env=env) for name, path in ggufs.items()}
    for kv_type in KV_TYPES:
        f32_TV = peer_TV["f32"] if kv_type == "f16" else logits(ggufs["f32"], tokens, kv_type=kv_type, env=env)
        diff = np.abs(f32_TV - hf_TV)
        out[f"f32_kv{kv_type}_vs_transformers"] = {
            "max_abs_diff": float(diff.max()), "max_rel_diff": float(diff.max() / np.abs(hf_TV).max()),
            **kl_stats(hf_TV, f32_TV)}
    for name in ggufs:
        if name != "f32":
            out[f"{name}_vs_f32"] = kl_stats(peer_TV["f32"], peer_TV[name])
    # an f32 cache, so that near ties among a random model's logits fall as in transformers
    peer_greedy, tok_s = greedy_decode(ggufs["f32"], tokens, n_new, kv_type="f32", env=env)
    out["greedy_f32_matches_transformers"] = peer_greedy == hf_greedy
    out["f32_decode_tok_s"] = tok_s
    text = ("def main(argv: list[str]) -> None:\n    print(f'{argv!r} café 🦙 3.14')\n\n\n \t  x = 33333 + 3..3\n"
            "I've been 'told he's there, 'RE you sure? 我想在apple工作1314151天～ нещо на Български\n")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(hf, "tokenizer.json"))
    out["tokenizer_matches"] = tokenize(ggufs["f32"], text, env=env) == hf_tok.encode(text, add_special_tokens=False)
    out["gguf_bytes"] = {name: os.path.getsize(path) for name, path in ggufs.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env-dir", default=None, help=f"the peer env (default {default_env_dir()})")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="build the peer env (once; about 18 minutes on 2 cores)")
    p = sub.add_parser("add-tokenizer", help="train a byte-level BPE into a checkpoint without a tokenizer")
    p.add_argument("hf_dir")
    p.add_argument("--sentencepiece", action="store_true",
                   help="also a sentencepiece tokenizer.model, for converters that read only that (ERNIE-4.5's)")
    p = sub.add_parser("convert", help="HuggingFace checkpoint -> GGUF")
    p.add_argument("hf_dir")
    p.add_argument("out_gguf")
    p.add_argument("--outtype", default="f32", choices=CONVERT_OUTTYPES)
    p = sub.add_parser("quantize", help="GGUF -> quantized GGUF with llama-quantize")
    p.add_argument("src_gguf")
    p.add_argument("out_gguf")
    p.add_argument("qtype", choices=QUANTIZE_TYPES)
    p = sub.add_parser("selfcheck", help="end-to-end check on a small random Mixtral")
    p.add_argument("--workdir", required=True)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:  # the peer-venv side, kept out of --help
        _worker(argv[1])
        return
    if argv[:1] == ["_sentencepiece"]:  # the same
        _train_sentencepiece(argv[1], int(argv[2]), int(argv[3]))
        return
    args = ap.parse_args(argv)
    if args.cmd == "add-tokenizer":
        print(add_tokenizer(args.hf_dir))
        if args.sentencepiece:
            print(add_sentencepiece(args.hf_dir, ensure_env(args.env_dir)))
    else:
        env = ensure_env(args.env_dir)
        if args.cmd == "setup":
            print(json.dumps(dataclasses.asdict(env), indent=1))
        elif args.cmd == "convert":
            print(convert(args.hf_dir, args.out_gguf, args.outtype, env))
        elif args.cmd == "quantize":
            print(quantize(args.src_gguf, args.out_gguf, args.qtype, env))
        elif args.cmd == "selfcheck":
            os.makedirs(args.workdir, exist_ok=True)
            print(json.dumps(selfcheck(args.workdir, env=env), indent=1))


if __name__ == "__main__":
    main()
