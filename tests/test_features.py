"""Feature cache: shards + manifest, resume after interruption, corruption detection, online mode, vocab."""
from __future__ import annotations

import json
import math
import os
import types

import pytest
import torch
from safetensors.torch import load_file

from jakiro_lib.data import dataset as D
from jakiro_lib.data import feature_store as FS
from jakiro_lib.data import features as F
from jakiro_lib.data.chat import format_conversation
from jakiro_lib.config import TargetConfig
from jakiro_lib.models.target import load_target
from jakiro_lib.files import file_sha256
from jakiro_lib.distributed import launched_world
from helpers import single_thread, word_conversations

MAX_LEN = 64
SHARD = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(model="tiny:llama"))


@pytest.fixture(scope="module")
def convs():
    return word_conversations()


@pytest.fixture(scope="module")
def cache(target, convs, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache")
    F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, progress=False)
    return out


def _formatted(target, convs):
    return [format_conversation(target.tokenizer, c.messages, max_length=MAX_LEN) for c in convs]


def test_manifest_counts(cache, target, convs):
    m = json.loads((cache / F.MANIFEST).read_text())
    fmt = _formatted(target, convs)
    kept = [f for f in fmt if sum(f.loss_mask)]
    assert len(kept) == 12 and m["skipped_empty_mask"] == 2
    assert m["complete"] and m["num_shards"] == m["num_shards_expected"] == math.ceil(len(convs) / SHARD)
    assert m["num_conversations"] == 12
    assert m["num_tokens"] == sum(len(f.input_ids) for f in kept)
    assert m["num_loss_tokens"] == sum(sum(f.loss_mask) for f in kept)
    assert m["hidden_size"] == 64 and m["vocab_size"] == 260 and m["feature_dtype"] == "float16"
    assert m["max_length"] == MAX_LEN and m["template"] == "auto" and m["target"] == "tiny:llama"
    assert "run_metadata" in m
    for s, entry in enumerate(m["shards"]):
        path = cache / F.shard_name(s)
        assert entry["file"] == path.name and entry["bytes"] == path.stat().st_size
        assert entry["sha256"] == file_sha256(path)
        tensors = load_file(str(path))
        assert tensors["hidden"].dtype == torch.float16 and tensors["input_ids"].dtype == torch.int32
        assert tensors["loss_mask"].dtype == torch.uint8 and tensors["offsets"].dtype == torch.int64
        assert tensors["offsets"].shape == (entry["conversations"], 2)
        assert int(tensors["offsets"][-1, 1]) == entry["tokens"] == tensors["input_ids"].numel()
    assert sum(e["conversations"] + e["skipped_empty_mask"] for e in m["shards"]) == len(convs)
    assert FS.verify_cache(cache, full=True)["complete"]


def test_dataset_returns_target_features(cache, target, convs):
    ds = D.FeatureDataset(cache, split="all")
    assert len(ds) == 12
    fmt = _formatted(target, convs)
    for item in ds:
        f = fmt[item["index"]]
        assert item["input_ids"].tolist() == f.input_ids and item["loss_mask"].tolist() == f.loss_mask
        ids = torch.tensor(f.input_ids)
        h = F.target_features(target.model, ids)[0]
        assert item["hidden"].dtype == torch.float32 and item["hidden"].shape == h.shape
        torch.testing.assert_close(item["hidden"], h, atol=1e-2, rtol=1e-2)
        logits = target.model(ids[None]).logits[0]
        assert torch.equal(item["target_top1"], logits.argmax(-1))
    assert sorted(item["index"] for item in ds) == [i for i, c in enumerate(convs) if not c.id.startswith("long")]


def test_split_is_deterministic_and_disjoint(cache):
    tr = D.FeatureDataset(cache, "train", 0.25)
    he = D.FeatureDataset(cache, "heldout", 0.25)
    assert len(he) == 3 and len(tr) == 9
    idx_tr, idx_he = {it[3] for it in tr.items}, {it[3] for it in he.items}
    assert not idx_tr & idx_he and len(idx_tr | idx_he) == 12
    assert [it[3] for it in D.FeatureDataset(cache, "heldout", 0.25).items] == [it[3] for it in he.items]
    assert len(D.FeatureDataset(cache, "heldout", 0.0)) == 0


def _stop_after_second(index, entry):
    """``on_shard`` callback: an interruption right after the second shard is written."""
    if index == 1:
        raise KeyboardInterrupt("simulated interruption")


def test_interrupted_caching_resumes(target, convs, cache, tmp_path, monkeypatch):
    out = tmp_path / "c"

    with pytest.raises(KeyboardInterrupt):
        F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, progress=False,
                         on_shard=_stop_after_second)
    m = json.loads((out / F.MANIFEST).read_text())
    assert not m["complete"] and [e["file"] for e in m["shards"]] == [F.shard_name(0), F.shard_name(1)]
    assert not (out / F.shard_name(2)).exists()
    with pytest.raises(FS.CacheError, match="incomplete"):
        D.FeatureDataset(out)
    mtimes = {s: (out / F.shard_name(s)).stat().st_mtime_ns for s in (0, 1)}

    calls = []
    real = F.target_features
    monkeypatch.setattr(F, "target_features", lambda model, ids, *a, **k: calls.append(1) or real(model, ids, *a, **k))
    F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, progress=False)
    # conversations 8..13 (shards 2 and 3) only; none of them is an empty-mask one
    assert len(calls) == len(convs) - 2 * SHARD
    assert {s: (out / F.shard_name(s)).stat().st_mtime_ns for s in (0, 1)} == mtimes
    m = FS.verify_cache(out, full=True)
    ref = json.loads((cache / F.MANIFEST).read_text())
    assert m["complete"] and m["num_tokens"] == ref["num_tokens"]
    for s in range(m["num_shards"]):
        a, b = load_file(str(out / F.shard_name(s))), load_file(str(cache / F.shard_name(s)))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    calls.clear()  # a rerun of a complete cache computes nothing
    F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, progress=False)
    assert not calls


def test_corrupt_shard_is_named_and_recomputed(target, convs, tmp_path, caplog):
    out = tmp_path / "c"
    F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, progress=False)
    path = out / F.shard_name(2)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(FS.CacheError, match=r"shard_00002\.safetensors is corrupt.*rerun caching"):
        FS.verify_cache(out)
    with pytest.raises(FS.CacheError, match=r"shard_00002\.safetensors"):
        D.FeatureDataset(out)
    path.write_bytes(b"\xff" * len(good))  # same size, garbage header
    with pytest.raises(FS.CacheError, match=r"shard_00002\.safetensors is corrupt"):
        FS.verify_cache(out)
    path.write_bytes(good[:-4] + b"\x00\x01\x02\x03")  # same size, altered data: only the checksum sees it
    with pytest.raises(FS.CacheError, match=r"shard_00002\.safetensors is corrupt \(sha256"):
        FS.verify_cache(out, full=True)
    path.unlink()
    with pytest.raises(FS.CacheError, match=r"shard_00002\.safetensors is missing"):
        FS.verify_cache(out)
    path.write_bytes(good[: len(good) // 2])  # truncated again: the rerun says which shard it rewrites
    with caplog.at_level("INFO", logger="jakiro_lib.data.features"):
        F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, progress=False)
    rewrites = [r for r in caplog.records if "rewriting damaged shard" in r.getMessage()]
    assert len(rewrites) == 1 and rewrites[0].levelname == "WARNING"
    assert "shard_00002.safetensors" in rewrites[0].getMessage() and "truncated" in rewrites[0].getMessage()
    assert "resuming: 3 of 4 shards present" in caplog.text
    FS.verify_cache(out, full=True)
    assert path.read_bytes() == good


def test_other_settings_are_refused(target, convs, cache):
    with pytest.raises(FS.CacheError, match="max_length"):
        F.cache_features(target, convs, cache, max_length=MAX_LEN + 1, shard_size=SHARD, progress=False)


def test_bfloat16_cache(target, convs, tmp_path):
    out = F.cache_features(target, convs[:3], tmp_path / "bf", max_length=MAX_LEN, shard_size=2,
                           feature_dtype="bfloat16", progress=False)
    ds = D.FeatureDataset(out, "all", dtype=None)
    assert ds[0]["hidden"].dtype == torch.bfloat16 and len(ds) == 3


def test_online_dataset_equals_cached(target, convs, cache):
    for split in ("train", "heldout"):
        cached = D.FeatureDataset(cache, split, 0.25)
        online = D.OnlineFeatureDataset(target, convs, MAX_LEN, "auto", split=split, heldout_fraction=0.25)
        assert len(online) == len(cached) and online.lengths() == cached.lengths()
        for a, b in zip(online, cached):
            assert a["index"] == b["index"]
            for key in ("input_ids", "loss_mask", "target_top1"):
                assert torch.equal(a[key], b[key]), key
            torch.testing.assert_close(a["hidden"], b["hidden"], atol=1e-2, rtol=1e-3)
    assert D.OnlineFeatureDataset(target, convs, MAX_LEN).skipped_empty_mask == 2


def test_draft_vocab_picks_most_frequent():
    items = [
        {"input_ids": torch.tensor([5, 5, 5, 7, 7, 9, 1, 1, 1, 1]),
         "loss_mask": torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0, 0])},
        {"input_ids": torch.tensor([3, 7, 2, 4]), "loss_mask": torch.tensor([1, 1, 1, 1])},
    ]
    arrays = types.SimpleNamespace(token_arrays=lambda: ((it["input_ids"], it["loss_mask"]) for it in items))
    freqs = D.token_frequencies(arrays, vocab_size=12)
    with pytest.raises(ValueError, match="token id 9 is outside the vocabulary of 9"):
        D.token_frequencies(arrays, vocab_size=9)
    assert freqs.shape == (12,)
    assert freqs[5] == 3 and freqs[7] == 3 and freqs[1] == pytest.approx(0.04) and freqs[11] == 0
    # 5 and 7 tie at 3 (both kept); then 2, 3, 4, 9 tie at 1: ids 2 and 3 win the tie
    assert D.build_draft_vocab(freqs, 4).tolist() == [2, 3, 5, 7]
    # then 1 (prompt-only, weight 0.01 each) beats the unseen ids, and unseen id 0 wins their tie
    assert D.build_draft_vocab(freqs, 8).tolist() == [0, 1, 2, 3, 4, 5, 7, 9]
    assert D.build_draft_vocab(freqs, 4, always=[11]).tolist() == [2, 5, 7, 11]
    assert D.vocab_coverage(freqs, D.build_draft_vocab(freqs, 12)) == pytest.approx(1.0)


def test_token_frequencies_from_cache(cache):
    ds = D.FeatureDataset(cache, "train", 0.25)
    freqs = D.token_frequencies(ds, ds.vocab_size)
    ref = torch.zeros(260, dtype=torch.float64)
    for item in ds:
        ref.index_add_(0, item["input_ids"], torch.where(item["loss_mask"] > 0, 1.0, 0.01).double())
    torch.testing.assert_close(freqs, ref)
    d2t = D.build_draft_vocab(freqs, 32)
    assert d2t.numel() == 32 and freqs[d2t].min() >= freqs[[i for i in range(260) if i not in d2t.tolist()]].max()


def test_collate_pads_right():
    a = {"input_ids": torch.tensor([1, 2, 3]), "hidden": torch.ones(3, 4), "loss_mask": torch.tensor([0, 1, 1]),
         "target_top1": torch.tensor([2, 3, 4]), "index": 7}
    b = {"input_ids": torch.tensor([5]), "hidden": 2 * torch.ones(1, 4), "loss_mask": torch.tensor([1]),
         "target_top1": torch.tensor([9]), "index": 8}
    out = D.collate([a, b])
    assert out["input_ids"].tolist() == [[1, 2, 3], [5, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]] and out["loss_mask"].dtype == torch.float32
    assert out["target_top1"].tolist() == [[2, 3, 4], [9, -1, -1]]
    assert out["hidden"][1, 1:].abs().sum() == 0 and out["hidden"].shape == (2, 3, 4)
    assert out["lengths"].tolist() == [3, 1] and out["index"].tolist() == [7, 8]


def test_disk_estimates(target, convs):
    assert FS.estimate_disk(1000, 4096, "float16") == 1000 * (4096 * 2 + 9)
    assert FS.estimate_disk(10, 64, "float32") == 10 * (64 * 4 + 9)
    assert FS.human_bytes(1536) == "1.5 KiB" and FS.human_bytes(3 * 1024**3) == "3.0 GiB"
    est = F.estimate_cache(target, convs, max_length=MAX_LEN)
    assert est["conversations"] == 12 and est["skipped_empty_mask"] == 2
    assert est["bytes"] == FS.estimate_disk(est["tokens"], 64)
    # Vicuna-7B scale (DESIGN.md 4): H=4096 fp16 is 8 KB per token
    assert FS.bytes_per_token(4096) // 1024 == 8
    assert os.path.basename(F.shard_name(3)) == "shard_00003.safetensors"


def _two_process_run(target, convs, out, **kw):
    """Simulate `accelerate launch` with 2 processes, one after the other: process 1, then the main one."""
    waits, written = [], {0: [], 1: []}
    for rank in (1, 0):
        world = F.World(index=rank, size=2, wait=lambda: waits.append(rank))
        F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, progress=False,
                         on_shard=lambda s, e: written[rank].append(s), world=world, **kw)
        if rank == 1 and not (out / F.MANIFEST).exists():  # its shards are only in sidecars so far
            assert sorted(p.name for p in out.glob("shard_*.json")) == ["shard_00001.json", "shard_00003.json"]
    assert waits == [1] * 3 + [0] * 3
    return written


def test_two_processes_merge_into_single_process_cache(target, convs, cache, tmp_path, monkeypatch):
    out = tmp_path / "mp"
    assert _two_process_run(target, convs, out) == {1: [1, 3], 0: [0, 2]}
    assert not list(out.glob("shard_*.json"))  # sidecars merged and removed
    m, ref = FS.verify_cache(out, full=True), json.loads((cache / F.MANIFEST).read_text())
    assert [e["file"] for e in m["shards"]] == [e["file"] for e in ref["shards"]]
    assert m["shards"] == ref["shards"]  # same counts, sizes and checksums
    for key in ("num_shards", "num_conversations", "num_tokens", "num_loss_tokens", "skipped_empty_mask",
                "bytes", "complete", "settings"):
        assert m[key] == ref[key], key
    for s in range(m["num_shards"]):
        a, b = load_file(str(out / F.shard_name(s))), load_file(str(cache / F.shard_name(s)))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    calls = []  # a rerun skips the complete shards in every process
    real = F.target_features
    monkeypatch.setattr(F, "target_features", lambda model, ids, *a, **k: calls.append(1) or real(model, ids, *a, **k))
    assert _two_process_run(target, convs, out) == {1: [], 0: []} and not calls
    assert FS.verify_cache(out, full=True)["shards"] == ref["shards"]


def test_interrupted_multi_process_run_resumes_from_sidecars(target, convs, cache, tmp_path):
    out = tmp_path / "mp"

    def stop(index, entry):
        if index == 0:
            raise KeyboardInterrupt("simulated interruption")

    F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, progress=False,
                     world=F.World(index=1, size=2))
    with pytest.raises(KeyboardInterrupt):  # the main process stops before merging
        F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, progress=False,
                         world=F.World(index=0, size=2), on_shard=stop)
    assert [e["file"] for e in json.loads((out / F.MANIFEST).read_text())["shards"]] == [F.shard_name(0)]
    assert sorted(p.name for p in out.glob("shard_*.json")) == ["shard_00001.json", "shard_00003.json"]
    written = []  # a single-process rerun keeps the sidecars' shards and computes only shard 2
    F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, progress=False,
                     on_shard=lambda s, e: written.append(s))
    assert written == [2] and not list(out.glob("shard_*.json"))
    assert FS.verify_cache(out, full=True)["shards"] == json.loads((cache / F.MANIFEST).read_text())["shards"]


def test_single_process_world_without_accelerate(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    world = launched_world()
    assert (world.index, world.size, world.device) == (0, 1, None)


# --------------------------------------------------------------------------------------------------
# Batched caching: several conversations per target forward
# --------------------------------------------------------------------------------------------------


def _shards(out):
    m = json.loads((out / F.MANIFEST).read_text())
    return [load_file(str(out / e["file"])) for e in m["shards"]]


@pytest.fixture(scope="module")
def fp32_cache(target, convs, tmp_path_factory):
    """One conversation per forward, features stored in fp32: the reference for batched caches."""
    out = tmp_path_factory.mktemp("fp32")
    F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, feature_dtype="float32",
                     progress=False)
    return out


@pytest.mark.parametrize("batch_size", [2, 3, 16])
def test_batched_cache_equals_per_conversation(target, convs, fp32_cache, tmp_path, batch_size):
    out = tmp_path / "b"
    F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, feature_dtype="float32",
                     progress=False, batch_size=batch_size)
    ref, got = _shards(fp32_cache), _shards(out)
    assert len(ref) == len(got) == math.ceil(len(convs) / SHARD)
    for a, b in zip(ref, got):
        assert a.keys() == b.keys()
        for key in ("input_ids", "loss_mask", "target_top1", "offsets", "conversation_index"):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        assert b["hidden"].shape == a["hidden"].shape  # one row per real token: no padded row stored
        torch.testing.assert_close(b["hidden"], a["hidden"], atol=1e-5, rtol=1e-5)
    m, ref_m = FS.verify_cache(out, full=True), json.loads((fp32_cache / F.MANIFEST).read_text())
    assert m["settings"] == ref_m["settings"] and m["cache_batch_size"] == batch_size
    assert [e["batch_size"] for e in m["shards"]] == [batch_size] * len(ref)
    assert [(e["conversations"], e["tokens"], e["loss_tokens"]) for e in m["shards"]] == \
        [(e["conversations"], e["tokens"], e["loss_tokens"]) for e in ref_m["shards"]]


def test_padding_never_leaks_into_stored_rows(target, convs, tmp_path, monkeypatch):
    masks = []
    real = F.target_features
    monkeypatch.setattr(F, "target_features",
                        lambda model, ids, mask=None: masks.append(mask) or real(model, ids, mask))
    outs = []
    for pad in (0, 7, 259):  # whatever sits on the padded positions, the stored rows are the same bits
        monkeypatch.setattr(F, "PAD_ID", pad)
        outs.append(F.cache_features(target, convs, tmp_path / f"pad{pad}", max_length=MAX_LEN, shard_size=SHARD,
                                     feature_dtype="float32", progress=False, batch_size=SHARD))
    assert any(m is not None and (m == 0).any() for m in masks)  # some batches really were padded
    for a, b in zip(_shards(outs[0]), _shards(outs[1])):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for a, b in zip(_shards(outs[0]), _shards(outs[2])):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_length_batches_sort_within_the_list():
    assert F.length_batches([3, 9, 5, 9, 1], 2) == [[1, 3], [2, 0], [4]]
    assert F.length_batches([4, 2], 1) == [[0], [1]]
    assert F.length_batches([], 4) == []
    with pytest.raises(ValueError):
        F.length_batches([1], 0)


def test_resume_with_another_batch_size_says_so(target, convs, fp32_cache, tmp_path, caplog):
    out = tmp_path / "r"

    with pytest.raises(KeyboardInterrupt):
        F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, feature_dtype="float32",
                         progress=False, on_shard=_stop_after_second)
    written = []
    with caplog.at_level("INFO", logger="jakiro_lib.data.features"):
        F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, feature_dtype="float32",
                         progress=False, batch_size=3, on_shard=lambda s, e: written.append(s))
    assert written == [2, 3]  # the batch size is no setting: the per-conversation shards are kept
    assert [e["batch_size"] for e in FS.verify_cache(out)["shards"]] == [1, 1, 3, 3]
    assert f"resuming: 2 of 4 shards present in {out}" in caplog.text
    for a, b in zip(_shards(fp32_cache), _shards(out)):
        torch.testing.assert_close(b["hidden"], a["hidden"], atol=1e-5, rtol=1e-5)
        assert torch.equal(a["target_top1"], b["target_top1"])
    caplog.clear()
    with caplog.at_level("INFO", logger="jakiro_lib.data.features"):
        F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, feature_dtype="float32",
                         progress=False)
    assert "resuming: 4 of 4 shards present" in caplog.text and "damaged" not in caplog.text
