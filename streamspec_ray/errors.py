"""Errors users see as one clear line (the CLI prints `error: <message>` and exits non-zero)."""


class StreamspecError(Exception):
    """Base class: anything the user can fix (bad input, bad store, bad flag)."""


def describe(e: BaseException) -> str:
    """One line for an error that ends a request: a StreamspecError's own message; anything else (a bug, a
    torch error) with its type, which its message alone often does not say."""
    return str(e) if isinstance(e, StreamspecError) else f"{type(e).__name__}: {e}"


class StoreError(StreamspecError):
    """A store is missing, truncated, corrupt or of an unknown architecture."""


class ConfigError(StreamspecError):
    """A model config or a flag value that cannot be run."""


class SamplingError(StreamspecError):
    """A distribution that cannot be sampled (NaN or inf logits): it ends that sequence alone."""


class TokenizerMismatch(StreamspecError):
    """Draft and target do not share a vocabulary."""

# `extra=STATUS` on a log call marks a line that says what is being done (loading, converting, building a draft):
# the CLI shows those on a terminal (or with --debug) and leaves them out when stderr goes to a file or a pipe,
# where the result line, warnings and errors are what is read.
STATUS = {"status": True}
