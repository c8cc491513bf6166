"""Errors users see as one clear line (the CLI prints `error: <message>` and exits non-zero)."""


class StreamspecError(Exception):
    """Base class: anything the user can fix (bad input, bad store, bad flag)."""


class StoreError(StreamspecError):
    """A store is missing, truncated, corrupt or of an unknown architecture."""


class ConfigError(StreamspecError):
    """A model config or a flag value that cannot be run."""


class TokenizerMismatch(StreamspecError):
    """Draft and target do not share a vocabulary."""
