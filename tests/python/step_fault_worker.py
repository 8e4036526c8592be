"""One rank of test_faults_step.py (started with torchrun's variables): a
sequence of mistakes in building a two-rank Pipeline and in its step()'s
arguments, one Pipeline each, in one launch. Every case prints one line per
rank, "rank R: CASE WHAT after S s: MESSAGE", and the worker exits 0 once
every line was printed.

    dp_world      dp_group=WORLD, the pipeline's own two ranks
    tp_over_pp    a DTensor (tensor-parallel) layer sharded over the
                  pipeline's own two ranks
    refused       declared shape: rank 0's batch does not divide in step 1
                  (rank 1's step is under way); then step() again
    typo          declared shape: rank 1 gives attn_mask= (no stage takes it)
                  in step 1; then step() again
    one_sided     declared shape, first step: a keyword argument on rank 0 only;
                  then a good step
    constants     nothing declared: shift=0.25 on rank 0, 0.5 on rank 1; then a
                  good step
    no_targets    nothing declared: rank 1 forgets its targets in step 1; then a
                  good step
    changed       nothing declared: rank 0 adds a keyword argument in step 2
    fsdp_one_copy (pp 1 x dp 2) rank 0's chunk fully_shard'ed over both
                  ranks, rank 1's not
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import hyperparallel as hp


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x, attention_mask=None, shift=0.0):
        h = self.lin(x) + shift
        return h if attention_mask is None else h * attention_mask[:, None]


def say(rank, case, what, t0, message=""):
    print(f"rank {rank}: {case} {what} after {time.monotonic() - t0:.2f} s: "
          f"{str(message).splitlines()[0] if message else ''}".rstrip(), flush=True)


def attempt(rank, case, what, fn, t0):
    """Runs fn; prints WHAT done, or WHAT failed with the error's first line."""
    try:
        fn()
        say(rank, case, f"{what} ran", t0)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        say(rank, case, f"{what} failed", t0, e)


def pipeline(rank, found=False, **kw):
    sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
    shape = None if found else (2, 4)
    return hp.pipeline.Pipeline({rank: Scaled()}, sched, loss_fn=torch.nn.functional.mse_loss,
                                activation_shape=shape, timeout=30, **kw)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, dtype=torch.float64)

    def step(pipe, inputs=x, **kw):
        return pipe.step(inputs if rank == 0 else None, x if rank == 1 else None, **kw)

    case = "dp_world"
    t0 = time.monotonic()
    attempt(rank, case, "construction", lambda: pipeline(rank, dp_group=dist.group.WORLD), t0)

    case = "tp_over_pp"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    t0 = time.monotonic()

    def tp():
        chunk = Scaled()
        parallelize_module(chunk, mesh, {"lin": ColwiseParallel()})
        sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
        hp.pipeline.Pipeline({rank: chunk}, sched, loss_fn=torch.nn.functional.mse_loss,
                             activation_shape=(2, 4), timeout=30)

    attempt(rank, case, "construction", tp, t0)

    case = "refused"
    pipe = pipeline(rank)
    step(pipe)
    t0 = time.monotonic()
    attempt(rank, case, "step", lambda: step(pipe, inputs=x[:3]), t0)
    attempt(rank, case, "next step", lambda: step(pipe), t0)

    case = "typo"
    pipe = pipeline(rank)
    step(pipe, attention_mask=mask)
    t0 = time.monotonic()
    if rank == 1:
        attempt(rank, case, "step", lambda: step(pipe, attn_mask=mask), t0)
    else:
        attempt(rank, case, "step", lambda: step(pipe, attention_mask=mask), t0)
    attempt(rank, case, "next step", lambda: step(pipe, attention_mask=mask), t0)

    case = "one_sided"
    pipe = pipeline(rank)
    t0 = time.monotonic()
    kw = {"attention_mask": mask} if rank == 0 else {}
    attempt(rank, case, "step", lambda: step(pipe, **kw), t0)
    attempt(rank, case, "next step", lambda: step(pipe, attention_mask=mask), t0)

    case = "constants"
    pipe = pipeline(rank, found=True)
    t0 = time.monotonic()
    attempt(rank, case, "step", lambda: step(pipe, shift=0.25 if rank == 0 else 0.5), t0)
    attempt(rank, case, "next step", lambda: step(pipe, shift=0.25), t0)

    case = "no_targets"
    pipe = pipeline(rank, found=True)
    step(pipe)
    t0 = time.monotonic()
    attempt(rank, case, "step",
            lambda: pipe.step(x if rank == 0 else None, None), t0)
    attempt(rank, case, "next step", lambda: step(pipe), t0)

    case = "changed"
    pipe = pipeline(rank, found=True)
    step(pipe)
    t0 = time.monotonic()
    kw = {"attention_mask": mask} if rank == 0 else {}
    attempt(rank, case, "step", lambda: step(pipe, **kw), t0)

    case = "fsdp_one_copy"
    from torch.distributed.fsdp import fully_shard

    solo = dist.new_group([0]), dist.new_group([1])
    dp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    t0 = time.monotonic()

    def fsdp():
        chunk = Scaled()
        if rank == 0:
            fully_shard(chunk, mesh=dp_mesh["dp"])
        sched = hp.pipeline.schedule("1f1b", ranks=1, microbatches=2)
        hp.pipeline.Pipeline({0: chunk}, sched, loss_fn=torch.nn.functional.mse_loss,
                             activation_shape=(2, 4), group=solo[rank], timeout=30)

    attempt(rank, case, "construction", fsdp, t0)
    time.sleep(1)  # each process lives on while its peer finishes


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
