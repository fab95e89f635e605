"""The planner, export, the per-position check, the preview and the long-range demo."""
