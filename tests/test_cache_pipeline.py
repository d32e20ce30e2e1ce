"""Feature caching as a pipeline (issue 42): shards tokenized ahead by worker processes, one copy to the host per
batch, each shard written on a thread while the next is computed -- and the same files as caching one step after
another: byte for byte, with the same manifest, resume and errors."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from jakiro_lib.config import ConfigError, TargetConfig
from jakiro_lib.data import cache_pipeline as P
from jakiro_lib.data import feature_store as FS
from jakiro_lib.data import features as F
from jakiro_lib.data.chat import tokenize_conversation
from jakiro_lib.files import file_sha256
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile
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
    return word_conversations(13, 1, long_chars=1000)  # 14, the sixth skipped (also at max_length 256)


def cache(target, convs, out, workers, **kw):
    return F.cache_features(target, convs, out, max_length=MAX_LEN, shard_size=SHARD, progress=False,
                            tokenize_workers=workers, **kw)


def files(out: Path) -> dict[str, bytes]:
    """Every file of a cache (hidden work folders included) by name; the manifest without its run metadata."""
    found = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    manifest = json.loads(found.pop(F.MANIFEST))
    del manifest["run_metadata"]  # the time, the machine, the commit: what legitimately differs between runs
    return {**found, F.MANIFEST: json.dumps(manifest, sort_keys=True).encode()}


@pytest.fixture(scope="module")
def reference(target, convs, tmp_path_factory):
    """The cache tokenized in this process (1 worker: the path of a 1-2 CPU machine)."""
    return cache(target, convs, tmp_path_factory.mktemp("ref"), 1)


def test_worker_count(monkeypatch):
    for cpus, processes, expected in [(1, 1, 0), (2, 1, 0), (3, 1, 2), (16, 1, 15), (64, 1, 16), (8, 2, 3),
                                      (4, 2, 0)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)), raising=False)
        assert P.worker_count(0, processes) == expected, (cpus, processes)
    assert P.worker_count(1) == 0 and P.worker_count(2) == 2 and P.worker_count(40) == 40
    with pytest.raises(ValueError, match="tokenize_workers"):
        P.worker_count(-1)


def test_workers_write_the_same_bytes(target, convs, reference, tmp_path, monkeypatch):
    in_parent = []
    real = P.tokenize_conversation  # forked workers call their own copy: only this process's calls are counted
    monkeypatch.setattr(P, "tokenize_conversation", lambda *a: in_parent.append(1) or real(*a))
    out = cache(target, convs, tmp_path / "pool", 2)
    assert not in_parent  # every conversation was tokenized by a worker
    assert files(out) == files(reference)
    assert FS.verify_cache(out, full=True)["complete"]
    cache(target, convs, tmp_path / "one", 1)
    assert len(in_parent) == len(convs)  # 1 worker: tokenized here, shard by shard


def test_tokens_ahead_in_any_order(target, convs):
    def shard(i):
        return convs[i * SHARD:(i + 1) * SHARD]
    kw = dict(max_length=MAX_LEN, template="auto")
    with P.ShardTokens(target.tokenizer, shard, [3, 1, 2], workers=2, **kw) as tokens:
        got = {i: tokens.get(i) for i in (3, 1, 2)}
    assert got == {i: [tokenize_conversation(target.tokenizer, c, MAX_LEN, "auto") for c in shard(i)] for i in got}
    with P.ShardTokens(target.tokenizer, shard, [], workers=2, **kw) as tokens:
        assert tokens.get(0) == [tokenize_conversation(target.tokenizer, c, MAX_LEN, "auto") for c in shard(0)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_one_host_copy_per_batch_gives_the_same_tensors(target, convs, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    shard, n = convs[4:8], 256  # the second is skipped (an empty loss mask); unequal lengths: batches are padded
    model = target.model.to(device)
    try:
        tensors, _, skipped = F.shard_tensors(target, shard, 4, max_length=n, template="auto",
                                              dtype=torch.float16, bar=None, batch_size=2)
        seqs = [ids for ids, mask in (tokenize_conversation(target.tokenizer, c, n, "auto") for c in shard) if sum(mask)]
        per_conversation = {}
        for group in F.length_batches([len(s) for s in seqs], 2):  # as before: one copy per conversation
            rows, top1 = F.batch_features(model, [seqs[g] for g in group])
            lens = [len(seqs[g]) for g in group]
            for g, h, t in zip(group, rows.split(lens), top1.split(lens)):
                per_conversation[g] = (h.to(torch.float16).cpu(), t.to(torch.int32).cpu())
    finally:
        target.model.to("cpu")
    assert skipped == 1 and len({len(s) for s in seqs}) == 3
    assert (tensors["hidden"].dtype, tensors["target_top1"].dtype) == (torch.float16, torch.int32)
    assert torch.equal(tensors["hidden"], torch.cat([per_conversation[g][0] for g in range(len(seqs))]))
    assert torch.equal(tensors["target_top1"], torch.cat([per_conversation[g][1] for g in range(len(seqs))]))
    a, b = torch.ones(3, 2), torch.arange(3)
    assert P.to_host(a, b)[0] is a and P.to_host(a, b)[1] is b  # on the host: nothing copied


def test_stored_bytes_equal_save_file(tmp_path):
    tensors = {"hidden": torch.randn(7, 5).to(torch.bfloat16), "h16": torch.randn(3, 4).half(),
               "ids": torch.arange(7, dtype=torch.int32), "mask": torch.tensor([0, 1, 1], dtype=torch.uint8),
               "offsets": torch.zeros(0, 2, dtype=torch.int64), "z": torch.zeros(0, dtype=torch.int32)}
    meta = {"jakiro": json.dumps({"format": FS.FORMAT, "conversation_ids": ["a", "b"]})}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=meta)
    size, sha = P.store_shard(tmp_path / "new.safetensors", tensors, meta)
    assert (tmp_path / "new.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert (size, sha) == ((tmp_path / "ref.safetensors").stat().st_size, file_sha256(tmp_path / "ref.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.safetensors", "ref.safetensors"]


def _cut_write(fail_on: str):
    """An ``atomic_path`` whose write of ``fail_on`` stops half-way with a full disk."""
    real = P.atomic_path

    @contextlib.contextmanager
    def cut(path):
        with real(path) as tmp:
            yield tmp
            if Path(path).name == fail_on:
                tmp.write_bytes(tmp.read_bytes()[:100])
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return cut


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failing_write_raises_and_leaves_no_half_shard(target, convs, reference, tmp_path, monkeypatch, workers):
    out = tmp_path / "c"
    monkeypatch.setattr(P, "atomic_path", _cut_write(F.shard_name(1)))
    with pytest.raises(OSError, match="No space left"):
        cache(target, convs, out, workers)
    assert sorted(p.name for p in out.iterdir()) == [F.MANIFEST, F.shard_name(0)]  # no half shard, no work folder
    assert [e["file"] for e in json.loads((out / F.MANIFEST).read_text())["shards"]] == [F.shard_name(0)]
    monkeypatch.undo()
    cache(target, convs, out, workers)
    assert files(out) == files(reference)


def test_writer_errors_surface():
    with pytest.raises(ZeroDivisionError):  # raised where the next write waits for it
        with P.ShardWriter() as writer:
            writer.put(0, lambda: 1 / 0)
            writer.put(1, lambda: 1)
    with pytest.raises(ZeroDivisionError):  # never waited for: raised on leaving
        with P.ShardWriter() as writer:
            writer.put(0, lambda: 1 / 0)
    written = []
    with P.ShardWriter(lambda i, r: written.append((i, r))) as writer:
        for i in range(3):
            writer.put(i, lambda i=i: i * 10)
        writer.wait()
    assert written == [(0, 0), (1, 10), (2, 20)]


def test_a_writer_error_behind_another_is_logged(caplog):
    with caplog.at_level(logging.ERROR, logger=P.__name__), pytest.raises(KeyError):
        with P.ShardWriter() as writer:
            writer.put(3, lambda: 1 / 0)
            raise KeyError("first")
    assert "writing shard 3 failed too" in caplog.text and "division by zero" in caplog.text


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_while_computing_keeps_the_shard_written_behind(target, convs, reference, tmp_path, monkeypatch,
                                                                     workers):
    out = tmp_path / "c"
    calls = []
    real = F.shard_tensors

    def stop_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated Ctrl-C")
        return real(*a, **k)
    monkeypatch.setattr(F, "shard_tensors", stop_third)
    with pytest.raises(KeyboardInterrupt):
        cache(target, convs, out, workers)
    m = json.loads((out / F.MANIFEST).read_text())
    assert [e["file"] for e in m["shards"]] == [F.shard_name(0), F.shard_name(1)] and not m["complete"]
    assert sorted(p.name for p in out.iterdir()) == [F.MANIFEST, F.shard_name(0), F.shard_name(1)]
    monkeypatch.undo()
    written = []
    cache(target, convs, out, workers, on_shard=lambda s, e: written.append(s))
    assert written == [2, 3] and files(out) == files(reference)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_conversation_raises_as_before(target, convs, tmp_path, workers):
    bad = [*convs[:9], {"id": "bad", "messages": [{"role": "robot", "content": "beep"}]}, *convs[9:]]
    out = tmp_path / "c"
    with pytest.raises(ValueError, match="message 0 has unknown role 'robot'") as caught:
        cache(target, bad, out, workers)
    assert caught.value.__cause__ is None  # no worker traceback attached
    assert [e["file"] for e in json.loads((out / F.MANIFEST).read_text())["shards"]] == \
        [F.shard_name(0), F.shard_name(1)]  # the shards before it are kept, as one step after another kept them


def _die(convs):
    os._exit(3)


def test_a_dead_worker_is_one_clear_error(target, convs, tmp_path, monkeypatch):
    monkeypatch.setattr(P, "_tokenize_chunk", _die)
    with pytest.raises(FS.CacheError, match="tokenizing worker process died.*tokenize_workers=1"):
        cache(target, convs, tmp_path / "c", 2)


def test_two_processes_with_workers_write_the_same_bytes(target, convs, reference, tmp_path):
    out = tmp_path / "mp"
    for rank in (1, 0):  # `accelerate launch` with 2 processes, one after the other: shards [1, 3], then [0, 2]
        cache(target, convs, out, 2, world=F.World(index=rank, size=2))
    assert files(out) == files(reference)


def test_the_tokenizer_pickles(target, convs):
    """Where workers cannot be forked (not Linux), each is spawned and gets the tokenizer pickled: the same tokens."""
    copy = pickle.loads(pickle.dumps(target.tokenizer))
    assert [tokenize_conversation(copy, c, MAX_LEN, "auto") for c in convs] == \
        [tokenize_conversation(target.tokenizer, c, MAX_LEN, "auto") for c in convs]


def test_the_setting_is_checked():
    assert get_profile("smoke").data.tokenize_workers == 0  # auto
    assert get_profile("smoke", **{"data.tokenize_workers": "4"}).data.tokenize_workers == 4
    with pytest.raises(ConfigError, match=r"data.tokenize_workers.*>= 0"):
        get_profile("smoke", **{"data.tokenize_workers": "-1"})


def test_the_estimate_tokenized_by_workers_counts_the_same(target, convs, monkeypatch):
    """estimate_cache (every conversation tokenized before caching) counts the same with 2 workers as in this
    process, across several worker tasks and the skipped conversation."""
    monkeypatch.setattr(F, "ESTIMATE_CHUNK", 3)
    alone = F.estimate_cache(target, convs, max_length=MAX_LEN)
    made = [tokenize_conversation(target.tokenizer, c, MAX_LEN, "auto") for c in convs]
    kept = [(ids, mask) for ids, mask in made if sum(mask)]
    assert (alone["conversations"], alone["skipped_empty_mask"]) == (len(convs) - 1, 1)
    assert (alone["tokens"], alone["loss_tokens"]) == (sum(len(i) for i, _ in kept), sum(sum(m) for _, m in kept))
    assert F.estimate_cache(target, convs, max_length=MAX_LEN, tokenize_workers=2) == alone
