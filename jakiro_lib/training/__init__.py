"""Stage 01's side: draft training, checkpoints, the main job's sizing and the pipeline's throughput."""
