"""The queue's pause of Python's cycle collector counts overlapping pauses (threads pause at once)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from straw._queue.collector import collector_paused


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_overlapping_pauses_resume_only_when_the_last_ends() -> None:
    gc.enable()
    first, second = collector_paused(), collector_paused()
    first.__enter__()
    second.__enter__()
    # The first pause ends while the second is still on (another thread's page of receipts
    # during the snapshot copy): the collector must stay off.
    first.__exit__(None, None, None)
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()


def test_a_collector_the_application_turned_off_stays_off() -> None:
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_an_error_inside_still_resumes() -> None:
    gc.enable()
    with pytest.raises(ValueError, match="inside"), collector_paused():
        raise ValueError("inside")
    assert gc.isenabled()


def test_threads_pausing_at_once_leave_it_on_afterwards() -> None:
    gc.enable()
    inside = threading.Barrier(4)
    seen: list[bool] = []

    def work() -> None:
        with collector_paused():
            inside.wait(timeout=30)  # all four are paused together here
            seen.append(gc.isenabled())
            inside.wait(timeout=30)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert seen == [False] * 4
    assert gc.isenabled()
