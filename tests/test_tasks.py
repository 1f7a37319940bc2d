"""tasks.py: loading (JSONL, directories, the Hub names, addition), its errors, the prompts, and the
gold data scoring itself through rewards.reward."""
import json
import os

import pytest

import tasks
from rewards import RewardStats, gsm8k_flexible_match, gsm8k_strict_match, rewards
from tasks import Example, build_prompt, load_task, read_jsonl


# -----------------------------------------------------------------------------
# loading

def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_read_jsonl_gsm8k_and_math_records(tmp_path):
    p = _write(tmp_path / "mix.jsonl", [
        json.dumps({"question": "2+2?", "answer": "2+2=<<2+2=4>>4\n#### 4"}),
        "",
        json.dumps({"problem": "Half?", "answer": r"\frac{1}{2}", "solution": r"It is \boxed{\frac{1}{2}}."}),
        json.dumps({"question": "Name?", "answer": "Alice"}),
        json.dumps({"question": "Count?", "answer": 7}),
    ])
    ex = read_jsonl(p)
    assert ex[0] == Example("2+2?", "4", "numeric", "2+2=<<2+2=4>>4\n#### 4")
    assert ex[1] == Example("Half?", r"\frac{1}{2}", "math", r"It is \boxed{\frac{1}{2}}.")
    assert ex[2].kind == "math" and ex[3] == Example("Count?", "7", "numeric")


def test_malformed_jsonl_names_file_and_line(tmp_path):
    p = _write(tmp_path / "bad.jsonl", [json.dumps({"question": "a", "answer": "1"}), "", '{"question": "b", '])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        read_jsonl(p)
    p = _write(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object"):
        read_jsonl(p)


@pytest.mark.parametrize("rec, names", [
    ({"question": "q"}, "'answer'"),
    ({"problem": "p", "solution": "s"}, "'answer'"),
    ({"prompt": "p", "label": "1"}, "'answer'"),          # TRL's prompt column, but no gold
    ({"text": "p", "answer": "1"}, "a prompt column"),
])
def test_missing_fields_are_named(tmp_path, rec, names):
    p = _write(tmp_path / "miss.jsonl", [json.dumps({"question": "ok", "answer": "1"}), json.dumps(rec)])
    with pytest.raises(ValueError, match=rf"miss\.jsonl:2: missing {names}"):
        read_jsonl(p)


def test_load_task_paths_and_errors(tmp_path, test_data):
    gsm = load_task(os.path.join(test_data, "gsm8k"), "test")
    assert len(gsm) == 100 and gsm[0].answer == "18" and gsm[0].kind == "numeric"
    assert len(load_task(os.path.join(test_data, "gsm8k", "test.jsonl"), limit=5)) == 5
    with pytest.raises(tasks.DatasetError, match=r"holds none of \['validation\.jsonl'"):
        load_task(os.path.join(test_data, "math500"), "validation")
    with pytest.raises(tasks.DatasetError, match="unknown task"):
        load_task(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="split"):
        load_task("addition", "dev")


def test_load_task_hub_names(monkeypatch):
    import datasets
    calls = []

    def fake_load_dataset(repo, config=None, split=None):
        calls.append((repo, config, split))
        if repo == "openai/gsm8k":
            return datasets.Dataset.from_list([{"question": "q", "answer": "x\n#### 1,234"}])
        return datasets.Dataset.from_list([{"problem": "p", "solution": r"\boxed{2}", "answer": "2",
                                            "subject": "Algebra", "level": 1}])
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")   # no connection probe: the fake stands for the Hub
    assert load_task("gsm8k", "train") == [Example("q", "1,234", "numeric", "x\n#### 1,234")]
    assert load_task("math500", "test")[0] == Example("p", "2", "math", r"\boxed{2}")
    assert calls == [("openai/gsm8k", "main", "train"), ("HuggingFaceH4/MATH-500", None, "test")]
    with pytest.raises(ValueError, match="only the 'test' split"):
        load_task("math500", "train")


@pytest.mark.parametrize("name, op, sizes, first, second", [
    ("addition", "+", (8100 - 1000, 1000), range(10, 100), range(10, 100)),
    ("multiplication", "*", (720 - 200, 200), range(10, 100), range(2, 10))])
def test_arithmetic_task_is_seeded_and_split(name, op, sizes, first, second):
    train, test = load_task(name, "train"), load_task(name, "test")
    assert (len(train), len(test)) == sizes
    assert not {e.question for e in train} & {e.question for e in test}
    assert load_task(name, "test") == test and load_task(name, "test", seed=1) != test
    for e in test[:50]:
        a, b = map(int, e.question.removeprefix("What is ").removesuffix("?").split(f" {op} "))
        assert a in first and b in second and e.kind == "numeric"
        assert e.answer == str(a + b if op == "+" else a * b) == e.columns["answer"]


# -----------------------------------------------------------------------------
# prompts

def test_build_prompt_uses_the_chat_template(smollm2_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    p = build_prompt(tok, "What is 2 + 3?")
    want = tok.apply_chat_template([{"role": "system", "content": tasks.SYSTEM_PROMPT},
                                    {"role": "user", "content": "What is 2 + 3?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert p == want and r"\boxed{}" in p and p.endswith("<|im_start|>assistant\n")


def test_build_prompt_without_template():
    class Plain:
        chat_template = None
    assert build_prompt(Plain(), "Q?") == tasks.SYSTEM_PROMPT + "\n\nQuestion: Q?\nAnswer:"


# -----------------------------------------------------------------------------
# the gold data scores itself

def test_gsm8k_gold_solutions_score_100_percent(test_data):
    data = load_task(os.path.join(test_data, "gsm8k"), "test")
    stats = RewardStats()
    scores = rewards(data, [e.solution for e in data], stats)
    acc = 100 * sum(scores) / len(data)
    strict = 100 * sum(gsm8k_strict_match(e.solution, e.solution) for e in data) / len(data)
    flexible = 100 * sum(gsm8k_flexible_match(e.solution, e.solution) for e in data) / len(data)
    print(f"\nGSM8K test gold-vs-gold: reward {acc:.2f}%, lm-eval strict {strict:.2f}%, flexible {flexible:.2f}% "
          f"({len(data)} examples, {stats.as_dict()})")
    assert acc == 100.0 and strict == 100.0 and flexible == 100.0 and stats.errors == stats.timeouts == 0


def test_math500_gold_solutions_score_at_least_99_percent(test_data):
    data = load_task(os.path.join(test_data, "math500"), "test")
    assert len(data) == 100 and all(e.kind == "math" and e.solution for e in data)
    stats = RewardStats()
    scores = rewards(data, [e.solution for e in data], stats)
    acc = 100 * sum(scores) / len(data)
    print(f"\nMATH500 gold answer vs \\boxed{{}} of the gold solution: {acc:.2f}% ({stats.as_dict()})")
    misses = [e.answer for e, s in zip(data, scores) if s == 0][:10]
    assert acc >= 99.0, f"{acc:.2f}%; first misses: {misses}"
