"""The run: configuration, DeepSpeed config, the trainer, the loop, checkpoints, faults, metrics, --verify."""
