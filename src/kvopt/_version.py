"""The package version, in a module of its own: code inside kvopt names it without importing the package's
public face (``kvopt/__init__``, which imports nearly everything)."""

__version__ = "0.1.0"
