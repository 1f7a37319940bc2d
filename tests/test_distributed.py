"""train.py's data parallelism on CPU: 2 processes over gloo, checked against 1 process; and two
machines without a shared disk, played by two torchrun agents on this one.

The reference is the single-process train_step on the whole generation batch: with 2 ranks, each
runs the forward/backward on its half of the groups and the summed gradient must give the same
LoRA update (fp32, to rounding) for every loss type, and the two replicas must stay bit-identical.
The tiny model, the fake rollout groups and the one-step update come from test_train.py.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import distributed
import lora
import run_dir
import train
from test_train import FAST, ROOT, lora_update, make_groups, make_tiny_model, read_metrics
from safetensors.torch import load_file

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
# 4 groups of G = 4 (2 per rank), mixed rewards so that every group has a non-zero advantage.
REWARDS = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1])


@pytest.fixture(scope="module")
def tiny_model(smollm2_tokenizer, tmp_path_factory):
    return make_tiny_model(smollm2_tokenizer, str(tmp_path_factory.mktemp("tiny") / "model"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, model_dir: str, out_dir: str, device: str) -> None:
    """One rank: torchrun's environment, distributed.dist_setup, then one update per loss type."""
    torch.set_num_threads(1)
    # As under torchrun, the rendezvous store lives outside the ranks (here: in the test process), so
    # no rank takes it down while the other is still tearing its process group down.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True")
    rank_, world_, dev = distributed.dist_setup(device)   # gloo on CPU, nccl on cuda:<rank>
    assert (rank_, world_) == (rank, world)
    for loss_type in LOSS_TYPES:
        update, metrics = lora_update(model_dir, make_groups(4, seed=5), REWARDS, loss_type, micro_batch=2, device=dev)
        torch.save((update, metrics), os.path.join(out_dir, f"{loss_type}-{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Results are on disk: leave without C++ static teardown, where gloo's threads have been seen to
    # abort the process ("terminate called without an active exception") after the work was done.
    os._exit(0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_ranks_give_the_single_process_update(tiny_model, tmp_path, device):
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    torch.multiprocessing.spawn(_worker, args=(2, port, tiny_model, str(tmp_path), device), nprocs=2, join=True)
    del store
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the CPU matmul blocking (and so the rounding) depends on it
    try:
        reference = {lt: lora_update(tiny_model, make_groups(4, seed=5), REWARDS, lt, micro_batch=2, device=device)
                     for lt in LOSS_TYPES}
    finally:
        torch.set_num_threads(threads)
    for loss_type, (want, want_met) in reference.items():
        (got, met), (got1, _) = [torch.load(tmp_path / f"{loss_type}-{r}.pt", weights_only=True) for r in (0, 1)]
        assert all(torch.equal(a, b) for a, b in zip(got, got1)), f"{loss_type}: the replicas differ"
        assert any(g.abs().max() > 0 for g in want), "the update is zero: nothing is tested"
        err = max((a - b).abs().max().item() / (b.abs().max().item() + 1e-12) for a, b in zip(got, want))
        print(f"{device} {loss_type}: 2 ranks vs 1 process, LoRA update max rel err {err:.2e}")
        assert err < 1e-4, f"{loss_type}: 2 ranks vs 1 process, LoRA update max rel err {err:.2e}"
        for k in ("loss", "grad_norm", "num_tokens", "entropy", "clip_ratio/region_mean"):
            assert met[k] == pytest.approx(want_met[k], rel=1e-4, abs=1e-6), (loss_type, k, met[k], want_met[k])


@pytest.mark.slow
def test_torchrun_two_processes_end_to_end(tiny_model, tmp_path):
    """`torchrun --nproc-per-node 2 train.py` on CPU: rank 0 logs and checkpoints, both resume. Each step
    fills its batch by dynamic sampling over both ranks (the reward leaves the groups of odd answers
    without a spread): every rank must agree on the rounds and their sizes, a round of one prompt
    included (rank 1 draws none), and the resumed step sizes its round from the checkpoint's keep rate."""
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "train.py"), "--model", tiny_model, "--output-dir", out, "--device", "cpu",
           "--max-steps", "4", "--save-every", "1", *FAST, "--eval-limit", "3", "--dynamic-sampling",
           "--prompts-per-step", "4", "--max-sampling-rounds", "2", "--dynamic-sampling-threshold", "0",
           "--reward", "reward_examples:spread_on_even_answers"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "tests")}
    res = subprocess.run([*cmd, "--stop-at", "2"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    res = subprocess.run([*cmd, "--resume"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("resumed from") == 1, "only rank 0 prints"
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "eval/accuracy" in rows[3], rows
    assert all("loss" in r for r in rows), rows
    # The data order's answers (even: a spread), a budget of 2 rounds · 4 = 8 prompts a step.
    # step 0, rate 1: 128 137 52 122 (3 of 4), then round_size(1, 3/4, 4) = 3 (n = 2: 1.5 - 0.61 < 1):
    #   100 144 23 -> 7 prompts, 5 informative
    # step 1, rate 5/7: round_size(4, 5/7, 8) = 8 (n = 7: 5 - 1.20 < 4): 117 155 192 88 117 142 120 91 (4)
    # step 2 (resumed), rate 1/2: round_size(4, 1/2, 8) = the budget: 40 154 85 155 58 66 100 112 (6)
    # step 3, rate 3/4: round_size(4, 3/4, 8) = 7 (n = 6: 4.5 - 1.06 < 4): 98 87 145 94 132 101 163 (3),
    #   then the one prompt left, 102: rank 1 draws none
    assert [(r["sampling/keep_rate"], r["sampling/prompts"], r["sampling/rounds"]) for r in rows] == \
        [(1.0, 7, 2), (pytest.approx(5 / 7), 8, 1), (0.5, 8, 1), (0.75, 8, 2)], rows
    state = torch.load(os.path.join(out, "checkpoint-000004", run_dir.TRAINER_STATE), weights_only=True)
    assert state["data_pos"] == sum(r["sampling/prompts"] for r in rows), "a round's prompts are the global count"
    with open(os.path.join(out, run_dir.RUN_CONFIG)) as f:
        assert '"world_size": 2' in f.read()


# ----------------------------------------------------------------------------------------------
# machines without a shared disk


def _separate_disks_worker(rank: int, port: int, tmp: str) -> None:
    """One of 2 ranks, each with a directory of its own: from_rank0, check_ranks, the waits."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True")
    distributed.dist_setup("cpu")
    distributed.CHUNK = 1000     # several broadcasts a file
    mine = os.path.join(tmp, f"rank{rank}", "checkpoint-000003")
    os.makedirs(mine)
    for name, size in (("big.bin", 2500), ("small.json", 7), ("empty", 0)):
        with open(os.path.join(mine, name), "wb") as f:
            f.write(os.urandom(size) if rank == 0 else b"rank 1's own")
    seen = {}
    with distributed.from_rank0(mine) as got:      # rank 1's own directory is never read
        seen["files"] = {f: open(os.path.join(got, f), "rb").read() for f in sorted(os.listdir(got))}
        seen["name"] = os.path.basename(got)
        seen["own"] = got == mine
    seen["removed"] = not os.path.exists(got)
    with distributed.from_rank0(mine if rank == 1 else None) as got:   # rank 0 resumes nothing: nobody does
        seen["none"] = got
    args = argparse.Namespace(lr=1e-5, seed=0, output_dir=mine, device="cpu")
    distributed.check_ranks(vars(args), mine)       # the same flags but the directory: accepted
    seen["start"] = distributed.check_ranks(vars(args), mine if rank == 0 else None)  # rank 1 holds none
    errors = []
    for a, ckpt in ((argparse.Namespace(**{**vars(args), "lr": 2e-5 if rank else 1e-5}), mine),
                    (args, os.path.join(tmp, "checkpoint-000004") if rank else mine)):
        try:
            distributed.check_ranks(vars(a), ckpt)
        except SystemExit as e:
            errors.append(str(e))
    if rank == 1:
        time.sleep(0.3)                             # a straggler: rank 0 waits for it in the next gather
    distributed.gather(rank)
    seen.update(errors=errors, times=distributed.rank_times({"time/rollout": 1.0 + rank}))
    torch.save(seen, os.path.join(tmp, f"seen{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)


def test_rank_0s_checkpoint_reaches_a_rank_without_its_disk(tmp_path):
    """from_rank0 gives rank 1 a copy of rank 0's directory, byte for byte (files larger than a broadcast
    included), under rank 0's name, removed afterwards; check_ranks refuses other flags and a newer
    checkpoint on rank 1, on both ranks alike, and gives every rank rank 0's step; rank_times reports
    each rank's wait."""
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    torch.multiprocessing.spawn(_separate_disks_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    del store
    s0, s1 = (torch.load(tmp_path / f"seen{r}.pt", weights_only=False) for r in (0, 1))
    assert s0["own"] and not s1["own"] and s1["name"] == "checkpoint-000003" and s1["removed"]
    assert s1["files"] == s0["files"] and len(s0["files"]["big.bin"]) == 2500 and s0["files"]["empty"] == b""
    assert s0["none"] is None and s1["none"] is None
    assert s0["start"] == s1["start"] == 3          # the step rank 0 resumes after, on every rank
    assert s0["errors"] == s1["errors"] and len(s0["errors"]) == 2, s0["errors"]
    assert "rank 1 was started with other flags than rank 0: --lr 2e-05 (rank 0: 1e-05)" in s0["errors"][0]
    assert "rank 1's --output-dir holds checkpoint-000004, newer than rank 0's (checkpoint-000003)" in s0["errors"][1]
    t = s0["times"]
    assert t == s1["times"] and (t["time/rank0/rollout"], t["time/rank1/rollout"]) == (1.0, 2.0)
    assert t["time/rank0/wait"] > 0.25 > t["time/rank1/wait"], t           # rank 0 waited for the straggler
    assert t["time/wait"] == pytest.approx((t["time/rank0/wait"] + t["time/rank1/wait"]) / 2)


def machine_children(pid: int) -> list[int]:
    """The processes `pid` started (a torchrun agent's workers run in sessions of their own)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if d.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return out


def two_machines(flags: list, outs: list, tmp_path, name: str) -> list:
    """Two torchrun agents as machines 0 and 1 of 2 (the static rendezvous: --node-rank is the rank),
    one process each, machine i writing to --output-dir outs[i]; their output goes to tmp_path."""
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "tests")}
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                              "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                              os.path.join(ROOT, "train.py"), *flags, "--output-dir", out],
                             cwd=ROOT, env=env, stdout=open(tmp_path / f"{name}{i}.out", "w"), stderr=subprocess.STDOUT)
            for i, out in enumerate(outs)]


def finish(procs: list, tmp_path, name: str) -> str:
    for i, p in enumerate(procs):
        assert p.wait(timeout=300) == 0, (tmp_path / f"{name}{i}.out").read_text()[-3000:]
    return (tmp_path / f"{name}0.out").read_text()


@pytest.mark.slow
def test_two_machines_without_a_shared_disk_killed_and_resumed_exactly(tiny_model, tmp_path):
    """torchrun --nnodes 2 on CPU, one process a machine, each machine its own --output-dir. Rank 0 writes
    every file, in its own directory; a run SIGKILLed once it has a checkpoint (both machines: agents and
    workers) resumes, rank 0 sending its checkpoint to rank 1, and ends with the adapter bits and the metrics
    of an uninterrupted two-machine run. Dynamic sampling is on (a round's size follows the keep rate the
    checkpoint carries, on every rank alike), and metrics.jsonl has each rank's times."""
    flags = ["--model", tiny_model, "--device", "cpu", "--max-steps", "5", "--save-every", "1", *FAST,
             "--eval-limit", "0", "--dynamic-sampling", "--dynamic-sampling-threshold", "0", "--max-sampling-rounds",
             "2", "--reward", "reward_examples:spread_on_even_answers"]
    ref, run = [str(tmp_path / f"ref{i}") for i in (0, 1)], [str(tmp_path / f"run{i}") for i in (0, 1)]
    finish(two_machines(flags, ref, tmp_path, "ref"), tmp_path, "ref")

    procs = two_machines(flags, run, tmp_path, "killed")
    latest = os.path.join(run[0], run_dir.LATEST)
    while not (os.path.exists(latest) and open(latest).read() >= "checkpoint-000002"):
        assert all(p.poll() is None for p in procs), "a machine ended before its first checkpoints"
        time.sleep(0.01)
    workers = [c for p in procs for c in machine_children(p.pid)]
    for pid in [p.pid for p in procs] + workers:      # the machines go down: every process at once
        os.kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait()
    killed_at = max(s for s, _ in run_dir.checkpoints(run[0]))
    assert 2 <= killed_at < 5, killed_at

    out = finish(two_machines([*flags, "--resume"], run, tmp_path, "resumed"), tmp_path, "resumed")
    assert f"at step {killed_at}" in out, out[-2000:]
    assert not os.path.exists(ref[1]) and not os.path.exists(run[1]), "rank 1 wrote to its own directory"
    a, b = (load_file(os.path.join(d, "checkpoint-000005", lora.ADAPTER_WEIGHTS)) for d in (ref[0], run[0]))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the resumed adapter differs"
    assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k), "the adapters never moved"
    untimed = [[{k: v for k, v in r.items() if not k.startswith("time") and k not in ("step_time", "rollout/tokens_per_s")}
                for r in read_metrics(d)] for d in (ref[0], run[0])]
    assert untimed[0] == untimed[1] and [r["step"] for r in untimed[0]] == list(range(1, 6))
    rows = read_metrics(run[0])
    assert all(r["time/rank1/wait"] >= 0 and "time/rank0/rollout" in r and "time/wait" in r for r in rows), rows[0]


# ----------------------------------------------------------------------------------------------
# bad input


def test_prompts_not_divisible_by_world_size_are_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "x", "--prompts-per-step", "3"])
    assert "--prompts-per-step (3, the global count) must divide by the number of processes (2)" in capsys.readouterr().err


def test_more_processes_than_gpus_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit, match="4 processes per node asked for, but 2 CUDA devices visible"):
        distributed.dist_setup("cuda")
    assert not torch.distributed.is_initialized()
