"""Child program of the batch builder's crash tests: build a batch through a remote controller.

``python batch_child.py HOST PORT KEY CONFIG RAW LOG`` connects to the parent's controller
(``rpc_link``), loads the accepted raw collection pickled in the file ``RAW``, and builds its
batch with a reward hook that appends a line to ``LOG`` each time it runs. It prints
``building`` first and ``built`` at the end; the parent kills it in between.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: rpc_link

from rpc_link import Remote
from straw.rollout.batch import BatchBuilder, default_reward_post_process
from straw.rollout.config import RolloutConfig
from straw.rollout.hooks import Hooks
from straw.rollout.refs import load_groups
from straw.rollout.sample import iter_samples

#: The identity both the child's hook and the parent's stand-in carry (plans compare identities).
HOOK_IDENTITY = "crash_tests.reward_post_process"


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(host: str, port: str, key: str, flags: str, raw_file: str, log_file: str) -> None:
    config = RolloutConfig.from_args(SimpleNamespace(**json.loads(flags)))
    controller = Remote((host, int(port)), bytes.fromhex(key))
    raw = pickle.loads(Path(raw_file).read_bytes())
    samples = [s for group in load_groups(raw) for s in iter_samples(group)]

    def reward(batch: list[Any], config: RolloutConfig) -> tuple[list[float], list[float]]:
        with open(log_file, "a") as log:
            log.write("reward_post_process\n")
        return default_reward_post_process(batch, config)

    hooks = Hooks(reward_post_process=reward, paths={"reward_post_process": HOOK_IDENTITY})
    say("building")
    BatchBuilder(config, controller, hooks=hooks).build(raw, samples, rollout_id=0)  # type: ignore[arg-type]
    say("built")


if __name__ == "__main__":
    main(*sys.argv[1:])
