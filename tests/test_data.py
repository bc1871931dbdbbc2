"""Bad data is reported at start-up in one sentence naming the row and the field."""

import json

import pytest

from common.data import DataError, load_rows
from common.tiny import tiny_dataset, tiny_reward, tiny_solution


def test_local_jsonl_and_json(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"problem": "a", "answer": "1"}\n\n{"problem": "b", "answer": "2"}\n')
    assert [r["problem"] for r in load_rows(str(p), "train", ["problem", "answer"])] == ["a", "b"]
    q = tmp_path / "d.json"
    q.write_text(json.dumps({"train": [{"problem": "a"}]}))
    assert load_rows(str(q), "train", ["problem"]) == [{"problem": "a"}]
    assert len(load_rows(str(p), "train", ["problem"], limit=1)) == 1


def test_missing_and_empty_fields_name_the_row_and_field(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b"}\n')
    with pytest.raises(DataError, match=r"row 1 is missing field 'answer'"):
        load_rows(str(p), "train", ["problem", "answer"])
    p.write_text('{"problem": "a", "answer": "1"}\n{"problem": " ", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"row 1 has an empty field 'problem'"):
        load_rows(str(p), "train", ["problem", "answer"])


def test_empty_malformed_and_missing_files(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n")
    with pytest.raises(DataError, match="has no rows"):
        load_rows(str(p), "train", ["problem"])
    p.write_text('{"problem": "a"}\n{"problem": \n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        load_rows(str(p), "train", ["problem"])
    with pytest.raises(DataError, match="does not exist"):
        load_rows(str(tmp_path / "nope.json"), "train", ["problem"])


def test_save_to_disk_folder(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"problem": "a", "answer": "1"}])}).save_to_disk(
        str(tmp_path / "ds"))
    assert load_rows(str(tmp_path / "ds"), "train", ["problem", "answer"]) == [{"problem": "a", "answer": "1"}]
    with pytest.raises(DataError, match="splits"):
        load_rows(str(tmp_path / "ds"), "test", ["problem"])


def test_unreachable_hub_dataset_is_one_clear_sentence():
    with pytest.raises(DataError, match=r"could not load dataset 'no-such-org/no-such-set'"):
        load_rows("no-such-org/no-such-set", "train", ["problem"])


def test_tiny_task_splits_and_verifier():
    train, test = tiny_dataset("train"), tiny_dataset("test")
    assert len(test) == 256 and len(train) == 4096
    assert not {p["problem"] for p in train} & {p["problem"] for p in test}
    assert tiny_dataset("test") == test  # fixed
    assert {p["difficulty"] for p in train} == {2, 3, 4, 5, 6}
    p = {"problem": "Add: 33+95+46", "answer": "174"}
    assert tiny_solution([33, 95, 46]) == "33+95=128\n128+46=174\n</think>\n\n\\boxed{174}"
    assert tiny_reward(tiny_solution([33, 95, 46]), p["answer"]) == 1.0
    assert tiny_reward("33+95=128\n128+46=175\n</think>\n\n\\boxed{175}", p["answer"]) == 0.0
    assert tiny_reward("33+95=128\n128+46=174\n\\boxed{174}", p["answer"]) == 0.0  # thinking never closed
    for p in train[:50]:
        numbers = [int(x) for x in p["problem"][5:].split("+")]
        assert tiny_reward(p["solution"], p["answer"]) == 1.0 and sum(numbers) == int(p["answer"])
