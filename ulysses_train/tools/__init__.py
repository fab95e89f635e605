"""The planner, export, the per-position check and the long-range demo."""
