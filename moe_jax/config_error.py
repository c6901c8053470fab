"""ConfigError: the one error type of config validation.

Its own module so that the modules config validation calls (the curriculum's
stage parser) can raise it without importing config_validation back.
"""


class ConfigError(ValueError):
  """A config value is outside its allowed range."""
