"""One rank of the pytree tests (test_pipeline_pytrees.py, started with
torchrun's variables): a float64 model whose chunks hand each other tuples
and dicts (a differentiable tensor, a bool mask, a side tensor, a string, an
int, a tensor the next chunk ignores, a float table that takes no gradient,
an int64 of 2^40 + 1 + chunk and a bfloat16 tensor that takes a gradient),
trained with each schedule on hyperparallel's executor over a Gloo group,
nothing declared (no activation_shape); saves its losses and chunk
parameters.

    pytree_worker.py OUT_DIR SCHEDULES [bad]

"bad": chunk 0's forward of microbatch 1 returns a structure holding no
tensor (the test expects every rank to fail, naming the stage and
microbatch)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_model as pm  # noqa: E402

import hyperparallel as hp  # noqa: E402


class TreeChunk(torch.nn.Module):
    def __init__(self, c: int, n: int, bad: bool = False):
        super().__init__()
        self.c, self.n, self.bad, self.calls = c, n, bad, 0
        g = torch.Generator().manual_seed(3000 + c)
        self.lin = torch.nn.Linear(pm.D, pm.D, dtype=torch.float64)
        self.side = torch.nn.Linear(pm.D, pm.D, dtype=torch.float64)
        with torch.no_grad():
            for lin in (self.lin, self.side):
                lin.weight.copy_(torch.randn(pm.D, pm.D, generator=g, dtype=torch.float64) / pm.D**0.5)
                lin.bias.copy_(torch.randn(pm.D, generator=g, dtype=torch.float64) * 0.1)

    def forward(self, x):
        if isinstance(x, tuple):
            h, mask, side, tag, k, _ignored, table, big, half = x
            assert tag == "tree" and k == 3 and mask.dtype == torch.bool, (tag, k, mask.dtype)
            assert not table.requires_grad and not mask.requires_grad
            # Each leaf in its own dtype, bit for bit: a cast to float32
            # would make 2^40 + 1 + c even.
            assert big.dtype == torch.int64 and bool((big == 2**40 + self.c).all()), big
            assert half.dtype == torch.bfloat16 and (half.requires_grad or not h.requires_grad)
            h = h + 0.5 * side * mask + table + 0.25 * half.to(h.dtype)
        else:
            h, mask = x, x[:, :1] > 0
        y = torch.tanh(self.lin(h))
        side = self.side(h)
        if self.c == self.n - 1:
            return {"out": y + side, "mask": mask}
        # A float tensor that takes no gradient (like a rotary table): it
        # travels forward only, its gradient never comes back.
        table = 0.1 * torch.cos(torch.arange(h.shape[0] * h.shape[1], dtype=h.dtype)
                                ).view_as(h) * (1 + self.c)
        self.calls += 1
        if self.bad and self.c == 0 and self.calls == 2:  # microbatch 1's F
            return ("tree", 3)
        big = torch.full((h.shape[0],), 2**40 + 1 + self.c, dtype=torch.int64)
        return (y, mask, side, "tree", 3, 2 * side, table, big, side.to(torch.bfloat16))


def loss_fn(out, target):
    return pm.loss_fn(out["out"] * (1 + out["mask"]), target)


def main():
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    bad = len(sys.argv) > 3 and sys.argv[3] == "bad"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in names:
        m = pm.microbatches(name, p)
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=m)
        chunks = {c: TreeChunk(c, sched.num_chunks, bad) for c in sched.chunks_of_rank(rank)}
        pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, timeout=60)
        opt = torch.optim.SGD([q for c in chunks.values() for q in c.parameters()], lr=pm.LR)
        losses = []
        for step in range(pm.STEPS):
            x, y = pm.batch(step, m)
            opt.zero_grad()
            losses.append(pipe.step(x, y))
            opt.step()
        results[name] = {
            "losses": losses,
            "chunks": {c: [q.detach() for q in mod.parameters()] for c, mod in chunks.items()},
        }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
