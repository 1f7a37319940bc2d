"""Data parallel with torchrun: one process per GPU, on one machine or several; every helper a no-op in a
single process.

    torchrun --standalone --nproc-per-node N train.py ...                                   one machine
    torchrun --nnodes M --node-rank i --nproc-per-node N --master-addr HOST0 --master-port 29500 \\
        train.py ...                                                                        machine i of M

The ranks are replicas of one policy (same adapters, same AQN noise, same AdamW steps). Each samples
its share of the global batch with its own seed; one all_gather_object per sampling round gives every
rank the whole generation batch (ids and rewards: small), so advantages, dynamic sampling, the data
position and the loss normalisers are those of one process; each rank trains on its slice of the
groups, and the adapter gradients are summed in one flat all_reduce before clipping, which gives the
one-process gradient for dapo, grpo and dr_grpo, and for bnpo the mean of micro-batch means as TRL does.
A run may resume with another N (the same global batch; the per-rank sampling seeds make it a new
draw). A single process never touches torch.distributed.

Machines without a shared disk. Rank 0 writes every file, in its own --output-dir, and no other rank
reads one: a resumed run takes rank 0's newest checkpoint, whose files rank 0 sends to every other rank
over the process group (from_rank0; a temporary copy there, in chunks of CHUNK bytes, removed once
loaded), so each rank loads the adapter, optimizer, schedule, data position and dynamic sampling's keep
rate that rank 0 loads. The machine holding the run must therefore host rank 0: torchrun's static
rendezvous (--master-addr, --node-rank 0 on that machine) does that; its c10d rendezvous orders machines
by host name. check_ranks stops a start, before anything loads, where another rank's --output-dir holds
a newer checkpoint than rank 0's, or where a rank was started with other flags than rank 0's (each
machine runs the same flags but for PER_RANK_FLAGS: its own --output-dir and --device, the --config
file it read them from, --resume).

Where the time goes. Each collective counts the seconds its rank spends in it: all_gather_object and
the barrier on the host clock, the gradient all_reduce until its result is on the device. A rank waits
there for the slowest (a straggler waits least; a rank that draws no prompt in a round waits the whole
round), so rank_times, once a step, gives rank 0's metrics each rank's rollout and training time and
its waits: time/rank<r>/rollout, /train, /wait, and time/wait, the mean over ranks.

Test: tests/test_distributed.py (2 CPU processes over gloo give the single-process update; torchrun on
one machine, and as two machines with separate output directories, killed mid-run and resumed).
"""
import os
import tempfile
import time
from contextlib import contextmanager

import torch

from run_dir import CHECKPOINT_RE

PER_RANK_FLAGS = ("output_dir", "device", "config", "resume")  # may differ between machines; no other flag
CHUNK = 1 << 26          # bytes one broadcast of from_rank0 carries: memory stays bounded whatever the file
_waited = {"s": 0.0}     # seconds this process spent in collectives since rank_times last read it


def dist_setup(device_arg: str | None) -> tuple[int, int, torch.device]:
    """(rank, world size, device). Joins the process group only when torchrun set WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(device_arg or ("cuda" if torch.cuda.is_available() else "cpu"))
    if world == 1:
        return 0, 1, device
    if device.type == "cuda":  # one GPU per rank; Triton kernels and CUDA graphs use the current device
        per_node, n_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", world)), torch.cuda.device_count()
        if per_node > n_gpus:
            raise SystemExit(f"error: {per_node} processes per node asked for, but {n_gpus} CUDA devices visible")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         device_id=device if device.type == "cuda" else None)
    return torch.distributed.get_rank(), world, device


def rank_world() -> tuple[int, int]:
    """(rank, world size); (0, 1) in a single process."""
    d = torch.distributed
    return (d.get_rank(), d.get_world_size()) if d.is_available() and d.is_initialized() else (0, 1)


# ----------------------------------------------------------------------------------------------
# collectives, each timed


@contextmanager
def _waiting():
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _waited["s"] += time.perf_counter() - t0


def gather(obj) -> list:
    """Every rank's obj (any picklable value), in rank order; [obj] in a single process."""
    out = [obj] * rank_world()[1]
    if len(out) > 1:
        with _waiting():
            torch.distributed.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait until every rank is here."""
    if rank_world()[1] > 1:
        with _waiting():
            torch.distributed.barrier()


def all_reduce_grads(params: list) -> None:
    """Sum the adapter gradients over ranks: one flat buffer, one collective (not one per tensor)."""
    if rank_world()[1] > 1:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
        with _waiting():
            torch.distributed.all_reduce(flat)
            if flat.is_cuda:  # NCCL returns at once: the wait ends when the sum is there
                torch.cuda.synchronize(flat.device)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad = g.view_as(p)


def rank_times(metrics: dict) -> dict:
    """Each rank's time this step, for rank 0's metrics: its time/rollout and time/train (waits included)
    and the seconds it waited in collectives since the last call, as time/rank<r>/{rollout,train,wait},
    and time/wait, the mean wait over ranks; {} in a single process."""
    world = rank_world()[1]
    if world == 1:
        return {}
    mine = (metrics.get("time/rollout", 0.0), metrics.get("time/train", 0.0), _waited["s"])
    _waited["s"] = 0.0   # this gather's own wait counts in the next step's
    parts = gather(mine)
    out = {f"time/rank{r}/{k}": v for r, part in enumerate(parts) for k, v in zip(("rollout", "train", "wait"), part)}
    return {**out, "time/wait": sum(part[2] for part in parts) / world}


# ----------------------------------------------------------------------------------------------
# machines without a shared disk


def check_ranks(settings: dict, ckpt: str | None) -> int:
    """At start, on every rank, before anything loads (a barrier too): stop, on every rank alike, where a
    rank's settings (flags.record) differ from rank 0's (PER_RANK_FLAGS aside), or where a rank's
    --output-dir holds a newer checkpoint than rank 0's. ckpt: the checkpoint this rank's own directory
    would resume from. -> the step the run resumes after: rank 0's checkpoint's (0 for a new run)."""
    step = int(CHECKPOINT_RE.fullmatch(os.path.basename(ckpt)).group(1)) if ckpt else 0
    if rank_world()[1] == 1:
        return step
    flags = {k: v for k, v in settings.items() if k not in PER_RANK_FLAGS}
    parts = gather((flags, step, os.path.basename(ckpt) if ckpt else "none"))
    first = parts[0][0]
    for r, (other, _, _) in enumerate(parts[1:], 1):
        differ = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
        if differ:
            shown = "; ".join(f"--{k.replace('_', '-')} {other.get(k)!r} (rank 0: {first.get(k)!r})" for k in differ)
            raise SystemExit(f"error: rank {r} was started with other flags than rank 0: {shown}. Start every "
                             f"machine with the same flags; only --output-dir, --device, --config and --resume "
                             f"may differ")
    newest = max(range(len(parts)), key=lambda r: (parts[r][1], -r))
    if parts[newest][1] > parts[0][1]:
        raise SystemExit(f"error: rank {newest}'s --output-dir holds {parts[newest][2]}, newer than rank 0's "
                         f"({parts[0][2]}): rank 0 reads and writes the run, so start the machine that holds it "
                         f"as rank 0 (torchrun --node-rank 0 with --master-addr: c10d's rendezvous orders "
                         f"machines by host name)")
    return parts[0][1]


def _broadcast_file(path: str, size: int, send: bool, device) -> None:
    """Rank 0's file `path` (size bytes) to every rank, CHUNK bytes a broadcast; the others write it."""
    buf = torch.empty(min(CHUNK, max(size, 1)), dtype=torch.uint8, device=device)
    with open(path, "rb" if send else "wb") as f:
        for start in range(0, size, CHUNK):
            n = min(CHUNK, size - start)
            if send:
                buf[:n].copy_(torch.frombuffer(bytearray(f.read(n)), dtype=torch.uint8))
            torch.distributed.broadcast(buf[:n], src=0)
            if not send:
                f.write(buf[:n].cpu().numpy().tobytes())


@contextmanager
def from_rank0(path: str | None):
    """Rank 0's directory `path` (the checkpoint it resumes from) on every rank, whether or not the
    ranks share a disk: rank 0 gets its own path; every other rank a temporary copy of its files, sent
    by rank 0 over the process group and removed on leaving; all get None where rank 0's path is None
    (the other ranks' `path` is not read). A single process gets path."""
    rank, world = rank_world()
    if world == 1:
        yield path
        return
    head = [None]
    if rank == 0 and path:
        files = [(f, os.path.getsize(os.path.join(path, f))) for f in sorted(os.listdir(path))
                 if os.path.isfile(os.path.join(path, f))]
        head = [(os.path.basename(os.path.normpath(path)), files)]
    with _waiting():
        torch.distributed.broadcast_object_list(head, src=0)
    if head[0] is None:
        yield None
        return
    name, files = head[0]
    nccl = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if rank == 0:
        for f, size in files:
            _broadcast_file(os.path.join(path, f), size, True, device)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="qerl-from-rank0-") as tmp:
        local = os.path.join(tmp, name)          # named as rank 0's: load_checkpoint checks the step in it
        os.makedirs(local)
        for f, size in files:
            _broadcast_file(os.path.join(local, f), size, False, device)
        yield local
