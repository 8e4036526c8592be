"""Graph-mode FSDP (hyperparallel.compile, AutoOverlapPass) against eager
FSDP2 (torch.distributed.fsdp.fully_shard) on the same GPT, side by side.

Two real processes (Gloo, CPU, float32, one intra-op thread each) hold three
sides of each setting and take turns, round by round, in alternating order:

  graph     GraphTrainer, PassConfig(reshard_after_forward=R): FSDPPass +
            AutoOverlapPass (prefetch 1)
  graph-no  the same without AutoOverlapPass (enable_overlap=False): every
            wait right after its collective, so all communication exposed
  fsdp2     fully_shard on every block, then on the root
            (reshard_after_forward=R), loss.backward()

All three train the same GPT (hyperparallel.models, one seed) on the same
batches (each rank its own microbatch of RandomTokens) with Adam
(foreach=False, lr 1e-3), so their losses must agree step by step (float32:
checked to 1e-3 relative; the run fails otherwise).

Measured per step (each rank's wall time of train step + optimizer step;
the step's time is the slower rank's): the median over all timed steps of
each side, and the ratio graph / fsdp2 (< 1: graph mode faster); also the
ratio of each round's medians (its median, min and max over the rounds).

Communication ("comm ms"): the time the training thread is blocked in
communication per step, on rank 0.
  graph sides: every collective-issue and wait_tensor node of the compiled
    graph is wrapped with perf_counter (the graph's node targets replaced
    after compile; the same wrapping on both graph sides). hidden share =
    1 - comm(graph) / comm(graph-no).
  fsdp2: time inside torch.distributed.all_gather_into_tensor,
    reduce_scatter_tensor, all_reduce and Work.wait as FSDP2 calls them
    (patched for the run). FSDP2 on the CPU issues its collectives with
    async_op=False (no streams to overlap on), so all of it is exposed; the
    column shows how much that is.

Optimizer ("opt ms"): rank 0's time of optimizer.step() + zero_grad() in
the step (graph: on the plain shards; FSDP2: on its DTensor parameters).

Peak memory ("peak MiB"): one extra step per side after the timed rounds,
the peak of hyperparallel's tracking CPU allocator (installed before any
model is built; it counts inside ops too: NOTE [Peak memory without a
dispatch mode]); reported: the highest reading minus the reading at the
step's start (parameters, optimizer state and gradients of the last step
freed at zero_grad are in the baseline), rank 0.

Usage: python bench/python/bench_graph_fsdp.py [--rounds 5] [--steps 4]
         [--settings small,medium] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RANKS = 2

# name -> (GPTConfig kwargs, rows per rank)
MODELS = {
    "tiny": (dict(layers=1, d_model=16, heads=2, vocab=32, seq_len=8), 2),
    "small": (dict(layers=2, d_model=64, heads=4, vocab=256, seq_len=32), 4),
    "medium": (dict(layers=4, d_model=128, heads=4, vocab=256, seq_len=64), 4),
}
SIDES = ("graph", "graph-no", "fsdp2")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per side per round")
    ap.add_argument("--settings", default="small,medium",
                    help=f"models, comma-separated, from {', '.join(MODELS)}; each runs with "
                         "reshard_after_forward off and on")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.settings = args.settings.split(",")
    bad = [s for s in args.settings if s not in MODELS]
    if bad:
        ap.error(f"--settings: unknown {', '.join(bad)} (known: {', '.join(MODELS)})")
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be >= 1")
    return args


# ---------------------------------------------------------------------------
# One rank.
# ---------------------------------------------------------------------------
class Comm:
    """Seconds the training thread spent blocked in communication (the
    outermost timed call only: a synchronous dist.all_gather_into_tensor
    waits on its Work inside)."""
    total = 0.0
    depth = 0
    optimizer = 0.0  # seconds of the last step's optimizer step + zero_grad


def _timed(fn):
    def wrapper(*a, **k):
        if Comm.depth:
            return fn(*a, **k)
        Comm.depth += 1
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            Comm.total += time.perf_counter() - t
            Comm.depth -= 1
    wrapper.__name__ = getattr(fn, "__name__", "timed")
    return wrapper


def _instrument_graph(gm):
    """Replaces every collective and wait node's target by a timed wrapper."""
    from hyperparallel.compile.passes._collectives import COLLECTIVES, WAIT

    wrapped = {t: _timed(t) for t in (*COLLECTIVES, WAIT)}
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in wrapped:
            node.target = wrapped[node.target]
            n += 1
    gm.recompile()
    return n


def _patch_fsdp2_comm():
    import torch.distributed as dist
    from torch._C._distributed_c10d import Work

    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
        setattr(dist, name, _timed(getattr(dist, name)))
    Work.wait = _timed(Work.wait)


class PeakMemory:
    """The tracking CPU allocator's peak (hp/core/memory.h) over a block:
    every byte of CPU tensor storage, inside an op too.

    NOTE [Peak memory without a dispatch mode]
    This was a TorchDispatchMode reading memory_allocated() after every ATen
    op. A Python dispatch mode is thread-local state that torch carries into
    the threads it runs work on, and a rank segfaulted mid-step about once in
    eleven runs with it on (never without); the allocator counts its peak
    itself, at no cost per op and on every thread."""

    def __init__(self):
        import hyperparallel._C as _C

        self._C, self.peak = _C, 0

    def __enter__(self):
        self._C.profile.reset_peak_memory()
        self.base = self._C.profile.memory_allocated()
        return self

    def __exit__(self, *exc):
        self.peak = self._C.profile.peak_memory_allocated()


def rank_main(args, out_dir):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "python"))
    import hyperparallel._C as _C
    from hyperparallel.compile import GraphTrainer, PassConfig
    from hyperparallel.models import GPT, GPTConfig, RandomTokens, gpt_loss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    _C.profile.install_memory_tracker()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    _patch_fsdp2_comm()

    def train_fn(model, x, y):
        return gpt_loss(model(x), y)

    class GraphSide:
        def __init__(self, config, overlap, reshard):
            self.model = GPT(config, seed=1)
            self.trainer = GraphTrainer(
                self.model, train_fn,
                PassConfig(enable_overlap=overlap, reshard_after_forward=reshard),
                None, {"lr": 1e-3}, device="cpu")
            self.instrumented = set()

        def step(self, x, y):
            loss = self.trainer.train_step(x, y)
            for gm in self.trainer.graph_modules:
                if id(gm) not in self.instrumented:
                    self.instrumented.add(id(gm))
                    _instrument_graph(gm)
            t = time.perf_counter()
            self.trainer.optimizer_step()
            Comm.optimizer = time.perf_counter() - t
            return loss

    class FSDP2Side:
        def __init__(self, config, reshard):
            self.model = GPT(config, seed=1)
            for block in self.model.blocks():
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(self.model, mesh=mesh, reshard_after_forward=reshard)
            self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3, foreach=False)

        def step(self, x, y):
            loss = train_fn(self.model, x, y)
            loss.backward()
            t = time.perf_counter()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            Comm.optimizer = time.perf_counter() - t
            return loss.detach()

    report = {}
    for model_name in args.settings:
        kwargs, rows = MODELS[model_name]
        config = GPTConfig(**kwargs)
        data = RandomTokens(config, rows, seed=2)
        for reshard in (False, True):
            setting = f"{model_name}/reshard={'on' if reshard else 'off'}"
            sides = {"graph": GraphSide(config, True, reshard),
                     "graph-no": GraphSide(config, False, reshard),
                     "fsdp2": FSDP2Side(config, reshard)}
            counters = {s: 0 for s in SIDES}
            times = {s: [] for s in SIDES}
            comm = {s: [] for s in SIDES}
            optim = {s: [] for s in SIDES}
            losses = {s: [] for s in SIDES}
            round_ratio = []

            def run(side, timed):
                step = counters[side]
                counters[side] += 1
                x, y = data.get(step, rank)
                dist.barrier()
                Comm.total = 0.0
                t = time.perf_counter()
                loss = sides[side].step(x, y)
                dt = time.perf_counter() - t
                c = Comm.total
                slow = torch.tensor([dt])
                dist.all_reduce(slow, op=dist.ReduceOp.MAX)
                mean = loss.detach().float().reshape(1).clone()
                dist.all_reduce(mean)
                losses[side].append(mean.item() / world)
                if timed:
                    times[side].append(slow.item())
                    comm[side].append(c)
                    optim[side].append(Comm.optimizer)
                return slow.item()

            for side in SIDES:  # warm-up: compile (graph), first-step allocations
                run(side, False)
            for r in range(args.rounds):
                order = SIDES if r % 2 == 0 else tuple(reversed(SIDES))
                got = {s: [] for s in SIDES}
                for side in order:
                    for _ in range(args.steps):
                        got[side].append(run(side, True))
                round_ratio.append(statistics.median(got["graph"])
                                   / statistics.median(got["fsdp2"]))
            peak = {}
            for side in ("graph", "fsdp2"):
                with PeakMemory() as pm:
                    run(side, False)
                peak[side] = pm.peak - pm.base
            diff = max(abs(a - b) / abs(b) for s in ("graph", "graph-no")
                       for a, b in zip(losses[s], losses["fsdp2"]))
            med = {s: statistics.median(times[s]) * 1e3 for s in SIDES}
            cms = {s: statistics.median(comm[s]) * 1e3 for s in SIDES}
            report[setting] = {
                "steps": {s: len(times[s]) for s in SIDES},
                "median_ms": med,
                "ratio": med["graph"] / med["fsdp2"],
                "round_ratios": round_ratio,
                "round_ratio_median": statistics.median(round_ratio),
                "comm_ms": cms,
                "optimizer_ms": {s: statistics.median(optim[s]) * 1e3 for s in SIDES},
                "hidden_share": (1.0 - cms["graph"] / cms["graph-no"]) if cms["graph-no"] > 0
                                else None,
                "peak_mib": {s: v / 2**20 for s, v in peak.items()},
                "loss_max_rel_diff": diff,
                "losses": losses,
            }
            del sides
    if rank == 0:
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# The launcher.
# ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(report, args) -> str:
    lines = [f"graph FSDP (AutoOverlapPass) / eager FSDP2, paired: {RANKS} ranks, Gloo, CPU, "
             f"float32, 1 thread per rank, {args.rounds} rounds x {args.steps} steps per side",
             f"{'setting':<22} {'graph ms':>9} {'fsdp2 ms':>9} {'ratio':>6} {'rounds med (min-max)':>20} "
             f"{'graph-no ms':>11} {'comm ms g/no/f2':>17} {'hidden':>7} "
             f"{'peak MiB g/f2':>14} {'opt ms g/f2':>12} {'loss diff':>9}"]
    for name, s in report.items():
        m, c, p = s["median_ms"], s["comm_ms"], s["peak_mib"]
        rr = s["round_ratios"]
        hidden = "-" if s["hidden_share"] is None else f"{100 * s['hidden_share']:.0f}%"
        lines.append(
            f"{name:<22} {m['graph']:>9.2f} {m['fsdp2']:>9.2f} {s['ratio']:>6.2f} "
            f"{s['round_ratio_median']:>8.2f} ({min(rr):.2f}-{max(rr):.2f}) "
            f"{m['graph-no']:>11.2f} "
            f"{c['graph']:>5.2f}/{c['graph-no']:.2f}/{c['fsdp2']:.2f} {hidden:>7} "
            f"{p['graph']:>6.2f}/{p['fsdp2']:<6.2f} "
            f"{s['optimizer_ms']['graph']:>5.2f}/{s['optimizer_ms']['fsdp2']:<6.2f} "
            f"{s['loss_max_rel_diff']:>9.1e}")
    return "\n".join(lines)


def main(argv=None):
    args = parse(argv)
    if "RANK" in os.environ:
        rank_main(args, os.environ["HP_BENCH_OUT"])
        from hyperparallel.train_utils import end_rank

        end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        procs = []
        for r in range(RANKS):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(r),
                       LOCAL_WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", HP_BENCH_OUT=tmp)
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                           *(argv if argv is not None else sys.argv[1:])],
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=3600))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
        if failed:
            for r, rc in failed:
                sys.stderr.write(f"rank {r} exit {rc}:\n{outs[r][1][-4000:]}\n")
            return 1
        with open(os.path.join(tmp, "report.json")) as f:
            report = json.load(f)
    bad = {n: s["loss_max_rel_diff"] for n, s in report.items() if s["loss_max_rel_diff"] > 1e-3}
    print(table(report, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "settings": report}, f, indent=1)
    if bad:
        sys.stderr.write(f"the sides' losses disagree: {bad}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
