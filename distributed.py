"""Data parallel with torchrun: one process per GPU, every helper a no-op in a single process.

    torchrun --standalone --nproc-per-node N train.py ...

The N ranks are replicas of one policy (same adapters, same AQN noise, same AdamW steps). Each
samples its share of the global batch with its own seed; one all_gather_object per sampling round
gives every rank the whole generation batch (ids and rewards: small), so advantages, dynamic
sampling, the data position and the loss normalisers are those of one process; each rank trains on
its slice of the groups, and the adapter gradients are summed in one flat all_reduce before clipping,
which gives the one-process gradient for dapo, grpo and dr_grpo, and for bnpo the mean of micro-batch
means as TRL does. Rank 0 writes all files. A run may resume with another N (the same global batch;
the per-rank sampling seeds make it a new draw). A single process never touches torch.distributed.
Left out: multi-node (the output directory would have to be shared).

Test: tests/test_distributed.py (2 CPU processes over gloo give the single-process update).
"""
import os

import torch


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


def gather(obj) -> list:
    """Every rank's obj (any picklable value), in rank order; [obj] in a single process."""
    out = [obj] * rank_world()[1]
    if len(out) > 1:
        torch.distributed.all_gather_object(out, obj)
    return out


def all_reduce_grads(params: list) -> None:
    """Sum the adapter gradients over ranks: one flat buffer, one collective (not one per tensor)."""
    if rank_world()[1] > 1:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
        torch.distributed.all_reduce(flat)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad = g.view_as(p)
