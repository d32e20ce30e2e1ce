"""Self-distillation data: the target's own greedy answers to the training prompts (docs/DESIGN.md section 4).

The answers go to a JSON-lines file a rerun resumes from: its first line names the settings and the data
source, and each answer carries the sha256 of the prompt it answers.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from ..files import end_last_line, free_name, read_jsonl, text_sha256
from .chat import format_prompt
from .conversations import Conversation

log = logging.getLogger(__name__)

HEADER_KEY = "__settings__"


def _read(path: Path) -> tuple[dict[str, Any] | None, dict[str, tuple[str | None, str]]]:
    """(settings header, {conversation id: (prompt sha256, answer)}) of an existing file; torn lines are ignored."""
    settings, answers = None, {}
    for rec in read_jsonl(path):
        if not isinstance(rec, dict):
            continue
        if HEADER_KEY in rec:
            settings = rec[HEADER_KEY]
        elif "id" in rec and "answer" in rec:
            answers[rec["id"]] = (rec.get("prompt_sha256"), rec["answer"])
    return settings, answers


def _open_answers(out_path: Path, settings: dict[str, Any]) -> dict[str, tuple[str | None, str]]:
    """The answers ``out_path`` holds for ``settings``, ready to append to (a torn last line ended); a file of
    other settings or another source is moved aside (said, never overwritten) and a new one begun."""
    old, answers = _read(out_path)
    if old is not None and old != settings:
        aside = free_name(out_path.with_name(f"{out_path.stem}.stale{out_path.suffix}"))
        changed = sorted(k for k in {*old, *settings} if old.get(k) != settings.get(k))
        os.replace(out_path, aside)
        log.warning("self-distillation: %s was made with other %s; moved to %s, answers regenerated",
                    out_path, ", ".join(changed), aside.name)
        old, answers = None, {}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if old is None:
        with out_path.open("w") as fh:
            fh.write(json.dumps({HEADER_KEY: settings}) + "\n")
    end_last_line(out_path)
    return answers


@torch.inference_mode()
def _generate_batch(target: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every row's answer starts at column ``width``
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = target.model.generate(ids.to(target.device), attention_mask=mask.to(target.device), do_sample=False,
                                max_new_tokens=max_new_tokens, pad_token_id=pad,
                                eos_token_id=list(target.eos_token_ids) or None)
    answers = []
    eos = set(target.eos_token_ids)
    for row in out[:, width:].tolist():
        cut = next((j for j, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:cut])
    return answers


def regenerate(target: Any, conversations: Sequence[Conversation], out_path: str | Path, *,
               max_prompt_tokens: int = 256, max_new_tokens: int = 256, batch_size: int = 16,
               template: str = "auto", progress: bool = True, source: str = "") -> list[Conversation]:
    """Conversations ``[first user turn, the target's greedy answer]``, in input order; those without a user
    turn, or whose first user turn formats to more than ``max_prompt_tokens``, are dropped. Answers are
    appended to ``out_path`` after every batch; a file of other settings or another ``source`` is moved
    aside to ``<stem>.stale[.N]<suffix>``."""
    out_path = Path(out_path)
    settings = {"target": str(getattr(target.model.config, "_name_or_path", "")),
                "vocab_size": target.model.config.vocab_size, "max_prompt_tokens": max_prompt_tokens,
                "max_new_tokens": max_new_tokens, "template": template, "source": source}
    answers = _open_answers(out_path, settings)
    todo: list[tuple[str, list[int]]] = []
    firsts: dict[str, str] = {}
    for conv in conversations:
        user = next((m["content"] for m in conv.messages if m["role"] == "user"), None)
        if user is None:
            continue
        firsts[conv.id] = user
        if answers.get(conv.id, (None,))[0] != text_sha256(user):
            answers.pop(conv.id, None)
            ids = format_prompt(target.tokenizer, [{"role": "user", "content": user}], template=template)
            if len(ids) <= max_prompt_tokens:
                todo.append((conv.id, ids))
    todo.sort(key=lambda t: len(t[1]))  # similar lengths per batch: little padding
    bar = tqdm(total=len(todo), desc="self-distill", unit="conv", disable=not progress)
    with out_path.open("a") as fh:
        for s in range(0, len(todo), batch_size):
            chunk = todo[s:s + batch_size]
            for (cid, _), ans in zip(chunk, _generate_batch(target, [c[1] for c in chunk], max_new_tokens)):
                text = target.tokenizer.decode(ans, skip_special_tokens=True)
                answers[cid] = (text_sha256(firsts[cid]), text)
                fh.write(json.dumps({"id": cid, "prompt_sha256": answers[cid][0], "answer": text}) + "\n")
            fh.flush()
            bar.update(len(chunk))
    bar.close()
    return [Conversation(id=c.id, messages=[{"role": "user", "content": firsts[c.id]},
                                            {"role": "assistant", "content": answers[c.id][1]}])
            for c in conversations if c.id in answers and c.id in firsts and answers[c.id][1].strip()]
