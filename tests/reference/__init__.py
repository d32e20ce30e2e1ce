"""The loop engine: the algorithm written plainly, node by node, as the readable reference the engine is tested
against (greedy identity, the sampling law); not on the runtime path (docs/DESIGN.md section 12)."""
