"""Where the time goes and whether speculation pays on this machine: :func:`cost_model`, :func:`lever_table` (what each
lever bought) and :func:`performance_targets`, from one run's measurements."""
from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from ..models import fast_paths, kernels
from .summary import by_method_temperature, headline_table, ratio_interval
from .budgets import PAPER_TREE_TOKENS, fixed_tree
from ..config import EAGLE2_DRAFT, JAKIRO_DRAFT, TreeConfig
from .costmodel import measure_draft_costs, measure_draft_cycle, measure_target_cost_variants
from ..models.draft import DraftModel
from ..models.target import plain_kernels
from ..layout import draft_path, has_weights
from .methods import group_names

# the goals' method groups, from the registry (jakiro_lib.measure.methods.MAIN)
JAKIRO_METHODS = group_names("jakiro")
EAGLE_METHODS = group_names("eagle2")
HF_METHODS = group_names("hf")  # HF generate eager, and with a static cache + torch.compile
OUR_VANILLA = group_names("our_vanilla")  # our plain decoder (eager or captured, as the target's capture says)
LOOKUP_METHODS = group_names("jakiro_lookup")  # Jakiro's tuned tree + a prompt-lookup chain (extension)
LOOKUP_METHOD = LOOKUP_METHODS[0]


def _primary_order(group: tuple[str, ...], *first: str) -> tuple[str, ...]:
    return (*first, *(m for m in group if m not in first))


# Each goal's own method: the first of these that the run has, never the fastest of several rows (an interval
# that treats such a pick as named in advance flatters the goal); the group's other rows follow in registry order.
PRIMARY = {
    "jakiro": _primary_order(JAKIRO_METHODS, "jakiro_auto", "jakiro"),
    "our_vanilla": OUR_VANILLA,
    "jakiro_lookup": LOOKUP_METHODS,
}
PACKED_GEMM_LEVER = "packed GEMM weights (streaming, MKL or oneDNN, chosen at load)"
PACKED_HEAD_LEVER = "packed draft head (the target's packed GEMM)"


def cost_model(target: Any, drafts_dir: str | Path, *, drafts: Sequence[str] = (EAGLE2_DRAFT, JAKIRO_DRAFT),
               sizes: Sequence[int] = (1, 2, 4, 6, 8, 12, 16, 24, 32), widths: Sequence[int] = (1, 3),
               tree: TreeConfig | None = None, context: int = 256, repeats: int = 7,
               draft_dtype: str | None = None) -> dict[str, pd.DataFrame]:
    """Measured T(n) of the target, draft-step times (trained vocabulary vs the full one, on an untrained copy) and,
    given ``tree``, drafting time per cycle: ``{"target": [n, ms, x_one_step, ms_library_defaults,
    ms_without_packed_gemm], "draft": [draft, vocab, width, ms, x_target_step], "draft_cycle": [draft, decoupled,
    total_tokens, ms, ms_plain_head]}`` (``ms`` as decoding runs; each ``ms_*`` without a fast path, timed back to back,
    where it is on). ``draft_dtype``: the drafts' precision, both copies set up alike (None: the target's)."""
    model = target.model
    variants: dict[str, Any] = {"ms": nullcontext}
    if model.config._attn_implementation == fast_paths.GQA_ATTENTION or kernels.packed_gemm(model) is not None:
        variants["ms_library_defaults"] = lambda: plain_kernels(model)
        if kernels.packed_gemm(model) is not None:
            variants["ms_without_packed_gemm"] = lambda: plain_kernels(model, gqa=False)
    times = measure_target_cost_variants(model, sorted({1, *sizes}), variants, context=context, repeats=repeats)
    target_table = pd.DataFrame([{"n": n, **{col: 1000 * s for col, s in row.items()}} for n, row in times.items()])
    one = float(target_table["ms"].iloc[0])
    target_table.insert(2, "x_one_step", target_table["ms"] / one)
    vocab = target.model.config.vocab_size
    draft_rows, cycle_rows = [], []
    for name in drafts:
        path = draft_path(drafts_dir, name)
        if not has_weights(path):
            continue
        trained = DraftModel.load(path, target.model, dtype=draft_dtype)
        if tree is not None:
            cycle_rows += _draft_cycle_rows(name, trained, tree, context=context, repeats=repeats)
        variants = [(trained.cfg.draft_vocab_size or vocab, trained)]
        if trained.cfg.draft_vocab_size is not None:
            full_cfg = dataclasses.replace(trained.cfg, draft_vocab_size=None)
            variants.append((vocab, DraftModel.build(full_cfg, target.model).for_decoding(target.model, draft_dtype)))
        for v, draft in variants:
            for w, s in measure_draft_costs(draft, widths=widths, context=context, repeats=repeats).items():
                draft_rows.append({"draft": name, "vocab": v, "width": w, "ms": 1000 * s,
                                   "x_target_step": 1000 * s / one})
    return {"target": target_table, "draft": pd.DataFrame(draft_rows),
            "draft_cycle": pd.DataFrame(cycle_rows, columns=["draft", "decoupled", "total_tokens", "ms",
                                                             "ms_plain_head"])}


def _draft_cycle_rows(name: str, draft: Any, tree: TreeConfig, *, context: int, repeats: int) -> list[dict[str, Any]]:
    """Drafting ms per cycle with the packed and the plain head, back to back (see :func:`cost_model`)."""
    fixed = fixed_tree(tree, tree)
    total = fixed.total_tokens
    rows, before = [], draft.packed_head
    for decoupled in (False, True) if draft.cfg.num_experts > 1 else (False,):
        cfg = dataclasses.replace(fixed, decoupled=decoupled, ar_steps=None)
        row = {"draft": name, "decoupled": decoupled, "total_tokens": total}
        for col, packed in (("ms", True), ("ms_plain_head", False)):
            draft.packed_head = packed
            try:
                row[col] = 1000 * measure_draft_cycle(draft, cfg, context=context, repeats=repeats)
            finally:
                draft.packed_head = before
        rows.append(row)
    return rows


def performance_targets(main: pd.DataFrame, records: Sequence[dict[str, Any]] | None = None) -> pd.DataFrame:
    """The speed goals as measured ratios (mean over benchmarks) with pass/fail; with the study's ``records``, tokens/s
    ratios get a paired bootstrap interval (:func:`~jakiro_lib.measure.summary.ratio_interval`), ``resolved`` False
    where it straddles the threshold. Each goal's method is :data:`PRIMARY`'s, its baseline the fastest of its group per
    temperature (docs/DESIGN.md section 11); ``selection`` says which rule picked a row. Tau compares ``jakiro`` with
    ``eagle2`` on the same tree."""
    goals = _Goals(headline_table(main), records)  # mean over benchmarks per (temperature, method)
    for temp in sorted(goals.h["temperature"].unique()):
        goals.add_temperature(temp)
    return pd.DataFrame(goals.rows)


_NAMED = "primary method (named before the run)"
_FIXED = "both methods fixed"


def _against(methods: Sequence[str]) -> str:
    return f"{_NAMED}; baseline the fastest of {', '.join(methods)}"


class _Goals:
    """The goals table being built: measured values of the headline table, intervals from the records."""

    def __init__(self, h: pd.DataFrame, records: Sequence[dict[str, Any]] | None) -> None:
        self.h, self.records, self.rows = h, records, []
        self.by_method = by_method_temperature(records or ())

    def value(self, temp: float, method: str, col: str = "tokens_per_s") -> float:
        sel = self.h[(self.h["temperature"] == temp) & (self.h["method"] == method)]
        return float(sel[col].iloc[0]) if len(sel) else math.nan

    def interval(self, temp: float, ours: str, base: str) -> tuple[float, float]:
        if self.records is None:
            return math.nan, math.nan
        return ratio_interval(self.by_method.get((ours, temp), []), self.by_method.get((base, temp), []))

    def fastest(self, temp: float, methods: Sequence[str]) -> str | None:
        present = [m for m in methods if not math.isnan(self.value(temp, m))]
        return max(present, key=lambda m: self.value(temp, m)) if present else None

    def primary(self, temp: float, group: str | Sequence[str]) -> str | None:
        names = PRIMARY[group] if isinstance(group, str) else group
        return next((m for m in names if not math.isnan(self.value(temp, m))), None)

    def add(self, goal: str, temp: float, ours: str, base: str, threshold: float, strict: bool = False,
            col: str = "tokens_per_s", selection: str = "") -> None:
        a, b = self.value(temp, ours, col), self.value(temp, base, col)
        ratio = a / b if b and not math.isnan(b) else math.nan
        met = None if math.isnan(ratio) else bool(ratio > threshold if strict else ratio >= threshold)
        lo, hi = self.interval(temp, ours, base) if col == "tokens_per_s" else (math.nan, math.nan)
        # resolved: the whole interval lies on one side of the threshold (None: no interval to judge by)
        if math.isnan(lo):
            resolved = None
        else:
            resolved = bool(lo > threshold or hi <= threshold) if strict else bool(lo >= threshold or hi < threshold)
        self.rows.append({"goal": goal, "temperature": temp, "method": ours, "baseline": base,
                          "metric": "tokens/s" if col == "tokens_per_s" else col, "method_value": a,
                          "baseline_value": b, "ratio": ratio, "ratio_ci_low": lo, "ratio_ci_high": hi,
                          "target": f"{'>' if strict else '>='} {threshold:g}", "met": met, "resolved": resolved,
                          "selection": selection})

    def add_temperature(self, temp: float) -> None:
        """The goals at one temperature: against HF's generate, our fastest plain decoder, HF's prompt lookup
        and EAGLE-2; then the lookup extension's."""
        jakiro = self.primary(temp, "jakiro")
        if jakiro is None:
            return
        best_eagle = self.fastest(temp, EAGLE_METHODS) or "eagle2"
        hf = self.fastest(temp, HF_METHODS) or "hf_generate"
        plain = self.fastest(temp, OUR_VANILLA) or "vanilla"
        if temp == 0:
            self.add("Jakiro >= 1.5x HF generate (greedy)", temp, jakiro, hf, 1.5, selection=_against(HF_METHODS))
            self.add("Jakiro >= 1.5x our fastest plain decoder (greedy)", temp, jakiro, plain, 1.5,
                     selection=_against(OUR_VANILLA))
            self.add("Jakiro > HF prompt lookup", temp, jakiro, "hf_prompt_lookup", 1.0, strict=True, selection=_NAMED)
            self.add("our vanilla loop within 5% of HF generate", temp, self.primary(temp, "our_vanilla") or "vanilla",
                     hf, 0.95, selection=_against(HF_METHODS))
        else:
            self.add(f"Jakiro >= 1.3x HF sampling (T={temp:g})", temp, jakiro, hf, 1.3, selection=_against(HF_METHODS))
            self.add(f"Jakiro >= 1.3x our fastest plain decoder (T={temp:g})", temp, jakiro, plain, 1.3,
                     selection=_against(OUR_VANILLA))
        self.add("Jakiro >= EAGLE-2 (tokens/s)", temp, jakiro, best_eagle, 1.0, selection=_against(EAGLE_METHODS))
        self.add("Jakiro >= EAGLE-2 (tau)", temp, "jakiro", "eagle2", 1.0, col="tau", selection=_FIXED)
        self.add_lookup(temp, hf)

    def add_lookup(self, temp: float, hf: str) -> None:
        """This repo's extension, Jakiro + a prompt-lookup chain, held to the same goals."""
        lookup = self.primary(temp, "jakiro_lookup")
        if lookup is None:
            return
        ext = "Jakiro + lookup branch (extension)"
        if temp == 0:
            self.add(f"{ext} >= 1.5x HF generate (greedy)", temp, lookup, hf, 1.5, selection=_against(HF_METHODS))
            self.add(f"{ext} > HF prompt lookup", temp, lookup, "hf_prompt_lookup", 1.0, strict=True, selection=_NAMED)
        else:
            self.add(f"{ext} >= 1.3x HF sampling (T={temp:g})", temp, lookup, hf, 1.3, selection=_against(HF_METHODS))
        self.add(f"{ext} >= EAGLE-2 + lookup branch (tokens/s)", temp, LOOKUP_METHOD, "eagle2_lookup", 1.0,
                 selection=_FIXED)


LEVER_COLUMNS = ["lever", "measured", "without", "with", "speedup"]
# The main study's levers compared by greedy tokens/s: (lever, ((method without it, method with it), ...))
_DECODER_LEVERS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("tree budget tuned on this machine", (("eagle2", "eagle2_auto"), ("jakiro", "jakiro_auto"))),
    ("prompt-lookup chain grafted on the tuned tree (extension)",
     (("eagle2_auto", "eagle2_lookup"), ("jakiro_auto", "jakiro_lookup"))),
    ("draft tree under the lookup chain (extension)",
     (("lookup_only", "eagle2_lookup"), ("lookup_only", "jakiro_lookup"))),
)


class _Levers:
    """The lever table's rows as they are found: one lever measured without and with it (NaN readings left out)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, lever: str, measured: str, without: float, with_: float, lower_is_better: bool = True) -> None:
        """One row: the lever's speedup is without / with (times) or with / without (rates)."""
        if math.isnan(without) or math.isnan(with_):
            return
        gain = without / with_ if lower_is_better else with_ / without
        self.rows.append({"lever": lever, "measured": measured, "without": without, "with": with_, "speedup": gain})

    def frame(self) -> pd.DataFrame:
        """The table (its columns even when no lever was measured)."""
        return pd.DataFrame(self.rows, columns=LEVER_COLUMNS)


def _kernel_levers(levers: _Levers, target_costs: pd.DataFrame, tree_tokens: int) -> None:
    """The target's kernel fast paths: T(``tree_tokens``) (and T(1) where measured) with and without each."""
    t = target_costs.set_index("n") if len(target_costs) else pd.DataFrame()
    if tree_tokens not in t.index:
        return
    row = t.loc[tree_tokens]
    if "ms_without_packed_gemm" in t.columns:
        for n in sorted({1, tree_tokens} & set(t.index)):  # one-token decoding too where the copy serves it
            levers.add(PACKED_GEMM_LEVER, f"target T({n}) ms", float(t.loc[n, "ms_without_packed_gemm"]),
                       float(t.loc[n, "ms"]))
        if "ms_library_defaults" in t.columns:
            levers.add("SDPA's own GQA under tree masks", f"target T({tree_tokens}) ms",
                       float(row["ms_library_defaults"]), float(row["ms_without_packed_gemm"]))
    if "ms_library_defaults" in t.columns:
        levers.add("all kernel fast paths", f"target T({tree_tokens}) ms", float(row["ms_library_defaults"]),
                   float(row["ms"]))
        if 1 in t.index:
            one = t.loc[1]
            levers.add("all kernel fast paths", f"T({tree_tokens}) / T(1)",
                       float(row["ms_library_defaults"] / one["ms_library_defaults"]), float(row["ms"] / one["ms"]))


def _draft_vocabulary_levers(levers: _Levers, draft_costs: pd.DataFrame) -> None:
    """The reduced draft vocabulary: one draft step at the widest measured frontier, full against reduced."""
    if not len(draft_costs):
        return
    for draft, d in draft_costs.groupby("draft"):
        width = d["width"].max()
        d = d[d["width"] == width]
        if d["vocab"].nunique() == 2:
            full, small = d.sort_values("vocab", ascending=False)["ms"].tolist()
            levers.add(f"draft vocabulary {int(d['vocab'].min())} instead of {int(d['vocab'].max())}",
                       f"{draft} draft step ms (width {width})", full, small)


def _draft_head_levers(levers: _Levers, draft_cycle: pd.DataFrame | None) -> None:
    """The packed draft head: drafting time per cycle with the plain head and the packed one."""
    for r in (draft_cycle.itertuples() if draft_cycle is not None else ()):
        kind = "decoupled" if r.decoupled else "coupled"
        levers.add(PACKED_HEAD_LEVER, f"{r.draft} {kind} drafting ms per cycle ({r.total_tokens}-token tree)",
                   float(r.ms_plain_head), float(r.ms))


def _decoder_levers(levers: _Levers, main: pd.DataFrame) -> None:
    """The main study's pairs of methods (:data:`_DECODER_LEVERS`): greedy tokens/s, mean over benchmarks."""
    h = headline_table(main) if len(main) else pd.DataFrame()
    if not len(h):
        return
    greedy = h[h["temperature"] == 0].set_index("method")
    for lever, pairs in _DECODER_LEVERS:
        for without, with_ in pairs:
            if without in greedy.index and with_ in greedy.index:
                levers.add(lever, f"{with_} vs {without} tokens/s (T=0)", float(greedy.loc[without, "tokens_per_s"]),
                           float(greedy.loc[with_, "tokens_per_s"]), lower_is_better=False)


def lever_table(target_costs: pd.DataFrame, draft_costs: pd.DataFrame, main: pd.DataFrame, *,
                tree_tokens: int = PAPER_TREE_TOKENS, draft_cycle: pd.DataFrame | None = None) -> pd.DataFrame:
    """What each speed lever bought, each measured with and without it in this run: kernel levers by
    T(``tree_tokens``), the draft vocabulary by one draft step, the packed draft head by drafting time per cycle
    (``draft_cycle`` of :func:`cost_model`), the decoder levers by the main study's greedy tokens/s."""
    levers = _Levers()
    _kernel_levers(levers, target_costs, tree_tokens)
    _draft_vocabulary_levers(levers, draft_costs)
    _draft_head_levers(levers, draft_cycle)
    _decoder_levers(levers, main)
    return levers.frame()
