"""Validation of the config dataclasses (:mod:`jakiro_lib.config`): every field by its type annotation and a
range (:data:`RULES`, then name patterns such as ``*_fraction``). A bad value raises
:class:`~jakiro_lib.config.ConfigError` naming the key, the value and what is allowed."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from typing import Any, Callable, Literal, Union

from .config import CAPTURES, DRAFT_DTYPES, ConfigError


Rule = tuple[Callable[[Any], bool], str]  # (allowed?, what is allowed), applied to each number of a value


def _at_least(lo: float) -> Rule:
    return (lambda v: v >= lo), f">= {lo}"


def _above(lo: float) -> Rule:
    return (lambda v: v > lo), f"> {lo}"


def _one_of(*choices: str) -> Rule:
    return (lambda v: v in choices), "one of " + ", ".join(repr(c) for c in choices)


_UNIT: Rule = ((lambda v: 0 <= v < 1), "in [0, 1)")
# the devices a target runs on, as torch.device reads them ("cuda:1": the second GPU)
_DEVICE: Rule = ((lambda v: re.fullmatch(r"(cpu|cuda|mps|xpu)(:\d+)?", v) is not None),
                 "one of 'cpu', 'cuda', 'cuda:<index>', 'mps', 'xpu'")
_DTYPE = _one_of("float32", "float16", "bfloat16")

# Ranges by "Class.field"; fields not listed fall back to the name patterns of _PATTERN_RULES. A range a config's
# __post_init__ checks (on every construction, not only here) is not repeated.
RULES: dict[str, Rule] = {
    "TargetConfig.dtype": _DTYPE, "TargetConfig.max_context": _at_least(1), "TargetConfig.packed_gemm": _at_least(0),
    "TargetConfig.gemm_backend": _one_of("auto", "stream", "mkl", "onednn"), "TargetConfig.device": _DEVICE,
    "TargetConfig.capture": _one_of(*CAPTURES),
    "DataConfig.feature_dtype": _DTYPE, "DataConfig.scale": _one_of("fixed", "auto"), "DataConfig.cache_dtype": _one_of("float32", "float16", "bfloat16", "auto"),
    "DataConfig.tokenize_workers": _at_least(0),
    "TrainConfig.epochs": _at_least(1), "TrainConfig.lr": _above(0), "TrainConfig.betas": _UNIT,
    "TrainConfig.grad_clip_value": _above(0), "TrainConfig.max_steps": _at_least(1),
    "TrainConfig.mixed_precision": _one_of("no", "fp16", "bf16", "auto"), "TrainConfig.compile": _one_of("no", "yes", "auto"),
    "TreeConfig.children_per_expert": _at_least(1),
    "BenchConfig.repeats": _at_least(1), "BenchConfig.temperatures": _at_least(0),
    "BenchConfig.draft_dtype": _one_of("target", "auto", *DRAFT_DTYPES),
}
_PATTERN_RULES: tuple[tuple[str, Rule], ...] = (
    (r"fraction$", _UNIT),
    (r"(^|_)(max|num)_|_size$", _at_least(1)),
    (r"(^|_)(seed|steps|tokens|weight|warmup|temperature|amplitude|decay)s?$", _at_least(0)),
)


def _rule(cls: type, name: str) -> Rule | None:
    """The range of ``cls.name``: its entry in RULES, else the first name pattern it matches, else none."""
    rule = RULES.get(f"{cls.__name__}.{name}")
    return rule or next((r for pattern, r in _PATTERN_RULES if re.search(pattern, name)), None)


def _matches(value: Any, tp: Any) -> bool:
    """Whether ``value`` fits the annotation ``tp`` (unknown kinds of annotation accept anything)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None) or tp is None:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if origin is Literal:
        return value in args
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_matches(k, args[0]) and _matches(v, args[1])
                                               for k, v in value.items())
    return isinstance(value, tp) if isinstance(tp, type) else True


def _describe(tp: Any, bound: str = "") -> str:
    """Words for an annotation and a range: ``int | None``, ">= 1" -> "an integer >= 1 or none"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    simple = {str: "a string", bool: "true or false", type(None): "none"}
    if tp in (int, float):
        return ("an integer" if tp is int else "a number") + (f" {bound}" if bound else "")
    if tp in simple:
        return simple[tp]
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a, bound) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a list of {len(args)} values, each {_describe(args[0], bound)}"
    if origin in (tuple, list):
        return f"a comma-separated list of values, each {_describe(args[0], bound)}" if args else "a list"
    if origin is dict:
        return f"a mapping of names to {_describe(args[1])}"
    return f"a {getattr(tp, '__name__', tp)}"


def _numbers(value: Any) -> list[Any]:
    """The scalars a range rule applies to: the value itself, or each item of a list (None skipped)."""
    items = value if isinstance(value, (tuple, list)) else [value]
    return [v for v in items if v is not None]


def check_field(obj: Any, name: str, path: str, given: str | None = None) -> None:
    """Type and range of one dataclass field; lists become tuples and integers floats where annotated so.

    ``given``: the value as the user wrote it, for the message (default: the field's value)."""
    tp = _hints(type(obj))[name]
    value = getattr(obj, name)
    rule = _rule(type(obj), name)
    choice = rule is not None and rule[1].startswith("one of")
    allowed = rule[1] + (" or none" if _matches(None, tp) else "") if choice else _describe(tp, rule[1] if rule else "")
    if not _matches(value, tp):
        raise ConfigError(f"{path} = {given or repr(value)} is not allowed: expected {allowed}")
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        setattr(obj, name, value := tuple(value))
    if tp is float and isinstance(value, int):
        setattr(obj, name, value := float(value))
    if rule and not all(_rule_ok(rule, v) for v in _numbers(value)):
        raise ConfigError(f"{path} = {given or repr(value)} is not allowed: expected {allowed}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    """A dataclass's resolved field annotations (the annotations are strings under ``from __future__``)."""
    return typing.get_type_hints(cls)


def _rule_ok(rule: Rule, value: Any) -> bool:
    try:
        return bool(rule[0](value))
    except TypeError:  # a range on a value of another kind (e.g. "auto" where numbers have a range)
        return True


def post_init(obj: Any, path: str, value: Any) -> None:
    """Rerun a config's own cross-field checks after a change; their errors become ConfigErrors."""
    check = getattr(obj, "__post_init__", None)
    if check is None:
        return
    try:
        check()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path} = {value!r} is not allowed: {exc}") from None


def validate(config: Any, prefix: str = "") -> None:
    """Check every field of a config dataclass (and of the dataclasses inside it); raise ConfigError."""
    for f in dataclasses.fields(config):
        path = f"{prefix}{f.name}"
        value = getattr(config, f.name)
        check_field(config, f.name, path)
        if dataclasses.is_dataclass(value):
            validate(value, path + ".")
            post_init(value, path, value)
        elif isinstance(value, dict):
            for key, item in value.items():
                if dataclasses.is_dataclass(item):
                    validate(item, f"{path}.{key}.")
                    post_init(item, f"{path}.{key}", item)
