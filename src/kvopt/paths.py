"""Folders kvopt writes into (results, reports, the model cache): usable, or one clear error.

A path that is a file, or a folder that cannot be created or written, would otherwise fail
with a raw OSError after minutes of work (an evaluation writes its first row late).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvopt.errors import KVOptError


def cache_root() -> Path:
    """``$KVOPT_CACHE`` or ``~/.cache/kvopt`` (``~`` expanded), as it is: for reading what is kept there."""
    return Path(os.environ.get("KVOPT_CACHE") or Path.home() / ".cache" / "kvopt").expanduser()


def writable_folder(path: str | os.PathLike, what: str) -> Path:
    """``path`` (``~`` expanded) as an existing folder this process can write into, created if missing.

    ``what`` names the setting in errors, e.g. ``--out`` or ``KVOPT_CACHE``.
    """
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise KVOptError(f"{what} {folder} is a file, not a folder; pass a folder path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KVOptError(
            f"{what} {folder} cannot be created ({error.strerror}); pass a folder you can write to"
        ) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise KVOptError(f"{what} {folder} is not writable; pass a folder you can write to")
    return folder


def writable_file(path: Path, what: str) -> Path:
    """``path`` inside a :func:`writable_folder`, refusing a folder standing where the file goes."""
    writable_folder(path.parent, what)
    if path.is_dir():
        raise KVOptError(f"{what}: {path} is a folder where kvopt writes a file; move it away")
    if path.exists() and not os.access(path, os.W_OK):
        raise KVOptError(f"{what}: {path} is not writable; pass another folder")
    return path
