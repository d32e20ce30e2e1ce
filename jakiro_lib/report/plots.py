"""Report figures (seaborn on matplotlib's Agg canvas); the report's front page is :mod:`jakiro_lib.report.page`. Every
``plot_*`` takes a DataFrame (columns as :func:`jakiro_lib.measure.summary.summarize` names them) or the raw records and
returns a ``Figure`` built without pyplot (headless, no global state, whatever the notebook backend);
:func:`save_figure` writes it as PNG."""
from __future__ import annotations

import io
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..config import SPEC
from ..files import atomic_path
from ..measure.methods import record_label

SERIES_ORDER = ("train loss", "train loss A (t+1)", "train loss B (t+2)", "train acc A", "held-out acc A",
                "held-out acc B")


def new_figure(ncols: int = 1, nrows: int = 1, *, width: float = 5.0, height: float = 3.6,
               sharey: bool = False) -> tuple[Figure, np.ndarray]:
    """An Agg-backed figure and a 2-D array of axes."""
    sns.set_theme(style="whitegrid", context="notebook")
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=sharey)
    return fig, axes


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 110) -> Path:
    """Write ``fig`` as PNG atomically; returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    return path


def figure_png(fig: Figure, *, dpi: int = 110) -> bytes:
    """PNG bytes of ``fig``."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    return buf.getvalue()


def show_figure(fig: Figure, path: str | Path | None = None, *, dpi: int = 110) -> None:
    """Display ``fig`` inline in a notebook as a PNG (saving it to ``path`` first when given)."""
    from IPython.display import Image, display

    title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) is not None else ""
    alt = title or (Path(path).stem if path is not None else "figure")
    if path is not None:
        path = save_figure(fig, path, dpi=dpi)
        display(Image(filename=str(path), alt=alt))
    else:
        display(Image(data=figure_png(fig, dpi=dpi), alt=alt))


def _message_figure(text: str) -> Figure:
    fig, axes = new_figure(width=6, height=1.6)
    ax = axes[0, 0]
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True)
    return fig


def _frame(data: Any) -> pd.DataFrame:
    return data.copy() if isinstance(data, pd.DataFrame) else pd.DataFrame(list(data))


def _ordered(df: pd.DataFrame, col: str) -> list[Any]:
    """The values of ``col`` in the order they first appear (the study's order), not sorted."""
    return list(dict.fromkeys(df[col].tolist()))


def _grouped_bars(ax: Any, df: pd.DataFrame, *, x: str, y: str, hue: str | None, yerr: str | None = None,
                  interval: tuple[str, str] | None = None, order: Sequence[str] | None = None,
                  horizontal: bool = False, annotate: bool = True) -> None:
    """Bars of precomputed values (means) grouped by ``hue``, with error bars of precomputed stds
    (``yerr``) or of an interval's low and high columns (``interval``, drawn instead)."""
    order = list(order) if order is not None else _ordered(df, x)
    hues = _ordered(df, hue) if hue else [None]
    keys = [x] + ([hue] if hue else [])
    cols = [c for c in (y, yerr, *(interval or ())) if c and c in df]
    if df.duplicated(keys).any():  # several rows per bar (e.g. benchmarks): plot their mean
        df = df.groupby(keys, sort=False)[cols].mean().reset_index()
    palette = sns.color_palette("deep", max(len(hues), 1))
    width = 0.8 / len(hues)
    pos = np.arange(len(order))
    for j, h in enumerate(hues):
        sub = df if h is None else df[df[hue] == h]
        vals = sub.set_index(x)[y].reindex(order).to_numpy(dtype=float)
        errs = (sub.set_index(x)[yerr].reindex(order).to_numpy(dtype=float)
                if yerr and yerr in sub else None)
        if interval and all(c in sub for c in interval):
            lo, hi = (sub.set_index(x)[c].reindex(order).to_numpy(dtype=float) for c in interval)
            errs = np.nan_to_num(np.vstack([vals - lo, hi - vals]))
        where = pos - 0.4 + width * (j + 0.5)
        label = None if h is None else str(h)
        if horizontal:
            bars = ax.barh(where, vals, height=width, xerr=errs, color=palette[j], label=label, capsize=2)
        else:
            bars = ax.bar(where, vals, width=width, yerr=errs, color=palette[j], label=label, capsize=2)
        if annotate and len(order) * len(hues) <= 24:
            ax.bar_label(bars, labels=["" if not np.isfinite(v) else f"{v:.2f}" for v in vals], fontsize=7,
                         padding=2)
    if horizontal:
        ax.set_yticks(pos, order)
        ax.invert_yaxis()
    else:
        ax.set_xticks(pos, order, rotation=30, ha="right")
    if hue and len(hues) > 1:
        ax.legend(title=hue, fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _temperatures(df: pd.DataFrame) -> list[float]:
    return sorted(df["temperature"].dropna().unique().tolist()) if "temperature" in df else [None]


# Benchmark figures


def plot_metric(summary: pd.DataFrame | Iterable[dict], metric: str = "speedup", *, spec_only: bool = False,
                reference: float | None = 1.0, title: str | None = None) -> Figure:
    """One panel per temperature: ``metric`` per method (bars), one colour per benchmark; error bars: the
    bootstrap interval over prompts where the summary has one (``<metric>_ci_low/_high``), else the std."""
    df = _frame(summary)
    if spec_only and "kind" in df:
        df = df[df["kind"] == SPEC]
    df = df[np.isfinite(pd.to_numeric(df.get(metric), errors="coerce"))] if metric in df else df.iloc[0:0]
    if df.empty:
        return _message_figure(f"no {metric} values to plot")
    temps = _temperatures(df)
    order = _ordered(df, "method")
    fig, axes = new_figure(len(temps), width=max(4.5, 0.55 * len(order) + 2.5), sharey=True)
    std = f"{metric}_std" if f"{metric}_std" in df else None
    ci = (f"{metric}_ci_low", f"{metric}_ci_high")
    ci = ci if all(c in df for c in ci) and np.isfinite(df[list(ci)].to_numpy(dtype=float)).any() else None
    for ax, t in zip(axes[0], temps):
        sub = df if t is None else df[df["temperature"] == t]
        _grouped_bars(ax, sub, x="method", y=metric, hue="benchmark", yerr=std, interval=ci,
                      order=[m for m in order if m in set(sub["method"])])
        if reference is not None:
            ax.axhline(reference, color="0.3", lw=1, ls="--")
        ax.set_title(f"T = {t:g}" if t is not None else "")
        ax.set_xlabel("")
        ax.set_ylabel(metric)
    fig.suptitle(title or metric)
    return fig


def plot_speedup(summary: pd.DataFrame | Iterable[dict]) -> Figure:
    """Speedup over the fastest plain decoder (ours or HF's) per method, benchmark and temperature (1x dashed)."""
    return plot_metric(summary, "speedup", title="Speedup vs the fastest plain decoder (bars: 95% bootstrap CI over prompts)")


def plot_tau(summary: pd.DataFrame | Iterable[dict]) -> Figure:
    """Average acceptance length tau (tokens per draft-verify cycle, bonus included) of the spec methods."""
    return plot_metric(summary, "tau", spec_only=True,
                       title="Average acceptance length tau (generated tokens / cycles)")


def plot_ablations(ablations: pd.DataFrame | Iterable[dict]) -> Figure:
    """Horizontal bars of speedup and tau per ablation method (T=0), one colour per benchmark."""
    df = _frame(ablations)
    if df.empty:
        return _message_figure("no ablation results")
    order = _ordered(df, "method")
    fig, axes = new_figure(2, width=5.5, height=max(2.8, 0.38 * len(order) + 1.2))
    for ax, metric in zip(axes[0], ("speedup", "tau")):
        sub = df[np.isfinite(pd.to_numeric(df[metric], errors="coerce"))]
        _grouped_bars(ax, sub, x="method", y=metric, hue="benchmark",
                      yerr=f"{metric}_std" if f"{metric}_std" in sub else None,
                      order=[m for m in order if m in set(sub["method"])], horizontal=True)
        ax.axvline(1.0, color="0.3", lw=1, ls="--")
        ax.set_xlabel(metric)
        ax.set_title(metric)
    fig.suptitle("Ablations (T = 0)")
    return fig


CYCLE_PARTS = ("verify", "draft_forward", "tree", "evaluate", "update", "read", "host")  # measure.cycles' parts


def plot_cycle_costs(cycles: pd.DataFrame | Iterable[dict]) -> Figure:
    """What a cycle costs, in plain steps, part by part (the cycle-cost table, ``cycles.csv``): one stacked bar a
    method, a line at one plain step, T(n) of its tree marked."""
    df = _frame(cycles)
    if df.empty or "plain_ms" not in df:
        return _message_figure("no cycle costs measured")
    fig, axes = new_figure(width=max(5.0, 0.6 * len(df) + 3.0))
    ax = axes[0][0]
    pos, left = np.arange(len(df)), np.zeros(len(df))
    for part, color in zip(CYCLE_PARTS, sns.color_palette("deep", len(CYCLE_PARTS))):
        width = (df[f"{part}_ms"] / df["plain_ms"]).to_numpy(dtype=float)
        ax.barh(pos, width, left=left, color=color, label=part.replace("_", " "))
        left += width
    ax.scatter(df["tn_ms"] / df["plain_ms"], pos, marker="|", s=200, color="black", label="T(n) alone", zorder=3)
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(pos, df["method"].tolist())
    ax.invert_yaxis()
    ax.set_xlabel("plain decoding steps per cycle")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("What a cycle costs, part by part")
    return fig


def accepted_lengths(records: Iterable[dict]) -> pd.DataFrame:
    """Long table (method, benchmark, temperature, accepted) with one row per draft-verify cycle."""
    rows = []
    for r in records:
        if r.get("kind") != SPEC:
            continue
        for a in r.get("accepted") or []:
            rows.append({"method": record_label(r), "benchmark": r["benchmark"], "temperature": r["temperature"],
                         "accepted": int(a)})
    return pd.DataFrame(rows, columns=["method", "benchmark", "temperature", "accepted"])


def plot_accept_hist(records: Iterable[dict] | pd.DataFrame) -> Figure:
    """Distribution of tokens emitted per cycle (accepted drafts + bonus) per spec method and temperature."""
    if isinstance(records, pd.DataFrame):
        flat = ("accepted" in records and "kind" not in records and not records.empty
                and not isinstance(records["accepted"].iloc[0], (list, tuple)))
        df = records if flat else accepted_lengths(records.to_dict("records"))
    else:
        df = accepted_lengths(records)
    if df.empty:
        return _message_figure("no speculative cycles recorded")
    temps, order = _temperatures(df), _ordered(df, "method")
    # one legend, beside the last panel, as tall as the methods need (an ablation study has 18)
    fig, axes = new_figure(len(temps), width=5.5 + 2.8 / len(temps), height=max(3.6, 1.4 + 0.22 * len(order)),
                           sharey=True)
    for i, (ax, t) in enumerate(zip(axes[0], temps)):
        sub = df if t is None else df[df["temperature"] == t]
        sns.histplot(data=sub, x="accepted", hue="method", discrete=True, multiple="dodge", stat="probability",
                     common_norm=False, shrink=0.85, ax=ax, hue_order=order, legend=i == len(temps) - 1)
        ax.set_xlabel("tokens per cycle (accepted + bonus)")
        ax.set_title(f"T = {t:g}" if t is not None else "")
        ax.xaxis.get_major_locator().set_params(integer=True)
    sns.move_legend(axes[0][len(temps) - 1], "upper left", bbox_to_anchor=(1.02, 1.0), frameon=False,
                    fontsize="small", title_fontsize="small")
    fig.suptitle("Accepted length per draft-verify cycle")
    return fig


# Training figures


def plot_training_curves(history: pd.DataFrame | Iterable[dict], *, smooth: int = 1) -> Figure:
    """Loss curves: long table (draft, step, series, value), one panel per series, one line per draft.

    ``smooth`` > 1 applies a centred rolling mean of that many logged points.
    """
    df = _frame(history)
    if df.empty:
        return _message_figure("no training history")
    seen = _ordered(df, "series")
    series = [s for s in SERIES_ORDER if s in seen] + [s for s in seen if s not in SERIES_ORDER]
    ncols = min(3, len(series))
    nrows = math.ceil(len(series) / ncols)
    fig, axes = new_figure(ncols, nrows, width=4.6, height=3.2)
    for ax, name in zip(axes.flat, series):
        sub = df[df["series"] == name].sort_values(["draft", "step"])
        if smooth > 1:
            sub = sub.assign(value=sub.groupby("draft")["value"].transform(
                lambda s: s.rolling(smooth, min_periods=1, center=True).mean()))
        sns.lineplot(data=sub, x="step", y="value", hue="draft", ax=ax, hue_order=_ordered(df, "draft"))
        ax.set_title(name)
        ax.set_ylabel("")
        if ax.get_legend() is not None and ax is not axes.flat[0]:
            ax.get_legend().remove()
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.suptitle("Training losses")
    return fig


def plot_heldout_accuracy(training: pd.DataFrame | Iterable[dict]) -> Figure:
    """Held-out top-1 accuracy of each draft's branches (A: next token, B: two ahead)."""
    df = _frame(training)
    cols = [c for c in ("acc_a", "acc_b") if c in df]
    if df.empty or not cols or df[cols].isna().all().all():  # none, or imported drafts only (none evaluated)
        return _message_figure("no held-out accuracies")
    long = df.melt(id_vars=["draft"], value_vars=cols, var_name="branch", value_name="accuracy").dropna()
    long["branch"] = long["branch"].map({"acc_a": "A (t+1)", "acc_b": "B (t+2)"})
    fig, axes = new_figure(width=max(4.5, 0.9 * df["draft"].nunique() + 2.5))
    _grouped_bars(axes[0, 0], long, x="draft", y="accuracy", hue="branch", order=_ordered(df, "draft"))
    axes[0, 0].set_ylabel("held-out top-1 accuracy")
    axes[0, 0].set_ylim(0, 1.05)
    fig.suptitle("Held-out top-1 accuracy per branch")
    return fig


def plot_router_load(load: pd.DataFrame | Iterable[dict]) -> Figure:
    """Fraction of tokens routed to each expert (branch-A top-k), one group per draft."""
    df = _frame(load)
    if df.empty:
        return _message_figure("no router statistics")
    df = df.assign(expert=df["expert"].map(lambda e: f"expert {e}"))
    fig, axes = new_figure(width=max(4.5, 0.9 * df["draft"].nunique() + 2.5))
    _grouped_bars(axes[0, 0], df, x="draft", y="load", hue="expert", order=_ordered(df, "draft"))
    axes[0, 0].set_ylabel("share of tokens routed to the expert")
    axes[0, 0].set_title("top-k routing: shares sum to k", fontsize=9)
    fig.suptitle("Router load on held-out data")
    return fig


def plot_cost_model(target_costs: pd.DataFrame | Iterable[dict], draft_costs: pd.DataFrame | Iterable[dict],
                    tree_budget: pd.DataFrame | Iterable[dict] | None = None) -> Figure:
    """Left: measured T(n) of the target vs one decoding step, with draft-step times as dotted lines.
    Right (when tuned): estimated tokens/s per tree budget for each tuned method, chosen budget marked."""
    t, d = _frame(target_costs), _frame(draft_costs)
    b = _frame(tree_budget) if tree_budget is not None else pd.DataFrame()
    if t.empty:
        return _message_figure("no cost measurements")
    fig, axes = new_figure(ncols=2 if not b.empty else 1, width=5.2)
    ax = axes[0, 0]
    ax.plot(t["n"], t["ms"], marker="o", color="black", label="target: verify n tokens")
    if "ms_library_defaults" in t.columns:
        ax.plot(t["n"], t["ms_library_defaults"], marker=".", ls="--", color="grey",
                label="target, library default kernels")
    palette = sns.color_palette("deep", max(len(d), 1))
    for i, row in enumerate(d.itertuples(index=False)):
        ax.axhline(row.ms, ls=":", color=palette[i], label=f"draft {row.draft}, vocab {row.vocab}, width {row.width}")
    ax.set_xlabel("tree tokens n (root included)")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the curve fills the axes
    if not b.empty:
        ax2 = axes[0, 1]
        for i, (method, sub) in enumerate(b.groupby("method", sort=False)):
            color = sns.color_palette("deep", 8)[i % 8]
            best = sub.groupby("total_tokens", sort=True)["tokens_per_s"].max()  # the best shape at each budget
            ax2.plot(best.index, best.values, marker="o", color=color, label=method)
            chosen = sub[sub["chosen"].astype(bool)]
            ax2.scatter(chosen["total_tokens"], chosen["tokens_per_s"], s=120, facecolors="none",
                        edgecolors=color, linewidths=2)
        ax2.set_xlabel("tree budget total_tokens")
        ax2.set_ylabel("estimated tokens/s, best depth and width")
        ax2.set_title("circle: chosen tree ('auto')", fontsize=9)
        ax2.legend(fontsize=8)
    fig.suptitle("Cost model on this machine")
    return fig


def plot_papercost(tn: pd.DataFrame | Iterable[dict], cycles: pd.DataFrame | Iterable[dict]) -> Figure:
    """``papercost``'s tables (:mod:`jakiro_lib.measure.papercost`): left, measured T(n) of the random paper-shaped
    target, eager and captured; right, the speedups the paper's tau would give on this engine beside the paper's
    own, labelled a model (no acceptance is measured on random weights)."""
    t, c = _frame(tn), _frame(cycles)
    if t.empty:
        return _message_figure("no papercost measurements")
    fig, axes = new_figure(ncols=2, width=5.2)
    ax = axes[0, 0]
    ax.plot(t["n"], t["eager_ms"], marker=".", ls="--", color="grey", label="eager")
    ax.plot(t["n"], t["captured_ms"], marker="o", color="black", label="captured (CUDA graphs)")
    ax.set_xlabel("tree tokens n")
    ax.set_ylabel("ms per target forward, T(n)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    spec = c[c["method"] != "vanilla"] if not c.empty else c
    if not spec.empty:
        long = pd.concat([spec.assign(source="model: paper's tau x our cycle", value=spec["modelled_speedup"]),
                          spec.assign(source="paper (measured, A40)", value=spec["paper_speedup"])])
        sns.barplot(data=long, x="method", y="value", hue="source", ax=axes[0, 1], palette=["#4c72b0", "#bbbbbb"])
        axes[0, 1].set_ylabel("speedup over plain decoding")
        axes[0, 1].set_xlabel("")
        axes[0, 1].tick_params(axis="x", labelrotation=20)
        axes[0, 1].set_ylim(0, 1.35 * float(long["value"].max()))  # room for the legend above the bars
        axes[0, 1].legend(fontsize=8, title=None, loc="upper left", ncol=2)
        axes[0, 1].set_title("modelled, not a measurement of acceptance", fontsize=9)
    fig.suptitle("The paper's shape by simulation (random weights)")
    return fig


# Notebook stage titles (the report's front page, jakiro_lib.report.page, lists them)
STAGE_TITLES = {
    "00_data_caching": "Data and feature caching",
    "01_train_moe_head": "Training the draft heads (dense, MoE, contrastive off)",
    "02_hybrid_decoding_ablations": "Benchmarks: main comparison and ablations",
    "03_result_figures": "Result figures and published numbers",
}
