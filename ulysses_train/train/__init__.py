"""The run: configuration (and the field's names for it), DeepSpeed config, the trainer, the loop, checkpoints,
faults, metrics, --verify, and the Python API (api.py)."""
