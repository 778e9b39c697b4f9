"""Compression methods: one file each, registered by name, composed by spec strings.

Every module of this package is imported here, so a new method file registers itself.
"""

import importlib
import pkgutil

from kvopt.methods.base import Method, available, get, register
from kvopt.methods.spec import canonical_spec, parse, spec_text

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Method", "available", "canonical_spec", "get", "parse", "register", "spec_text"]
