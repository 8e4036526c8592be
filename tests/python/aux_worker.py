"""One rank of the auxiliary-loss tests (test_pipeline_aux.py, started with
torchrun's variables): a float64 model whose every chunk adds a router's
load-balancing loss with hyperparallel.pipeline.add_loss, trained with each
schedule on hyperparallel's executor over a Gloo group; saves its losses,
auxiliary losses and chunk parameters.

    aux_worker.py OUT_DIR SCHEDULES [bad]

"bad": chunk 1 adds a loss that is not a scalar (the test expects every
rank to fail, naming it)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_model as pm  # noqa: E402

import hyperparallel as hp  # noqa: E402

E = 3  # experts of each chunk's router


class RoutedChunk(torch.nn.Module):
    """pipeline_model's chunk with a router: its gate scales the output, and
    its load-balancing loss (E * sum of squared mean gates) goes to add_loss."""

    def __init__(self, c: int, num_chunks: int, bad: bool = False):
        super().__init__()
        self.body = pm.make_chunk(c, num_chunks)
        g = torch.Generator().manual_seed(2000 + c)
        self.router = torch.nn.Linear(pm.D, E, dtype=torch.float64)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(E, pm.D, generator=g, dtype=torch.float64))
            self.router.bias.zero_()
        self.bad = bad and c == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        balance = 0.1 * E * (gate.mean(0) ** 2).sum()
        hp.pipeline.add_loss(gate.mean(0) if self.bad else balance)
        return self.body(x) * (1 + gate[:, :1])


def microbatches(name: str, p: int) -> int:
    return pm.microbatches(name, p)


def main():
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    bad = len(sys.argv) > 3 and sys.argv[3] == "bad"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in names:
        # "graph-": every chunk a hyperparallel.compile.GraphStage (its
        # add_loss an output of the captured graphs).
        graph = name.startswith("graph-")
        sched_name = name[len("graph-"):] if graph else name
        m = microbatches(sched_name, p)
        sched = hp.pipeline.schedule(sched_name, ranks=p, microbatches=m)
        chunks = {c: RoutedChunk(c, sched.num_chunks, bad) for c in sched.chunks_of_rank(rank)}
        if graph:
            from hyperparallel.compile import GraphStage

            chunks = {c: GraphStage(ch) for c, ch in chunks.items()}
        pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=pm.loss_fn,
                                    activation_shape=(pm.MB, pm.D), timeout=60)
        opt = torch.optim.SGD([q for c in chunks.values() for q in c.parameters()], lr=pm.LR)
        losses, aux = [], []
        for step in range(pm.STEPS):
            x, y = pm.batch(step, m)
            opt.zero_grad()
            losses.append(pipe.step(x, y))
            aux.append(pipe.last_stats["aux_loss"])
            opt.step()
        results[name] = {
            "losses": losses,
            "aux": aux,
            "chunks": {c: [q.detach() for q in mod.parameters()] for c, mod in chunks.items()},
        }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
