#!/usr/bin/env python3
"""PP x FSDP2: PyTorch's pipelining against our Python runtime with the same
`fully_shard`ed stages, step by step in the same processes (paired.py's
method on 4 ranks).

    .venv/bin/python bench/peers/paired_fsdp.py --rounds 2 --steps 12

Each row starts 4 ranks: pp 2 x dp 2, the mesh of
tests/python/stack_worker.py's "fsdp" mode (init_device_mesh("cpu", (2, 2),
("dp", "pp")): ranks 0, 1 and 2, 3 are the two pipelines, 0, 2 and 1, 3 the
data-parallel pairs). Each side gets a mesh of its own (so its own Gloo
groups) and its own copy of the same GPT chunks, each chunk's blocks and then
the chunk itself `fully_shard`ed over the mesh's "dp" dimension with
reshard_after_forward=False (torchtitan's choice under PP: no all-gather per
microbatch); the same settings on both sides. PyTorch's side: Schedule<NAME>
over PipelineStages on the "pp" group (its own FSDP2 handling: gradient sync
and resharding off until the stage's last backward, then post_backward).
Ours: hyperparallel.pipeline.Pipeline over the "pp" group, no dp_group
(NOTE [FSDP2 stages] in python/hyperparallel/pipeline/fsdp2.py). Data-parallel rank
d of step k trains on the dataset's batch 2k + d; both sides report the mean
loss over the dp ranks (ours does it inside Pipeline.step; PyTorch's side
all-reduces it over its "dp" group inside its timed step), and the two must
agree (relative 1e-4). Four processes share the host's cores (rank r pinned
to core r mod the cores, one intra-op thread each): on a 2-core host each
core runs one rank of each pipeline.

The two sides then take turns as in paired.py (paired.take_turns): a row's
ratio is the median over its pairs of PyTorch's step over ours (above 1: we
are faster), the first step of each side is warm-up. A PyTorch schedule that
fails with FSDP2 is a row with its error text.

--memory SCHEDULES: one more step per side after the timed ones of the
row (a run of its own, one step of warm-up, for a schedule without a row),
with hyperparallel's tracking CPU allocator counting its peak
(bench/python/bench_graph_fsdp.py's PeakMemory, inside ops too; the
tracker is installed before any model is built): the highest reading minus
the reading at the step's start, taken after zero_grad(set_to_none=True):
the shards and the optimizer's state are in the baseline, the unsharded
parameters are not (FSDP2 freed their storage at the end of the step
before, on both sides). So it counts the step's
activations and their gradients, the all-gathered (unsharded) parameters and
their unsharded gradients, the reduce-scatter's buffers and sharded
gradients, and the optimizer step's temporaries; op-internal temporaries
freed inside one op are not seen. Our side's memory rows also run schedules
PyTorch lacks: SCHEDULES are ours (e.g. 1f1b,zb-h1,zbv); where a PyTorch
schedule maps to one of them (PAIRS), its step is measured too.
"""
import argparse
import copy
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(os.path.dirname(HERE), "python"))  # bench_graph_fsdp
import common  # noqa: E402
import paired  # noqa: E402
from compare import PAIRS, max_rel_diff  # noqa: E402

HP_OF = paired.HP_OF
THEIRS_OF = {ours: theirs for theirs, ours, _ in PAIRS}
PP, DP = 2, 2
GOALS = {"*": 1.0, "ZBVZeroBubble": 1.1}  # the issue: never slower; ZB-V at least 1.1x
# Our schedules that only the memory rows run (no PyTorch counterpart): chunks per rank.
HP_ONLY = {"zb-h1": 1, "zb-h2": 1}


def shard(mesh):
    """chunk -> chunk with each block, then the chunk, fully_shard'ed over mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard

    def prepare(chunk):
        for block in chunk.blocks():
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        return fully_shard(chunk, mesh=mesh["dp"], reshard_after_forward=False)
    return prepare


def worker(args):
    common.run_worker(args, run_rank)


def run_rank(args, rank, world, torch, dist, error):
    import hp_python
    from torch.distributed.device_mesh import init_device_mesh

    import hyperparallel._C as _C

    if args.memory_step:
        _C.profile.install_memory_tracker()  # before any model: every tensor counted
    if world != PP * DP:
        raise ValueError(f"paired_fsdp runs on {PP * DP} ranks, not {world}")
    config, data = common.model_and_data(args.setting, args.seed)
    m = common.SETTINGS[args.setting]["microbatches"]
    meshes = {k: init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
              for k in ("torch", "hp-py")}
    pp_rank = meshes["hp-py"].get_local_rank("pp")
    dp_rank = meshes["hp-py"].get_local_rank("dp")
    sides = {}
    if args.schedule in HP_OF:
        theirs, (ours, chunks) = args.schedule, HP_OF[args.schedule]
        error[0] = f"PyTorch's Schedule{theirs}, building"
        sides["torch"] = TorchFsdpSide(args, pp_rank, PP, config, meshes["torch"])
    else:  # one of ours alone (memory rows)
        ours, chunks = args.schedule, HP_ONLY[args.schedule]
    hp_args = copy.copy(args)
    hp_args.schedule, hp_args.chunks = ours, chunks
    hp_args.receive_lookahead, hp_args.malloc_default, hp_args.p2p = 0, False, args.hp_p2p
    error[0] = f"our {ours}, building"
    sides["hp-py"] = hp_python.HpSide(hp_args, pp_rank, PP, config,
                                      group=meshes["hp-py"].get_group("pp"),
                                      prepare=shard(meshes["hp-py"]))

    def batch(step):
        return data.batch(DP * step + dp_rank, m)

    result = {k: {"step_seconds": [], "losses": [], "cpu_seconds": []} for k in sides}
    actions, outside = {}, []
    if args.steps:
        error[0] = "the paired steps (PyTorch's or ours)"
        result, actions, outside = paired.take_turns(args, sides, batch, rank, world, torch,
                                                     dist)
    if args.memory_step:
        from bench_graph_fsdp import PeakMemory

        x, y = batch(args.steps)
        for k, side in sides.items():
            error[0] = f"the memory step of {'PyTorch' if k == 'torch' else 'ours'}"
            dist.barrier()
            side.optimizer.zero_grad(set_to_none=True)
            with PeakMemory() as pm:
                loss = side.step(x, y)
            mine = torch.tensor([pm.peak - pm.base, unsharded_bytes(side.optimizer)],
                                dtype=torch.float64)
            everyone = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine)
            result[k]["memory_loss"] = loss
            result[k]["peak_bytes"] = [float(t[0]) for t in everyone]
            result[k]["unsharded_param_bytes"] = [float(t[1]) for t in everyone]
    everyone = [None] * world
    dist.all_gather_object(everyone, {"actions": actions, "outside": outside})
    if rank == 0:
        if args.steps > 1:
            result["ideal_seconds"] = paired.ideal_step(sides["hp-py"].sched, everyone)
        result.update({"setting": args.setting, "schedule": args.schedule, "hp_schedule": ours,
                       "nproc": world, "mesh": "dp 2 x pp 2", "torch_version": torch.__version__})
        common.write_result(args.out, result)
    dist.barrier()
    dist.destroy_process_group()


def unsharded_bytes(optimizer):
    """Bytes of the optimizer's (FSDP2's sharded) parameters at full size (a
    DTensor's numel is its global one): the rank's unsharded parameters, and
    as much again for their unsharded gradients."""
    return sum(q.numel() * q.element_size() for g in optimizer.param_groups
               for q in g["params"])


class TorchFsdpSide:
    """torch_pipelining.TorchSide on the mesh's "pp" group over fully_shard'ed
    chunks, its step's loss averaged over the "dp" group as ours is."""

    def __init__(self, args, pp_rank, pp, config, mesh):
        import torch_pipelining

        self.inner = torch_pipelining.TorchSide(args, pp_rank, pp, config,
                                                group=mesh.get_group("pp"), instrument=False,
                                                prepare=shard(mesh))
        self.optimizer, self.dp_group = self.inner.optimizer, mesh.get_group("dp")

    def step(self, x, y):
        import torch
        import torch.distributed as dist

        loss = torch.tensor([self.inner.step(x, y)], dtype=torch.float64)
        dist.all_reduce(loss, group=self.dp_group)
        return float(loss.item()) / DP


def summarize_row(runs):
    """paired.summarize over a row's runs, or None when no run had both sides."""
    both = [r for r in runs if "torch" in r and r["torch"]["step_seconds"]]
    return paired.summarize(both) if both else None


def memory_of(runs):
    """{side: (peak MiB of the busiest rank, rank, unsharded parameter MiB of that rank)}."""
    out = {}
    for r in runs:
        for k in ("torch", "hp-py"):
            if k in r and "peak_bytes" in r[k]:
                peaks = r[k]["peak_bytes"]
                i = max(range(len(peaks)), key=peaks.__getitem__)
                out[k] = (peaks[i] / 2**20, i, r[k]["unsharded_param_bytes"][i] / 2**20,
                          [p / 2**20 for p in peaks])
    return out


def render(report):
    out = []
    a = report["args"]
    for setting, rows in report["rows"].items():
        spec = common.SETTINGS[setting]
        out.append(f"**{setting}**: gpt, {spec['layers']} layers, d_model {spec['d_model']}, "
                   f"{spec['heads']} heads, seq {spec['seq_len']}, {spec['microbatches']} "
                   f"microbatches of {spec['microbatch_size']} per dp rank, pp 2 x dp 2 = 4 "
                   f"ranks, FSDP2 over dp (blocks and chunk, reshard_after_forward=False), "
                   f"{a['steps']} steps x {a['rounds']} rounds, our side's p2p={a['hp_p2p']}\n")
        out.append("| PyTorch schedule | hp schedule | PyTorch step ms | hp Python step ms | "
                   "PyTorch / hp Python, paired (middle half) | per round | "
                   "CPU ms per step, busiest rank (PyTorch / hp Python) | goal | losses agree |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for name, row in rows.items():
            s, err = row["summary"], row.get("error")
            goal = GOALS.get(name, GOALS["*"])
            if s is None:
                err = (err or "?").replace("|", "/")
                out.append(f"| {name} | {HP_OF[name][0]} | failed: {err} | | | | | "
                           f">= {goal} | |")
                continue
            agree = "yes" if s["max_loss_rel_diff"] <= a["tolerance"] else "NO"
            met = "met" if s["ratio"] >= goal else "NOT met"
            out.append(
                f"| {name} | {HP_OF[name][0]} | {s['torch_ms']:.1f} | {s['hp_ms']:.1f} | "
                f"{s['ratio']:.2f} ({s['q25']:.2f}-{s['q75']:.2f}) | "
                f"{', '.join(f'{x:.2f}' for x in s['per_round'])} | "
                f"{s['torch_cpu_ms']:.1f} / {s['hp_cpu_ms']:.1f} | >= {goal}: {met} | "
                f"{agree} ({s['max_loss_rel_diff']:.1e}) |")
        mem = report["memory"].get(setting, {})
        if mem:
            out.append("\nPeak CPU memory of one step over its start (after zero_grad), "
                       "the busiest rank (MiB; every rank's in brackets, ranks 0-3); "
                       "unsharded parameters of that rank (their unsharded gradients are as "
                       "much again):\n")
            out.append("| hp schedule | hp Python peak MiB (ranks) | PyTorch schedule | "
                       "PyTorch peak MiB (ranks) | unsharded params MiB |")
            out.append("|---|---|---|---|---|")
            for ours, row in mem.items():
                mine = row.get("hp-py")
                theirs = row.get("torch")
                cell = (lambda v: f"{v[0]:.2f} ({', '.join(f'{p:.2f}' for p in v[3])})"
                        if v else (row.get("error") or "-"))
                out.append(f"| {ours} | {cell(mine)} | {THEIRS_OF.get(ours, '-')} | "
                           f"{cell(theirs) if ours in THEIRS_OF else '-'} | "
                           f"{(mine or theirs or (0, 0, float('nan')))[2]:.2f} |")
        out.append("")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="steps of each side per run")
    ap.add_argument("--settings", default="compute")
    ap.add_argument("--schedules", default=",".join(p[0] for p in PAIRS),
                    help="PyTorch names, e.g. 1F1B,ZBVZeroBubble")
    ap.add_argument("--memory", default="",
                    help="our schedules whose peak memory to measure (one step per side "
                         "after a row's timed steps), e.g. 1f1b,zb-h1,zbv")
    ap.add_argument("--hp-p2p", default="auto", choices=["auto", "group", "shm"])
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--json", default="")
    ap.add_argument("--markdown", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=300)
    # one rank of one row (internal)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--setting", default="")
    ap.add_argument("--schedule", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--memory-step", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    args.model = "gpt"
    if args.worker:
        worker(args)
        common.end_rank()
    settings = [s for s in args.settings.split(",") if s]
    schedules = [s for s in args.schedules.split(",") if s]
    memory = [s for s in args.memory.split(",") if s]
    for s in settings:
        if s not in common.SETTINGS:
            ap.error(f"--settings: {s!r} is not one of {', '.join(common.SETTINGS)}")
    for s in schedules:
        if s not in HP_OF:
            ap.error(f"--schedules: {s!r} is not one of {', '.join(HP_OF)}")
    for s in memory:
        if s not in THEIRS_OF and s not in HP_ONLY:
            ap.error(f"--memory: {s!r} is not one of {', '.join([*THEIRS_OF, *HP_ONLY])}")
    if schedules and args.steps < 3:
        ap.error("--steps must be at least 3 (the first is warm-up)")
    script = os.path.abspath(__file__)

    def argv_of(steps, measured):
        def f(setting, name):
            return ["--setting", setting, "--schedule", name, "--steps", str(steps),
                    "--seed", str(args.seed), "--lr", str(args.lr),
                    "--weight-decay", str(args.weight_decay), "--timeout", str(args.timeout),
                    "--hp-p2p", args.hp_p2p,
                    *(["--memory-step"] if HP_OF.get(name, (name,))[0] in measured else [])]
        return f

    # A paired row of a schedule in --memory measures its memory step after
    # the timed ones; --memory's schedules without a row here get a run of
    # their own: one step of warm-up (the first allocates FSDP2's buffers and
    # the optimizer's state), then the measured one.
    runs, failed, errors = paired.run_rows(script, args, settings, schedules,
                                           argv_of(args.steps, memory), nproc=PP * DP)
    report = {"args": vars(args), "rows": {}, "memory": {}, "runs": runs, "failed": failed,
              "date": time.strftime("%Y-%m-%d")}
    for setting in settings:
        report["rows"][setting] = {
            n: {"summary": summarize_row(rs), "error": errors.get((setting, n))}
            for n, rs in runs[setting].items()}
    alone = [THEIRS_OF.get(s, s) for s in memory if THEIRS_OF.get(s) not in schedules]
    mruns, merrors = {st: {} for st in settings}, {}
    if alone:
        margs = copy.copy(args)
        margs.rounds = 1
        mruns, mfailed, merrors = paired.run_rows(script, margs, settings, alone,
                                                  argv_of(1, memory), nproc=PP * DP)
        report["failed"] = failed + [f"memory {x}" for x in mfailed]
    report["memory_runs"] = mruns
    for setting in settings:
        rows = {}
        for ours in memory:
            name = THEIRS_OF.get(ours, ours)
            where, errs = (runs, errors) if name in schedules else (mruns, merrors)
            rows[ours] = memory_of(where[setting].get(name, []))
            if (setting, name) in errs:
                rows[ours]["error"] = "failed: " + errs[(setting, name)]
        report["memory"][setting] = rows
    text = render(report)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    disagree = [f"{st} {n}" for st, rows in report["rows"].items() for n, r in rows.items()
                if r["summary"] and r["summary"]["max_loss_rel_diff"] > args.tolerance]
    for st, rows in report["memory"].items():  # the memory step's losses, where both ran
        for ours in rows:
            name = THEIRS_OF.get(ours, ours)
            for r in (report["runs"] if name in schedules else report["memory_runs"])[st].get(
                    name, []):
                if "memory_loss" in r.get("torch", {}) and max_rel_diff(
                        [r["hp-py"]["memory_loss"]], [r["torch"]["memory_loss"]]) > args.tolerance:
                    disagree.append(f"{st} memory {ours}")
    if disagree:
        print("losses disagree: " + ", ".join(disagree), file=sys.stderr)
    if report["failed"]:
        print("failed runs: " + ", ".join(report["failed"]), file=sys.stderr)
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
