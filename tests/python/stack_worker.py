"""One rank of the composition tests (test_stack_*.py): hyperparallel's
Pipeline with FSDP2 (fully_shard, HSDP), DTensor tensor parallelism,
torch.compile'd chunks and activation checkpointing, on real processes over
Gloo in float64. Started with torchrun's variables by the tests:

    stack_worker.py OUT_DIR MODE[+MODE...] [SCHEDULES]

Every mode saves, per configuration, the losses and the full (unsharded)
parameters of this rank's chunks after STEPS optimizer steps, for the test to
compare with single-process training (`reference` below), or the text of the
error each bad configuration raised."""

import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pipeline_model  # noqa: E402

# H = 5: dim 0 of the first linear shards unevenly. MB = 32 rows: a compiled
# GraphStage's bias sums become products from 32 rows (NOTE [Column sums as products]).
D, H, MB, STEPS, LR = 6, 5, 32, 3, 0.1


class Chunk(torch.nn.Module):
    """Linear(D, H), tanh, Linear(H, D) (tanh but on the last chunk); every
    chunk's weights from its own seed, so a chunk built alone equals the same
    chunk of the whole model."""

    def __init__(self, c: int, num_chunks: int, checkpointed=False, h: int = H):
        super().__init__()
        g = torch.Generator().manual_seed(2000 + c)
        self.up = torch.nn.Linear(D, h, dtype=torch.float64)
        self.down = torch.nn.Linear(h, D, dtype=torch.float64)
        with torch.no_grad():
            for lin in (self.up, self.down):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g, dtype=torch.float64)
                                 / lin.weight.shape[1] ** 0.5)
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=g, dtype=torch.float64) * 0.1)
        self.last = c == num_chunks - 1
        self.checkpointed = checkpointed
        self.runs = 0  # forwards of the checkpointed block, recomputes included
        # checkpointed: False, "torch" (torch.utils.checkpoint, non-reentrant)
        # or "hp" (hyperparallel.recompute.checkpoint)

    def block(self, x):
        if self.checkpointed:  # counted only here: under torch.compile a recompile per call
            self.runs += 1
        return self.down(torch.tanh(self.up(x)))

    def forward(self, x):
        if self.checkpointed == "torch":
            import torch.utils.checkpoint as ckpt

            y = ckpt.checkpoint(self.block, x, use_reentrant=False)
        elif self.checkpointed == "hp":
            import hyperparallel.recompute as rc

            y = rc.checkpoint(self.block, x, weights=list(self.parameters()))
        else:
            y = self.block(x)
        return y if self.last else torch.tanh(y)


def loss_fn(out, target):
    return torch.nn.functional.mse_loss(out, target)


def batch(step: int, m: int):
    g = torch.Generator().manual_seed(91 + step)
    x = torch.randn(m * MB, D, generator=g, dtype=torch.float64)
    y = torch.randn(m * MB, D, generator=g, dtype=torch.float64)
    return x, y


def reference(num_chunks: int, m: int, steps: int = STEPS, h: int = H):
    """Single-process training of the whole model: mean loss over the m
    microbatches (gradient accumulation), SGD."""
    chunks = [Chunk(c, num_chunks, h=h) for c in range(num_chunks)]
    return pipeline_model.train_single_process(chunks, batch, m, steps, LR, loss_fn)


def microbatches(name: str, p: int) -> int:
    return 2 * p + 2 if name == "dualpipev" else 2 * p


def full(q):
    from torch.distributed.tensor import DTensor

    q = q.detach()
    return (q.full_tensor() if isinstance(q, DTensor) else q).clone()


def train(hp, sched, chunks, *, group, dp_rank, dp, steps=STEPS, activation_shape=(MB, D),
          **kwargs):
    """Trains this rank's chunks; returns the losses and the full parameters."""
    pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, activation_shape=activation_shape,
                                timeout=60, group=group, **kwargs)
    opt = torch.optim.SGD([q for c in chunks.values() for q in c.parameters()], lr=LR)
    m = sched.num_microbatches
    losses = []
    for step in range(steps):
        x, y = batch(step, dp * m)
        rows = m * MB
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        opt.zero_grad()
        losses.append(pipe.step(x, y))
        opt.step()
    return {"losses": losses,
            "chunks": {c: [full(q) for q in mod.parameters()] for c, mod in chunks.items()}}


def shard_chunk(chunk, mesh, nested=True, **kwargs):
    from torch.distributed.fsdp import fully_shard

    if nested:
        fully_shard(chunk.up, mesh=mesh, **kwargs)
        fully_shard(chunk.down, mesh=mesh, **kwargs)
    return fully_shard(chunk, mesh=mesh, **kwargs)


def mode_fsdp(hp, out, names):
    """pp = 2 x dp = 2: each chunk fully_shard'ed over "dp" (nested: both
    linears and the chunk), the Pipeline over "pp"; every schedule named."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    p, dp, rank, dp_rank = 2, 2, mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=microbatches(name, p))
        chunks = {c: shard_chunk(Chunk(c, sched.num_chunks), mesh["dp"])
                  for c in sched.chunks_of_rank(rank)}
        out[name] = train(hp, sched, chunks, group=mesh.get_group("pp"), dp_rank=dp_rank, dp=dp)


MIXED = ["1f1b", "zbv"]  # the schedules of mode "mixed"


def mode_mixed(hp, out, names):
    """FSDP2 beside dp_group: in each chunk, `up` is fully_shard'ed over "dp"
    and `down` stays a plain module averaged by dp_group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    p, dp, rank, dp_rank = 2, 2, mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    for name in MIXED:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=microbatches(name, p))
        chunks = {}
        for c in sched.chunks_of_rank(rank):
            chunk = Chunk(c, sched.num_chunks)
            fully_shard(chunk.up, mesh=mesh["dp"])
            chunks[c] = chunk
        out["mixed-" + name] = train(hp, sched, chunks, group=mesh.get_group("pp"),
                                     dp_rank=dp_rank, dp=dp, dp_group=mesh.get_group("dp"))


STACKED = ["zb-h1", "zbv"]  # the schedules of the 8-rank modes (split: I and W)


def mode_hsdp(hp, out, names):
    """pp = 2 x HSDP (replicate 2 x shard 2) on 8 ranks: each chunk
    fully_shard'ed over the 2-D mesh ("rep", "shard"): reduce-scatter over
    "shard", all-reduce over "rep"; 4 copies of the pipeline."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "pp"))
    p, rank = 2, mesh.get_local_rank("pp")
    dp_rank = mesh.get_local_rank("rep") * 2 + mesh.get_local_rank("shard")
    for name in STACKED[:1]:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=microbatches(name, p))
        chunks = {c: shard_chunk(Chunk(c, sched.num_chunks), mesh["rep", "shard"])
                  for c in sched.chunks_of_rank(rank)}
        out["hsdp-" + name] = train(hp, sched, chunks, group=mesh.get_group("pp"),
                                    dp_rank=dp_rank, dp=4)


TP_H = 4  # the hidden width of the TP modes: DTensor's Rowwise input needs it even over tp = 2


def tensor_parallel(chunk, tp_mesh):
    """Megatron's MLP: `up` column-parallel, `down` row-parallel (its output
    all-reduced, replicated)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    return parallelize_module(chunk, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def mode_tp(hp, out, names):
    """pp = 2 x dp = 2 x tp = 2 on 8 ranks: DTensor tensor parallelism
    inside each stage, alone ("tp-": the dp copies train the same batch) and
    with each chunk fully_shard'ed over "dp" ("fsdp-tp-")."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "tp", "pp"))
    p, rank, dp_rank = 2, mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    for name in STACKED:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=microbatches(name, p))
        if name == STACKED[0]:  # TP alone: one schedule (the dp copies train the same batch)
            chunks = {c: tensor_parallel(Chunk(c, sched.num_chunks, h=TP_H), mesh["tp"])
                      for c in sched.chunks_of_rank(rank)}
            out["tp-" + name] = train(hp, sched, chunks, group=mesh.get_group("pp"), dp_rank=0,
                                      dp=1)
        chunks = {c: shard_chunk(tensor_parallel(Chunk(c, sched.num_chunks, h=TP_H), mesh["tp"]),
                                 mesh["dp"], nested=False)
                  for c in sched.chunks_of_rank(rank)}
        out["fsdp-tp-" + name] = train(hp, sched, chunks, group=mesh.get_group("pp"),
                                       dp_rank=dp_rank, dp=2)


def expect_error(out, key, fn):
    """Runs fn, which must raise: saves the exception's type and text."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        out[key] = {"error": f"{type(e).__name__}: {e}"}
    else:
        out[key] = {"error": None}


def mode_bad(hp, out, names):
    """Bad compositions on 4 ranks: each must fail on every rank at
    construction, naming the cause, and leave the groups usable."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    p, rank = 2, mesh.get_local_rank("pp")
    sched = hp.pipeline.schedule("zb-h1", ranks=p, microbatches=microbatches("zb-h1", p))

    def build(chunks, **kw):
        hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, activation_shape=(MB, D),
                             timeout=30, group=mesh.get_group("pp"), **kw)

    # Sharded over the pipeline's own dimension.
    expect_error(out, "mesh-is-pp", lambda: build(
        {c: shard_chunk(Chunk(c, 2), mesh["pp"]) for c in sched.chunks_of_rank(rank)}))
    # FSDP2 and dp_group both for the same parameters.
    expect_error(out, "fsdp-and-dp-group", lambda: build(
        {c: shard_chunk(Chunk(c, 2), mesh["dp"]) for c in sched.chunks_of_rank(rank)},
        dp_group=mesh.get_group("dp")))
    # Only rank 0 of each pipeline shards its chunk wrongly: still every rank fails.
    expect_error(out, "one-rank-bad", lambda: build(
        {c: shard_chunk(Chunk(c, 2), mesh["pp"] if rank == 0 else mesh["dp"])
         for c in sched.chunks_of_rank(rank)}))
    # dp_group over other ranks than FSDP2's mesh (the world: 4 ranks, not 2).
    def mixed(c):
        chunk = Chunk(c, 2)
        from torch.distributed.fsdp import fully_shard

        fully_shard(chunk.up, mesh=mesh["dp"])
        return chunk

    expect_error(out, "dp-group-other-ranks", lambda: build(
        {c: mixed(c) for c in sched.chunks_of_rank(rank)}, dp_group=dist.group.WORLD))
    # A schedule that replicates chunks (DualPipe's mirrored copies).
    dual = hp.pipeline.schedule("dualpipe", ranks=p, microbatches=4)
    expect_error(out, "replicated", lambda: hp.pipeline.Pipeline(
        {c: shard_chunk(Chunk(c, dual.num_chunks), mesh["dp"]) for c in dual.chunks_of_rank(rank)},
        dual, loss_fn=loss_fn, activation_shape=(MB, D), timeout=30, group=mesh.get_group("pp")))
    # The groups still work: a good pipeline trains after the refusals.
    chunks = {c: shard_chunk(Chunk(c, 2), mesh["dp"]) for c in sched.chunks_of_rank(rank)}
    out["after-errors"] = train(hp, sched, chunks, group=mesh.get_group("pp"),
                                dp_rank=mesh.get_local_rank("dp"), dp=2)
    # FSDP2 stages with nothing declared: the messages describe themselves,
    # no forward runs outside FSDP2's control (NOTE [Pytrees between stages]).
    chunks = {c: shard_chunk(Chunk(c, 2), mesh["dp"]) for c in sched.chunks_of_rank(rank)}
    out["fsdp-messages"] = train(hp, sched, chunks, group=mesh.get_group("pp"),
                                 dp_rank=mesh.get_local_rank("dp"), dp=2, activation_shape=None)


def counting_backend(counts, c):
    """AOTAutograd without a code generator (the graphs run as they are),
    counting the runs of the compiled backward of chunk c."""
    from torch._dynamo.backends.common import aot_autograd

    def bw_compiler(gm, example_inputs):
        def run(*args):
            counts[c] = counts.get(c, 0) + 1
            return gm.forward(*args)

        return run

    return aot_autograd(fw_compiler=lambda gm, ex: gm.forward, bw_compiler=bw_compiler)


def mode_compile(hp, out, names):
    """pp = 2: every chunk torch.compile'd (AOTAutograd's compiled backward,
    one autograd node); counts the compiled backward's runs."""
    p = dist.get_world_size()
    for name in [n for n in dict.fromkeys(names) if not n.startswith(("hp-", "graph-"))]:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=microbatches(name, p))
        torch._dynamo.reset()
        counts = {}
        chunks = {c: torch.compile(Chunk(c, sched.num_chunks), backend=counting_backend(counts, c))
                  for c in sched.chunks_of_rank(dist.get_rank())}
        key = "compile-" + name
        out[key] = train(hp, sched, chunks, group=None, dp_rank=0, dp=1)
        out[key]["bw_runs"] = {c: counts.get(c, 0) / (STEPS * sched.num_microbatches)
                               for c in chunks}


def mode_graph(hp, out, names):
    """pp = 2: every chunk a hyperparallel.compile.GraphStage (captured FX
    graphs, backward split into dx and dw at the graph level; NOTE [Graph
    stages]); "inductor-" before a schedule's name compiles each graph with
    inductor. Counts each graph's runs."""
    from hyperparallel.compile import GraphStage

    p = dist.get_world_size()
    for key in [n for n in dict.fromkeys(names) if n.startswith("graph-")]:
        name = key[len("graph-"):]
        backend = None
        if name.startswith("inductor-"):
            name, backend = name[len("inductor-"):], "inductor"
            torch._dynamo.reset()
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=microbatches(name, p))
        chunks = {c: GraphStage(Chunk(c, sched.num_chunks), backend=backend)
                  for c in sched.chunks_of_rank(dist.get_rank())}
        out[key] = train(hp, sched, chunks, group=None, dp_rank=0, dp=1)
        # Each graph's runs per microbatch (captures: per chunk).
        out[key]["counts"] = {c: {k: (v if k == "capture" else v / (STEPS * sched.num_microbatches))
                                  for k, v in ch.counts.items()}
                              for c, ch in chunks.items()}
        # The bias sums left in each chunk's dw and fused graphs (NOTE [Column
        # sums as products]: none once inductor compiles them).
        out[key]["sums"] = {c: sum(n.target is torch.ops.aten.sum.dim_IntList
                                   for g in ch.graphs() for gm in (g.dw, g.backward)
                                   for n in gm.graph.nodes)
                            for c, ch in chunks.items()}


CHECKPOINTED = ["1f1b", "zb-h1", "hp-zb-h1", "hp-zbv"]  # what mode "checkpoint" runs


def mode_checkpoint(hp, out, names):
    """pp = 2: every chunk's block under torch.utils.checkpoint
    (non-reentrant), or under hyperparallel.recompute.checkpoint ("hp-"
    before the schedule's name); counts the block's runs."""
    p = dist.get_world_size()
    for key in [n for n in dict.fromkeys(names) if n in CHECKPOINTED]:
        name = key[3:] if key.startswith("hp-") else key
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=microbatches(name, p))
        chunks = {c: Chunk(c, sched.num_chunks,
                           checkpointed="hp" if key.startswith("hp-") else "torch")
                  for c in sched.chunks_of_rank(dist.get_rank())}
        key = "checkpoint-" + key
        out[key] = train(hp, sched, chunks, group=None, dp_rank=0, dp=1)
        # Runs of each chunk's block per microbatch: 1 (the forward) + recomputes.
        out[key]["runs"] = {c: ch.runs / (STEPS * sched.num_microbatches)
                            for c, ch in chunks.items()}


def main():
    out_dir, mode = sys.argv[1], sys.argv[2]
    names = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else []
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import hyperparallel as hp

    out = {}
    modes = {"fsdp": mode_fsdp, "mixed": mode_mixed, "bad": mode_bad, "compile": mode_compile,
             "checkpoint": mode_checkpoint, "graph": mode_graph, "hsdp": mode_hsdp, "tp": mode_tp}
    for one in mode.split("+"):  # several modes in one launch: one start-up of the ranks
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            modes[one](hp, out, names)
        out["warnings-" + one] = [f"{w.category.__name__}: {w.message}" for w in caught]
    torch.save(out, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
