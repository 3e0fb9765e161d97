"""The accepted-results log (``straw._queue.commits.CommitLog``): packed rows read lazily.

A snapshot's log must come back receipt for receipt, whether a receipt was loaded as a
row or appended since, and the packed form must not depend on when it was loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from straw._queue.commits import CommitLog
from straw.protocol import CommitReceipt, decode, encode

RUN = "run-commits"
PACK_A = f"raw/{'a' * 32}/{'1' * 32}.pack"
PACK_B = f"raw/{'b' * 32}/{'2' * 32}.seg"


def receipt(position: int, path: str = PACK_A, offset: int = 64, **segment: Any) -> dict[str, Any]:
    digest = f"{position:064x}"
    seg = {
        "run_id": RUN,
        "path": path,
        "segment_id": path.rsplit("/", 1)[1].split(".")[0],
        "size": 300 + offset,  # an extent (path, offset) always has one size and checksum
        "checksum": f"{offset:032x}",
        "version": 1,
        "checksum_algorithm": "xxh3-128",
        "offset": offset,
    }
    seg.update(segment)
    return {
        "commit_id": f"c{position}",
        "task_id": f"t{position}",
        "submission_id": f"s{position}",
        "digest": digest,
        "position": position,
        "result_ref": {
            "manifest": {"segment": seg, "ordinal": position % 3},
            "digest": digest if position % 2 else "f" * 64,
            "records": 1 + position,
            "payload_bytes": 10 * position,
            "tokens": position,
        },
    }


def receipts() -> list[dict[str, Any]]:
    return [
        receipt(0),
        receipt(1, offset=400),
        receipt(2, offset=400),  # shares receipt 1's extent
        receipt(3, path=PACK_B),
        receipt(4, offset=800, run_id="another-run"),  # fields the queue does not imply are kept
        receipt(5, offset=1200, segment_id="not-the-stem", version=2, checksum_algorithm="blake3"),
    ]


def log_of(items: list[dict[str, Any]]) -> CommitLog:
    log = CommitLog(RUN)
    for item in items:
        log.append(item)
    return log


def reload(log: CommitLog) -> CommitLog:
    return CommitLog.unpack(decode(encode(log.pack(RUN))), RUN)


def test_a_loaded_log_gives_back_every_receipt_as_accepted() -> None:
    items = receipts()
    loaded = reload(log_of(items))
    assert len(loaded) == len(items)
    assert list(loaded) == items
    assert loaded[2:5] == items[2:5] and loaded[-1] == items[-1]
    assert loaded.submissions() == {f"s{p}": p for p in range(len(items))}
    assert [loaded.result_path(p) for p in range(len(items))] == [
        r["result_ref"]["manifest"]["segment"]["path"] for r in items
    ]
    with pytest.raises(IndexError):
        loaded[len(items)]


def test_segments_and_paths_are_stored_once_and_defaults_are_implied() -> None:
    packed = log_of(receipts()).pack(RUN)
    assert packed["paths"] == [PACK_A, PACK_B]
    assert len(packed["segments"]) == 5  # receipts 1 and 2 share one extent
    assert packed["segments"][0] == [0, 364, f"{64:032x}", 64]
    assert packed["segments"][3][-1] == {"run_id": "another-run"}
    assert packed["segments"][4][-1] == {
        "segment_id": "not-the-stem",
        "version": 2,
        "checksum_algorithm": "blake3",
    }


def test_appending_after_a_load_packs_like_one_log_built_at_once() -> None:
    items = receipts()
    more = [receipt(6, offset=400), receipt(7, path=PACK_B, offset=900)]  # 6 shares a loaded extent
    for position, item in enumerate(more, start=len(items)):
        item["position"] = position
    loaded = reload(log_of(items))
    for item in more:
        loaded.append(item)
    assert loaded.pack(RUN) == log_of(items + more).pack(RUN)
    everything = items + more
    for window in (slice(4, 8), slice(6, 8), slice(7, 3), slice(0, 8, 3), slice(-3, None)):
        assert loaded[window] == everything[window], window
    assert list(reload(loaded)) == items + more
    assert loaded.submissions()["s7"] == 7 and loaded.result_path(7) == PACK_B


def test_receipt_objects_are_the_receipts_as_read_back_from_the_journal() -> None:
    items = receipts()
    more = [receipt(6, offset=400), receipt(7, path=PACK_B, offset=900)]
    odd = receipt(8, offset=1600)
    odd["result_ref"]["manifest"]["extra"] = 1  # a shape the flat form does not keep: stored as is
    loaded = reload(log_of(items))
    for item in [*more, odd]:
        loaded.append(item)
    everything = [*items, *more, odd]
    for start, stop in ((0, 9), (2, 7), (6, 9), (7, 8), (8, 30), (9, 12), (5, 5)):
        got = loaded.receipts(start, stop)
        expected = [CommitReceipt.from_journal(r) for r in everything[start:stop]]
        assert got == expected, (start, stop)
        assert [dataclasses.asdict(r) for r in got] == [dataclasses.asdict(r) for r in expected]
    fresh = log_of(everything)  # nothing loaded: every receipt from the flat form (or kept dict)
    assert fresh.receipts(0, 9) == [CommitReceipt.from_journal(r) for r in everything]
