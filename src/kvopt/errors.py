"""User-facing errors.

Every mistake a user can make (bad spec, bad path, too-long prompt) raises a subclass of
:class:`KVOptError`, itself a ``ValueError``, whose message names the problem *and* the fix.
The CLI turns these into a one-line message and exit code 2, never a traceback.
"""

from __future__ import annotations


class KVOptError(ValueError):
    """Base class of errors caused by user input."""


class UnknownMethodError(KVOptError):
    """A method name in a spec string is not registered."""


class MethodParameterError(KVOptError):
    """A method parameter is unknown, malformed or out of range."""


class ModelNotFoundError(KVOptError):
    """A model path or name cannot be resolved to local weights."""


class DefaultModelMissingError(ModelNotFoundError):
    """The package that ships the default model is not installed."""


class ModelFileError(ModelNotFoundError):
    """A model file or folder exists but cannot be used (not a GGUF, truncated, no weights, unknown architecture)."""


class ModelShapeError(KVOptError):
    """A model shape (layers, heads, head dimension) that no model can have."""


class ContextTooLongError(KVOptError):
    """A prompt (plus the tokens to generate) exceeds what the model supports."""


class CacheUsageError(KVOptError):
    """A kvopt cache is used in a way it cannot serve correctly."""


class DeviceError(KVOptError):
    """A device name torch does not know, or a device this machine does not have."""
