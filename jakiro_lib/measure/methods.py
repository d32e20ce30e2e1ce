"""Every decoding method the project compares, in one registry: name -> kind, draft, tree settings. The studies' method
sets (:func:`study_methods`), the goals' groups (:func:`group_names`), the serialised form (:func:`portable`) and
records' labels (:func:`record_label`) are read from it; a method runs through
:class:`~jakiro_lib.decoding.methods.MethodRunner`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection

from ..config import EAGLE2_DRAFT, JAKIRO_DRAFT, OUR_KINDS, SPEC, Profile, TreeConfig
from ..decoding.methods import MethodSpec
from ..files import relative_path
from ..layout import draft_name, draft_path
from ..models.draft import resolve_draft_dtype

STUDIES = ("main", "ablations")
LOOKUP_TOKENS = 10  # chain length of the lookup-branch methods: HF prompt lookup's default


def portable(spec: MethodSpec, relative_to: str | Path | None = None) -> dict[str, Any]:
    """A method's settings as JSON-ready values with no machine's directories in them: the draft named by its folder
    (``relative_to`` None: the study stamp, where the weights' digest identifies it, so a moved run keeps its records)
    or relative to ``relative_to`` (``bench_config.json``, in the same run); ``draft_dtype`` only where it is set."""
    d = dataclasses.asdict(spec)
    if spec.draft_dtype is None:
        del d["draft_dtype"]
    if spec.draft is not None:
        if relative_to is None:
            d["draft"] = draft_name(spec.draft)
        else:
            d["draft"] = relative_path(spec.draft, relative_to)
    return d


# The registry

EAGLE2 = "<eagle2 draft>"  # Method.draft placeholders in the main study: bench.eagle2_draft / bench.jakiro_draft
JAKIRO = "<jakiro draft>"
CEPD = "cepd"  # tree.ar_steps placeholder: depth - 2, the last draft forward yields two layers (reference)
TUNED = "tuned"  # a tree setting's placeholder: "auto" when the study tunes trees, else the study tree's own


@dataclass(frozen=True)
class Method:
    """One registered method: its kind, draft (a name under ``drafts/``) and tree settings. ``group``: its role in the
    performance goals (:func:`group_names`); ``when``: the study switch it needs ("compiled": bench.compiled_baseline,
    "tuned": bench.tuned with a fixed budget, "imported": the profile imports heads). How it runs is not part of it
    (``target.capture``), except ``hf_compiled``'s."""

    name: str
    kind: str
    draft: str | None = None
    tree: dict[str, Any] = field(default_factory=dict)
    compile: bool = False
    group: str = ""
    when: str | None = None

    def on_drafts(self, eagle2_draft: str, jakiro_draft: str) -> "Method":
        """This method with the :data:`EAGLE2` / :data:`JAKIRO` placeholders of the main study named
        (``bench.eagle2_draft``, ``bench.jakiro_draft``)."""
        return dataclasses.replace(self, draft={EAGLE2: eagle2_draft, JAKIRO: jakiro_draft}.get(self.draft, self.draft))

    def spec(self, tree: TreeConfig, drafts_dir: str | Path, *, tuned: bool, draft_dtype: str | None = None
             ) -> MethodSpec:
        """The runnable spec on the study's ``tree`` with drafts under ``drafts_dir``, decoding in ``draft_dtype``."""
        if self.kind != SPEC:
            return MethodSpec(self.kind, compile=self.compile)
        values = {k: _resolve(k, v, tree, tuned) for k, v in self.tree.items()}
        return MethodSpec(SPEC, draft=str(draft_path(drafts_dir, self.draft)) if self.draft else None,
                          tree=dataclasses.replace(tree, **values), compile=self.compile,
                          draft_dtype=draft_dtype if self.draft else None)


def _resolve(name: str, value: Any, tree: TreeConfig, tuned: bool) -> Any:
    if value == CEPD:
        return cepd_steps(tree)
    if value == TUNED:
        return "auto" if tuned else getattr(tree, name)
    return value


def cepd_steps(tree: TreeConfig) -> int:
    """CEPD's autoregressive layers on ``tree``: all but the last two (docs/DESIGN.md section 3)."""
    return max(tree.depth - 2, 0)


_JAKIRO = {"decoupled": True}
_AUTO = dict.fromkeys(("total_tokens", "depth", "top_k"), TUNED)  # the tree's budget and shape tuned on this machine
# the chain grafted on the _auto methods' tree: the same tuned settings, so one tuning serves both (the tuner's key
# leaves the chain out)
_LOOKUP = {**_AUTO, "lookup_tokens": LOOKUP_TOKENS}
# The Jakiro authors' released configuration: the coupled mixture (one candidate list from the mixed
# expert output) with CEPD on the last layer
_RELEASED_TREE = {"decoupled": False, "ar_steps": CEPD}
JAKIRO_STAR_DRAFT = "jakiro_star"  # the draft the jakiro_star row drafts from: the authors' Jakiro* head, imported

MAIN = (
    Method("vanilla", "vanilla", group="our_vanilla"),
    Method("hf_generate", "hf", group="hf"),
    Method("hf_compiled", "hf", compile=True, group="hf", when="compiled"),
    Method("hf_prompt_lookup", "pld", group="pld"),
    Method("eagle2", SPEC, EAGLE2, group="eagle2"),
    Method("jakiro", SPEC, JAKIRO, _JAKIRO, group="jakiro"),
    Method("jakiro_cepd", SPEC, JAKIRO, {**_JAKIRO, "ar_steps": CEPD}, group="jakiro"),
    Method("eagle2_auto", SPEC, EAGLE2, _AUTO, group="eagle2", when="tuned"),
    Method("jakiro_auto", SPEC, JAKIRO, {**_JAKIRO, **_AUTO}, group="jakiro", when="tuned"),
    Method("lookup_only", SPEC, None, {"lookup_tokens": LOOKUP_TOKENS}, group="lookup_only"),
    Method("eagle2_lookup", SPEC, EAGLE2, _LOOKUP, group="eagle2_lookup"),
    Method("jakiro_lookup", SPEC, JAKIRO, {**_JAKIRO, **_LOOKUP}, group="jakiro_lookup"),
    # Where the profile imports heads (DraftConfig.import_from; profile vicuna-7b-released): the authors' released
    # configuration on the Jakiro draft, and the Jakiro* head (a draft of that name) with decoupled candidates (each
    # expert's own output, as its sampler drafts)
    Method("jakiro_coupled_cepd", SPEC, JAKIRO, _RELEASED_TREE, group="jakiro_released", when="imported"),
    Method("jakiro_star", SPEC, JAKIRO_STAR_DRAFT, _JAKIRO, group="jakiro_star", when="imported"),
)

ABLATIONS = (
    Method("vanilla", "vanilla"),
    Method("experts=1 (eagle2)", SPEC, "dense"),
    Method("experts=2", SPEC, "moe2", _JAKIRO),
    Method("experts=4", SPEC, "moe4", _JAKIRO),
    Method("experts=2, coupled", SPEC, "moe2", {"decoupled": False}),
    Method("experts=2, scoring=best", SPEC, "moe2", {**_JAKIRO, "scoring": "best"}),
    # EAGLE-2 trees on the H-wide dense draft: the equal-parameter control (one expert's width, not EAGLE-2)
    Method("eagle2_h", SPEC, "dense_h"),
    # Jakiro decoupled on the 2-expert drafts whose experts' own outputs were trained too (DraftConfig.expert_loss)
    Method("jakiro_xgate", SPEC, "moe2_xgate", _JAKIRO),
    Method("jakiro_xequal", SPEC, "moe2_xequal", _JAKIRO),
    # the same trees on the drafts trained with two unrolled steps (multi-step training, DraftConfig.unroll_steps):
    # EAGLE-2, the equal-parameter control, Jakiro decoupled and coupled, Jakiro on the per-expert-trained draft
    Method("eagle2_u2", SPEC, "dense_u2"),
    Method("eagle2_h_u2", SPEC, "dense_h_u2"),
    Method("jakiro_u2", SPEC, "moe2_u2", _JAKIRO),
    Method("jakiro_coupled_u2", SPEC, "moe2_u2", {"decoupled": False}),  # "experts=2, coupled" on moe2_u2
    Method("jakiro_xgate_u2", SPEC, "moe2_xgate_u2", _JAKIRO),
)
# The Jakiro authors' released configuration on the 2-expert draft (and on its multi-step-trained twin).
RELEASED = Method("jakiro_coupled_cepd", SPEC, "moe2", _RELEASED_TREE)
RELEASED_U2 = Method("jakiro_coupled_cepd_u2", SPEC, "moe2_u2", _RELEASED_TREE)


# EAGLE-2 (the dense draft on the study's tree) in each study: what the other drafted methods are judged against
EAGLE2_BASELINE = {"main": "eagle2", "ablations": "experts=1 (eagle2)"}


def _ablation_methods(tree: TreeConfig) -> tuple[Method, ...]:
    """The ablation set on ``tree``: the fixed rows, a CEPD sweep, CEPD without contrastive training and
    the authors' released configuration."""
    cepd = cepd_steps(tree)
    sweep = tuple(Method(f"cepd ar_steps={s}", SPEC, "moe2", {**_JAKIRO, "ar_steps": s})
                  for s in sorted({0, 1, cepd} - {tree.depth}))
    nocontrast = Method(f"cepd ar_steps={cepd}, contrastive off", SPEC, "moe2_nocontrast",
                        {**_JAKIRO, "ar_steps": cepd})
    return (*ABLATIONS, *sweep, nocontrast, RELEASED, RELEASED_U2)


def parse_names(text: str, known: Collection[str]) -> list[str]:
    """A comma-separated list of method names, where a name may hold a comma itself ("experts=2, coupled"):
    at each place the longest run of parts that names a known method, else one part (an unknown name)."""
    parts, names, i = text.split(","), [], 0
    while i < len(parts):
        j = next((j for j in range(len(parts), i + 1, -1) if ",".join(parts[i:j]).strip() in known), i + 1)
        names.append(",".join(parts[i:j]).strip())
        i = j
    return [n for n in names if n]


# old records' run labels past the method's name, by (engine, compiled): written when a method could run on two
# engines in one study (the loop engine's run under the bare name); records of the one engine carry "capture"
_OLD_SUFFIXES = {("static", True): "_static_compiled", ("static", False): "_static"}


def _old_run(r: dict[str, Any]) -> tuple[str, str, bool]:
    """An old record's run (method, engine, compiled): the oldest named a static engine's run by its label
    (``jakiro_auto_static_compiled``, no ``engine`` or ``compiled``); a missing ``engine`` is the loop's for our
    kinds, HF's for HF's."""
    method, compiled = r["method"], bool(r.get("compiled", False))
    engine = r.get("engine") or ("loop" if r.get("kind", SPEC) in OUR_KINDS else "hf")
    if engine in ("loop", "static"):
        for (eng, comp), suffix in _OLD_SUFFIXES.items():
            if method.endswith(suffix):
                return method[:-len(suffix)], eng, comp
    return method, engine, compiled


def record_label(r: dict[str, Any], method: str | None = None) -> str:
    """A benchmark record's run label: its method. Old records (no ``capture``) keep the labels they were
    tabled under: a static engine's run ``<method>_static`` or ``<method>_static_compiled``, the loop's the name.
    ``method``: the label that method's run has on the engine ``r`` ran on (an old study's pairs)."""
    if "capture" in r:
        return method or r["method"]
    name, engine, compiled = _old_run(r)
    return (method or name) + _OLD_SUFFIXES.get((engine, compiled), "")


def record_method(r: dict[str, Any]) -> str:
    """The registry method a record (old or new) is a run of."""
    return r["method"] if "capture" in r else _old_run(r)[0]


def record_capture(r: dict[str, Any]) -> str:
    """How a record's run ran its decoding step: its ``capture``; an old record's "compiled" (how it was captured
    was not recorded) or "none"."""
    if "capture" in r:
        return r["capture"]
    return "compiled" if _old_run(r)[2] else "none"


def group_names(group: str) -> tuple[str, ...]:
    """The main study's methods of a goals group (e.g. ``"jakiro"``), in registry order."""
    return tuple(m.name for m in MAIN if m.group == group)


DRAFTED_METHODS = tuple(m.name for m in MAIN if m.kind == SPEC and m.draft)  # compared with published numbers


def study_methods(tree: TreeConfig, drafts_dir: str | Path, *, study: str = "main", tuned: bool = True,
                  compiled: bool = True, drafts: Collection[str] | None = None, eagle2_draft: str = EAGLE2_DRAFT,
                  jakiro_draft: str = JAKIRO_DRAFT, imported: bool = False,
                  draft_dtype: str | None = None) -> dict[str, MethodSpec]:
    """The method sets the notebooks compare, keyed by name, drafts read from ``drafts_dir/<name>/draft``. ``main``
    (:data:`MAIN`): the baselines, EAGLE-2, Jakiro and Jakiro + CEPD on ``tree``, with ``tuned`` their ``_auto`` twins,
    the ``_lookup`` extension and ``lookup_only``; ``ablations``: :func:`_ablation_methods`. ``drafts``: the drafts a
    profile trains (None: none); ``draft_dtype``: their precision (None: the target's); ``compiled``: also
    ``hf_compiled``; ``imported``: also the authors' configuration and the Jakiro* head (``jakiro_star``)."""
    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}: use {' or '.join(repr(s) for s in STUDIES)}")
    switches: dict[str, Callable[[], bool]] = {"compiled": lambda: compiled, "imported": lambda: imported,
                                               "tuned": lambda: tuned and not tree.tuned}
    registered = [m.on_drafts(eagle2_draft, jakiro_draft) for m in (MAIN if study == "main" else _ablation_methods(tree))]
    chosen = [m for m in registered if (m.when is None or switches[m.when]())
              and (drafts is None or m.draft is None or m.draft in drafts)]
    return {m.name: m.spec(tree, drafts_dir, tuned=tuned, draft_dtype=draft_dtype) for m in chosen}


def profile_methods(prof: Profile, drafts_dir: Path, study: str) -> dict[str, MethodSpec]:
    """The methods of ``study`` under the profile's switches (tuned budgets, the compiled HF baseline); methods on a
    draft the profile does not train are left out, the authors' configurations run where the profile imports heads."""
    return study_methods(prof.tree, drafts_dir, study=study, tuned=prof.bench.tuned,
                         compiled=prof.bench.compiled_baseline, drafts=prof.drafts, eagle2_draft=prof.bench.eagle2_draft,
                         jakiro_draft=prof.bench.jakiro_draft,
                         imported=any(d.import_from for d in prof.drafts.values()),
                         draft_dtype=resolve_draft_dtype(prof.bench.draft_dtype, prof.target))
