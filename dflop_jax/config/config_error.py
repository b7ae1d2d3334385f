"""The one exception of a bad config. Its own module: the loader and the input checks both raise it,
and neither imports the other for it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem, phrased for the person who wrote the config (always one line)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
