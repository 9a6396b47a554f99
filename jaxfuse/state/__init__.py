"""Per-worker state: placement on the mesh, checkpoints, relayout, elastic restarts."""
