"""bench/paper.py on CPU: which rows the paper's table has, and the tiny model's batch-2 row end to end
(both formats through bench/step.py's worker), with the ratios computed from the records."""
import json

from test_step_bench import load_bench


def test_rows_follow_the_paper():
    paper = load_bench("paper")
    rows = paper.configurations(["7b", "32b"], [2, 8])
    assert rows == [("7b", "nvfp4", 2), ("7b", "bf16", 2), ("7b", "bf16-unmerged", 2), ("7b", "nvfp4", 8),
                    ("7b", "bf16", 8), ("7b", "bf16-unmerged", 8), ("32b", "nvfp4", 8)]
    assert paper.BATCHES[8] == (1, 8) and paper.BATCHES[32] == (4, 8)


def test_tiny_batch_two_end_to_end(tmp_path):
    paper = load_bench("paper")
    paper.main(["--models", "tiny", "--batches", "2", "--device", "cpu", "--dtype", "float32", "--completion", "4",
                "--prompt-len", "8", "--out", str(tmp_path)])
    rows = json.load(open(tmp_path / "paper.json"))["rows"]
    assert sorted((r["quant"], r["batch"], r["prompts"], r["group"]) for r in rows) == [
        ("bf16", 2, 1, 2), ("bf16-unmerged", 2, 1, 2), ("nvfp4", 2, 1, 2)]
    assert all(r["status"] == "ok" and r["forced"] and r["new_tokens"] == 2 * 4 for r in rows), rows
    # train.py's bf16 samples merged (the plan keeps the copies), the unmerged arm does not, NVFP4 cannot
    assert [r["step_plan"]["merged_sampling"] for r in sorted(rows, key=lambda r: r["quant"])] == [True, False, False]
    b, m, q = sorted(rows, key=lambda r: r["quant"])
    line = [ln for ln in paper.table(rows).splitlines() if ln.startswith("| tiny | 2 |")][0]
    for peer in (b, m):
        assert f"{peer['step_s'] / q['step_s']:.2f}×" in line and f"{q['rollout_tok_s'] / peer['rollout_tok_s']:.2f}×" in line
