"""Self-distillation data: batched greedy answers equal unbatched greedy decoding; resumable file."""
import json

import pytest
import torch

from jakiro_lib.data import distill
from jakiro_lib.data.chat import format_prompt
from jakiro_lib.config import TargetConfig
from jakiro_lib.data.conversations import Conversation
from reference.loop import vanilla_generate
from jakiro_lib.models.target import load_target


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(model="tiny:llama", max_context=512))


def _convs(n: int) -> list[Conversation]:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return [Conversation(id=f"c{i}", messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": " ".join(words[: 1 + i % len(words)]) * (1 + i % 3)},
        {"role": "assistant", "content": "a reply written by someone else"},
        {"role": "user", "content": "a second turn that is dropped"}]) for i in range(n)]


def test_batched_answers_equal_greedy_decoding_of_each_prompt(target, tmp_path):
    convs = _convs(7)
    out = distill.regenerate(target, convs, tmp_path / "d.jsonl", max_new_tokens=12, batch_size=3, progress=False)
    assert [c.id for c in out] == [c.id for c in convs if c.id in {o.id for o in out}]
    for conv, got in zip(convs, out):
        assert [m["role"] for m in got.messages] == ["user", "assistant"]
        assert got.messages[0]["content"] == conv.messages[1]["content"]
        ids = torch.tensor(format_prompt(target.tokenizer, got.messages[:1]))
        ref = vanilla_generate(target.model, ids, max_new_tokens=12, eos_token_ids=target.eos_token_ids)
        expected = [t for t in ref.output_ids if t not in target.eos_token_ids]
        assert got.messages[1]["content"] == target.tokenizer.decode(expected, skip_special_tokens=True)


def test_interrupted_generation_resumes_without_redoing(target, tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    real = distill._generate_batch
    calls = []

    def flaky(t, prompts, n):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(t, prompts, n)

    monkeypatch.setattr(distill, "_generate_batch", flaky)
    with pytest.raises(KeyboardInterrupt):
        distill.regenerate(target, _convs(6), path, max_new_tokens=6, batch_size=2, progress=False)
    with path.open("a") as fh:
        fh.write('{"id": "c5", "ans')  # a torn line, as a kill mid-write leaves it
    calls.clear()
    monkeypatch.setattr(distill, "_generate_batch", real)
    spy = []
    monkeypatch.setattr(distill, "_generate_batch", lambda t, p, n: spy.append(len(p)) or real(t, p, n))
    out = distill.regenerate(target, _convs(6), path, max_new_tokens=6, batch_size=2, progress=False)
    assert sum(spy) == 4 and len(out) == 6  # the first batch of 2 was kept
    lines = path.read_text().splitlines()
    assert lines[-5] == '{"id": "c5", "ans'  # the torn line ended where it was cut, and left
    records = [json.loads(line) for i, line in enumerate(lines) if i != len(lines) - 5]
    assert len(records) == 7 and {r["id"] for r in records[1:]} == {f"c{i}" for i in range(6)}
    spy.clear()  # the file holds every answer: nothing is redone
    assert distill.regenerate(target, _convs(6), path, max_new_tokens=6, batch_size=2, progress=False) == out
    assert spy == []


def test_other_settings_move_the_old_file_aside(target, tmp_path):
    path = tmp_path / "d.jsonl"
    distill.regenerate(target, _convs(2), path, max_new_tokens=4, progress=False)
    first = path.read_text()
    distill.regenerate(target, _convs(2), path, max_new_tokens=5, progress=False)
    assert (tmp_path / "d.stale.jsonl").read_text() == first
    header = json.loads(path.read_text().splitlines()[0])[distill.HEADER_KEY]
    assert header["max_new_tokens"] == 5
    distill.regenerate(target, _convs(2), path, max_new_tokens=4, progress=False)  # never over the first aside
    assert (tmp_path / "d.stale.jsonl").read_text() == first and (tmp_path / "d.stale.1.jsonl").is_file()


def test_another_source_or_prompt_text_is_never_answered_from_the_old_file(target, tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    distill.regenerate(target, _convs(2), path, max_new_tokens=4, progress=False, source="sharegpt:/data/a.json")
    first = path.read_text()
    other = [Conversation(id=c.id, messages=[{"role": "user", "content": f"another text {c.id}"}]) for c in _convs(2)]
    out = distill.regenerate(target, other, path, max_new_tokens=4, progress=False, source="sharegpt:/data/b.json")
    assert (tmp_path / "d.stale.jsonl").read_text() == first and "source" in caplog.text and "d.stale.jsonl" in caplog.text
    fresh = distill.regenerate(target, other, tmp_path / "fresh.jsonl", max_new_tokens=4, progress=False)
    assert [c.messages for c in out] == [c.messages for c in fresh]
    edited = [other[0], Conversation(id="c1", messages=[{"role": "user", "content": "an edited text"}])]
    spy = []
    real = distill._generate_batch
    distill._generate_batch = lambda t, p, n: spy.append(len(p)) or real(t, p, n)
    try:  # the same source with one prompt edited: that one answer is redone, the other kept
        out = distill.regenerate(target, edited, path, max_new_tokens=4, progress=False, source="sharegpt:/data/b.json")
    finally:
        distill._generate_batch = real
    assert spy == [1] and out[1].messages[0]["content"] == "an edited text"


def test_long_prompts_are_dropped(target, tmp_path):
    convs = _convs(3)
    convs[1] = Conversation(id="long", messages=[{"role": "user", "content": "word " * 400}])
    out = distill.regenerate(target, convs, tmp_path / "d.jsonl", max_prompt_tokens=150, max_new_tokens=4,
                             progress=False)
    assert "long" not in {c.id for c in out} and len(out) == 2
