"""Glue between the library and the study notebooks (and the ``cache``/``train``/``bench`` CLI commands).

The notebooks stay thin: ``from jakiro_lib import study as S``, then one call per step. By stage:

* :mod:`.context`: profiles, ``run_dir`` / ``report_dir`` (layout: :class:`jakiro_lib.layout.RunLayout`),
  :class:`StudyContext`, :func:`setup` and the notebooks' :func:`notebook_setup`, the shared target.
* :mod:`.s00_data` (notebook 00): :func:`prepare_features`, ShareGPT conversations -> ``run_dir/features``.
* :mod:`.s01_train` (notebook 01): :func:`train_all`, every draft of ``profile.drafts`` -> ``run_dir/drafts``.
* :mod:`.s02_bench` (notebook 02): :func:`run_study`, ``"main"`` / ``"ablations"`` -> ``run_dir/bench/<study>``.
* :mod:`.tables`: records -> summary DataFrames and the report's CSV/JSON files.
* :mod:`.published` (notebook 03): published numbers and the comparison with ours.

The methods live in :mod:`jakiro_lib.measure.methods`; ``total_tokens="auto"`` is resolved in
:mod:`jakiro_lib.measure.budgets`.
"""
from __future__ import annotations

from ..measure.budgets import resolve_tree_budgets
from ..measure.methods import STUDIES
from ..files import write_json
from .context import (SMOKE_BANNER, StudyContext, configure_logging, default_report_dir, default_run_dir,
                      get_target, notebook_setup, reports_root, resolve_profile, runs_root, setup)
from .performance import cycle_cost_table, write_performance_report
from .published import PUBLISHED, beside_published, comparison_table
from .s00_data import (PAPER_CONVERSATIONS, PAPER_TOKENS_PER_CONVERSATION, disk_estimates, load_training_conversations,
                       loss_mask_html, manifest_table, prepare_features, sample_conversation_html)
from .s01_train import (drafts_table, load_training_results, router_load_table, train_all, training_datasets,
                        training_history, training_table, write_training_tables)
from ..measure.methods import profile_methods
from .s02_bench import (bench_environment, methods_table, run_study, study_questions,
                        study_temperatures)
from ..measure.summary import headline_table
from .tables import (acceptance_by_depth, category_table, display_table, load_study_records, method_setting,
                     records_frame, study_table, tree_budget_table, versus_eagle2_table, write_study_tables)
from ..files import write_table

__all__ = [
    "PAPER_CONVERSATIONS", "PAPER_TOKENS_PER_CONVERSATION", "PUBLISHED", "SMOKE_BANNER", "STUDIES", "StudyContext",
    "acceptance_by_depth",
    "beside_published", "bench_environment", "category_table", "cycle_cost_table", "comparison_table", "configure_logging", "default_report_dir",
    "default_run_dir", "disk_estimates", "drafts_table", "display_table", "get_target", "headline_table", "load_study_records",
    "load_training_conversations", "load_training_results", "loss_mask_html", "manifest_table", "method_setting",
    "methods_table", "notebook_setup", "prepare_features", "profile_methods", "records_frame", "reports_root",
    "resolve_profile", "resolve_tree_budgets", "router_load_table", "run_study", "runs_root",
    "sample_conversation_html", "setup", "study_questions", "study_table", "study_temperatures", "train_all",
    "training_datasets", "training_history", "training_table", "tree_budget_table", "versus_eagle2_table", "write_json",
    "write_performance_report", "write_study_tables", "write_table", "write_training_tables",
]
