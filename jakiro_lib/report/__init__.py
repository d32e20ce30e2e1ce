"""Stage 03's side: figures, the report's front page and the papermill pipeline."""
