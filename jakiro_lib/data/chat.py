"""Chat formatting with an assistant-only loss mask: 1 on each assistant reply and its end-of-turn marker, 0 on role
headers, system and user text. ``template="auto"`` uses the tokenizer's chat template, each reply's character span found
by rendering prefix by prefix (so the template must render earlier messages unchanged and replies verbatim);
``template="vicuna"`` builds the FastChat Vicuna v1.1 prompt, which has no HF template.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
TEMPLATES: tuple[str, ...] = ("auto", "vicuna")
_ROLES = ("system", "user", "assistant")


@dataclass
class Formatted:
    """Token ids of one formatted conversation and its 0/1 assistant-only loss mask (same length)."""

    input_ids: list[int]
    loss_mask: list[int]


# Validation


def _check_messages(messages: Sequence[dict[str, Any]], template: str) -> list[dict[str, str]]:
    """Validate roles and contents early, so a bad record fails here and not inside Jinja."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; valid: {', '.join(TEMPLATES)}")
    if not messages:
        raise ValueError("empty conversation: at least one message is needed")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in _ROLES:
            raise ValueError(f"message {i} has unknown role {m['role']!r}; valid: {', '.join(_ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i} content must be a string, got {type(m['content']).__name__}")
        out.append({"role": m["role"], "content": m["content"]})
    if all(m["role"] == "system" for m in out):
        raise ValueError("empty conversation: only system messages")
    return out


def _check_template(tokenizer: Any, template: str) -> None:
    if template == "auto" and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(f"tokenizer {name!r} has no chat_template; use template='vicuna' (or set "
                         "tokenizer.chat_template)")


# Rendering


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _special_strings(tokenizer: Any) -> list[str]:
    """Special-token strings, longest first (fallback end-of-turn detection)."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials.update(str(t) for t in added.values() if getattr(t, "special", False))
    return sorted((s for s in specials if s), key=len, reverse=True)


def _assistant_spans_auto(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Render with the tokenizer's template; return the text and each assistant reply's char span: from its
    content to the end of what the template writes after it in that message, trailing whitespace left out."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    cursor = 0  # everything before it belongs to earlier messages
    specials: list[str] | None = None
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = cursor
        if i > 0:
            for gen in (True, False):  # prefer the prefix that ends with the assistant header
                try:
                    prefix = _render(tokenizer, messages[:i], add_generation_prompt=gen)
                except Exception:  # noqa: BLE001 - some templates refuse partial conversations
                    continue
                if full.startswith(prefix) and len(prefix) >= cursor:
                    start = len(prefix)
                    break
        content = m["content"]
        pos = full.find(content, start) if content else -1
        if pos < 0:
            content = content.strip()
            pos = full.find(content, start)
        if pos < 0:
            raise ValueError(f"cannot locate assistant message {i} in the rendered template: the "
                             "template must write assistant content verbatim (possibly stripped)")
        content_end = pos + len(content)
        try:
            upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        except Exception:  # noqa: BLE001
            upto = None
        if upto is not None and full.startswith(upto) and len(upto) >= content_end:
            end = content_end + len(full[content_end:len(upto)].rstrip())
            cursor = len(upto)
        else:  # template not prefix-stable: take one special token right after the content
            if specials is None:
                specials = _special_strings(tokenizer)
            rest = full[content_end:]
            ws = len(rest) - len(rest.lstrip())
            eot = next((s for s in specials if rest.startswith(s, ws)), None)
            end = content_end + (ws + len(eot) if eot else 0)
            cursor = end
        spans.append((pos, end))
    return full, spans


def _vicuna_system(messages: list[dict[str, str]]) -> tuple[str, list[dict[str, str]]]:
    if messages[0]["role"] == "system":
        system, rest = messages[0]["content"], messages[1:]
    else:
        system, rest = VICUNA_SYSTEM, messages
    if any(m["role"] == "system" for m in rest):
        raise ValueError("the vicuna template allows a system message only as the first message")
    return system, rest


def _assistant_spans_vicuna(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """FastChat ``vicuna_v1.1``: ``SYSTEM USER: q ASSISTANT: a</s>USER: ...`` (sep " ", sep2 eos)."""
    eos = getattr(tokenizer, "eos_token", None) or "</s>"
    system, rest = _vicuna_system(messages)
    parts = [system + " "]
    length = len(parts[0])
    spans: list[tuple[int, int]] = []
    for m in rest:
        if m["role"] == "user":
            piece = f"USER: {m['content']} "
        else:
            head = "ASSISTANT: "
            piece = f"{head}{m['content']}{eos}"
            spans.append((length + len(head), length + len(piece)))
        parts.append(piece)
        length += len(piece)
    return "".join(parts), spans


# Tokenization with a character-span mask


def _tokenize_with_mask(
    tokenizer: Any, text: str, spans: list[tuple[int, int]], add_special_tokens: bool
) -> Formatted:
    """Tokenize ``text`` once; a token gets mask 1 when its characters overlap an assistant span."""
    try:
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    except (NotImplementedError, ValueError, TypeError):
        return _tokenize_by_segments(tokenizer, text, spans, add_special_tokens)
    mask = [0] * len(ids)
    k = 0
    for t, (s, e) in enumerate(offsets):
        if e <= s:  # special tokens added by the tokenizer (BOS) have empty spans
            continue
        while k < len(spans) and spans[k][1] <= s:
            k += 1
        if k < len(spans) and s < spans[k][1] and e > spans[k][0]:
            mask[t] = 1
    return Formatted(input_ids=ids, loss_mask=mask)


def _tokenize_by_segments(
    tokenizer: Any, text: str, spans: list[tuple[int, int]], add_special_tokens: bool
) -> Formatted:
    """Slow-tokenizer fallback (no offsets): tokenize alternating non-assistant / assistant pieces (merges
    across a span boundary are lost)."""
    ids: list[int] = []
    mask: list[int] = []
    if add_special_tokens:
        bos = tokenizer("", add_special_tokens=True)["input_ids"]
        ids.extend(bos)
        mask.extend([0] * len(bos))
    pos = 0
    for s, e in [*spans, (len(text), len(text))]:
        for piece, flag in ((text[pos:s], 0), (text[s:e], 1)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids.extend(piece_ids)
                mask.extend([flag] * len(piece_ids))
        pos = e
    return Formatted(input_ids=ids, loss_mask=mask)


# Public API


def format_conversation(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    template: str = "auto",
    max_length: int | None = None,
) -> Formatted:
    """Token ids of a whole conversation plus its assistant-only loss mask, cut to ``max_length``. Only
    ``"vicuna"`` lets the tokenizer add its BOS; a chat template writes its own where the model wants one."""
    msgs = _check_messages(messages, template)
    _check_template(tokenizer, template)
    if max_length is not None and max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    vicuna = template == "vicuna"
    text, spans = (_assistant_spans_vicuna if vicuna else _assistant_spans_auto)(tokenizer, msgs)
    out = _tokenize_with_mask(tokenizer, text, spans, add_special_tokens=vicuna)
    if max_length is not None:
        out = Formatted(out.input_ids[:max_length], out.loss_mask[:max_length])
    return out


def messages_of(conv: Any) -> Any:
    """A conversation's messages, whether it is a dict or a :class:`~jakiro_lib.data.conversations.Conversation`."""
    return conv["messages"] if isinstance(conv, dict) else conv.messages


def conversation_id(conv: Any, index: int) -> str:
    """A conversation's id, else its ``index`` in the input list."""
    value = conv.get("id") if isinstance(conv, dict) else getattr(conv, "id", None)
    return str(index if value is None else value)


def tokenize_conversation(tokenizer: Any, conv: Any, max_length: int | None,
                          template: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one conversation in the chat template, cut to ``max_length``."""
    f = format_conversation(tokenizer, messages_of(conv), template=template, max_length=max_length)
    return f.input_ids, f.loss_mask


def format_prompt(tokenizer: Any, turns_so_far: Sequence[dict[str, Any]], *, template: str = "auto") -> list[int]:
    """Ids of a prompt for ``turns_so_far`` that ends with the assistant generation header (Vicuna:
    ``"ASSISTANT:"``), ready for decoding."""
    msgs = _check_messages(turns_so_far, template)
    _check_template(tokenizer, template)
    if template == "vicuna":
        text, _ = _assistant_spans_vicuna(tokenizer, msgs)
        return list(tokenizer(text + "ASSISTANT:", add_special_tokens=True)["input_ids"])
    text = _render(tokenizer, msgs, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_message(target: Any, output_ids: list[int]) -> dict[str, str]:
    """A method's answer as the next turn's history entry (decoded without special tokens)."""
    return {"role": "assistant", "content": target.tokenizer.decode(output_ids, skip_special_tokens=True)}


def format_prompt_ids(target: Any, history: list[dict[str, str]]) -> torch.Tensor:
    """Chat-formatted prompt ids (ending with the assistant header) for ``history``."""
    return torch.tensor(format_prompt(target.tokenizer, history, template=target.config.template), dtype=torch.long)
