"""The throughput command: its table's columns and rows on the smoke profile at tiny sizes (no speed
assertions), hardware detection, and the gpu profile."""
from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch

from jakiro_lib.data import dataset as D
from jakiro_lib.data import features as F
from jakiro_lib.training import throughput as TP
from jakiro_lib.training import throughput_plan as TPP
from jakiro_lib.training import train as T
from jakiro_lib.models import loss as L
from jakiro_lib import machine, precision
from jakiro_lib.cli import main
from jakiro_lib.config import TargetConfig, TrainConfig
from jakiro_lib.profiles import get_profile
from jakiro_lib.data.conversations import Conversation
from jakiro_lib.models.target import load_target
from helpers import single_thread

WORDS = "the cat sat on a mat while dogs ran far away and birds sang in tall green trees".split()


@pytest.fixture()
def conversations_file(tmp_path):
    """Eight ShareGPT-format conversations of varied lengths (so batches pad)."""
    path = tmp_path / "convs.jsonl"
    with path.open("w") as fh:
        for i in range(8):
            q = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + 3 * i))
            a = " ".join(WORDS[(2 * i + k) % len(WORDS)] for k in range(3 + 5 * i))
            fh.write(json.dumps({"id": f"t{i}", "conversations": [{"from": "human", "value": q},
                                                                   {"from": "gpt", "value": a}]}) + "\n")
    return path


@pytest.fixture(autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.mark.parametrize("favoured", [None, "bfloat16"])
def test_throughput_command_writes_its_table(conversations_file, tmp_path, capsys, monkeypatch, favoured):
    monkeypatch.setattr(TP, "favoured_dtype", lambda device: favoured)  # both layouts on any machine
    out = tmp_path / "tp"
    assert main(["throughput", "--profile", "smoke", "--set", f"data.path={conversations_file}",
                 "--set", "data.shard_size=5", "--set", "train.batch_size=3", "--conversations", "7",
                 "--steps", "2", "--cache-batch-sizes", "1,3", "--out", str(out)]) == 0
    table = pd.read_csv(out / TP.CSV)
    assert list(table.columns) == list(TP.COLUMNS)
    dtypes = ["float32"] + ([favoured] if favoured else [])
    kept = machine.keep_freed_memory(True)  # glibc: the favoured dtype's rows again with freed memory kept
    cache = table[table["part"] == "cache"]
    sizes = ((1, "per conversation"), (3, "batch 3"))
    assert [(r.dtype, r.batch_size, r.variant, r.allocator) for r in cache.itertuples()] == \
        [(d, b, v, "system") for d in dtypes for b, v in sizes] + \
        [(d, b, f"{v}, freed memory kept", "kept") for d in dtypes[-1:] for b, v in sizes if kept]
    assert (cache["items"] == 7).all() and cache["tokens"].nunique() == 1  # the same conversations each time
    assert (cache.loc[cache["batch_size"] == 1, "padding"] == 0).all()
    assert (cache.loc[cache["batch_size"] == 3, "padding"] > 0).all()  # varied lengths share a forward
    train = table[table["part"] == "train"]
    precisions = ["fp32"] + (["bf16"] if favoured else [])
    assert list(train["variant"]) == [f"dense {p}{b}" for p in precisions for b in ("", " bucketed")] + \
        [f"dense {precisions[-1]}, freed memory kept"] * kept
    assert list(train["bucketed"]) == [False, True] * len(precisions) + [False] * kept
    assert (train["items"] == 2).all() and (train["batch_size"] == 3).all()
    stages = [f"{s}_ms" for s in TP.STAGES] + ["step_ms"]
    assert train[stages].notna().all().all() and (train[stages] >= 0).all().all()
    assert cache[stages].isna().all().all()
    assert (table["tokens_per_s"] > 0).all() and (table["padding"].between(0, 1)).all()
    for part in ("cache", "train"):
        assert table.loc[table["part"] == part, "speedup"].iloc[0] == pytest.approx(1.0)
    config = json.loads((out / TP.CONFIG_JSON).read_text())
    assert config["profile"]["name"] == "smoke" and config["options"]["cache_batch_sizes"] == [1, 3]
    env = json.loads((out / TP.ENV_JSON).read_text())
    assert {"cpu_capability", "cpu_flags", "favoured_dtype", "threads", "torch", "device"} <= set(env)
    assert not list(out.glob(".features.*"))  # the temporary feature cache is gone
    plan = pd.read_csv(out / TP.PLAN_CSV)  # the smoke profile's whole data (8 conversations) and every draft
    assert list(plan.columns) == list(TPP.PLAN_COLUMNS) and list(plan["stage"]).count("train") == len(get_profile("smoke").drafts)
    assert plan["tokens"].iloc[0] > cache["tokens"].iloc[0] and list(plan["stage"])[::len(plan) - 1] == ["cache", "total"]
    printed = capsys.readouterr().out
    assert all(col in printed for col in ("tokens_per_s", "speedup", "forward_ms", "step_ms"))
    measured, planned = printed.split("expected minutes")
    assert measured.count("dense fp32") == 2 + (kept and not favoured) and "caching + training" in planned
    # the same plan from the table alone, as for a table measured on another machine
    assert main(["throughput", "--profile", "smoke", "--set", f"data.path={conversations_file}",
                 "--plan-from", str(out / TP.CSV), "--out", str(tmp_path / "again")]) == 0
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "again" / TP.PLAN_CSV), plan)
    with pytest.raises(SystemExit, match="not a throughput.csv"):
        main(["throughput", "--profile", "smoke", "--plan-from", str(out / TP.PLAN_CSV), "--out", str(tmp_path)])
    (tmp_path / "notes.txt").write_text("name\nx\ny,z,w\n")  # not even a table
    with pytest.raises(SystemExit, match=r"notes.txt is not a throughput.csv \(ParserError\)"):
        main(["throughput", "--profile", "smoke", "--plan-from", str(tmp_path / "notes.txt"), "--out", str(tmp_path)])


class _FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


def test_keep_freed_memory_sets_and_restores_glibc_and_is_recorded(monkeypatch):
    fake = _FakeLibc()
    monkeypatch.setattr(machine, "c_library", lambda: fake)
    assert machine.keep_freed_memory() is True and machine.run_metadata()["malloc_keeps_freed"] is True
    assert fake.calls == [(machine.M_MMAP_MAX, 0), (machine.M_TRIM_THRESHOLD, 2**31 - 1)]  # no mmap, no trimming
    fake.calls.clear()
    assert machine.keep_freed_memory(False) is False and machine.run_metadata()["malloc_keeps_freed"] is False
    assert (machine.M_MMAP_MAX, 65536) in fake.calls and (machine.M_MMAP_THRESHOLD, 32 * 2**20) in fake.calls
    monkeypatch.setattr(machine, "c_library", lambda: object())  # a C library without mallopt (not glibc)
    assert machine.keep_freed_memory() is False


def test_bad_options_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit, match="unknown draft"):
        main(["throughput", "--profile", "smoke", "--drafts", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:  # argparse's usage and one error line, status 2
        main(["throughput", "--profile", "smoke", "--cache-batch-sizes", "1,x", "--out", str(tmp_path)])
    assert exc.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(
        "argument --cache-batch-sizes: expected comma-separated integers >= 1, got '1,x'")
    with pytest.raises(ValueError, match="unknown draft"):
        TP.run_throughput(get_profile("smoke"), tmp_path, drafts=["nope"])
    with pytest.raises(ValueError):
        TP.run_throughput(get_profile("smoke"), tmp_path, steps=0)


def test_favoured_dtype_follows_the_cpu_flags(monkeypatch):
    from jakiro_lib import precision

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2", "fma"})
    assert precision.favoured_dtype(cpu) is None and precision.resolve_precision("auto", precision.favoured_dtype(cpu)) == "no"
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2", "avx512f", "amx_tile", "amx_bf16"})
    assert precision.favoured_dtype(cpu) == "bfloat16" and precision.resolve_precision("auto", precision.favoured_dtype(cpu)) == "bf16"
    assert precision.resolve_precision("no", "bfloat16") == "no"  # a setting other than auto is kept
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert precision.favoured_dtype(cpu) == "bfloat16"


def test_cpu_flags_read_this_machine():
    flags = precision.cpu_flags()
    assert isinstance(flags, frozenset)  # read once per process and shared: immutable
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return
    assert all(f in text for f in flags)


def _measured(favoured: bool) -> pd.DataFrame:
    """A throughput table as run_throughput writes it (rates chosen so that each row is told apart)."""
    rows = [dict(part="cache", variant=f"batch {b}", dtype=d, allocator=a, batch_size=b, tokens_per_s=r)
            for d, r0 in (("float32", 100), ("bfloat16", 200)) if favoured or d == "float32"
            for a, r1 in (("system", 0), ("kept", 10)) for b, r2 in ((1, 0), (4, 1), (16, 2))
            for r in [r0 + r1 + r2]]
    rows += [dict(part="train", draft=n, variant=f"{n} {p} {a} {c}", dtype=dt, allocator=a, bucketed=False,
                  compiled=c, batch_size=8, tokens_per_s=r0 * (3 if p == "bf16" else 1) * (2 if c else 1) + (a == "kept"))
             for n, r0 in (("dense", 1000), ("moe2", 500))
             for p, dt in (("fp32", "float32"), ("bf16", "bf16 autocast")) if favoured or p == "fp32"
             for a in ("system", "kept") for c in (False, True)]
    return pd.DataFrame(rows)


@pytest.mark.parametrize("favoured", [None, "bfloat16"])
def test_stage_plan_takes_the_rows_the_profile_would_run_at(monkeypatch, favoured):
    """From the table alone (the machine that measured it favours the dtype it measured besides fp32): caching
    at the dtype caching uses and the nearest measured batch; each draft at its own row in the
    profile's precision and compilation (freed memory kept); an unmeasured draft at its MLP kind's rate over
    its unroll steps; seconds = tokens / rate; the total adds them up."""
    p = get_profile("default", **{"data.cache_batch_size": "8", "drafts": "dense,moe2,dense_u2", "train.epochs": "3"})
    plan = TP.stage_plan(p, _measured(bool(favoured)), tokens=10_000).set_index("draft")
    cache, total = plan.iloc[0], plan.iloc[-1]
    assert cache["stage"] == "cache" and cache["tokens"] == 10_000
    assert cache["tokens_per_s"] == (211 if favoured else 111)  # freed memory kept; of 1, 4 and 16, 4 is nearest to 8
    bf16 = 3 if favoured else 1
    compiled = 2 if favoured else 1  # compile "auto": where training runs in bf16
    rates = {"dense": 1000 * bf16 * compiled + 1, "moe2": 500 * bf16 * compiled + 1}
    rates["dense_u2"] = rates["dense"] / 2
    train_tokens = 3 * round(10_000 * (1 - p.data.heldout_fraction))
    for name, rate in rates.items():
        assert plan.loc[name, "tokens_per_s"] == pytest.approx(rate) and plan.loc[name, "tokens"] == train_tokens
        assert plan.loc[name, "seconds"] == pytest.approx(train_tokens / rate)
    assert "unroll" in plan.loc["dense_u2", "basis"] and "unroll" not in plan.loc["dense", "basis"]
    assert total["stage"] == "total" and total["seconds"] == pytest.approx(plan["seconds"].iloc[:-1].sum())
    assert total["minutes"] == pytest.approx(total["seconds"] / 60)


def test_gpu_profile():
    p = get_profile("gpu")
    assert (p.target.model, p.target.dtype, p.target.device) == ("builtin:smollm2", "bfloat16", "cuda")
    assert p.data.num_conversations >= 17_671 and p.data.cache_batch_size > 1
    assert (p.train.epochs, p.tree.depth, p.tree.top_k, p.tree.total_tokens) == (20, 5, 10, 60)  # DESIGN.md 4-5
    assert p.train.mixed_precision == "bf16" and p.train.batch_size >= 16
    assert set(get_profile("default").drafts) <= set(p.drafts)  # the default job's drafts and the ablations'


def test_training_step_passes_the_loss_options_train_draft_uses(tmp_path, monkeypatch):
    """The timed step runs draft_loss as train_draft's step does for that draft: its per-expert loss and
    its unrolled steps (a draft's own unroll_steps over the training config's)."""
    target = load_target(TargetConfig(model="tiny:llama"))
    convs = [Conversation(f"c{i}", [{"role": "user", "content": " ".join(WORDS[i:i + 3])},
                                    {"role": "assistant", "content": " ".join(WORDS[i:i + 6])}]) for i in range(8)]
    cache = F.cache_features(target, convs, tmp_path / "cache", max_length=32, shard_size=4, progress=False)
    train, held = D.FeatureDataset(cache, "train", 0.25), D.FeatureDataset(cache, "heldout", 0.25)
    tc = TrainConfig(epochs=1, batch_size=3, max_steps=1, warmup_steps=0, unroll_steps=2)
    base = get_profile("smoke").drafts["moe2_xgate"]
    for draft_cfg in (base, dataclasses.replace(base, unroll_steps=3, expert_loss="equal")):
        calls: dict[str, list] = {}
        where = ["train"]
        real = L.draft_loss  # both reach it through L.step_loss

        def spy(draft, batch, **kw):
            if draft.training:  # train_draft's held-out evaluations call it too, in eval mode
                calls.setdefault(where[0], []).append((L._core(draft).cfg.expert_loss, kw))
            return real(draft, batch, **kw)

        monkeypatch.setattr(L, "draft_loss", spy)
        T.train_draft(target, draft_cfg, train, held, tmp_path / f"t{draft_cfg.unroll_steps}", tc, progress=False)
        where[0] = "throughput"
        TP.training_rows(target, {"d": draft_cfg}, train, tc, steps=1, warmup=0, precisions=["fp32"])
        monkeypatch.undo()
        assert calls["train"][0][0] == draft_cfg.expert_loss != "off"
        assert calls["train"][0][1]["unroll_steps"] == (draft_cfg.unroll_steps or tc.unroll_steps)
        assert all(c == calls["train"][0] for c in calls["train"] + calls["throughput"])
