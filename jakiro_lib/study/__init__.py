"""Glue between the library and the study notebooks (and the ``cache``/``train``/``bench`` CLI commands): the notebooks
stay thin, ``from jakiro_lib import study as S`` then one call a step. :mod:`.context` sets up, :mod:`.s00_data`,
:mod:`.s01_train` and :mod:`.s02_bench` run a stage each, :mod:`.tables` and :mod:`.published` make the report's tables
(docs/DESIGN.md section 10)."""
from __future__ import annotations

from ..measure.budgets import resolve_tree_budgets
from ..measure.methods import STUDIES, profile_methods
from ..files import write_json, write_table
from .context import (SMOKE_BANNER, StudyContext, configure_logging, default_report_dir, default_run_dir,
                      get_target, notebook_setup, reports_root, resolve_profile, runs_root, setup)
from .performance import cycle_cost_table, write_performance_report
from .published import PUBLISHED, beside_published, comparison_table
from .s00_data import (PAPER_CONVERSATIONS, PAPER_TOKENS_PER_CONVERSATION, disk_estimates, load_training_conversations,
                       loss_mask_html, manifest_table, prepare_features, sample_conversation_html)
from .s01_train import (drafts_table, load_training_results, router_load_table, train_all, training_datasets,
                        training_history, training_table, write_training_tables)
from .s02_bench import (bench_environment, methods_table, run_study, study_questions,
                        study_temperatures)
from ..measure.summary import headline_table
from .tables import (acceptance_by_depth, category_table, display_table, load_study_records, method_setting,
                     records_frame, study_table, tree_budget_table, versus_eagle2_table, write_study_tables)

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
