"""Draft training: loss masking, learning, save/reload, resume after interruption, finished reruns."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import Dataset

from jakiro_lib.data import dataset as D
from jakiro_lib.data import features as F
from jakiro_lib.training import train as T
from jakiro_lib.models import loss as L
from jakiro_lib.data.batching import EpochSampler
from jakiro_lib.training.checkpoints import STATE_FILE, CheckpointError, list_checkpoints
from jakiro_lib.config import DraftConfig, TargetConfig, TrainConfig
from jakiro_lib.profiles import get_profile
from jakiro_lib.data.conversations import Conversation
from jakiro_lib.models.draft import WEIGHTS_FILE, DraftModel
from jakiro_lib.models.target import load_target
from helpers import single_thread

MAX_LEN = 48
WORDS = "the cat sat on a mat while dogs ran far away and birds sang in tall green trees".split()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():  # tiny ops: threads only add overhead (and fight other processes)
        yield


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(model="tiny:llama"))


@pytest.fixture(scope="module")
def cache(target, tmp_path_factory):
    convs = []
    for i in range(10):
        q = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + i % 3))
        a = " ".join(WORDS[(2 * i + k) % len(WORDS)] for k in range(5 + i % 4))
        convs.append(Conversation(f"c{i}", [{"role": "user", "content": q}, {"role": "assistant", "content": a}]))
    out = tmp_path_factory.mktemp("cache")
    return F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=4, progress=False)


@pytest.fixture(scope="module")
def data(cache):
    return D.FeatureDataset(cache, "train", 0.2), D.FeatureDataset(cache, "heldout", 0.2)


class Repeat(Dataset):
    """The same few conversations many times: more steps per epoch, fewer epoch-end evaluations."""

    def __init__(self, ds, times):
        self.ds, self.times = ds, times

    def __len__(self):
        return len(self.ds) * self.times

    def __getitem__(self, i):
        return self.ds[i % len(self.ds)]

    def lengths(self):
        return self.ds.lengths() * self.times

    def token_arrays(self):
        for _ in range(self.times):
            yield from self.ds.token_arrays()


def smoke_drafts():
    return get_profile("smoke").drafts


def cfg(**kw):
    base = dict(epochs=2, batch_size=4, lr=3e-3, warmup_steps=5, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def test_draft_loss_masks_padding_and_noise(target, data, monkeypatch):
    train, _ = data
    torch.manual_seed(0)
    draft = DraftModel.build(smoke_drafts()["moe2"], target.model).eval()
    item = train[0]
    batch = D.collate([item])
    loss, m = L.draft_loss(draft, batch, noise_amplitude=0.2)
    assert torch.isfinite(loss) and loss.requires_grad
    for key in ("loss", "loss_a", "vloss_a", "ploss_a", "acc_a", "loss_b", "acc_b"):
        assert key in m
    assert m["count_a"] == item["loss_mask"][1:].sum() and m["count_b"] == item["loss_mask"][2:].sum()
    assert m["loss"] == pytest.approx(m["loss_a"] + 0.5 * m["loss_b"], rel=1e-5)
    assert m["loss_a"] == pytest.approx(m["vloss_a"] + 0.1 * m["ploss_a"], rel=1e-5)

    # right padding (and a longer neighbour) changes nothing for this sequence: causal + masked
    long_item = max(train, key=lambda it: len(it["input_ids"]))
    assert len(long_item["input_ids"]) > len(item["input_ids"])
    padded = D.collate([item, long_item])
    one = {k: v[:1] for k, v in padded.items()}
    _, m2 = L.draft_loss(draft, one, noise_amplitude=0.2)
    for key in ("loss_a", "loss_b", "acc_a", "acc_b", "count_a"):
        assert m2[key] == pytest.approx(m[key], rel=1e-4, abs=1e-6), key

    # loss rows padded to SHAPE_MULTIPLE and lengths to TIME_MULTIPLE (few GEMM shapes for oneDNN): the loss,
    # metrics and gradients are those of the unpadded batch; with unroll steps and per-expert losses too
    both = D.collate([item, long_item])
    assert L.train_collate([item, long_item])["input_ids"].shape[1] % L.TIME_MULTIPLE == 0
    grads = {}
    for rows, batch_ in ((1, both), (L.SHAPE_MULTIPLE, L.train_collate([item, long_item]))):
        monkeypatch.setattr(L, "SHAPE_MULTIPLE", rows)
        draft.zero_grad()
        loss_, mm = L.draft_loss(draft, batch_, noise_amplitude=0.0, unroll_steps=2, depths=3)
        loss_.backward()
        grads[rows] = (mm, [q.grad.clone() for q in draft.parameters() if q.grad is not None])
    (m_plain, g_plain), (m_pad, g_pad) = grads[1], grads[L.SHAPE_MULTIPLE]
    assert m_plain.keys() == m_pad.keys() and len(g_plain) == len(g_pad) > 0
    for key in m_plain:
        assert m_pad[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-6), key
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(g_plain, g_pad))
    draft.zero_grad()

    # noise only in training mode
    _, again = L.draft_loss(draft, batch, noise_amplitude=0.2)
    assert again["loss"] == m["loss"]
    draft.train()
    _, noisy = L.draft_loss(draft, batch, noise_amplitude=0.2)
    _, clean = L.draft_loss(draft, batch, noise_amplitude=0.0)
    assert noisy["loss"] != clean["loss"] and clean["loss"] == pytest.approx(m["loss"], rel=1e-5)

    # accuracy is exact: a draft that outputs the true next feature scores 1 on branch A
    class Oracle(torch.nn.Module):  # looks like a wrapper (.module) around the draft
        def __init__(self, d):
            super().__init__()
            self.module = d

        def forward(self, feats, ids, pos):
            out = self.module(feats, ids, pos)
            h = batch["hidden"]
            out.a = torch.cat([h[:, 1:], h[:, -1:]], 1)[:, : feats.shape[1]]
            return out

    oracle = Oracle(draft.eval())
    _, mo = L.draft_loss(oracle, batch, noise_amplitude=0.0)
    assert mo["acc_a"] > 0.95  # fp16 features can flip a near-tie; nearly all must match
    assert mo["vloss_a"] < 1e-5


def test_draft_vocab_accuracy_counts_outside_tokens_as_misses(target, data):
    train, _ = data
    item = train[0]
    batch = D.collate([item])
    ids_needed = torch.unique(item["target_top1"][1:][item["loss_mask"][1:] > 0])
    keep = ids_needed[: max(1, len(ids_needed) // 2)]
    filler = torch.tensor([i for i in range(260) if i not in ids_needed.tolist()][: 16])
    d2t = torch.sort(torch.cat([keep, filler])).values
    cfg_v = dataclasses.replace(smoke_drafts()["moe2"], draft_vocab_size=len(d2t))
    draft = DraftModel.build(cfg_v, target.model, d2t=d2t).eval()

    class Oracle(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.module = d

        def forward(self, feats, ids, pos):
            out = self.module(feats, ids, pos)
            h = batch["hidden"]
            out.a = torch.cat([h[:, 1:], h[:, -1:]], 1)[:, : feats.shape[1]].float()
            return out

    _, m = L.draft_loss(Oracle(draft), batch, noise_amplitude=0.0)
    sel = item["loss_mask"][1:] > 0
    tgt = item["target_top1"][1:][sel]
    in_vocab = torch.isin(tgt, d2t).float().mean().item()
    assert 0 < in_vocab < 1
    assert m["acc_a"] == pytest.approx(in_vocab, abs=0.1) and m["acc_a"] <= in_vocab + 1e-6


def test_training_reduces_both_losses_and_reloads(target, data, tmp_path):
    train, held = data
    out = tmp_path / "moe2"
    res = T.train_draft(target, smoke_drafts()["moe2"], Repeat(train, 16), held, out,
                        cfg(epochs=8), progress=False, log_every=8)
    hist = json.loads((out / "history.json").read_text())
    steps = hist["steps"]
    assert steps[-1]["step"] == res["steps"] == 8 * 32
    first, last = steps[:2], steps[-4:]  # averages over the first 16 and the last 32 steps

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    # a random tiny target's features are hard to predict (and the inputs are noised), so the loss
    # floor is high; the drop is still large and the next-token accuracy climbs far above chance
    for key in ("loss_a", "loss_b"):
        assert mean(last, key) < 0.85 * mean(first, key), (key, mean(first, key), mean(last, key))
    assert mean(last, "loss_a") < 0.7 * mean(first, "loss_a")
    assert mean(last, "acc_a") > mean(first, "acc_a") + 0.25
    assert mean(last, "acc_b") > mean(first, "acc_b") + 0.1
    assert len(hist["epochs"]) == 8 and all("heldout" in e for e in hist["epochs"])
    assert res["acc_a"] is not None and res["acc_b"] is not None and 0 <= res["acc_a"] <= 1
    assert len(res["router_load"]) == 2 and res["wall_time_s"] > 0 and res["train_tokens_per_s"] > 0
    assert "run_metadata" in res and json.loads((out / "results.json").read_text())["steps"] == 256

    # the final draft reloads strictly and reproduces the held-out results it was scored with
    loaded = DraftModel.load(out / "draft", target.model)
    ev = L.evaluate(loaded, held)
    assert ev["acc_a"] == pytest.approx(res["acc_a"]) and ev["acc_b"] == pytest.approx(res["acc_b"])
    assert ev["loss"] == pytest.approx(res["heldout_loss"], rel=1e-6)
    meta = json.loads((out / "draft" / "draft_config.json").read_text())["meta"]
    assert meta["train_config"]["epochs"] == 8 and meta["data"]["train_conversations"] == len(train) * 16
    batch = D.collate([held[0]])
    o1 = loaded(batch["hidden"][:, :-1], batch["input_ids"][:, 1:], torch.arange(batch["hidden"].shape[1] - 1)[None])
    loaded.save(tmp_path / "again")
    again = DraftModel.load(tmp_path / "again", target.model)
    o2 = again(batch["hidden"][:, :-1], batch["input_ids"][:, 1:], torch.arange(batch["hidden"].shape[1] - 1)[None])
    assert torch.equal(o1.a, o2.a) and torch.equal(o1.b, o2.b)
    ckpt = load_file(str(out / "checkpoints" / "epoch_8" / "draft" / "model.safetensors"))
    final = load_file(str(out / "draft" / "model.safetensors"))
    assert ckpt.keys() == final.keys() and all(torch.equal(ckpt[k], final[k]) for k in ckpt)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["epoch_7", "epoch_8"]  # keep 2


def test_resume_after_interruption_equals_uninterrupted(target, data, tmp_path, monkeypatch):
    train, held = data
    draft_cfg = smoke_drafts()["moe2"]
    tc = cfg(epochs=3)
    full = T.train_draft(target, draft_cfg, Repeat(train, 2), held, tmp_path / "full", tc, progress=False,
                         log_every=1)
    steps_per_epoch = math.ceil(len(train) * 2 / tc.batch_size)
    assert full["steps"] == 3 * steps_per_epoch

    class Stop(Exception):
        pass

    def stop(record):
        if record["epoch"] == 1:
            raise Stop

    out = tmp_path / "resumed"
    with pytest.raises(Stop):
        T.train_draft(target, draft_cfg, Repeat(train, 2), held, out, tc, progress=False, log_every=1,
                      on_epoch_end=stop)
    assert [p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")] == ["epoch_1"]
    assert not (out / "results.json").exists()

    seen = []
    real = L.draft_loss
    monkeypatch.setattr(L, "draft_loss", lambda *a, **k: seen.append(1) or real(*a, **k))
    res = T.train_draft(target, draft_cfg, Repeat(train, 2), held, out, tc, progress=False, log_every=1)
    # epochs 2 and 3 only: their training steps plus their two held-out evaluations
    assert len(seen) == 2 * steps_per_epoch + 2 * math.ceil(len(held) / tc.batch_size)
    assert res["steps"] == full["steps"]
    hist = json.loads((out / "history.json").read_text())
    assert [s["step"] for s in hist["steps"]] == list(range(1, full["steps"] + 1))
    assert len(hist["epochs"]) == 3
    a = load_file(str(tmp_path / "full" / "draft" / "model.safetensors"))
    b = load_file(str(out / "draft" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert res["acc_a"] == full["acc_a"] and res["heldout_loss"] == full["heldout_loss"]

    # a rerun of a finished training returns the saved results without building anything
    monkeypatch.setattr(T.DraftModel, "build", lambda *a, **k: pytest.fail("retrained a finished draft"))
    again = T.train_draft(target, draft_cfg, Repeat(train, 2), held, out, tc, progress=False)
    assert again == json.loads((out / "results.json").read_text()) and again["steps"] == full["steps"]


def test_max_steps_stops_mid_epoch_and_extends(target, data, tmp_path):
    train, held = data
    draft_cfg = smoke_drafts()["moe2_nocontrast"]
    out = tmp_path / "ms"
    res = T.train_draft(target, draft_cfg, Repeat(train, 2), held, out, cfg(epochs=2, max_steps=3),
                        progress=False)
    assert res["steps"] == 3 and res["epochs_completed"] == 0
    assert (out / "checkpoints" / "step_3").is_dir()
    res = T.train_draft(target, draft_cfg, Repeat(train, 2), held, out, cfg(epochs=2), progress=False)
    assert res["steps"] == 2 * math.ceil(len(train) * 2 / 4) and res["epochs_completed"] == 2


def test_other_architecture_in_out_dir_is_refused(target, data, tmp_path):
    train, held = data
    T.train_draft(target, smoke_drafts()["moe2"], train, held, tmp_path, cfg(epochs=1), progress=False)
    with pytest.raises(T.TrainError, match="another architecture"):
        T.train_draft(target, smoke_drafts()["moe4"], train, held, tmp_path, cfg(epochs=2), progress=False)


def test_damaged_newest_checkpoint_falls_back_to_the_one_before(target, data, tmp_path, caplog, monkeypatch):
    train, held = data
    draft_cfg = smoke_drafts()["moe2"]
    T.train_draft(target, draft_cfg, train, held, tmp_path, cfg(epochs=2), progress=False)
    (_, older), (_, newest) = list_checkpoints(tmp_path)
    older_weights = load_file(str(older / "draft" / "model.safetensors"))
    weights = newest / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short by a crash
    loaded = []
    real = T.DraftModel.load_state_dict
    monkeypatch.setattr(T.DraftModel, "load_state_dict",
                        lambda self, sd, *a, **k: loaded.append(dict(sd)) or real(self, sd, *a, **k))
    with caplog.at_level("WARNING", logger="jakiro_lib.training.train"):
        res = T.train_draft(target, draft_cfg, train, held, tmp_path, cfg(epochs=3), progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(weights) in warnings[0] and "\n" not in warnings[0]
    assert len(loaded) == 1 and loaded[0].keys() == older_weights.keys()
    assert all(torch.equal(loaded[0][k], older_weights[k]) for k in older_weights)
    assert res["epochs_completed"] == 3 and len(json.loads((tmp_path / "history.json").read_text())["epochs"]) == 3


def test_no_readable_checkpoint_is_a_train_error_naming_the_file(target, data, tmp_path):
    train, held = data
    draft_cfg = smoke_drafts()["moe2"]
    T.train_draft(target, draft_cfg, train, held, tmp_path, cfg(epochs=2), progress=False)
    for _, ckpt in list_checkpoints(tmp_path):
        state = ckpt / STATE_FILE
        state.write_bytes(state.read_bytes()[:50])
    newest = list_checkpoints(tmp_path)[-1][1] / STATE_FILE
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(newest))} cannot be read"):
        T.train_draft(target, draft_cfg, train, held, tmp_path, cfg(epochs=3), progress=False)


def test_dense_draft_with_reduced_vocab_trains(target, data, tmp_path):
    train, held = data
    dense = dataclasses.replace(smoke_drafts()["dense"], draft_vocab_size=64)
    out = tmp_path / "dense"
    res = T.train_draft(target, dense, Repeat(train, 16), held, out, cfg(epochs=6), progress=False, log_every=8)
    steps = json.loads((out / "history.json").read_text())["steps"]
    assert "loss_b" not in steps[0] and res["acc_b"] is None and res["router_load"] == [1.0]
    assert sum(s["loss_a"] for s in steps[-4:]) / 4 < 0.8 * sum(s["loss_a"] for s in steps[:2]) / 2
    draft = DraftModel.load(out / "draft", target.model)
    assert draft.d2t.numel() == 64 and torch.equal(draft.d2t, torch.sort(draft.d2t).values)
    assert set(target.eos_token_ids) <= set(draft.d2t.tolist())
    freqs = D.token_frequencies(train, target.model.config.vocab_size)
    assert torch.equal(draft.d2t, D.build_draft_vocab(freqs, 64, always=target.eos_token_ids))


def test_compiled_step_trains_the_same_draft_and_a_failure_is_one_line(target, data, tmp_path, monkeypatch):
    """train.compile: the step through torch.compile (noise, branch B, experts, unrolled steps, a reduced
    vocabulary and batches of several shapes) ends in the eager step's weights, is recorded, and resumes
    a finished eager training (same math); a compile that fails is one TrainError line naming the switch."""
    train, held = data
    draft = dataclasses.replace(smoke_drafts()["moe2_xgate"], unroll_steps=2, draft_vocab_size=64)
    eager = T.train_draft(target, draft, train, held, tmp_path / "eager", cfg(epochs=1), progress=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    import torch._inductor.config as inductor_config  # loads inductor: only this test needs it

    # the noise from eager's generator, not inductor's; the config's own patch (monkeypatch's undo deletes the option
    # from the config module: every later compile in the process then failed, "fallback_random does not exist")
    with inductor_config.patch(fallback_random=True):
        comp = T.train_draft(target, draft, train, held, tmp_path / "comp", cfg(epochs=1, compile="yes"), progress=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile
    assert comp["run_metadata"]["compiled_step"] and not eager["run_metadata"]["compiled_step"]
    assert comp["steps"] == eager["steps"] >= 2
    w_e = load_file(tmp_path / "eager" / "draft" / WEIGHTS_FILE)
    w_c = load_file(tmp_path / "comp" / "draft" / WEIGHTS_FILE)
    assert w_e.keys() == w_c.keys()
    for k in w_e:
        assert torch.allclose(w_e[k], w_c[k], rtol=1e-4, atol=1e-5), k
    assert comp["acc_a"] == pytest.approx(eager["acc_a"], abs=1e-6)
    again = T.train_draft(target, draft, train, held, tmp_path / "eager", cfg(epochs=1, compile="yes"), progress=False)
    assert again["wall_time_s"] == eager["wall_time_s"]  # finished: returned, not retrained

    def broken(*args, **kwargs):
        def fail(batch):
            raise RuntimeError("no C++ compiler")
        return fail

    monkeypatch.undo()
    monkeypatch.setattr(T.torch, "compile", broken)
    with pytest.raises(T.TrainError, match="train.compile=no"):
        T.train_draft(target, draft, train, held, tmp_path / "broken", cfg(epochs=1, compile="yes"), progress=False)
    # "auto" compiles only where the step runs in bf16 (in fp32 it bought nothing): here fp32, so not even tried
    fp32 = T.train_draft(target, draft, train, held, tmp_path / "auto", cfg(epochs=1, compile="auto"), progress=False)
    assert fp32["run_metadata"]["compiled_step"] is False


def test_lr_schedule():
    lrs = [T.lr_lambda(s, 4, 20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert all(x >= y for x, y in zip(lrs[4:], lrs[5:])) and lrs[-1] < 0.05
    s = EpochSampler(10, seed=1)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    assert sorted(e0) == list(range(10)) and list(s) != e0
    s.set_epoch(0)
    assert list(s) == e0


def test_online_data_trains(target, tmp_path):
    convs = [Conversation(f"o{i}", [{"role": "user", "content": " ".join(WORDS[i:i + 3])},
                                    {"role": "assistant", "content": " ".join(WORDS[i + 1:i + 7])}])
             for i in range(6)]
    train = D.OnlineFeatureDataset(target, convs, MAX_LEN, split="train", heldout_fraction=0.34)
    held = D.OnlineFeatureDataset(target, convs, MAX_LEN, split="heldout", heldout_fraction=0.34)
    assert len(train) == 4 and len(held) == 2
    res = T.train_draft(target, smoke_drafts()["moe2"], train, held, tmp_path, cfg(epochs=2), progress=False)
    assert res["steps"] == 2 and res["acc_a"] is not None and res["data"]["train_conversations"] == 4


# -- branch B, per-expert and multi-step losses ----------------------------------------------------------

def _fp32_batch(target, n=2, L=14, seed=0):
    """Random ids with the target's own fp32 features and their argmax (no fp16 rounding: ties cannot flip)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, L), generator=g)
    with torch.no_grad():
        hidden = target.model.model(input_ids=ids).last_hidden_state.float()
    return {"input_ids": ids, "hidden": hidden, "loss_mask": torch.ones(n, L), "lengths": torch.full((n,), L),
            "target_top1": (hidden @ target.model.lm_head.weight.T).argmax(-1)}


class _Fed(torch.nn.Module):
    """Wraps a draft (as DDP does, ``.module``) and overwrites some of its outputs."""

    def __init__(self, d, **set_out):
        super().__init__()
        self.module, self.set_out = d, set_out

    def forward(self, feats, ids, pos):
        out = self.module(feats, ids, pos)
        for name, fn in self.set_out.items():
            setattr(out, name, fn(out, feats.shape[1]))
        return out


def _entropy(target, feats):
    p = (feats @ target.model.lm_head.weight.T).float().softmax(-1)
    return float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())


def test_branch_b_loss_is_zero_when_fed_the_true_feature_two_ahead(target):
    """Branch B at t is scored against f_{t+2}: fed exactly f_{t+2}, its regression loss is 0, its top-1 is
    1 and its soft cross-entropy is the target's own entropy (its minimum); fed f_{t+1}, it is not."""
    batch = _fp32_batch(target)
    h = batch["hidden"]
    draft = DraftModel.build(smoke_drafts()["moe2"], target.model).eval()
    two_ahead = _Fed(draft, b=lambda out, L: torch.cat([h[:, 2:], h[:, :2]], 1)[:, :L])
    _, m = L.draft_loss(two_ahead, batch, noise_amplitude=0.0)
    assert m["vloss_b"] == 0.0 and m["acc_b"] == 1.0
    assert m["ploss_b"] == pytest.approx(_entropy(target, h[:, 2:].reshape(-1, h.shape[-1])), rel=1e-5)
    one_ahead = _Fed(draft, b=lambda out, L: h[:, 1:])
    _, m1 = L.draft_loss(one_ahead, batch, noise_amplitude=0.0)
    assert m1["vloss_b"] > 0.01 and m1["acc_b"] < 0.5


@pytest.mark.parametrize("mode", ["gate", "equal"])
def test_expert_loss_trains_each_selected_experts_own_output(target, mode):
    """The per-expert loss against a computation expert by expert: each selected expert's SmoothL1 and
    soft-CE to f_{t+1}, weighted by its gate (or equally), summed into the loss with expert_loss_weight;
    zero regression when every expert outputs f_{t+1}; off: no per-expert term in training."""
    batch = _fp32_batch(target)
    h = batch["hidden"]
    cfg = DraftConfig(num_experts=3, top_k_experts=2, expert_loss=mode, expert_loss_weight=0.7)
    torch.manual_seed(1)
    draft = DraftModel.build(cfg, target.model).eval()
    loss, m = L.draft_loss(draft, batch, noise_amplitude=0.0)
    feats, ids = h[:, :-1], batch["input_ids"][:, 1:]
    with torch.no_grad():
        out = draft(feats, ids, torch.arange(feats.shape[1])[None].expand(2, -1))
    t = h[:, 1:]
    p = (t @ target.model.lm_head.weight.T).softmax(-1)
    v_sum = p_sum = 0.0
    hits = [0.0] * 3
    for e in range(3):
        o = out.experts[..., e, :]
        v = torch.nn.functional.smooth_l1_loss(o, t, reduction="none").mean(-1)
        ce = -(p * (o @ target.model.lm_head.weight.T).log_softmax(-1)).sum(-1)
        sel = (out.gates[..., e] > 0).float()
        w = out.gates[..., e] if mode == "gate" else sel / (out.gates > 0).sum(-1)
        v_sum, p_sum = v_sum + (w * v).mean(), p_sum + (w * ce).mean()
        hits[e] = float((((o @ target.model.lm_head.weight.T).argmax(-1) == p.argmax(-1)).float() * sel).sum())
        assert m[f"count_e{e}"] == float(sel.sum()) and m[f"correct_e{e}"] == hits[e]
    assert m["vloss_x"] == pytest.approx(float(v_sum), rel=1e-4)
    assert m["ploss_x"] == pytest.approx(float(p_sum), rel=1e-4)
    assert m["loss"] == pytest.approx(m["loss_a"] + 0.5 * m["loss_b"] + 0.7 * m["loss_x"], rel=1e-5)
    oracle = _Fed(draft, experts=lambda o, L: h[:, 1:, None, :].expand_as(o.experts))
    _, mo = L.draft_loss(oracle, batch, noise_amplitude=0.0)
    assert mo["vloss_x"] == 0.0 and all(mo[f"correct_e{e}"] == mo[f"count_e{e}"] for e in range(3))
    # off: no per-expert term in the training loss (its metrics are still reported in evaluation)
    off = DraftModel.build(dataclasses.replace(cfg, expert_loss="off"), target.model)
    off.load_state_dict(draft.state_dict())
    _, m_off = L.draft_loss(off.eval(), batch, noise_amplitude=0.0)
    assert m_off["loss"] == pytest.approx(m_off["loss_a"] + 0.5 * m_off["loss_b"], rel=1e-5)
    off.train()
    _, m_train = L.draft_loss(off, batch, noise_amplitude=0.0)
    assert "loss_x" not in m_train


def test_unroll_runs_each_step_on_its_own_features_with_a_trees_attention(target):
    """Step j at position t of DraftModel.unroll equals drafting j tokens after the prefix ending at t-j
    (cache-free forwards: the prefix's target features, then the draft's own predictions), which is what
    a tree's depth j+1 sees."""
    batch = _fp32_batch(target, n=1, L=11)
    torch.manual_seed(2)
    draft = DraftModel.build(smoke_drafts()["moe2"], target.model).eval()
    feats, ids = batch["hidden"][:, :-1], batch["input_ids"][:, 1:]
    L = feats.shape[1]
    pos = torch.arange(L)[None]
    with torch.no_grad():
        steps = draft(feats, ids, pos, steps=3)
        assert len(steps) == 3
        torch.testing.assert_close(steps[0].a, draft(feats, ids, pos).a)
        for a in range(L - 2):  # prefix 0..a, then 2 drafted positions on the draft's own features
            f, x = feats[:, : a + 1], ids[:, : a + 1]
            for j in (1, 2):
                o = draft(f, x, torch.arange(f.shape[1])[None]).a[:, -1:]
                f, x = torch.cat([f, o], 1), ids[:, : a + j + 1]
                ref = draft(f, x, torch.arange(f.shape[1])[None])
                torch.testing.assert_close(steps[j].a[:, a + j], ref.a[0, -1:], atol=2e-5, rtol=1e-5)
                torch.testing.assert_close(steps[j].b[:, a + j], ref.b[0, -1:], atol=2e-5, rtol=1e-5)
    from jakiro_lib.models.draft import unroll_mask

    m = unroll_mask(4, 2)
    assert m.shape == (4, 12) and m[3].tolist() == [1, 1, 0, 0] + [0, 0, 1, 0] + [0, 0, 0, 1]


def test_multi_step_training_reports_depths_experts_and_params(target, data, tmp_path, monkeypatch):
    """unroll_steps=2 adds step 2's loss (rows t >= 1, weight 0.8) to the objective; results.json gets the
    held-out top-1 per depth, per expert, and the trainable parameter count; the loop reads metrics from
    the device only every log_every steps."""
    train, held = data
    batch = _fp32_batch(target)
    dcfg = dataclasses.replace(smoke_drafts()["moe2"], expert_loss="gate")
    draft = DraftModel.build(dcfg, target.model).eval()
    loss2, m2 = L.draft_loss(draft, batch, noise_amplitude=0.0, unroll_steps=2)
    _, m1 = L.draft_loss(draft, batch, noise_amplitude=0.0, depths=2)
    assert m2["loss"] == pytest.approx(m1["loss"] + 0.8 * m2["loss@2"], rel=1e-5)
    assert m1["count_a@2"] == m1["count_a"] - 2  # position 0 has no drafted ancestor: not scored at depth 2
    calls = []
    real = L.draft_loss

    def spy(*a, **k):
        loss, m = real(*a, **k)
        calls.append(all(torch.is_tensor(v) for v in m.values()))
        return loss, m

    monkeypatch.setattr(L, "draft_loss", spy)
    res = T.train_draft(target, dcfg, train, held, tmp_path, cfg(epochs=1, unroll_steps=2), progress=False,
                        log_every=2)
    n_steps = math.ceil(len(train) / 4)
    assert calls[:n_steps] == [True] * n_steps  # training steps leave their metrics on the device
    assert not any(calls[n_steps:])  # the held-out evaluation reads them per batch
    assert res["unroll_steps"] == 2 and len(res["acc_depth"]) == 4 and res["acc_depth"][0] == res["acc_a"]
    assert all(0 <= a <= 1 for a in res["acc_depth"]) and len(res["acc_experts"]) == 2
    core = DraftModel.build(dcfg, target.model)
    assert res["n_params"] == sum(p.numel() for p in core.parameters()) > 0
    hist = json.loads((tmp_path / "history.json").read_text())
    assert "loss@2" in hist["steps"][0] and isinstance(hist["steps"][0]["loss"], float)
    with pytest.raises(T.TrainError, match="unroll_steps"):
        T.train_draft(target, dcfg, train, held, tmp_path / "bad", cfg(unroll_steps=0), progress=False)


def test_eagle2_draft_has_the_targets_mlp_width_and_the_control_does_not(target):
    drafts = get_profile("smoke").drafts
    eagle2 = DraftModel.build(drafts["dense"], target.model)
    control = DraftModel.build(drafts["dense_h"], target.model)
    H, inter = target.model.config.hidden_size, target.model.config.intermediate_size
    assert eagle2.mlp.experts[0].up_proj.weight.shape == (inter, H) and inter != H
    assert control.mlp.experts[0].up_proj.weight.shape == (H, H)
    assert eagle2.n_params() - control.n_params() == 3 * H * (inter - H)


@pytest.mark.parametrize("flags,precision", [({"avx2", "fma"}, "no"), ({"avx512f", "amx_tile", "amx_bf16"}, "bf16")])
def test_mixed_precision_auto_follows_the_hardware(target, data, tmp_path, monkeypatch, flags, precision):
    """train.mixed_precision="auto": bf16 autocast where the CPU has bf16 matrix units (here pretended), fp32
    elsewhere; the precision used is recorded with the results."""
    from jakiro_lib import precision as device_precision

    monkeypatch.setattr(device_precision, "cpu_flags", lambda: flags)
    train, held = data
    res = T.train_draft(target, smoke_drafts()["dense"], train, held, tmp_path / precision,
                        cfg(epochs=1, mixed_precision="auto"), progress=False)
    assert res["run_metadata"]["mixed_precision"] == precision and math.isfinite(res["heldout_loss"])
    # nothing stays in bf16 afterwards: accelerate's autocast-wrapped forward, re-entered by the draft's unrolled
    # evaluation, left CPU autocast on for the rest of the process (later tests' drafts then accepted nothing)
    assert not torch.is_autocast_enabled("cpu")


def test_a_warm_start_begins_from_the_saved_drafts_weights(target, data, tmp_path):
    train, held = data
    first = T.train_draft(target, smoke_drafts()["moe2"], train, held, tmp_path / "first", cfg(epochs=1), progress=False)
    saved = tmp_path / "first" / "draft"
    # no step taken: the draft written is the one it started from, not a fresh draft of the same seed
    res = T.train_draft(target, smoke_drafts()["moe2"], train, held, tmp_path / "warm", cfg(max_steps=0),
                        progress=False, init_from=saved)
    a, b = load_file(str(saved / WEIGHTS_FILE)), load_file(str(tmp_path / "warm" / "draft" / WEIGHTS_FILE))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert res["acc_a"] == first["acc_a"] and res["steps"] == 0
    with pytest.raises(CheckpointError, match="another architecture"):
        T.train_draft(target, smoke_drafts()["moe4"], train, held, tmp_path / "other", cfg(max_steps=0),
                      progress=False, init_from=saved)
    # stamps leave a fresh start out (those written before the option still match) and name a warm one
    assert "init_from" not in T.train_identity(cfg()) and T.train_identity(cfg(init_from="r"))["init_from"] == "r"


def test_held_out_shards_combined_give_the_whole_sets_metrics(target, data):
    """Under several processes each evaluates every n-th held-out item and their sums are added up
    (training's combine): the metrics must be the whole set's, router load and per-depth top-1 included."""
    train, _ = data
    torch.manual_seed(0)
    draft = DraftModel.build(smoke_drafts()["moe2"], target.model).eval()
    whole = L.evaluate(draft, train, batch_size=2)
    parts = [L.eval_sums(draft, torch.utils.data.Subset(train, range(i, len(train), 2)), batch_size=2) for i in (0, 1)]
    assert 0 < parts[0]["count_a"] < whole["tokens_a"]  # each shard is a part

    def add(sums):
        return {k: parts[0].get(k, 0.0) + parts[1].get(k, 0.0) for k in {*parts[0], *parts[1]}}

    combined = L.evaluate(draft, torch.utils.data.Subset(train, range(0, len(train), 2)), batch_size=2, combine=add)
    for key in ("acc_a", "acc_b", "loss", "loss_a", "loss_b", "tokens_a", "tokens_b"):
        # other batch companions (padding) move float32 losses in the 8th digit
        assert combined[key] == pytest.approx(whole[key], rel=1e-6), key
    assert combined["acc_depth"] == pytest.approx(whole["acc_depth"]) and combined["router_load"] == pytest.approx(
        whole["router_load"])
    assert combined["acc_experts"] == pytest.approx(whole["acc_experts"])
    one = L.evaluate(draft, torch.utils.data.Subset(train, range(0, len(train), 2)), batch_size=2)
    assert one["tokens_a"] < whole["tokens_a"]  # without the combine a shard is only a shard


def test_gelu_expert_draft_trains_and_reloads(target, data, tmp_path):
    """Jakiro*'s experts (DraftConfig.expert_mlp="gelu": fc, GELU, proj) train like SwiGLU ones; the results record
    their width."""
    train, held = data
    star = dataclasses.replace(smoke_drafts()["moe2"], branch_b=False, contrastive=False, expert_mlp="gelu",
                               intermediate_size=96)
    res = T.train_draft(target, star, train, held, tmp_path, cfg(epochs=1), progress=False)
    assert res["intermediate_size"] == 96 and res["acc_b"] is None
    draft = DraftModel.load(tmp_path / "draft", target.model)
    assert draft.cfg.expert_mlp == "gelu" and draft.mlp.experts[1].fc.out_features == 96
