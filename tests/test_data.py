"""Prompt datasets (every reader and every designed error) and the resumable prompt sampler."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from klgrpo.core.data import PromptDataset, PromptSampler, load_prompts
from klgrpo.errors import ConfigError, DataError, KLGRPOError


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]


# ---------------------------------------------------------------------------------------------- readers

def test_jsonl_rows_columns_mapping_and_chat(tmp_path):
    path = tmp_path / "p.jsonl"
    # A blank line is skipped; "x" is absent from row 2 and becomes None there.
    path.write_text(json.dumps({"prompt": "1+1=", "solution": "2", "x": 7}) + "\n\n"
                    + json.dumps({"prompt": CHAT, "solution": "4"}) + "\n")
    ds = load_prompts(str(path), columns={"answer": "solution"})
    assert isinstance(ds, PromptDataset)
    assert len(ds) == 2
    assert ds.source == str(path)
    assert ds.prompts == ["1+1=", CHAT]
    assert ds.columns == {"x": [7, None], "answer": ["2", "4"]}  # solution handed over as answer only
    assert ds[0] == {"prompt": "1+1=", "x": 7, "answer": "2"}
    assert ds[1]["prompt"] == CHAT
    prompts, columns = ds.batch([1, 0, 1])
    assert prompts == [CHAT, "1+1=", CHAT]
    assert columns == {"x": [None, 7, None], "answer": ["4", "2", "4"]}


def test_prompt_column_and_limit(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": f"q{i}", "answer": i} for i in range(5)])
    ds = load_prompts(str(path), prompt_column="question", limit=3)
    assert ds.prompts == ["q0", "q1", "q2"]
    assert ds.columns == {"answer": [0, 1, 2]}


def test_mapping_wins_over_a_same_named_column(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "p", "answer": "old", "gold": "new"}])
    ds = load_prompts(str(path), columns={"answer": "gold"})
    assert ds.columns == {"answer": ["new"]}


def test_columns_prompt_entry_is_the_prompt_column(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"question": "p", "answer": 1}])
    assert load_prompts(str(path), columns={"prompt": "question"}).prompts == ["p"]
    with pytest.raises(ConfigError, match="data.prompt_column"):
        load_prompts(str(path), prompt_column="other", columns={"prompt": "question"})


def test_json_list_column_dict_and_jsonlines_saved_as_json(tmp_path):
    records = [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps(records))
    as_columns = tmp_path / "cols.json"
    as_columns.write_text(json.dumps({"prompt": ["a", "b"], "answer": [1, 2]}))
    as_lines = write_jsonl(tmp_path / "lines.json", records)
    for path in (as_list, as_columns, as_lines):
        ds = load_prompts(str(path))
        assert ds.prompts == ["a", "b"] and ds.columns == {"answer": [1, 2]}, path


def test_csv_with_bom_and_quoted_commas(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text('\ufeffquestion,answer\n"what is 1,000 + 1?",1001\nhi,3\n', encoding="utf-8")
    ds = load_prompts(str(path), prompt_column="question")
    assert ds.prompts == ["what is 1,000 + 1?", "hi"]
    assert ds.columns == {"answer": ["1001", "3"]}  # CSV values stay strings


def test_parquet_roundtrip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [1, 2]}), path)
    ds = load_prompts(str(path), limit=1)
    assert ds.prompts == ["a"] and ds.columns == {"answer": [1]}


def test_parquet_without_pyarrow_names_the_pip_command(tmp_path, monkeypatch):
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r'pip install "klgrpo\[data\]"') as info:
        load_prompts(str(path))
    assert str(path) in str(info.value)


def test_hub_name_without_datasets_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r'pip install "klgrpo\[data\]"') as info:
        load_prompts("someone/some-dataset")
    assert "someone/some-dataset" in str(info.value)
    with pytest.raises(DataError, match=r'pip install "klgrpo\[data\]"'):
        load_prompts(str(tmp_path))  # a local dataset folder needs datasets too


class _FakeDataset:
    def __init__(self, columns):
        self._columns = columns

    def __len__(self):
        return len(next(iter(self._columns.values())))

    def select(self, indices):
        return _FakeDataset({k: [v[i] for i in indices] for k, v in self._columns.items()})

    def to_dict(self):
        return self._columns


def test_hub_dataset_through_datasets_library(monkeypatch):
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        if name == "missing/ds":
            raise FileNotFoundError("Dataset 'missing/ds' doesn't exist on the Hub")
        return _FakeDataset({"question": ["q1", "q2", "q3"], "answer": ["#### 1", "#### 2", "#### 3"]})

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    ds = load_prompts("openai/gsm8k:main", prompt_column="question", split="test", limit=2)
    assert calls == [("openai/gsm8k", "main", "test")]
    assert ds.prompts == ["q1", "q2"] and ds.columns == {"answer": ["#### 1", "#### 2"]}
    with pytest.raises(DataError, match=r"cannot load dataset 'missing/ds' split 'train' .*doesn't exist"):
        load_prompts("missing/ds")


# ---------------------------------------------------------------------------------------------- errors

def _error(tmp_path, name, text, **kwargs) -> str:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as info:
        load_prompts(str(path), **kwargs)
    message = str(info.value)
    assert str(path) in message, message  # every file error names the file
    assert "\n" not in message
    return message


def test_error_file_not_found(tmp_path):
    with pytest.raises(DataError, match=r"prompt file .*nope\.jsonl not found.*data\.source"):
        load_prompts(str(tmp_path / "nope.jsonl"))


def test_error_invalid_json_line_names_the_line(tmp_path):
    message = _error(tmp_path, "bad.jsonl", '{"prompt": "a"}\n\n{"prompt": "b",\n')
    assert "line 3 is not valid JSON" in message and "fix or remove that line" in message


def test_error_invalid_pretty_printed_json_object_reports_the_document_error(tmp_path):
    message = _error(tmp_path, "cols.json", '{\n  "prompt": ["a",\n  "answer": [1]\n}\n')
    assert "is not valid JSON" in message and "line 3" in message and "fix the file" in message


def test_error_json_line_not_an_object(tmp_path):
    message = _error(tmp_path, "arr.jsonl", '{"prompt": "a"}\n["b"]\n')
    assert "line 2 holds a JSON array, not an object" in message


def test_error_invalid_json_file(tmp_path):
    message = _error(tmp_path, "bad.json", '[{"prompt": "a"},\n {"prompt": }]')
    assert "is not valid JSON" in message and "line 2" in message


def test_error_missing_prompt_column_lists_columns(tmp_path):
    message = _error(tmp_path, "q.csv", "question,answer\nhi,1\n")
    assert "no column 'prompt'" in message
    assert "'question', 'answer'" in message
    assert "set data.prompt_column" in message


def test_error_row_without_the_prompt_field(tmp_path):
    message = _error(tmp_path, "p.jsonl", '{"prompt": "a"}\n{"other": "b"}\n')
    assert "line 2 has no 'prompt' field" in message


def test_error_mapped_column_missing(tmp_path):
    message = _error(tmp_path, "p.jsonl", '{"prompt": "a", "solution": 1}\n', columns={"answer": "sol"})
    assert "no column 'sol'" in message and "'answer'" in message and "data.columns" in message
    message = _error(tmp_path, "p2.jsonl", '{"prompt": "a", "sol": 1}\n{"prompt": "b"}\n', columns={"answer": "sol"})
    assert "line 2 has no 'sol' field" in message


@pytest.mark.parametrize("prompt, fragment", [
    ("   ", "line 2: the prompt in column 'prompt' is empty"),
    (None, "line 2: the prompt in column 'prompt' is empty"),
    (17, "line 2: the prompt in column 'prompt' is of type int (17)"),
    ([], "line 2: the chat prompt in column 'prompt' has no messages"),
    (["hi"], "line 2: message 1 of the chat prompt in column 'prompt' is 'hi'"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], "line 2: message 2 of the chat prompt"),
    ([{"role": "user", "content": " "}], "line 2: every message of the chat prompt"),
])
def test_error_bad_prompt_names_line_and_column(tmp_path, prompt, fragment):
    text = json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": prompt}) + "\n"
    assert fragment in _error(tmp_path, "p.jsonl", text)


def test_error_empty_prompt_in_csv_names_data_row(tmp_path):
    message = _error(tmp_path, "p.csv", "prompt,answer\na,1\n,2\n")
    assert "row 2: the prompt in column 'prompt' is empty" in message


def test_error_csv_row_with_extra_fields(tmp_path):
    assert "row 1 has more fields than the header's 2" in _error(tmp_path, "p.csv", "prompt,answer\na,1,x\n")


@pytest.mark.parametrize("name, text", [("e.jsonl", ""), ("e2.jsonl", "\n\n"), ("e.csv", "prompt,answer\n"),
                                        ("e.json", "[]")])
def test_error_empty_dataset(tmp_path, name, text):
    assert "contains no rows" in _error(tmp_path, name, text)


def test_error_unsupported_extension(tmp_path):
    message = _error(tmp_path, "p.txt", "hello\n")
    assert "'.txt'" in message and ".jsonl, .json, .csv or .parquet" in message


def test_error_column_reaching_rewards_under_a_reserved_name(tmp_path):
    text = json.dumps({"question": "q", "prompt": "other"}) + "\n"
    message = _error(tmp_path, "p.jsonl", text, prompt_column="question")
    assert "'prompt'" in message and "data.columns" in message
    message = _error(tmp_path, "p2.jsonl", json.dumps({"prompt": "q", "completions": "c"}) + "\n")
    assert "'completions'" in message and "reserved" in message
    ds = load_prompts(str(tmp_path / "p2.jsonl"), columns={"reference": "completions"})  # the suggested fix
    assert ds.columns == {"reference": ["c"]}


def test_bad_limit_is_a_config_error(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    for limit in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="data.limit"):
            load_prompts(str(path), limit=limit)


def test_errors_are_user_facing():
    assert issubclass(DataError, KLGRPOError) and issubclass(ConfigError, KLGRPOError)


# ---------------------------------------------------------------------------------------------- sampler

def _orders(n, seed, epochs):
    return [torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist() for e in range(epochs)]


def test_sampler_epochs_are_seeded_permutations_and_batches_cross_epochs():
    sampler = PromptSampler(dataset_len=5, batch_size=3, seed=11)
    batches = [sampler.next_indices() for _ in range(4)]  # 12 indices: epochs 0 and 1 and 2 of epoch 2
    assert all(len(b) == 3 for b in batches)
    flat = sum(batches, [])
    orders = _orders(5, 11, 3)
    assert flat == orders[0] + orders[1] + orders[2][:2]
    assert all(sorted(o) == list(range(5)) for o in orders)
    assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["position"] == 2


def test_sampler_without_shuffle_and_batch_larger_than_dataset():
    sampler = PromptSampler(3, 7, seed=0, shuffle=False)
    assert sampler.next_indices() == [0, 1, 2, 0, 1, 2, 0]
    assert sampler.next_indices() == [1, 2, 0, 1, 2, 0, 1]


def test_sampler_seeds_differ():
    assert PromptSampler(50, 50, seed=0).next_indices() != PromptSampler(50, 50, seed=1).next_indices()


@pytest.mark.parametrize("steps_before", [0, 1, 2, 3, 5])  # 3 * 5 = 15 ends exactly on an epoch boundary
def test_sampler_resume_matches_uninterrupted(steps_before):
    uninterrupted = PromptSampler(15, 5, seed=3)
    expected = [uninterrupted.next_indices() for _ in range(steps_before + 6)]

    first = PromptSampler(15, 5, seed=3)
    got = [first.next_indices() for _ in range(steps_before)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = PromptSampler(15, 5, seed=3)
    resumed.load_state_dict(state)
    got += [resumed.next_indices() for _ in range(6)]
    assert got == expected


def test_sampler_rejects_bad_sizes_and_foreign_state():
    for batch_size in (0, -2, 1.0, True):
        with pytest.raises(ConfigError, match="batch size"):
            PromptSampler(10, batch_size, seed=0)
    with pytest.raises(ConfigError, match="at least one prompt"):
        PromptSampler(0, 2, seed=0)
    state = PromptSampler(10, 2, seed=0).state_dict()
    with pytest.raises(ConfigError, match="dataset_len=10 but this run has dataset_len=12"):
        PromptSampler(12, 2, seed=0).load_state_dict(state)
    with pytest.raises(ConfigError, match="seed=0 but this run has seed=1"):
        PromptSampler(10, 2, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="does not fit"):
        PromptSampler(10, 2, seed=0).load_state_dict({"epoch": 0, "position": 10})
