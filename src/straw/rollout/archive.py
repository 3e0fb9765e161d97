"""Debug rollout archives: binding a replay to the pool and run of its archive.

An archive index ``<name>.straw.json`` names the pool and run that hold an archived rollout
(docs/ROLLOUT.md, "Replays"). A train-only replay of such archives must use that pool and
run, whatever the flags say; :func:`bind_archive_pool` finds the index a replay template
names and returns the configuration bound to it.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from typing import Any

from .config import RolloutConfig, check_debug_template

__all__ = ["ARCHIVE_FORMAT", "ARCHIVE_VERSION", "bind_archive_pool", "read_archive_index"]

ARCHIVE_FORMAT = "straw.rollout-archive"
ARCHIVE_VERSION = 1
#: An archive index is a small JSON document; anything larger is not one.
ARCHIVE_INDEX_BYTES_MAX = 1 << 20
_FIELD = re.compile(r"\{rollout_id[^}]*\}")


def read_archive_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed index of an archive; ``ValueError`` when it is not a version 1 archive index."""
    where = os.fspath(path)
    problem = f"Unsupported straw rollout archive: {where}"
    with open(where, "rb") as handle:
        data = handle.read(ARCHIVE_INDEX_BYTES_MAX + 1)
    if len(data) > ARCHIVE_INDEX_BYTES_MAX:
        raise ValueError(problem)
    try:
        index = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ValueError(problem) from None
    if (
        not isinstance(index, dict)
        or index.get("format") != ARCHIVE_FORMAT
        or index.get("version") != ARCHIVE_VERSION
    ):
        raise ValueError(problem)
    root, run_id = index.get("root"), index.get("run_id")
    if not isinstance(root, str) or not os.path.isabs(root) or not isinstance(run_id, str) or not run_id:
        raise ValueError(problem)
    return index


def bind_archive_pool(config: RolloutConfig) -> RolloutConfig:
    """``config`` bound to the pool and run of the archive its replay template names.

    The template is formatted with ``--start-rollout-id`` when set; otherwise its field is
    globbed and the first match in sorted order is read. The flags' pool and run are
    overridden; the argument is never changed.
    """
    template = config.load_debug_rollout_data
    if template is None or not template.endswith(".straw.json"):
        raise ValueError("bind_archive_pool needs a --load-debug-rollout-data template ending in .straw.json")
    check_debug_template(template)
    if config.start_rollout_id is not None:
        path = os.path.expanduser(template.format(rollout_id=config.start_rollout_id))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No Straw rollout archive matches {template}")
    else:
        pattern = _FIELD.sub("*", glob.escape(template))
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise FileNotFoundError(f"No Straw rollout archive matches {template}")
        path = matches[0]
    index = read_archive_index(path)
    return dataclasses.replace(
        config, rollout_data_dir=os.path.abspath(index["root"]), rollout_queue_run_id=index["run_id"]
    )
