"""Durable JSON reports (API.md section 1): ``write_report(path, value)``.

The file appears atomically, complete and durable, through the single durable
publish path of ``straw._fs`` (docs/DURABILITY.md step D0).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ._fs import durable, posix
from .protocol import encode

__all__ = ["write_report"]


def write_report(path: str | os.PathLike[str], value: Any) -> Path:
    """Write ``value`` as canonical JSON to ``path`` atomically and durably; returns the path."""
    target = Path(os.path.abspath(os.fspath(path)))
    data = encode(value) + b"\n"
    try:
        durable.replace_file(str(target), [data], posix.sync_file, posix.sync_dir)
    except OSError as error:
        raise posix.storage_error(error, f"writing report {target}") from error
    return target
