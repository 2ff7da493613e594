"""`semoe train` run as a real subprocess: one-line errors, failed steps and checkpoints that leave the
last committed version intact, corrupt stores refused, logs and summaries."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig

import pytest

from semoe.train.data import prepare_data
from semoe.checkpoints.tokenizer import ByteTokenizer
from storage.store import Store
from helpers.procs import ROOT, child_env


TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--expert-ffn", "96",
        "--experts", "4", "--batch-size", "4", "--seq-len", "32"]
BASE_STEPS = 4  # the shared run: checkpoints at steps 0, 2 and 4
CORPUS_MODULES = ("argparse.py", "textwrap.py", "csv.py", "string.py", "shlex.py", "dataclasses.py")


def semoe(*args: str, check: bool = True, preexec_fn=None) -> subprocess.CompletedProcess:
    env = child_env()
    res = subprocess.run([sys.executable, "-m", "tools.cli", *args], check=False, capture_output=True, text=True,
                         env=env, cwd=ROOT, preexec_fn=preexec_fn, timeout=300)
    if check and res.returncode != 0:
        raise AssertionError(f"semoe {' '.join(args)} exited {res.returncode}: {res.stderr}")
    return res


def one_error_line(res: subprocess.CompletedProcess) -> str:
    """The whole of stderr, which must be exactly one `semoe: error:` line."""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{res.stderr}"
    assert lines[0].startswith("semoe: error:"), lines[0]
    return lines[0]


def snapshot(store) -> dict[str, str]:
    """Every file of a store (the lock file aside) and a digest of its bytes."""
    out = {}
    for dirpath, _dirs, files in os.walk(store):
        for f in files:
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(full, store)
            if rel == ".lock":
                continue
            with open(full, "rb") as fh:
                out[rel] = hashlib.sha256(fh.read()).hexdigest()
    return out


def trainer_step(store) -> int:
    return json.loads(Store.open(str(store)).read_file("trainer.json"))["step"]


def assert_nothing_staged_beyond(store, version: int) -> None:
    """No folder or history entry of a version above the committed one, and no temporary file."""
    for top in ("arrays", "files"):
        for name in os.listdir(store / top):
            assert re.fullmatch(r"v\d{8}", name) and int(name[1:]) <= version, f"{top}/{name} left behind"
    for name in os.listdir(store / "history"):
        assert int(name[1:9]) <= version, f"history/{name} left behind"
    assert not [n for n in os.listdir(store) if ".tmp-" in n]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Token shards (train/ and val/) built once from a few hundred KB of stdlib source."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = sysconfig.get_paths()["stdlib"]
    text = []
    for name in CORPUS_MODULES:
        with open(os.path.join(stdlib, name), encoding="utf-8") as f:
            text.append(f.read())
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(text), encoding="utf-8")
    out = root / "shards"
    prepare_data(str(corpus), str(out), ByteTokenizer())
    assert (out / "train" / "shards.json").is_file() and (out / "val" / "shards.json").is_file()
    return str(out)


@pytest.fixture(scope="module")
def base_run(shards, tmp_path_factory):
    """A finished run of BASE_STEPS steps with a checkpoint every 2; tests work on copies of it."""
    out = tmp_path_factory.mktemp("base") / "run"
    semoe("train", "--out", str(out), "--data", shards, *TINY, "--steps", str(BASE_STEPS),
          "--checkpoint-every", "2", "-q")
    store = out / "store"
    assert Store.open(str(store)).verify() == [] and trainer_step(store) == BASE_STEPS
    return out


@pytest.fixture
def run_copy(base_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    return out


# -- bad input: one line, exit 2, nothing written ------------------------------------------------


@pytest.mark.parametrize("case", ["indivisible-batch", "cpu-cache-too-small", "resume-empty-dir", "config-missing",
                                  "config-malformed", "config-not-an-object", "nproc-0", "data-missing"])
@pytest.mark.slow  # starts processes
def test_bad_input_is_one_line_and_writes_no_store(case, shards, tmp_path):
    out = tmp_path / "run"
    extra: list[str]
    if case == "indivisible-batch":
        extra, named = ["--batch-size", "5", "--micro-batches", "2"], ["--batch-size"]
    elif case == "cpu-cache-too-small":
        extra, named = ["--cpu-cache", "1KiB"], ["--cpu-cache"]
    elif case == "resume-empty-dir":
        out.mkdir()
        extra, named = ["--resume"], ["--resume"]
    elif case == "config-missing":
        missing = tmp_path / "missing.json"
        extra, named = ["--config", str(missing)], ["--config", str(missing)]
    elif case == "config-malformed":
        bad = tmp_path / "bad.json"
        bad.write_text('{"model": {"hidden_size": 64,', encoding="utf-8")
        extra, named = ["--config", str(bad)], ["--config", str(bad)]
    elif case == "config-not-an-object":
        bad = tmp_path / "list.json"
        bad.write_text("[1, 2]", encoding="utf-8")
        extra, named = ["--config", str(bad)], ["--config", str(bad)]
    elif case == "nproc-0":
        extra, named = ["--nproc", "0"], ["--nproc"]
    else:  # the last --data wins
        missing = tmp_path / "no-such-corpus.txt"
        extra, named = ["--data", str(missing)], [str(missing)]
    res = semoe("train", "--out", str(out), "--data", shards, *TINY, "--steps", "2", *extra, check=False)
    assert res.returncode == 2, res.stderr
    line = one_error_line(res)
    for word in named:
        assert word in line, line
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert not (out / "store").exists(), f"{case}: left {sorted(os.listdir(out / 'store'))} in {out / 'store'}"
    assert not (out / "data").exists()


@pytest.mark.slow  # starts processes
def test_out_holding_a_run_needs_resume(run_copy, shards):
    store = run_copy / "store"
    before, version = snapshot(store), Store.open(str(store)).version
    res = semoe("train", "--out", str(run_copy), "--data", shards, *TINY, "--steps", "6", check=False)
    assert res.returncode == 2
    line = one_error_line(res)
    assert "--out" in line and "--resume" in line
    assert Store.open(str(store)).version == version and snapshot(store) == before


# -- failures while training keep the last checkpoint ----------------------------------------------


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_non_finite_loss_stops_and_keeps_last_checkpoint(shards, tmp_path):
    out = tmp_path / "run"
    res = semoe("train", "--out", str(out), "--data", shards, *TINY, "--steps", "10", "--checkpoint-every", "2",
                "--lr", "1e6", "--grad-clip", "0", "--warmup-steps", "1", check=False)
    assert res.returncode == 1, "a learning rate of 1e6 trained 10 steps without a non-finite loss"
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("semoe: error:") and "loss is" in lines[-1], res.stderr
    assert "Traceback" not in res.stderr
    done = [int(m.group(1)) for m in re.finditer(r"^step (\d+)/10 ", res.stderr, re.MULTILINE)]
    assert done == list(range(1, len(done) + 1))  # one progress line per finished step
    last_done = done[-1] if done else 0
    store = out / "store"
    st = Store.open(str(store))
    assert st.verify() == []
    ckpt = trainer_step(store)
    assert ckpt % 2 == 0 and ckpt == last_done - last_done % 2  # the failing step is last_done + 1
    assert ckpt >= 2, "the loss went non-finite before any checkpoint after the first"
    assert_nothing_staged_beyond(store, st.version)
    # the run resumes from that checkpoint (and fails the same way, with the same one line)
    res2 = semoe("train", "--out", str(out), "--resume", "-q", check=False)
    assert res2.returncode == res.returncode and one_error_line(res2) == lines[-1]
    assert Store.open(str(store)).version == st.version


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_ranks_failing_alike_print_one_line(shards, tmp_path):
    out = tmp_path / "run"
    res = semoe("train", "--out", str(out), "--data", shards, *TINY, "--steps", "10", "--checkpoint-every", "2",
                "--lr", "1e6", "--grad-clip", "0", "--warmup-steps", "1", "--nproc", "2", "-q", check=False)
    assert res.returncode == 1, res.stderr
    line = one_error_line(res)  # both ranks see the same loss: one line, naming the ranks that reported
    assert re.match(r"semoe: error: ranks? [01](, 1)?: .*loss is", line), line
    assert Store.open(str(out / "store")).verify() == []


@pytest.mark.slow  # starts processes
def test_corrupt_store_refuses_to_resume_and_names_the_tensor(run_copy):
    store = run_copy / "store"
    st = Store.open(str(store))
    chunk = next(c for c in st.manifest.chunks if c.kind == "weight" and c.layer == 1 and c.expert == 2)
    pos = chunk.bytes // 2
    victim = next(t for t in st.manifest.tensors if t.file == chunk.file and t.offset <= pos < t.offset + t.bytes)
    with open(store / chunk.file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))
    before = snapshot(store)
    res = semoe("train", "--out", str(run_copy), "--resume", "--steps", str(BASE_STEPS + 2), check=False)
    assert res.returncode == 1  # a check failed, as `semoe store verify` exits
    line = one_error_line(res)
    assert f"{victim.name}: checksum mismatch" in line, line
    assert snapshot(store) == before and Store.open(str(store)).version == st.version
    assert trainer_step(store) == BASE_STEPS


def _file_size_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("limit", [50_000, 200_000], ids=["expert-write-fails", "checkpoint-commit-fails"])
@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_full_disk_keeps_the_last_checkpoint(run_copy, limit):
    # 50 kB: smaller than an expert chunk (72 KiB), so writing back the first updated expert fails;
    # 200 kB: chunks fit, the checkpoint's optimizer file (~480 kB) does not
    store = run_copy / "store"
    st = Store.open(str(store))
    version, before = st.version, snapshot(store)
    res = semoe("train", "--out", str(run_copy), "--resume", "--steps", str(BASE_STEPS + 4), "-q", check=False,
                preexec_fn=_file_size_limit(limit))
    assert res.returncode == 1
    line = one_error_line(res)
    assert os.strerror(errno.EFBIG) in line and "Traceback" not in res.stderr
    assert f"step {BASE_STEPS})" in line and "intact" in line, line
    assert "None" not in line, line
    after = Store.open(str(store))
    assert after.verify() == [] and after.version == version and trainer_step(store) == BASE_STEPS
    assert_nothing_staged_beyond(store, version)
    assert snapshot(store) == before
    # with the space back, the same run continues from that checkpoint
    semoe("train", "--out", str(run_copy), "--resume", "--steps", str(BASE_STEPS + 2), "-q")
    assert trainer_step(store) == BASE_STEPS + 2 and Store.open(str(store)).verify() == []


# -- output -------------------------------------------------------------------------------------


@pytest.mark.slow  # a training run through the CLI: CI runs it
def test_log_json_summary_and_progress(shards, tmp_path):
    out, log = tmp_path / "run", tmp_path / "log.jsonl"
    res = semoe("train", "--out", str(out), "--data", shards, *TINY, "--steps", "4", "--checkpoint-every", "2",
                "--log-json", str(log), "--json")
    entries = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    assert [e["step"] for e in entries] == [1, 2, 3, 4]
    for e in entries:
        assert {"step", "loss", "aux_loss", "tokens_per_s", "cpu_hit_rate", "ssd_read_gbps", "ssd_write_gbps"} <= set(e)
        assert e["loss"] > 0 and e["tokens_per_s"] > 0 and e["ssd_read_gbps"] >= 0 and e["ssd_write_gbps"] >= 0
        assert e["cpu_hit_rate"] is None or 0 <= e["cpu_hit_rate"] <= 1
    stdout = res.stdout.strip().splitlines()
    assert len(stdout) == 1
    summary = json.loads(stdout[0])
    assert summary["steps"] == 4 and summary["first_loss"] == entries[0]["loss"]
    assert summary["final_loss"] == entries[-1]["loss"]
    assert os.path.samefile(summary["store"], out / "store")
    progress = [line for line in res.stderr.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["1/4", "2/4", "3/4", "4/4"], res.stderr
    assert all(" loss " in line for line in progress)


@pytest.mark.slow  # starts processes
def test_help_names_the_main_flags():
    res = semoe("train", "--help")
    for flag in ("--expert-states", "--cpu-cache", "--nproc", "--resume"):
        assert flag in res.stdout
