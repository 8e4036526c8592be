"""What the Pipeline's Python paths cost per step, side by side in one run:
the GPT of hyperparallel.models on 2 real processes (Gloo, CPU, one thread
each, pinned where the machine allows), every variant built over the same
group and stepped in turn, round after round, so they share the machine's
noise:

* ``bare``: the C++ Runtime given the chunks behind the thinnest Python
  callable the runtime takes (what a stage cost before keyword arguments,
  auxiliary losses and structures between stages came in);
* ``declared``: hyperparallel.pipeline.Pipeline with activation_shape given;
* ``found``: the Pipeline with nothing declared (NOTE [Pytrees between
  stages] in python/hyperparallel/pipeline/transfers.py: the messages carry
  their layout; one small all-reduce per step checks the arguments);
* ``kwargs``: ``found``, plus a keyword argument (a per-row tensor) split
  into the microbatches and handed to every stage.

    .venv/bin/python bench/python/bench_pipeline_paths.py [--rounds 7] [--steps 10]

Prints the median step time of each variant and its ratio to ``bare``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _WithRows:
    """A chunk whose forward takes a keyword argument it does not need."""

    def __init__(self, chunk):
        self.chunk = chunk

    def __call__(self, x, row_weight=None):
        return self.chunk(x)


def join_ranks(rank: int, world: int, store_path: str) -> None:
    """A benchmark rank's set-up: one intra-op thread, pinned where the
    machine allows, the default group (Gloo) over a FileStore."""
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)


def gpt_rank(rank: int, world: int, store_path: str, schedule: str):
    """One rank of the benchmarks' GPT (4 layers, d_model 64, 8 microbatches
    of 4 rows): one intra-op thread, pinned where the machine allows, the
    default group over a FileStore. Returns (config, m, rows, sched,
    chunks, data)."""
    join_ranks(rank, world, store_path)
    import hyperparallel as hp
    from hyperparallel import models

    config = models.GPTConfig(layers=4, d_model=64, heads=4, seq_len=32)
    m, rows = 8, 4
    sched = hp.pipeline.schedule(schedule, ranks=world, microbatches=m)
    chunks = models.gpt_chunks(config, sched.chunks_of_rank(rank), sched.num_chunks, seed=0)
    return config, m, rows, sched, chunks, models.RandomTokens(config, rows, seed=0)


def rank_main(rank: int, world: int, store_path: str, args, out: str) -> None:
    config, m, rows, sched, chunks, data = gpt_rank(rank, world, store_path, args.schedule)
    import torch
    import torch.distributed as dist

    import hyperparallel as hp
    from hyperparallel import _C, models

    shape = config.activation_shape(rows)

    def bare():
        loss = hp.pipeline._LossOfMicrobatch(models.gpt_loss)
        fwd = {c: (lambda mod: lambda x, mb, stage: mod(x))(mod) for c, mod in chunks.items()}
        params = {c: [q for q in mod.parameters()] for c, mod in chunks.items()}
        options = _C.pipeline.PipelineOptions()
        options.cache_cpu_memory, options.recompute_sessions = True, sched.has_split
        rt = _C.pipeline.Runtime(sched, dist.group.WORLD, fwd, params, loss, tuple(shape),
                                 options)

        def step(x, y, w):
            loss.targets = list(y.chunk(m))
            try:
                return rt.step(list(x.chunk(m)) if sched.needs_inputs(rank) else [])["loss"]
            finally:
                loss.targets = []
        return step

    def pipeline(found: bool, kwargs: bool):
        mods = {c: _WithRows(mod) for c, mod in chunks.items()} if kwargs else chunks
        params = {c: list(mod.parameters()) for c, mod in chunks.items()}
        pipe = hp.pipeline.Pipeline(mods, sched, loss_fn=models.gpt_loss, parameters=params,
                                    activation_shape=None if found else shape)

        def step(x, y, w):
            return pipe.step(x, y, row_weight=w) if kwargs else pipe.step(x, y)
        return step

    variants = {"bare": bare(), "declared": pipeline(False, False),
                "found": pipeline(True, False), "kwargs": pipeline(True, True)}
    times = {k: [] for k in variants}
    step_no = 0
    for _ in range(args.rounds):
        for name, step in variants.items():
            for s in range(args.steps):
                x, y = data.batch(step_no, m)
                w = torch.ones(x.shape[0])
                for c in chunks.values():
                    c.zero_grad(set_to_none=False)
                dist.barrier()
                t0 = time.perf_counter()
                step(x, y, w)
                dt = time.perf_counter() - t0
                if s > 0:  # the first step of a round warms up
                    times[name].append(dt)
                step_no += 1
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def two_ranks(rank_main, *args):
    """Runs rank_main(rank, 2, store_path, *args, out_path) in 2 spawned
    processes; returns the JSON rank 0 wrote to out_path."""
    import json
    import multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, 2, store, *args, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        with open(out) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--schedule", default="zb-h1")
    args = ap.parse_args()
    times = two_ranks(rank_main, args)
    base = statistics.median(times["bare"])
    print(f"{args.schedule}, p = 2, m = 8, GPT 4 x 64, {args.rounds} rounds x "
          f"{args.steps - 1} timed steps per variant (median step)")
    print("| variant | ms per step | vs bare |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.2f} | {med / base:.3f} |")


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
