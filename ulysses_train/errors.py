"""The one error type every layer raises for a setting the user must change."""


class ConfigError(ValueError):
    """A setting the user must change. The message names the flag; the trainer prints it without a traceback."""
