"""The demo job's engine pieces: the weight board, the synced generator, the fake copy engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from straw.rollout import Sample, SampleStatus
from straw.rollout.demo import task
from straw.rollout.demo.engines import CopyEngine, LoggedReward, SyncedGenerator, WeightBoard

TEXT = "2 3 1"


def group(n: int = 2, base: int = 0) -> list[Sample]:
    return [Sample(index=base + i, group_index=base, prompt=TEXT, label=TEXT) for i in range(n)]


def test_the_board_keeps_the_newest_version_and_refuses_an_older_one() -> None:
    board = WeightBoard()
    assert board.current() == (0, None)
    board.post(3, None)
    assert board.current() == (3, None)
    with pytest.raises(ValueError, match="Weight version 2 is older than 3"):
        board.post(2, None)
    assert board.current() == (3, None)


class _Ref:
    """Stands in for a DiskPayloadRef: ``load()`` answers the weights and counts the reads."""

    def __init__(self, weights: dict[str, Any]) -> None:
        self.weights, self.loads = weights, 0

    def load(self) -> dict[str, Any]:
        self.loads += 1
        return self.weights


def test_a_synced_generator_loads_each_posted_version_once_before_generating() -> None:
    board = WeightBoard(-1)
    engine = CopyEngine(token_seconds=0)
    installed: list[tuple[dict[str, Any], str]] = []

    def load(weights: dict[str, Any], version: str) -> None:
        installed.append((weights, version))
        engine.load(weights, version)

    synced = SyncedGenerator(engine, board.current, load, version=-1)
    first = _Ref({"w": 1})
    board.post(0, first)  # type: ignore[arg-type]

    async def main() -> list[list[Sample]]:
        out = [await synced(group(base=0), weight_version="ignored")]
        out.append(await synced(group(base=2), weight_version=None))  # same version: no reload
        board.post(1, _Ref({"w": 2}))  # type: ignore[arg-type]
        out.append(await synced(group(base=4), weight_version=None))
        return out

    done = asyncio.run(main())
    assert installed == [({"w": 1}, "0"), ({"w": 2}, "1")] and first.loads == 1 and synced.loads == 2
    assert [s.weight_versions for s in done[0]] == [["0"], ["0"]]
    assert [s.weight_versions for s in done[2]] == [["1"], ["1"]]


def test_the_copy_engine_answers_with_rule_rewards_routes_and_keeps_partials_on_abort() -> None:
    calls: list[int] = []

    def reward(sample: Sample) -> float:
        calls.append(sample.index or 0)
        if len(calls) == 1:
            engine.abort()  # the first finished sample aborts the rest of the group
        return LoggedReward(None)(sample)

    engine = CopyEngine(token_seconds=0.001, reward=reward)

    async def main() -> tuple[list[Sample], list[Sample]]:
        partial = await engine(group(), weight_version="4")
        statuses = [s.status for s in partial]
        finished = await engine(partial, weight_version="5")
        return statuses, finished

    statuses, finished = asyncio.run(main())
    assert statuses == [SampleStatus.COMPLETED, SampleStatus.ABORTED]
    assert calls == [0, 1]  # the finished sample is not rewarded again
    for sample in finished:
        assert sample.status is SampleStatus.COMPLETED
        response = sample.tokens[len(sample.tokens) - sample.response_length :]
        assert sample.reward == task.reward(response, TEXT)
        assert sample.rollout_routed_experts.shape == (len(sample.tokens) - 1, 2, 2)
        assert len(sample.rollout_log_probs) == sample.response_length
    assert finished[0].weight_versions == ["4"] and finished[1].weight_versions[-1] == "5"


def test_the_logged_reward_stamps_each_call_and_logs_its_task(tmp_path: Path) -> None:
    log = tmp_path / "rewards.log"
    reward = LoggedReward(str(log))
    sample = Sample(index=7, label=TEXT, tokens=[*task.encode_prompt(TEXT), 2, 3, 1, task.EOS])
    sample.response_length = 4
    sample._queue_lease = {"task_id": "prompt:3"}  # type: ignore[attr-defined]
    assert reward(sample) == 1.0
    call = sample.metadata["reward_call"]
    assert json.loads(log.read_text()) == {"call": call, "task": "prompt:3", "index": 7}
    assert LoggedReward(None)(sample) == 1.0 and sample.metadata["reward_call"] == call  # no log: no stamp
