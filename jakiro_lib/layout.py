"""The run directory's layout: every path a stage writes or reads under ``run_dir``, spelled once (the tree:
docs/usage.md, Layout)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# files of a saved draft, a feature cache and a training's output folder (the modules that write them import these)
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "draft_config.json"
MANIFEST = "manifest.json"
RESULTS = "results.json"
HISTORY = "history.json"
# files of one benchmark output folder (``bench/<study>`` or the CLI's ``--out``)
RECORDS_FILE = "records.jsonl"
STALE_RECORDS_FILE = "records.stale.jsonl"
STUDY_STAMP = "study_stamp.json"
BENCH_CONFIG = "bench_config.json"
STUDY_TREE_BUDGET = "tree_budget.json"  # the budgets one study used (a copy of its choices)
SKIPPED_FILE = "skipped_benchmarks.json"
# files of the run directory
TREE_BUDGETS = "tree_budgets.json"  # the per-machine cache under bench/
TRAIN_STAMP = "train_stamp.json"
DRAFT_SUBDIR = "draft"


def draft_path(drafts_dir: str | Path, name: str) -> Path:
    """Where the weights of draft ``name`` are saved under a drafts folder: ``<drafts_dir>/<name>/draft``."""
    return Path(drafts_dir) / name / DRAFT_SUBDIR


def draft_name(path: str | Path) -> str:
    """The draft's name from its saved-weights folder (the inverse of :func:`draft_path`)."""
    return Path(path).parent.name


def has_weights(path: str | Path | None) -> bool:
    """Whether a saved draft folder holds its weights file."""
    return path is not None and (Path(path) / WEIGHTS_FILE).is_file()


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory."""

    root: Path

    @property
    def profile(self) -> Path:
        """The run's resolved profile, written by the pipeline, read by its notebooks."""
        return self.root / "profile.json"

    @property
    def features(self) -> Path:
        return self.root / "features"

    @property
    def features_manifest(self) -> Path:
        return self.features / MANIFEST

    @property
    def features_summary(self) -> Path:
        return self.root / "features_summary.json"

    @property
    def distill_conversations(self) -> Path:
        return self.root / "distill" / "conversations.jsonl"

    @property
    def drafts(self) -> Path:
        return self.root / "drafts"

    def draft_dir(self, name: str) -> Path:
        """Everything of draft ``name``: weights folder, results, history, training stamp."""
        return self.drafts / name

    def draft_training(self, name: str) -> Path:
        """Where a draft trains until complete; it then replaces :meth:`draft_dir` atomically."""
        return self.drafts / f".{name}.training"

    def draft(self, name: str) -> Path:
        return draft_path(self.drafts, name)

    def draft_results(self, name: str) -> Path:
        return self.draft_dir(name) / RESULTS

    def draft_history(self, name: str) -> Path:
        return self.draft_dir(name) / HISTORY

    def train_stamp(self, name: str) -> Path:
        return self.draft_dir(name) / TRAIN_STAMP

    @property
    def bench_root(self) -> Path:
        return self.root / "bench"

    @property
    def tree_budgets(self) -> Path:
        return self.bench_root / TREE_BUDGETS

    def bench(self, study: str) -> Path:
        return self.bench_root / study

    def records(self, study: str) -> Path:
        return self.bench(study) / RECORDS_FILE
