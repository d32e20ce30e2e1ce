"""Glue between the library and the study notebooks (and the ``cache``/``train``/``bench`` CLI commands): the notebooks
stay thin, ``from jakiro_lib import study as S`` then one call a step. :mod:`.context` sets up, :mod:`.s00_data`,
:mod:`.s01_train` and :mod:`.s02_bench` run a stage each, :mod:`.tables` and :mod:`.published` make the report's tables
(docs/DESIGN.md section 10). The names below are those the notebooks and their tests call as ``S.<name>``."""
from __future__ import annotations

from ..measure.methods import profile_methods
from ..measure.summary import headline_table
from ..files import write_json, write_table
from .context import SMOKE_BANNER, StudyContext, notebook_setup
from .performance import cycle_cost_table, write_performance_report
from .published import beside_published, comparison_table
from .s00_data import disk_estimates, manifest_table, prepare_features, sample_conversation_html
from .s01_train import (drafts_table, load_training_results, router_load_table, train_all, training_history,
                        write_training_tables)
from .s02_bench import bench_environment, methods_table, run_study
from .tables import (acceptance_by_depth, display_table, load_study_records, records_frame, study_table,
                     tree_budget_table, versus_eagle2_table, write_study_tables)

__all__ = [
    "SMOKE_BANNER", "StudyContext", "acceptance_by_depth", "beside_published", "bench_environment", "comparison_table",
    "cycle_cost_table", "display_table", "disk_estimates", "drafts_table", "headline_table", "load_study_records",
    "load_training_results", "manifest_table", "methods_table", "notebook_setup", "prepare_features",
    "profile_methods", "records_frame", "router_load_table", "run_study", "sample_conversation_html", "study_table",
    "train_all", "training_history", "tree_budget_table", "versus_eagle2_table", "write_json",
    "write_performance_report", "write_study_tables", "write_table", "write_training_tables",
]
