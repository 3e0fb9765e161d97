"""Child program of the rollout controller's process tests: run a job and die where told.

``python controller_child.py hold CONFIG`` starts a controller on the job (``CONFIG`` is the
JSON of the configuration's flags), prints ``ready`` and waits for stdin to close: the parent
kills it. Other commands are documented at :func:`main`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: rollout_helpers

from rollout_helpers import prompt_rows
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController


def config_from(text: str) -> RolloutConfig:
    return RolloutConfig.from_args(SimpleNamespace(**json.loads(text)))


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def hold(config: RolloutConfig) -> None:
    QueueController(config, dataset=prompt_rows(20))
    say("ready")
    sys.stdin.read()


def main(argv: list[str]) -> None:
    command, config = argv[0], config_from(argv[1])
    commands: dict[str, Any] = {"hold": hold}
    commands[command](config, *argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
