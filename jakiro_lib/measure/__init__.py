"""Stage 02's side: the method registry, the benchmark loop, cost model, tree budgets, goals, GPU checks."""
