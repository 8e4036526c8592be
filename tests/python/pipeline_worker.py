"""One rank of the Python runtime tests (started by test_pipeline_runtime.py
with torchrun's variables): trains a small float64 model with every schedule
on hyperparallel's executor over a Gloo group made by torch.distributed, and
saves its losses and chunk parameters for the test to compare with
single-process training."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_model as pm  # noqa: E402

import hyperparallel as hp  # noqa: E402


def main():
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in names:
        m = pm.microbatches(name, p)
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=m)
        chunks = {c: pm.make_chunk(c, sched.num_chunks) for c in sched.chunks_of_rank(rank)}
        pipe = hp.pipeline.Pipeline(
            chunks,
            sched,
            loss_fn=pm.loss_fn,
            activation_shape=(pm.MB, pm.D),
            timeout=60,
        )
        params = [q for c in chunks.values() for q in c.parameters()]
        opt = torch.optim.SGD(params, lr=pm.LR)
        losses = []
        for step in range(pm.STEPS):
            x, y = pm.batch(step, m)
            opt.zero_grad()
            losses.append(pipe.step(x, y))
            opt.step()
        results[name] = {
            "losses": losses,
            "chunks": {c: [q.detach().clone() for q in mod.parameters()] for c, mod in chunks.items()},
            "backend": pipe._runtime.backend,
        }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
