"""The two networks: the frozen target (loading, CPU kernels) and the draft head."""
