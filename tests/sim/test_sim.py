"""The seeded simulation (tests/sim/workload.py): a few seeds in `make test`, many in `make sim`.

``STRAW_SIM_SEEDS=N`` runs N more seeds from ``STRAW_SIM_BASE`` (default 1000; marked slow;
``make sim SEEDS=N BASE=B``), and
``STRAW_SIM_SEED=S`` replays exactly one seed; a failing seed prints that command.
"""

from __future__ import annotations

import os

import pytest

from sim.workload import Simulation

QUICK_SEEDS = tuple(range(1, 13))
MANY = int(os.environ.get("STRAW_SIM_SEEDS", "0") or 0)
MANY_BASE = int(os.environ.get("STRAW_SIM_BASE", "1000") or 1000)
REPLAY = os.environ.get("STRAW_SIM_SEED")


def _seeds() -> tuple[int, ...]:
    """One seed to replay, or the quick seeds of `make test` plus N more for `make sim`."""
    if REPLAY is not None:
        return (int(REPLAY),)
    return QUICK_SEEDS


@pytest.mark.parametrize("seed", _seeds())
def test_sim_acknowledged_data_survives_power_loss(seed: int) -> None:
    Simulation(seed).run()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(MANY_BASE, MANY_BASE + MANY) if REPLAY is None else ())
def test_sim_many_seeds(seed: int) -> None:
    Simulation(seed).run()


@pytest.mark.parametrize("seed", [3, 37])
def test_sim_with_sticky_sync_errors(seed: int) -> None:
    """Regression seeds for A3 (sticky sync errors), kept even if the default model changes.

    Seed 3 once failed: a journal sync failed, the coordinator was reopened in the same boot
    (J4.3 synced the replayed segment, which proves nothing), a power loss reverted the frames
    and the next segment "did not continue the previous segment". Seed 37: the same for the
    catalog log (G3). Fixed by J3.1 and the G3 cut (DURABILITY.md).
    """
    Simulation(seed, sticky=True).run()
