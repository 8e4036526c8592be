#!/usr/bin/env python3
"""PyTorch's pipelining against our Python runtime, step by step in the same
processes: a paired comparison that the host's drift cannot tilt.

    .venv/bin/python bench/peers/paired.py --rounds 2 --steps 24

compare.py runs each side in its own processes, one after the other; on a
shared host whose speed drifts by 30 % within seconds its per-round ratios
scatter (bench/peers/README.md). Here each row starts 2 ranks (pinned to
cores 0 and 1, one intra-op thread) that build both sides on two Gloo groups
of their own: PyTorch's Schedule<NAME> over its PipelineStages
(torch_pipelining.TorchSide, not instrumented) and hyperparallel.pipeline.Pipeline
(hp_python.HpSide), each with its own copy of the same GPT chunks and its own
AdamW. Then the two sides take turns: step k of one, step k of the other
(who goes first alternates with k), each after a barrier. Each pair of steps
ran within half a second of each other, so its ratio (PyTorch's step over
ours, above 1: we are faster) is nearly free of the host's drift; a row's
ratio is the median of its pairs over all rounds, with the middle half of
the pairs (25th to 75th percentile) beside it. The first step of each side
is warm-up and not counted. Both sides start from the same values and see
the same batches: their losses must agree (relative 1e-4). Beside the times,
the CPU time each rank's main thread spent in a step (the model's compute
and the runtime's own work; waits cost none), the median over steps of the
busiest rank's: where the two sides' CPU times are close, the step is the
model's own compute and no runtime can be much faster. Last, an ideal step
per row: the schedule simulated with our side's median action times and free
transfers (ideal_step), with PyTorch's step over it. Our side runs with
Pipeline's default p2p ("auto": shared-memory rings between the ranks, as
every rank here can reserve them); --hp-p2p group gives it the Gloo group's
point-to-point instead. PyTorch's side always uses its Gloo group.

One process holds both sides, so they share what is process-wide: the
Python runtime keeps freed memory mapped (Pipeline(keep_freed_memory)), which
PyTorch's side then gets too. The step cache that the same option turns on
is not process-wide: only our side's steps take blocks from it.
"""
import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
from compare import GOALS, PAIRS, max_rel_diff  # noqa: E402

HP_OF = {theirs: (ours, chunks) for theirs, ours, chunks in PAIRS}


def worker(args):
    rank, world, torch, dist = common.setup_rank(args)
    import hp_python
    import torch_pipelining

    config, data = common.model_and_data(args.setting, args.seed)
    m = common.SETTINGS[args.setting]["microbatches"]
    ours, chunks = HP_OF[args.schedule]
    hp_args = copy.copy(args)
    hp_args.schedule, hp_args.chunks = ours, chunks
    hp_args.receive_lookahead, hp_args.malloc_default = 0, False
    hp_args.p2p = args.hp_p2p
    sides = {
        "torch": torch_pipelining.TorchSide(args, rank, world, config,
                                            group=dist.new_group(backend="gloo"),
                                            instrument=False),
        "hp-py": hp_python.HpSide(hp_args, rank, world, config,
                                  group=dist.new_group(backend="gloo")),
    }
    result, actions, outside = take_turns(args, sides, lambda step: data.batch(step, m),
                                          rank, world, torch, dist)
    everyone = [None] * world
    dist.all_gather_object(everyone, {"actions": actions, "outside": outside})
    if rank == 0:
        result["ideal_seconds"] = ideal_step(sides["hp-py"].sched, everyone)
        result.update({"setting": args.setting, "schedule": args.schedule, "hp_schedule": ours,
                       "nproc": world, "torch_version": torch.__version__})
        common.write_result(args.out, result)
    dist.barrier()
    dist.destroy_process_group()


def take_turns(args, sides, batch, rank, world, torch, dist):
    """The paired steps: for each step k < args.steps, step k of every side
    in turn (who goes first alternates with k), each after a barrier over
    the world, on batch(k). Returns ({side: {"step_seconds", "losses",
    "cpu_seconds"}}, our side's compute seconds per action kind, our side's
    seconds outside the actions per step); the first step is in them (the
    summary drops it)."""
    now, cpu = time.perf_counter, time.thread_time
    names = list(sides)
    result = {k: {"step_seconds": [], "losses": [], "cpu_seconds": []} for k in names}
    actions, outside = {}, []  # our side's compute seconds per action kind; the rest of a step
    for step in range(args.steps):
        x, y = batch(step)
        for k in (names if step % 2 == 0 else names[::-1]):
            dist.barrier()
            t0, c0 = now(), cpu()
            loss = sides[k].step(x, y)
            t1, c1 = now(), cpu()
            # This thread's CPU time in the step, every rank's: the compute
            # and each runtime's own work, not its waits.
            spent = torch.zeros(world, dtype=torch.float64)
            spent[rank] = c1 - c0
            dist.all_reduce(spent)
            result[k]["cpu_seconds"].append(spent.tolist())
            result[k]["step_seconds"].append(t1 - t0)
            result[k]["losses"].append(loss)
            if k == "hp-py" and step > 0:
                for text, start, end in sides[k].pipe.last_stats["events"]:
                    if "SEND" not in text and "RECV" not in text:
                        actions.setdefault(action_kind(text), []).append(end - start)
                outside.append(sides[k].last_outside)
        if rank == 0 and args.verbose:
            print(f"step {step}: " + " ".join(
                f"{k} {result[k]['step_seconds'][-1] * 1e3:.1f} ms" for k in names),
                file=sys.stderr)
    return result, actions, outside


def action_kind(text):
    """"1F3" -> "1F"; an overlapped pair "2F0+1B3" -> "2F+1B"."""
    return "+".join(part.rstrip("0123456789") for part in text.split("+"))


def ideal_step(s, ranks):
    """The step of a runtime that costs nothing: the schedule simulated with
    each stage's median F, I, W (or B) seconds as our side measured them on
    every rank, transfers taking no time, plus the busiest rank's median time
    outside the actions (the optimizer's step and zero_grad). Medians leave out
    the host's pauses that the measured steps meet, so this is optimistic:
    about the best a runtime of this schedule and module could do here. Not a
    bound where overlapped F+B pairs run (DualPipeV): a pair measured as one
    action costs less than its F and B measured apart, which the simulator
    adds up."""
    from hyperparallel import schedule as hs

    seconds = {}
    for r in ranks:
        for kind, xs in r["actions"].items():
            seconds.setdefault(kind, []).extend(xs)
    med = {kind: statistics.median(xs) for kind, xs in seconds.items()}
    tiny = 1e-9  # the simulator wants positive costs; B alone is b + w
    f, b, w = [], [], []
    for st in range(s.num_stages):
        f.append(med.get(f"{st}F", tiny))
        if f"{st}I" in med:
            b.append(med[f"{st}I"])
            w.append(med.get(f"{st}W", tiny))
        else:
            b.append(med.get(f"{st}B", tiny))
            w.append(tiny)
    for kind, x in med.items():  # a stage whose B ran only inside overlapped pairs
        if "+" in kind:
            sf, sb = (int(part[:-1]) for part in kind.split("+"))
            if f"{sb}I" not in med and f"{sb}B" not in med:
                b[sb] = max(tiny, x - f[sf])
    costs = hs.CostModel(comm=0.0, stage_f=f, stage_b=b, stage_w=w)
    makespan = hs.simulate(s, costs, record_timeline=False).makespan
    steps = zip(*(r["outside"] for r in ranks))
    return makespan + statistics.median(max(xs) for xs in steps)


def quantile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = q * (len(xs) - 1)
    lo = int(i)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def summarize(runs):
    """A row's numbers from its runs (one per round)."""
    pairs, rounds, torch_steps, hp_steps, diff, ideal, bound = [], [], [], [], 0.0, [], []
    cpu = {"torch": [], "hp-py": []}  # the busiest rank's CPU seconds per step
    for r in runs:
        for k in cpu:
            cpu[k] += [max(c) for c in r[k]["cpu_seconds"][1:]]
        t, h = r["torch"]["step_seconds"][1:], r["hp-py"]["step_seconds"][1:]
        ps = [a / b for a, b in zip(t, h)]
        pairs += ps
        rounds.append(statistics.median(ps))
        torch_steps += t
        hp_steps += h
        diff = max(diff, max_rel_diff(r["hp-py"]["losses"], r["torch"]["losses"]))
        if "ideal_seconds" in r:
            ideal.append(r["ideal_seconds"])
            bound.append(statistics.median(t) / r["ideal_seconds"])
    return {"torch_ms": statistics.median(torch_steps) * 1e3,
            "hp_ms": statistics.median(hp_steps) * 1e3,
            "torch_cpu_ms": statistics.median(cpu["torch"]) * 1e3,
            "hp_cpu_ms": statistics.median(cpu["hp-py"]) * 1e3,
            "ratio": statistics.median(pairs), "q25": quantile(pairs, 0.25),
            "q75": quantile(pairs, 0.75), "per_round": rounds, "pairs": len(pairs),
            "max_loss_rel_diff": diff,
            "ideal_ms": statistics.median(ideal) * 1e3 if ideal else float("nan"),
            "torch_over_ideal": statistics.median(bound) if bound else float("nan")}


def run_rows(script, args, settings, schedules, argv_of, nproc=None):
    """Every row (setting x schedule) once per round, the schedules' order
    rotating by round: `script argv_of(setting, name) --out FILE` on nproc
    ranks (default args.nproc). Returns ({setting: {name: [run, ...]}},
    ["round R SETTING NAME", ...] of the failed runs, {(setting, name): the
    error text a rank left in FILE.error, the last one}); a run fails when a
    rank exits non-zero, the row times out or no result is written."""
    runs = {s: {n: [] for n in schedules} for s in settings}
    total, done, failed, errors = args.rounds * len(settings) * len(schedules), 0, [], {}
    started = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="hp-paired-")
    out = os.path.join(scratch, "run.json")
    for rnd in range(args.rounds):
        for setting in settings:
            order = schedules[rnd % len(schedules):] + schedules[:rnd % len(schedules)]
            for name in order:
                rc = common.launch(script, nproc or args.nproc,
                                   [*argv_of(setting, name), "--out", out], args.timeout,
                                   args.threads)
                done += 1
                if os.path.exists(out + ".error"):
                    with open(out + ".error") as f:
                        errors[(setting, name)] = f.read().strip()
                    os.remove(out + ".error")
                if rc != 0 or not os.path.exists(out):
                    failed.append(f"round {rnd + 1} {setting} {name}")
                    errors.setdefault((setting, name), "failed (no error text: a crash or "
                                      "a timeout; see the log above)")
                    print(f"[{done}/{total}] {setting} {name}: FAILED", file=sys.stderr)
                    continue
                with open(out) as f:
                    r = json.load(f)
                os.remove(out)
                runs[setting][name].append(r)
                took = f"({time.monotonic() - started:.0f} s)"
                if len(r.get("torch", {}).get("step_seconds", [])) < 2:  # no pair timed
                    print(f"[{done}/{total}] round {rnd + 1} {setting} {name}: done {took}",
                          file=sys.stderr)
                    continue
                s = summarize([r])
                print(f"[{done}/{total}] round {rnd + 1} {setting} {name}: PyTorch "
                      f"{s['torch_ms']:.1f} ms, hp Python {s['hp_ms']:.1f} ms, paired "
                      f"{s['ratio']:.2f} {took}", file=sys.stderr)
    shutil.rmtree(scratch, ignore_errors=True)
    return runs, failed, errors


def render(report):
    out = []
    for setting, rows in report["settings"].items():
        spec = common.SETTINGS[setting]
        model = {"gpt": "gpt", "hf-llama": "transformers LlamaForCausalLM (split_model)"}[
            report["args"].get("model", "gpt")]
        out.append(f"**{setting}**: {model}, {spec['layers']} layers, d_model {spec['d_model']}, "
                   f"{spec['heads']} heads, seq {spec['seq_len']}, {spec['microbatches']} "
                   f"microbatches of {spec['microbatch_size']}, 2 ranks, "
                   f"{report['args']['steps']} steps x {report['args']['rounds']} rounds, "
                   f"our side's p2p={report['args']['hp_p2p']}\n")
        out.append("| PyTorch schedule | hp schedule | PyTorch step ms | hp Python step ms | "
                   "PyTorch / hp Python, paired (middle half) | per round | "
                   "CPU ms per step, busiest rank (PyTorch / hp Python) | "
                   "ideal step ms (PyTorch / ideal) | losses agree |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for name, s in rows.items():
            agree = "yes" if s["max_loss_rel_diff"] <= report["args"]["tolerance"] else "NO"
            out.append(
                f"| {name} | {HP_OF[name][0]} | {s['torch_ms']:.1f} | {s['hp_ms']:.1f} | "
                f"{s['ratio']:.2f} ({s['q25']:.2f}-{s['q75']:.2f}) | "
                f"{', '.join(f'{x:.2f}' for x in s['per_round'])} | "
                f"{s['torch_cpu_ms']:.1f} / {s['hp_cpu_ms']:.1f} | "
                f"{s['ideal_ms']:.1f} ({s['torch_over_ideal']:.2f}) | "
                f"{agree} ({s['max_loss_rel_diff']:.1e}) |")
        goal = GOALS[("hp-py", setting)]
        low = min(rows.items(), key=lambda kv: kv[1]["ratio"])
        met = "met" if low[1]["ratio"] >= goal else "NOT met"
        out.append(f"\nhp Python: goal >= {goal}x on every row: {met} "
                   f"(lowest {low[1]['ratio']:.2f}x, {low[0]})\n")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24, help="steps of each side per run")
    ap.add_argument("--settings", default="compute,overhead")
    ap.add_argument("--schedules", default=",".join(p[0] for p in PAIRS),
                    help="PyTorch names, e.g. 1F1B,GPipe")
    ap.add_argument("--hp-p2p", default="auto", choices=["auto", "group", "shm"],
                    help="our side's Pipeline(p2p=...): its default (auto: shared-memory "
                         "rings where every rank could reserve them), the Gloo group's "
                         "point-to-point (as PyTorch's side), or the rings insisted on")
    ap.add_argument("--model", default="gpt", choices=["gpt", "hf-llama"],
                    help="the model both sides train: hyperparallel.models' GPT, or a "
                         "transformers LlamaForCausalLM of the setting's shape cut by "
                         "split_model (common.chunk_builder)")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--json", default="", help="write every run's steps and the summary here")
    ap.add_argument("--markdown", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600)
    # one rank of one row (internal)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--setting", default="")
    ap.add_argument("--schedule", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        common.end_rank()
    settings = [s for s in args.settings.split(",") if s]
    schedules = [s for s in args.schedules.split(",") if s]
    for s in settings:
        if s not in common.SETTINGS:
            ap.error(f"--settings: {s!r} is not one of {', '.join(common.SETTINGS)}")
    for s in schedules:
        if s not in HP_OF:
            ap.error(f"--schedules: {s!r} is not one of {', '.join(HP_OF)}")
    if args.steps < 3:
        ap.error("--steps must be at least 3 (the first is warm-up)")
    runs, failed, _ = run_rows(os.path.abspath(__file__), args, settings, schedules,
                               lambda setting, name: [
                                   "--setting", setting, "--schedule", name,
                                   "--steps", str(args.steps), "--seed", str(args.seed),
                                   "--lr", str(args.lr), "--weight-decay",
                                   str(args.weight_decay), "--timeout", str(args.timeout),
                                   "--hp-p2p", args.hp_p2p, "--model", args.model])
    report = {"args": vars(args), "settings": {}, "runs": runs, "failed": failed,
              "date": time.strftime("%Y-%m-%d")}
    for setting in settings:
        report["settings"][setting] = {n: summarize(rs) for n, rs in runs[setting].items() if rs}
    text = render(report)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    disagree = [f"{st} {n}" for st, rows in report["settings"].items() for n, s in rows.items()
                if s["max_loss_rel_diff"] > args.tolerance]
    if disagree:
        print("losses disagree: " + ", ".join(disagree), file=sys.stderr)
    if failed:
        print("failed runs: " + ", ".join(failed), file=sys.stderr)
    return 1 if disagree or failed else 0


if __name__ == "__main__":
    sys.exit(main())
