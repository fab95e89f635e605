"""The error types every layer raises for what the user must act on; the CLI prints them without a traceback."""


class ConfigError(ValueError):
    """A setting the user must change. The message names the flag; the trainer prints it without a traceback."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read (damaged, incomplete, unwritable); the message names the file."""
