"""bench/rollout.py on CPU: the critical-path attribution of its --profile, on a hand-made trace; its workloads; its timed calls."""
import json

import pytest

from test_step_bench import load_bench


class FakeProfile:
    """What _critical_path reads of a torch.profiler run: a Chrome trace (times in us)."""

    def __init__(self, events):
        self.events = events

    def export_chrome_trace(self, path):
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events}, f)


def test_critical_path_charges_what_each_kernel_adds():
    bench = load_bench("rollout")
    k = lambda name, ts, dur: dict(cat="kernel", name=name, ts=ts, dur=dur)
    prof = FakeProfile([
        k("gemv", 0.0, 10.0),
        k("norm", 4.0, 8.0),           # launched early (PDL) at 4, ends at 12: adds 2
        dict(cat="cpu_op", name="aten::mm", ts=0.0, dur=50.0),   # host events are not GPU time
        k("gemv", 15.0, 5.0),          # the GPU idle 12..15, then 5
        dict(cat="gpu_memcpy", name="Memcpy HtoD", ts=18.0, dur=1.0),   # inside the gemv: adds 0
        k("norm", 21.0, 1.0),          # idle 20..21, then 1
    ])
    cost, idle = bench._critical_path(prof)
    assert cost == {"gemv": (15.0, 2), "norm": (3.0, 2), "Memcpy HtoD": (0.0, 1)}
    # 12..15 after norm (it ended last, at 12) and before the second gemv; 20..21 after that gemv
    assert idle == {("norm", "gemv"): (3.0, 1), ("gemv", "norm"): (1.0, 1)}
    assert sum(us for us, _ in cost.values()) + sum(us for us, _ in idle.values()) == 22.0   # first start to last end


def test_per_step_takes_the_long_run_minus_the_short_one():
    bench = load_bench("rollout")
    long = {"gemv": (50.0, 12), ("a", "b"): (9.0, 3)}
    short = {"gemv": (10.0, 2)}
    assert bench._per_step(long, short, 10) == {"gemv": (4.0, 1.0), ("a", "b"): (0.9, 0.3)}


def test_workloads_take_a_count_of_new_tokens_and_must_fit_the_model_length():
    bench = load_bench("rollout")
    assert bench.workload("batch8") == dict(prompts=8, n=1, prompt_len=256, new=512)
    assert bench.workload("batch8:2048") == dict(prompts=8, n=1, prompt_len=256, new=2048)
    assert bench.WORKLOADS["batch8"]["new"] == 512                     # the table is not modified
    for bad in ("batch3", "batch8:", "batch8:1", "batch8:x", "grpo:2048", "decode"):
        with pytest.raises(ValueError, match="unknown workload"):
            bench.workload(bad)
    assert list(bench.workloads("batch1,batch8:2048", 2304)) == ["batch1", "batch8:2048"]
    with pytest.raises(ValueError, match="needs 2304 positions.*--max-model-len 2304"):
        bench.workloads("batch1,batch8:2048", 2048)


def test_timed_calls_free_the_cache_before_each_call_and_report_the_median(monkeypatch):
    bench = load_bench("rollout")
    events = []

    class Engine:
        def free_cache(self, keep_warm=False):
            events.append(("free", keep_warm))

    walls = iter([1.0, 3.0, 2.0])                    # three calls: the median by wall time is the third

    def run_ours(engine, prompts, n, new):
        events.append(("run", n, new))
        return dict(total_s=next(walls), ttft_s=0.5, new_tokens=2 * n * new)

    monkeypatch.setattr(bench, "run_ours", run_ours)
    w = dict(prompts=2, n=1, prompt_len=256, new=11)
    r = bench.timed_calls(Engine(), [[1], [2]], "batch2", w)
    assert events == [("free", True), ("run", 1, 11)] * 3          # a training step's free before every call
    assert r["total_s"] == 2.0
    # decode tok/s = prompts (new - 1) / (total - ttft): 20 / 0.5, 20 / 2.5, 20 / 1.5
    assert r["calls_tok_s"] == pytest.approx([40.0, 8.0, 40.0 / 3])
    assert bench.rate("grpo", w, r) == pytest.approx(22 / 2.0)     # grpo: all new tokens over the wall time
