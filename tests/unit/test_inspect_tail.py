"""straw.inspect.inspect_run counts bytes written after a closed journal's end zeros as its
incomplete tail (J7: a closed segment ends in zeros), and repairs nothing."""

from __future__ import annotations

from pathlib import Path

from straw import Coordinator, SharedFilesystemStore, TaskSpec


def test_bytes_appended_to_a_closed_journal_are_its_incomplete_tail(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    from straw.inspect import inspect_run

    store = SharedFilesystemStore(pool, "tail")
    queue = Coordinator(store, exclusive_owner="tail test")
    queue.submit_tasks("s", [TaskSpec("a")])
    queue.close()
    store.close()
    journal = Path(queue.journal.path)  # the segment a reopen would continue
    assert inspect_run(pool)["incomplete_journal_tail_bytes"] == 0
    with journal.open("ab") as stream:
        stream.write(b"abcde")
    before = journal.read_bytes()
    report = inspect_run(pool)
    assert report["incomplete_journal_tail_bytes"] == 5 and not report["deletion_allowed"]
    assert journal.read_bytes() == before  # inspecting repairs nothing
