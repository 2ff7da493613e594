"""Training: expert states on SSD give exactly the numbers of states in memory, which match a plain
PyTorch loop; two ranks match one; a run killed with SIGKILL and resumed ends bit-identical."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers.expert_states import RecordingStates
from helpers.training import (SHAPE_FLAGS, Tol, assert_stores_close, checkpoint_step, cli, kill_mid_run, log_losses,
                              optimizer_state, store_tensors, tiny_config)

from semoe.checkpoints.model_io import load_store
from semoe.train.expert_states import AdamWConfig, _ExpertFFN, adamw_, init_expert
from semoe.model.moe_gpt import MoEGPT
from semoe.model.experts import ResidentExperts, swiglu
from semoe.train.trainer import Trainer, init_dense
from semoe.train.config import TrainConfig
from storage.store import Store


# -- pieces -------------------------------------------------------------------------------------


def test_adamw_is_torch_adamw_bit_for_bit():
    """The experts' AdamW is torch's fused AdamW exactly (weights and both moments), and torch's
    single-tensor AdamW within float32 rounding of the update (relative 1e-6 of the weights)."""
    torch.manual_seed(0)
    cfg = AdamWConfig(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    p, q = (torch.nn.Parameter(torch.randn(7, 5)) for _ in range(2))
    q.data.copy_(p.data)
    w, m, v = p.detach().clone(), torch.zeros(7, 5), torch.zeros(7, 5)
    kw = dict(lr=1e-2, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    fused, single = torch.optim.AdamW([p], fused=True, **kw), torch.optim.AdamW([q], foreach=False, **kw)
    for step in range(1, 6):
        g = torch.randn(7, 5)
        p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        single.step()
        adamw_([w], [g.clone()], [m], [v], step=step, lr=1e-2, cfg=cfg)
        assert torch.equal(w, p.detach()), f"step {step}"
        state = fused.state[p]
        assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"]), f"step {step}"
        torch.testing.assert_close(w, q.detach(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("into", [False, True], ids=["allocated", "into-backend-memory"])
def test_expert_function_gradients_match_autograd(into):
    """The weight gradients as backward allocates them and as it computes them into the tensors the
    backend hands out (`grad_out`, filled with NaN first): both autograd's (relative 1e-5)."""
    torch.manual_seed(1)
    w = [torch.randn(12, 8) * 0.3, torch.randn(12, 8) * 0.3, torch.randn(8, 12) * 0.3]
    x = torch.randn(5, 8, requires_grad=True)
    rec = RecordingStates(w, into=into)
    y = _ExpertFFN.apply(x, *w, rec, 0, 3)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    leaves = [t.clone().requires_grad_() for t in w]
    x2 = x.detach().clone().requires_grad_()
    y2 = swiglu(x2, *leaves)
    ref = torch.autograd.grad(y2, [x2, *leaves], dy)
    torch.testing.assert_close(y, y2, rtol=0, atol=1e-6)
    torch.testing.assert_close(dx, ref[0], rtol=1e-5, atol=1e-6)
    for got, want in zip(rec.grads[(0, 3)], ref[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if into:
        assert all(g is o for g, o in zip(rec.grads[(0, 3)], rec.outs[(0, 3)]))


# -- whole runs, in process ---------------------------------------------------------------------


def _run(tmp_path, name, text_file, **kw):
    cfg = TrainConfig(out=str(tmp_path / name), data=text_file, steps=kw.pop("steps", 5),
                      batch_size=kw.pop("batch_size", 4), seq_len=kw.pop("seq_len", 32), warmup_steps=2, checkpoint_every=kw.pop("checkpoint_every", 2), **kw)
    trainer = Trainer(cfg, tiny_config())
    logs = trainer.run()
    return cfg, [(x.loss, x.aux_loss, x.grad_norm) for x in logs], trainer


@pytest.mark.parametrize("factors", [0.0, 1.0], ids=["gradients", "and-factors"])
def test_ssd_states_equal_device_states_bit_for_bit(tmp_path, text_file, monkeypatch, factors):
    """Same seed, float32: identical losses every step and identical stores, even with a cache that
    holds a fraction of the experts and gradients that spill to disk; and with gradients kept as
    their products (`GradFactors`, made again when the expert is stepped) beside those that spill."""
    import semoe.train.ssd_states
    from semoe.train.ssd_states import SSDExpertStates
    monkeypatch.setattr(semoe.train.ssd_states, "FACTORS_MAX_FRACTION", factors)
    small = SSDExpertStates.min_cache_bytes(tiny_config())
    # factors take fewer bytes than a gradient below 44 rows an expert: 2 x 16 tokens give 16 on average
    batch = dict(batch_size=2, seq_len=16) if factors else {}
    dev_cfg, dev, _ = _run(tmp_path, "device", text_file, expert_states="device", **batch)
    ssd_cfg, ssd, trainer = _run(tmp_path, "ssd", text_file, expert_states="ssd", cpu_cache_bytes=small,
                                 grad_budget_bytes=3 * 96 * 64 * 4, **batch)
    assert dev == ssd
    a, b = store_tensors(dev_cfg.store), store_tensors(ssd_cfg.store)
    assert a.keys() == b.keys() and any(k[1] == "adam_v" for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    stats = trainer.states.stats()
    assert stats["cpu_misses"] > 0 and stats["ssd_written_bytes"] > 0  # the cache really was too small
    # gradients computed into staging buffers spilled as they were and came back (the norm from
    # the norms taken as they were written): the same numbers
    assert stats["spill_written_bytes"] > 0 and stats["spill_read_bytes"] == stats["spill_written_bytes"]
    assert (stats["factored_grads"] > 0) == (factors > 0)
    assert Store.open(ssd_cfg.store).verify() == []


def test_matches_a_plain_pytorch_loop(tmp_path, text_file):
    """The expert function, sparse AdamW and clipping against nn.Parameters, autograd and
    torch.optim.AdamW (every expert gets tokens every step, so sparse and dense Adam agree): the
    losses and gradient norms of every step and the final weights of every parameter."""
    cfg, ours, trainer = _run(tmp_path, "ours", text_file, expert_states="device", steps=4, grad_clip=0.5)
    assert all(n == 4 for n in trainer.states.adam_steps.values()) and len(trainer.states.adam_steps) == 8
    config = tiny_config()
    torch.manual_seed(123)
    model = MoEGPT(config)
    init_dense(model, cfg.seed)
    with torch.no_grad():
        for ffn in model.moe_layers():
            assert isinstance(ffn.experts, ResidentExperts)
            for e in range(config.num_experts):
                for dst, src in zip((ffn.experts.w_gate, ffn.experts.w_up, ffn.experts.w_down),
                                    init_expert(config, cfg.seed, ffn.layer, e)):
                    dst[e].copy_(src)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=False)
    ref = []
    for step in range(4):
        ids, tgt = trainer.sampler.batch(step)
        out = model(ids)
        ce = F.cross_entropy(out.logits.reshape(-1, config.vocab_size), tgt.reshape(-1))
        loss = ce + config.aux_loss_coef * out.aux_loss + config.z_loss_coef * out.z_loss
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        opt.step()
        ref.append((float(ce.detach()), float(out.aux_loss.detach()), float(norm)))
    for (l1, a1, n1), (l2, a2, n2) in zip(ours, ref):
        assert l1 == pytest.approx(l2, rel=1e-5) and a1 == pytest.approx(a2, rel=1e-5)
        assert n1 == pytest.approx(n2, rel=1e-4)
    # Final weights of every parameter, dense and expert. The expert function gathers each expert's
    # tokens and sums their gradients in another order than the resident experts' batched matmuls,
    # and Adam's first steps scale a near-zero gradient's rounding up to a fraction of lr (2e-3)
    # whatever the weight: absolute tolerances in units of lr. Worst measured: dense 1.2e-7 on one
    # CPU and 4.7e-7 (2.3e-4 lr) on another, whose kernels round the sums differently; experts 1.1e-6
    # beyond rtol. One step's update is up to lr, so 1e-3 lr still fails on any real difference.
    tolerances = {"dense": Tol(rtol=1e-5, atol=1e-3 * cfg.lr), "expert": Tol(rtol=1e-5, atol=1.5e-3 * cfg.lr)}
    trained = dict(load_store(cfg.store).named_parameters())
    assert trained.keys() == {name for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        tol = tolerances["expert" if ".experts." in name else "dense"]
        torch.testing.assert_close(trained[name], p.detach(), rtol=tol.rtol, atol=tol.atol, msg=lambda m: f"{name}: {m}")


# -- the command line: two ranks, SIGKILL and resume, generation ---------------------------------


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_two_ranks_match_one_rank_and_loss_falls(tmp_path, text_file):
    """2 ranks of expert parallelism (all-to-all, bucketed all-reduce) == 1 rank accumulating the
    same two halves of each batch, within float32 reduction tolerance."""
    common = ["train", *SHAPE_FLAGS, "--data", text_file, "--batch-size", "8", "--seq-len", "32", "--steps", "12",
              "--checkpoint-every", "6", "--lr", "3e-3", "-q"]
    cli(*common, "--out", str(tmp_path / "one"), "--micro-batches", "2", "--log-json", str(tmp_path / "one.log"))
    cli(*common, "--out", str(tmp_path / "two"), "--nproc", "2", "--log-json", str(tmp_path / "two.log"))
    one, two = log_losses(str(tmp_path / "one.log")), log_losses(str(tmp_path / "two.log"))
    assert len(one) == len(two) == 12
    assert one == pytest.approx(two, rel=1e-4)
    assert sum(two[-3:]) / 3 < two[0] - 0.5, two  # loss falls with 2 ranks
    # Two ranks sum the same gradients in another order (all-to-all, bucketed all-reduce). Worst
    # measured: weight 3.4e-6 absolute, adam_m 5.7 ulps of its tensor's largest, adam_v 5e-6 relative.
    tolerances = {
        # Adam scales a near-zero gradient's rounding up to a fraction of lr (3e-3), whatever the weight
        "weight": Tol(rtol=1e-5, atol=1e-5),
        # a sum of gradients that cancel is off by ulps of its largest term, not of itself
        "adam_m": Tol(rtol=1e-5, ulps_of_max=16),
        # squares do not cancel: relative only, as the values span 1e-13..1e-6
        "adam_v": Tol(rtol=2e-5),
    }
    assert_stores_close(store_tensors(str(tmp_path / "two" / "store")), store_tensors(str(tmp_path / "one" / "store")),
                        tolerances)


def _dense_run(tmp_path, text_file, name: str, *flags: str) -> tuple[list[float], list[dict]]:
    """A 2-rank run of the tiny model into tmp_path/name: its losses and its log lines."""
    log = str(tmp_path / name) + ".log"
    cli("train", *SHAPE_FLAGS, "--data", text_file, "--batch-size", "8", "--seq-len", "32", "--checkpoint-every", "3",
        "--lr", "3e-3", "-q", "--nproc", "2", "--out", str(tmp_path / name), "--log-json", log, *flags)
    with open(log, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    return [x["loss"] for x in lines], lines


def _assert_same_run(a: str, b: str) -> None:
    """Two runs' stores and saved dense optimizers are the same, bit for bit."""
    ta, tb = store_tensors(a), store_tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    oa, ob = optimizer_state(a), optimizer_state(b)
    assert oa["state"].keys() == ob["state"].keys() and len(oa["state"]) > 0
    for i, st in oa["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[name], ob["state"][i][name]), (i, name)


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_dense_states_modes_give_the_replicated_numbers(tmp_path, text_file):
    """--dense-states zero1 and fsdp over 2 ranks against replicated.

    Without gradient clipping all three are bit-identical: FSDP's reduce-scatter sums then
    divides as the replicated all-reduce does, and the sharded AdamW is elementwise. With clipping
    the global norm is summed from two shards' float32 norms instead of one, so the clip factor,
    and after it everything, differs in the last bits: losses within rel 1e-5 over 10 steps, the
    store within the per-kind tolerances below. FSDP holds half the dense bytes per rank."""
    runs = {}
    for mode in ("replicated", "zero1", "fsdp"):
        runs[mode] = _dense_run(tmp_path, text_file, f"{mode}-noclip", "--dense-states", mode, "--steps", "6",
                                "--grad-clip", "0")
    assert runs["zero1"][0] == runs["replicated"][0] == runs["fsdp"][0]
    for mode in ("zero1", "fsdp"):
        _assert_same_run(str(tmp_path / f"{mode}-noclip" / "store"), str(tmp_path / "replicated-noclip" / "store"))
    dense = {mode: lines[-1]["dense_bytes_per_rank"] for mode, (_, lines) in runs.items()}
    # parameters + gradients + 2 moments, 4 bytes each; zero1 halves the moments, fsdp all three
    # (the tiny model's dim-0 sizes are even, so the halves are exact)
    assert dense["zero1"] == dense["replicated"] * 3 // 4, dense
    assert dense["fsdp"] == dense["replicated"] // 2, dense

    rep, _ = _dense_run(tmp_path, text_file, "replicated", "--dense-states", "replicated", "--steps", "10")
    fsdp, _ = _dense_run(tmp_path, text_file, "fsdp", "--dense-states", "fsdp", "--steps", "10")
    assert len(rep) == len(fsdp) == 10
    assert fsdp == pytest.approx(rep, rel=1e-5)
    assert_stores_close(store_tensors(str(tmp_path / "fsdp" / "store")),
                        store_tensors(str(tmp_path / "replicated" / "store")), {
        # Adam turns a last-bit difference of a near-zero gradient into up to a fraction of lr
        # (3e-3) in the weight; measured worst 3.6e-6
        "weight": Tol(rtol=1e-5, atol=1e-5),
        "adam_m": Tol(rtol=1e-5, ulps_of_max=16),  # sums that cancel: ulps of the largest term
        "adam_v": Tol(rtol=2e-5),  # squares: relative only, values span many decades
    })
    # with two micro-batches FSDP reduce-scatters each one's gradients, replicated sums them
    # locally first: the same sums in another order (measured 5e-8 relative over 6 steps)
    rep2, _ = _dense_run(tmp_path, text_file, "replicated-mb2", "--dense-states", "replicated", "--steps", "6",
                         "--micro-batches", "2")
    fsdp2, _ = _dense_run(tmp_path, text_file, "fsdp-mb2", "--dense-states", "fsdp", "--steps", "6",
                          "--micro-batches", "2")
    assert fsdp2 == pytest.approx(rep2, rel=1e-5)
    got, want = optimizer_state(str(tmp_path / "fsdp" / "store")), optimizer_state(str(tmp_path / "replicated" / "store"))
    # Dense moments: m is a sum of gradients that cancel (ulps of its largest); sqrt(v) is a
    # gradient magnitude with the same error, while v itself doubles a small gradient's relative
    # error (measured 3.3e-5 relative on a 1e-12 v), so v is compared through its square root.
    ulps = 16 * torch.finfo(torch.float32).eps
    for i, st in want["state"].items():
        for name, f in (("exp_avg", lambda t: t), ("exp_avg_sq", torch.sqrt)):
            w = f(st[name])
            torch.testing.assert_close(f(got["state"][i][name]), w, rtol=1e-5, atol=ulps * float(w.abs().max()))


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_a_run_resumes_in_another_dense_states_mode(tmp_path, text_file):
    """Checkpoints hold full dense tensors and a full optimizer state in every mode: a run that
    starts with zero1, goes on with fsdp and ends replicated ends bit-identical to one replicated
    throughout (no clipping: see the test above for why clipping costs the last bits)."""
    straight, _ = _dense_run(tmp_path, text_file, "straight", "--dense-states", "replicated", "--steps", "9",
                             "--grad-clip", "0")
    first, _ = _dense_run(tmp_path, text_file, "mixed", "--dense-states", "zero1", "--steps", "3", "--grad-clip", "0")
    for mode, steps in (("fsdp", "6"), ("replicated", "9")):
        cli("train", "--out", str(tmp_path / "mixed"), "--resume", "--steps", steps, "--nproc", "2", "-q",
            "--dense-states", mode, "--log-json", str(tmp_path / "mixed.log"))
    assert log_losses(str(tmp_path / "mixed.log")) == straight
    _assert_same_run(str(tmp_path / "mixed" / "store"), str(tmp_path / "straight" / "store"))


@pytest.mark.parametrize("states,ranks", [("ssd", []), ("device", []), ("ssd", ["--nproc", "2", "--dense-states", "fsdp"])],
                         ids=["ssd", "device", "ssd-fsdp-2ranks"])
@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_sigkill_then_resume_is_bit_exact(tmp_path, text_file, states, ranks):
    """Every process of the run (the launcher and its ranks) is killed at once, as a machine
    crash would; the resumed run ends with the store and dense optimizer of an uninterrupted one."""
    common = ["train", *SHAPE_FLAGS, "--data", text_file, "--batch-size", "4", "--seq-len", "32", "--steps", "14",
              "--checkpoint-every", "3", "--expert-states", states, "--cpu-cache", "1MiB", "-q", *ranks]
    straight = tmp_path / "straight"
    cli(*common, "--out", str(straight))
    killed = tmp_path / "killed"
    stopped_at = kill_mid_run(common, killed, "trainer.json", after_step=6, timeout_s=120)
    assert 6 <= stopped_at < 14, f"the run was not killed mid-way (checkpoint at step {stopped_at})"
    assert Store.open(str(killed / "store")).verify() == []
    cli(*common, "--out", str(killed), "--resume")
    assert checkpoint_step(killed / "store", "trainer.json") == 14
    _assert_same_run(str(straight / "store"), str(killed / "store"))


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_generate_from_a_trained_store_offloaded_equals_resident(tmp_path, text_file):
    """The same tokens; log-probs within 1e-5: the resident model decodes through the one-call step
    (semoe.decode.plan), whose router softmax and SiLU round differently from the call-by-call step
    the offloaded one takes (which is the module path's bits)."""
    out = tmp_path / "run"
    cli("train", *SHAPE_FLAGS, "--data", text_file, "--batch-size", "4", "--seq-len", "32", "--steps", "4",
        "--out", str(out), "-q")
    args = ["generate", "--model", str(out / "store"), "--prompt", "def main(", "--max-new-tokens", "12", "--json"]
    resident = json.loads(cli(*args).stdout)
    offloaded = json.loads(cli(*args, "--cpu-cache", "50%").stdout)
    assert resident["tokens"] == offloaded["tokens"] and len(resident["tokens"]) == 12
    assert resident["logprobs"] == pytest.approx(offloaded["logprobs"], rel=0, abs=1e-5)
    # half the experts fit the cache: the rest were read from the store while generating
    assert offloaded["stats"]["ssd_bytes_per_token"] > 0 and "stats" not in resident


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_init_from_an_imported_huggingface_model(tmp_path, hf_qwen2_moe):
    """Fine-tuning a model imported from transformers: the first step's loss is transformers' own
    cross-entropy on the same batch, and the trained store keeps the model's tokenizer."""
    import shutil

    from helpers.hf_models import add_word_tokenizer
    from transformers import AutoModelForCausalLM

    from semoe.train.data import BatchSampler, ShardSet
    hf = tmp_path / "hf"
    shutil.copytree(hf_qwen2_moe, hf)
    add_word_tokenizer(hf)
    words = "the cat sat on a mat and dog ran to big red blue one two three four five six seven".split()
    text = tmp_path / "words.txt"
    text.write_text("\n".join(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(400)))
    cli("store", "import", str(hf), str(tmp_path / "src"))
    out = tmp_path / "run"
    cli("train", "--init-from", str(tmp_path / "src"), "--data", str(text), "--out", str(out), "--steps", "2",
        "--batch-size", "2", "--seq-len", "16", "--lr", "1e-4", "--log-json", str(tmp_path / "log"), "-q")
    first = log_losses(str(tmp_path / "log"))[0]
    ids, tgt = BatchSampler(ShardSet.open(str(out / "data" / "train")), 2, 16, seed=0).batch(0)
    model = AutoModelForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits
    want = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1)))
    assert first == pytest.approx(want, rel=1e-5, abs=0)
    store = Store.open(str(out / "store"))
    assert store.manifest.has_file("tokenizer.json")
    gen = json.loads(cli("generate", "--model", str(out / "store"), "--prompt", "the cat", "--max-new-tokens", "4",
                         "--json").stdout)
    assert len(gen["tokens"]) == 4 and isinstance(gen["text"], str)
