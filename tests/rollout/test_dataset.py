"""straw.rollout.dataset: JSONL prompts, the dataset cursor and the pure PromptProducer."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from straw.rollout.dataset import Dataset, DatasetCursor, JsonlDataset, PromptProducer
from straw.rollout.sample import Sample


def write_jsonl(path: Path, rows: list[Any], *, blank: bool = False) -> Path:
    lines = [json.dumps(row) for row in rows]
    if blank:
        lines.insert(1, "   ")
    path.write_text("\n".join(lines) + "\n")
    return path


class Rows:
    """A plain in-memory dataset (the Protocol needs only len and indexing)."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]


# --------------------------------------------------------------------------- JsonlDataset


def test_jsonl_dataset_reads_filters_and_names_itself(tmp_path: Path) -> None:
    rows = [{"input": f"q{i}", "answer": str(i), "metadata": {"n": i}} for i in range(5)]
    path = write_jsonl(tmp_path / "prompts.jsonl", rows, blank=True)
    data = JsonlDataset(path, label_key="answer", keep=lambda row: row["metadata"]["n"] != 2)
    assert len(data) == 4 and data[2]["input"] == "q3"
    assert isinstance(data, Dataset)
    assert data.identity() == {
        "path": str(path),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "input_key": "input",
        "label_key": "answer",
        "metadata_key": "metadata",
    }
    config = SimpleNamespace(
        prompt_data=str(path), input_key="input", label_key="answer", metadata_key="metadata"
    )
    assert JsonlDataset.from_config(config).identity() == JsonlDataset(path, label_key="answer").identity()


def test_jsonl_dataset_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^No dataset: pass dataset= or --prompt-data$"):
        JsonlDataset.from_config(SimpleNamespace(prompt_data=None))
    with pytest.raises(FileNotFoundError):
        JsonlDataset(tmp_path / "absent.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"input": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object"):
        JsonlDataset(tmp_path / "bad.jsonl")
    write_jsonl(tmp_path / "list.jsonl", [[1, 2]])
    with pytest.raises(ValueError, match=r"list.jsonl:1: a row is a JSON object, got list"):
        JsonlDataset(tmp_path / "list.jsonl")
    write_jsonl(tmp_path / "nokey.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match=r"nokey.jsonl:1: row has no 'input' column"):
        JsonlDataset(tmp_path / "nokey.jsonl")


# --------------------------------------------------------------------------- DatasetCursor


def test_cursor_round_trip_and_checks() -> None:
    cursor = DatasetCursor(2, 5, 40, 160, {"note": [1]})
    assert DatasetCursor.from_dict(json.loads(json.dumps(cursor.asdict()))) == cursor
    for key in ("epoch_id", "sample_offset", "sample_group_index", "sample_index", "metadata"):
        data = cursor.asdict()
        del data[key]
        with pytest.raises(ValueError, match=rf"^Dataset checkpoint is missing {key}$"):
            DatasetCursor.from_dict(data)
    with pytest.raises(ValueError, match="non-negative integer"):
        DatasetCursor(epoch_id=-1)
    with pytest.raises(ValueError, match="non-negative integer"):
        DatasetCursor(sample_index=True)
    with pytest.raises(ValueError, match="metadata must be a dict"):
        DatasetCursor(metadata=[])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a mapping"):
        DatasetCursor.from_dict([1])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- PromptProducer


def prompts_of(groups: list[list[Sample]]) -> list[Any]:
    return [group[0].prompt for group in groups]


def test_draw_numbers_groups_and_samples_globally() -> None:
    producer = PromptProducer(Rows([{"input": f"p{i}", "metadata": {"i": i}} for i in range(3)]),
                              n_samples_per_prompt=2, shuffle=False, seed=0)  # fmt: skip
    groups, cursor = producer.draw(4, DatasetCursor())
    assert prompts_of(groups) == ["p0", "p1", "p2", "p0"]
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [g[0].group_index for g in groups] == [0, 1, 2, 3] and all(
        g[1].group_index == g[0].group_index for g in groups
    )
    assert cursor == DatasetCursor(epoch_id=1, sample_offset=1, sample_group_index=4, sample_index=8)
    assert groups[0][0] is not groups[0][1] and groups[0][0].metadata is not groups[0][1].metadata
    groups[0][0].metadata["i"] = 99
    assert groups[0][1].metadata == {"i": 0}
    more, after = producer.draw(2, cursor)
    assert prompts_of(more) == ["p1", "p2"] and after == DatasetCursor(2, 0, 6, 12)
    assert producer.draw(0, after) == ([], after)


def test_draw_is_pure_and_resumable() -> None:
    producer = PromptProducer(
        Rows([{"input": i} for i in range(7)]), n_samples_per_prompt=3, shuffle=True, seed=11
    )
    cursor = DatasetCursor(metadata={"kept": True})
    whole, end = producer.draw(20, cursor)
    pieces, at = [], cursor
    for count in (3, 0, 9, 8):
        groups, at = producer.draw(count, at)
        pieces += groups
    assert at == end and [[(s.prompt, s.index, s.group_index) for s in g] for g in pieces] == [
        [(s.prompt, s.index, s.group_index) for s in g] for g in whole
    ]
    assert end.metadata == {"kept": True}
    again, _ = PromptProducer(
        Rows([{"input": i} for i in range(7)]), n_samples_per_prompt=3, shuffle=True, seed=11
    ).draw(20, cursor)
    assert prompts_of(again) == prompts_of(whole)


def test_shuffle_order_is_random_random_of_seed_plus_epoch() -> None:
    size, seed = 10, 42
    producer = PromptProducer(
        Rows([{"input": i} for i in range(size)]), n_samples_per_prompt=1, shuffle=True, seed=seed
    )
    groups, _ = producer.draw(3 * size, DatasetCursor())
    expected = []
    for epoch in range(3):
        order = list(range(size))
        random.Random(seed + epoch).shuffle(order)
        expected += order
    assert prompts_of(groups) == expected
    assert prompts_of(groups[:size]) != prompts_of(groups[size : 2 * size])  # reshuffled per epoch
    assert sorted(prompts_of(groups[:size])) == list(range(size))


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 6),
    n=st.integers(1, 3),
    counts=st.lists(st.integers(0, 9), max_size=6),
    shuffle=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_every_group_index_is_issued_once_in_order(
    size: int, n: int, counts: list[int], shuffle: bool, seed: int
) -> None:
    producer = PromptProducer(
        Rows([{"input": i} for i in range(size)]), n_samples_per_prompt=n, shuffle=shuffle, seed=seed
    )
    cursor, issued = DatasetCursor(), []
    for count in counts:
        groups, cursor = producer.draw(count, cursor)
        issued += groups
    total = sum(counts)
    assert [g[0].group_index for g in issued] == list(range(total))
    assert [s.index for g in issued for s in g] == list(range(total * n))
    assert cursor.sample_group_index == total and cursor.sample_index == total * n
    assert cursor.epoch_id * size + cursor.sample_offset == total
    for epoch in range(total // size):  # every full epoch visits every row once
        assert sorted(prompts_of(issued[epoch * size : (epoch + 1) * size])) == list(range(size))


def test_rows_become_samples() -> None:
    template = Sample(prompt=[{"role": "user", "content": "hi"}], label="L")
    producer = PromptProducer(
        Rows([{"q": "a", "ans": "x", "meta": {"k": 1}}, {"q": "b"}, template]),
        n_samples_per_prompt=1, shuffle=False, seed=0, input_key="q", label_key="ans", metadata_key="meta",
    )  # fmt: skip
    groups, _ = producer.draw(3, DatasetCursor())
    a, b, c = (g[0] for g in groups)
    assert (a.prompt, a.label, a.metadata) == ("a", "x", {"k": 1})
    assert (b.prompt, b.label, b.metadata) == ("b", None, {})
    assert c.prompt == template.prompt and c is not template and c.index == 2 and template.index is None


def test_group_members_are_deep_copies_independent_of_each_other_and_of_the_row() -> None:
    row = {"q": [{"role": "user", "content": "hi"}], "ans": {"x": [1]}, "meta": {"k": [1, 2]}}
    template = Sample(prompt=[{"role": "user", "content": "t"}], metadata={"m": [0]}, tokens=[5])
    producer = PromptProducer(
        Rows([row, template]), n_samples_per_prompt=3, shuffle=False, seed=0,
        input_key="q", label_key="ans", metadata_key="meta",
    )  # fmt: skip
    (first, second), _ = producer.draw(2, DatasetCursor())
    for group, source in ((first, producer.prompt(row)), (second, template)):
        for sample in group:  # each member is what a deep copy of the prompt gives, numbered
            expected = copy.deepcopy(source)
            expected.group_index, expected.index = sample.group_index, sample.index
            assert dataclasses.asdict(sample) == dataclasses.asdict(expected)
        group[0].prompt[0]["content"] = "changed"
        group[0].metadata.setdefault("m", [0]).append(9)
        group[0].tokens.append(7)
        assert all(s.prompt[0]["content"] != "changed" for s in group[1:])
        assert all(s.metadata.get("m", [0]) == [0] and s.tokens == source.tokens for s in group[1:])
    assert row == {"q": [{"role": "user", "content": "hi"}], "ans": {"x": [1]}, "meta": {"k": [1, 2]}}
    assert first[1].label is not first[2].label and first[1].label == {"x": [1]}
    assert template.prompt[0]["content"] == "t" and template.tokens == [5]


def test_producer_takes_column_names_from_a_jsonl_dataset(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "q", "gold": "g", "extra": {"e": 1}}])
    data = JsonlDataset(path, input_key="question", label_key="gold", metadata_key="extra")
    (group,), _ = PromptProducer(data, n_samples_per_prompt=1, shuffle=False, seed=0).draw(1, DatasetCursor())
    assert (group[0].prompt, group[0].label, group[0].metadata) == ("q", "g", {"e": 1})


def test_producer_bad_input() -> None:
    rows = Rows([{"input": 1}])
    with pytest.raises(ValueError, match=r"^Queue rollout dataset is empty after filtering$"):
        PromptProducer(Rows([]), n_samples_per_prompt=1, shuffle=False, seed=0).draw(1, DatasetCursor())
    with pytest.raises(ValueError, match="n_samples_per_prompt must be a positive integer"):
        PromptProducer(rows, n_samples_per_prompt=0, shuffle=False, seed=0)
    with pytest.raises(ValueError, match="seed must be an integer"):
        PromptProducer(rows, n_samples_per_prompt=1, shuffle=False, seed="1")  # type: ignore[arg-type]
    producer = PromptProducer(rows, n_samples_per_prompt=1, shuffle=False, seed=0)
    with pytest.raises(ValueError, match="count must be a non-negative integer"):
        producer.draw(-1, DatasetCursor())
    with pytest.raises(TypeError, match="takes a DatasetCursor"):
        producer.draw(1, {"epoch_id": 0})  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="no 'input' column"):
        PromptProducer(Rows([{"other": 1}]), n_samples_per_prompt=1, shuffle=False, seed=0).draw(
            1, DatasetCursor()
        )
    with pytest.raises(TypeError, match="mapping or a Sample"):
        PromptProducer(Rows([3]), n_samples_per_prompt=1, shuffle=False, seed=0).draw(1, DatasetCursor())
