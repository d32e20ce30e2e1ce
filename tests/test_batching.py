"""Length-bucketed training batches: every conversation once per epoch, deterministic, less padding, and
the batches train_draft serves (also after a resume) are the sampler's."""
from __future__ import annotations

import math
import random

import pytest
import torch

from jakiro_lib.data import dataset as D
from jakiro_lib.data import features as F
from jakiro_lib.training import train as T
from jakiro_lib.models import loss as L
from jakiro_lib.data.batching import LengthBucketSampler, padded_tokens
from jakiro_lib.config import TargetConfig, TrainConfig
from jakiro_lib.profiles import get_profile
from jakiro_lib.data.conversations import Conversation
from jakiro_lib.models.target import load_target

WORDS = "the cat sat on a mat while dogs ran far away and birds sang in tall green trees".split()


def random_lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(5, 400) for _ in range(n)]


@pytest.mark.parametrize("n,batch_size,window", [(103, 8, 4), (16, 4, 32), (5, 8, 2), (64, 1, 3)])
def test_every_position_once_per_epoch(n, batch_size, window):
    s = LengthBucketSampler(random_lengths(n), batch_size, seed=3, window=window)
    for epoch in range(3):
        s.set_epoch(epoch)
        batches = list(s)
        assert len(batches) == len(s) == math.ceil(n / batch_size)
        assert sorted(i for b in batches for i in b) == list(range(n))
        assert sum(len(b) < batch_size for b in batches) <= 1  # only the last cut of the last window is short


def test_order_depends_only_on_seed_and_epoch():
    lengths = random_lengths(200)
    a, b = LengthBucketSampler(lengths, 8, seed=1), LengthBucketSampler(lengths, 8, seed=1)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b)
    b.set_epoch(3)
    assert list(a) != list(b)
    c = LengthBucketSampler(lengths, 8, seed=2)
    c.set_epoch(2)
    assert list(a) != list(c)
    b.set_epoch(2)
    assert list(a) == list(b)  # back to epoch 2: the same batches again (resume)


def test_buckets_pad_less_than_random_batches():
    lengths = random_lengths(512)
    bucketed = LengthBucketSampler(lengths, 8, seed=0)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    shuffled = [perm[s:s + 8] for s in range(0, len(perm), 8)]
    real = sum(lengths)
    assert padded_tokens(lengths, list(bucketed)) < 1.1 * real < 1.3 * real < padded_tokens(lengths, shuffled)


def test_bad_arguments():
    with pytest.raises(ValueError):
        LengthBucketSampler([1, 2], 0, seed=0)


# --------------------------------------------------------------------------------------------------
# The hook in train_draft
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(model="tiny:llama"))


@pytest.fixture(scope="module")
def train_data(target, tmp_path_factory):
    convs = []
    for i in range(14):
        q = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + (5 * i) % 11))
        a = " ".join(WORDS[(2 * i + k) % len(WORDS)] for k in range(1 + (7 * i) % 29))
        convs.append(Conversation(f"c{i}", [{"role": "user", "content": q}, {"role": "assistant", "content": a}]))
    out = F.cache_features(target, convs, tmp_path_factory.mktemp("cache"), max_length=400, shard_size=8,
                           progress=False)
    return D.FeatureDataset(out, "all", 0.0)


def _served(monkeypatch):
    """Record the dataset positions of each training batch (index == position: split 'all' of one list)."""
    seen: list[list[int]] = []
    real = L.draft_loss

    def spy(model, batch, **kw):
        if model.training:
            seen.append(batch["index"].tolist())
        return real(model, batch, **kw)

    monkeypatch.setattr(L, "draft_loss", spy)
    return seen


def test_train_draft_serves_the_buckets_and_resumes_on_them(target, train_data, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    draft_cfg = get_profile("smoke").drafts["dense"]
    tc = TrainConfig(epochs=2, batch_size=3, lr=1e-3, warmup_steps=1, bucket_by_length=True)
    index = [it[3] for it in train_data.items]
    expected = []
    for epoch in range(2):
        s = LengthBucketSampler(train_data.lengths(), 3, tc.seed)
        s.set_epoch(epoch)
        expected += [[index[p] for p in b] for b in s]
    seen = _served(monkeypatch)
    T.train_draft(target, draft_cfg, train_data, None, tmp_path / "full", tc, progress=False)
    assert seen == expected

    seen.clear()  # stopped after 3 steps (mid-epoch), then resumed: the same batches in the same order
    T.train_draft(target, draft_cfg, train_data, None, tmp_path / "resumed",
                  TrainConfig(**{**tc.__dict__, "max_steps": 3}), progress=False)
    T.train_draft(target, draft_cfg, train_data, None, tmp_path / "resumed", tc, progress=False)
    assert seen == expected

    seen.clear()  # off: the unbucketed order, which pads more
    T.train_draft(target, draft_cfg, train_data, None, tmp_path / "plain",
                  TrainConfig(**{**tc.__dict__, "bucket_by_length": False}), progress=False)
    assert sorted(map(sorted, seen)) != sorted(map(sorted, expected))
    lengths = dict(zip(index, train_data.lengths()))
    assert padded_tokens(lengths, expected) < padded_tokens(lengths, seen)


def test_fixture_lengths_vary(train_data):
    assert len(train_data) == 14 and len(set(train_data.lengths())) > 7 and max(train_data.lengths()) < 400
