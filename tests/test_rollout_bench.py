"""bench/rollout.py on CPU: the critical-path attribution of its --profile, on a hand-made trace."""
import json

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
    assert idle == 4.0
    assert sum(us for us, _ in cost.values()) + idle == 22.0       # first start to last end
