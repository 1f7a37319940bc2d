"""data.py and tasks.load_task on every local source `datasets` can write (save_to_disk directories,
CSV, Parquet), TRL's prompt formats, column mapping, and the Hub's failures as one line.

References: the files are written by `datasets` itself (Dataset.save_to_disk / to_csv / to_parquet) from
records made here, so what a row should become is known independently of the reader.
"""
import json
import os
import subprocess
import sys
import time

import pytest

import data
import tasks
from tasks import Columns, Example, load_task

datasets = pytest.importorskip("datasets")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A Hub-style dataset whose columns are not ours: the prompt is `text`, the gold `target`.
RECORDS = [{"text": f"What is {a} times 3?", "target": str(3 * a), "level": a % 3} for a in range(1, 7)]


def expected(records) -> list[Example]:
    return [Example(r["text"], r["target"], "numeric") for r in records]


def test_saved_dataset_dict_with_column_mapping(tmp_path):
    path = str(tmp_path / "saved")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS[:4]),
                          "test": datasets.Dataset.from_list(RECORDS[4:])}).save_to_disk(path)
    cols = Columns(prompt="text", answer="target")
    train, test = load_task(path, "train", columns=cols), load_task(path, "test", columns=cols)
    assert train == expected(RECORDS[:4]) and test == expected(RECORDS[4:])
    assert train[1].columns == {"target": "6", "level": 2}, "every column but the prompt rides along"
    assert tasks.source_problem(path, "validation", columns=cols) == f"{path} has splits ['train', 'test'], not 'validation'"
    with pytest.raises(tasks.DatasetError, match=r"missing 'answer_text'; the columns are \['level', 'target', 'text'\]"):
        load_task(path, "train", columns=Columns("text", "answer_text"))
    with pytest.raises(tasks.DatasetError, match=r"missing a prompt column .*the columns are \['level', 'target', 'text'\]"):
        load_task(path, "train")


def test_saved_dataset_is_one_split(tmp_path):
    path = str(tmp_path / "one")
    datasets.Dataset.from_list(RECORDS).save_to_disk(path)
    cols = Columns("text", "target")
    assert load_task(path, "train", columns=cols) == load_task(path, "test", columns=cols) == expected(RECORDS)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_csv_and_parquet_files_and_directories(tmp_path, fmt):
    ds = datasets.Dataset.from_list(RECORDS)
    file = str(tmp_path / f"all.{fmt}")
    getattr(ds, f"to_{fmt}")(file)
    cols = Columns("text", "target")
    got = load_task(file, columns=cols, limit=5)
    assert got == expected(RECORDS)[:5]                     # CSV reads `target` back as an int: still "3"
    assert got[0].columns["level"] == 1
    folder = tmp_path / "dir"
    folder.mkdir()
    getattr(datasets.Dataset.from_list(RECORDS[:2]), f"to_{fmt}")(str(folder / f"test.{fmt}"))
    assert load_task(str(folder), "test", columns=cols) == expected(RECORDS[:2])
    assert "holds none of ['train.jsonl'" in tasks.source_problem(str(folder), "train")


def test_trl_prompt_formats_in_jsonl(tmp_path):
    conv = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2 + 2?"}]
    rows = [{"prompt": "1 + 1?", "answer": "2", "source": "a"}, {"prompt": conv, "answer": 4, "source": "b"}]
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain, chat = load_task(str(path))
    assert (plain.prompt, plain.messages, plain.columns) == ("1 + 1?", (), {"answer": "2", "source": "a"})
    assert chat.prompt == conv and chat.question == "2 + 2?" and chat.answer == "4"

    class Plain:  # no chat template: the fallback shows which messages went in
        chat_template = None
    assert tasks.build_prompt(Plain(), chat.prompt, "SYS") == "system: Be terse.\nuser: 2 + 2?\nassistant:"
    assert tasks.conversation(chat.prompt, "SYS") == conv, "a conversation's own system message wins"
    assert tasks.conversation("hi", "SYS") == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"}]
    assert tasks.conversation("hi", "") == [{"role": "user", "content": "hi"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "1"}) + "\n")
    with pytest.raises(tasks.DatasetError, match=r"bad\.jsonl:1: column 'prompt' is a list but not a conversation"):
        load_task(str(bad))


def test_a_dataset_without_answers_loads_for_reward_functions(tmp_path):
    path = tmp_path / "open.jsonl"
    path.write_text(json.dumps({"prompt": "Write a haiku.", "style": "calm"}) + "\n")
    (ex,) = load_task(str(path))
    assert ex.answer is None and ex.kind is None and ex.columns == {"style": "calm"}


def test_sources_refused_before_reading(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    assert "unknown file type '.txt'" in tasks.source_problem(str(tmp_path / "x.txt"), "train")
    assert "unknown task" in tasks.source_problem("no/such/file.jsonl", "train")
    assert tasks.source_problem("openai/gsm8k", "train") is None          # a Hub id: known only when read
    assert "built in" in tasks.source_problem("addition", "train", columns=Columns(prompt="q"))
    assert "--dataset-config is for Hub datasets" in tasks.source_problem(str(tmp_path / "x.txt"), "train", "main")


def test_unreachable_hub_fails_fast_with_the_fix(monkeypatch):
    """A Hub that does not answer: one error within the probe's timeout, not datasets' retry loop."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")            # the discard port: refused at once
    t0 = time.monotonic()
    with pytest.raises(tasks.DatasetError) as e:
        load_task("someorg/some-dataset", "train")
    assert time.monotonic() - t0 < data.HUB_PROBE_TIMEOUT_S + 1
    msg = str(e.value)
    assert "cannot be reached" in msg and "HF_HUB_OFFLINE=1" in msg and "local file or directory" in msg, msg


def test_offline_unknown_hub_dataset_is_one_line_naming_the_fix(tmp_path):
    """train.py with HF_HUB_OFFLINE=1 and a Hub dataset that is not cached: exit 1, one line, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "train.py", "--model", "someorg/some-model", "--dataset", "someorg/not-cached",
                          "--output-dir", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: --dataset: someorg/not-cached is not in the local cache and HF_HUB_OFFLINE=1")
    assert "pass a local file or directory" in lines[0]
    assert time.monotonic() - t0 < 60
