#!/usr/bin/env python3
"""PyTorch's torch.distributed.pipelining against hyperparallel, side by side:
`hp train` (the C++ trainer) and our Python runtime (hyperparallel.pipeline).

On the pip target (the project's .venv, torch 2.11), from the repository root:

    .venv/bin/python bench/peers/compare.py --rounds 5

Three sides train the same GPT from the same initial values on the same
batches: PyTorch's Schedule<NAME> over hyperparallel.models' nn.Module chunks
(torch_pipelining.py), our Python runtime over the same chunks (hp_python.py),
and `hp train --untied` (its C++ GPT, bit-identical at the start:
NOTE [Same values as the C++ GPT] in python/hyperparallel/models.py). In each
round every schedule row runs each side once, back to back (the order
rotates by round), on 2 ranks pinned to cores 0 and 1 with one intra-op
thread each. A row's step time is the median over rounds of each run's
median step (the first step is warm-up); the ratios are PyTorch's step time
over ours (above 1: we are faster). The losses of every step must agree to a
relative 1e-4. See bench/peers/README.md.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from common import SETTINGS  # noqa: E402

# (PyTorch schedule, hp schedule, hp chunks per rank of the interleaved ones:
# -v / chunks=; the V schedules place their two stages per rank themselves)
PAIRS = [
    ("GPipe", "gpipe", 1),
    ("1F1B", "1f1b", 1),
    ("Interleaved1F1B", "interleaved-1f1b", 2),
    ("LoopedBFS", "interleaved-bfs", 2),
    ("InterleavedZeroBubble", "interleaved-zb", 2),
    ("ZBVZeroBubble", "zbv", 1),
    ("DualPipeV", "dualpipev", 1),
]
SIDES = ("torch", "hp", "hp-py")
SIDE_NAMES = {"torch": "PyTorch", "hp": "hp train", "hp-py": "hp Python"}
# The goals (issue 12 and 13): hp train >= 1.0x on every row; the Python
# runtime never slower, and >= 1.2x in the overhead setting.
GOALS = {("hp", "compute"): 1.0, ("hp", "overhead"): 1.0,
         ("hp-py", "compute"): 1.0, ("hp-py", "overhead"): 1.2}


def median(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def run(cmd, timeout):
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return 124, (e.stdout or "") + f"\ntimed out after {timeout} s"
    return p.returncode, p.stdout


def last_error(out):
    lines = [line for line in out.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line.strip()[:200]
    return (lines[-1] if lines else "no output")[:200]


def cpu_busy(seconds=1.0):
    """Share of all cores busy over `seconds` (from /proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v), idle
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(limit_s, threshold=0.15):
    """Waits up to limit_s for the machine to be idle (other load disturbs the
    pinned ranks); returns the busy share seen last."""
    deadline = time.monotonic() + limit_s
    busy = cpu_busy()
    while busy > threshold and time.monotonic() < deadline:
        busy = cpu_busy(2.0)
    return busy


SPIN = ("import os\n"
        "os.sched_setaffinity(0, {%d})\n"
        "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
        "while True:\n"
        "    pass\n")


class AwakeCores:
    """One SCHED_IDLE busy loop pinned to each rank's core while a run lasts.

    On this VM a core that went idle sometimes wakes for a message only at the
    next timer tick (4 ms): a Gloo round trip on loopback has a median of
    0.3 ms but a 90th percentile of 4 ms between idle cores, 0.33 ms when
    each core has such a loop. The loops run only when nothing else can, so
    they take no time from the ranks; they keep the cores from idling."""

    def __init__(self, cores):
        self.cores, self.procs = cores, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN % c]) for c in self.cores]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []


def common_args(a, setting, out):
    return ["--setting", setting, "--out", out, "--nproc", str(a.nproc), "--steps", str(a.steps),
            "--seed", str(a.seed), "--lr", str(a.lr), "--weight-decay", str(a.weight_decay),
            "--timeout", str(a.timeout)]


def run_torch(a, setting, name, out):
    cmd = [sys.executable, os.path.join(HERE, "torch_pipelining.py"), "--schedule", name,
           *common_args(a, setting, out)]
    rc, text = run(cmd, a.timeout + 30)
    if rc != 0:
        return {"error": last_error(text)}
    with open(out) as f:
        j = json.load(f)
    return {"steps": j["step_seconds"], "losses": j["losses"], "busy": j["busy_seconds"][-1],
            "kernel": j["kernel_seconds"][-1], "makespan": j["makespan_seconds"][-1]}


def run_hp_python(a, setting, name, chunks, out):
    cmd = [sys.executable, os.path.join(HERE, "hp_python.py"), "--schedule", name,
           *common_args(a, setting, out)]
    if chunks > 1:
        cmd += ["--chunks", str(chunks)]
    rc, text = run(cmd, a.timeout + 30)
    if rc != 0:
        return {"error": last_error(text)}
    with open(out) as f:
        j = json.load(f)
    return {"steps": j["step_seconds"], "losses": j["losses"], "busy": j["busy_seconds"][-1],
            "comm_wait": j["comm_wait_seconds"][-1], "overhead": j["overhead_seconds"][-1],
            "makespan": j["makespan_seconds"][-1]}


def run_hp(a, setting, name, chunks, out):
    s = SETTINGS[setting]
    cmd = [a.hp, "train", "--pin", "--no-progress", "--model", "gpt", "--untied",
           "--layers", str(s["layers"]), "--d-model", str(s["d_model"]), "--heads", str(s["heads"]),
           "--seq-len", str(s["seq_len"]), "-p", str(a.nproc), "-s", name,
           "-m", str(s["microbatches"]), "--microbatch-size", str(s["microbatch_size"]),
           "--steps", str(a.steps), "--seed", str(a.seed), "--lr", str(a.lr),
           "--weight-decay", str(a.weight_decay), "--dtype", "float32", "--report", out,
           "--p2p", a.hp_p2p, "--timeout", str(int(a.timeout))]
    if chunks > 1:
        cmd += ["-v", str(chunks)]
    rc, text = run(cmd, a.timeout + 30)
    if rc != 0:
        return {"error": last_error(text)}
    with open(out) as f:
        j = json.load(f)
    ranks = j["ranks"]
    return {"steps": j["step_seconds"], "losses": j["loss"],
            "busy": [r["compute_seconds"] for r in ranks],
            "comm_wait": [r["comm_wait_seconds"] for r in ranks],
            "overhead": [r["overhead_seconds"] for r in ranks],
            "makespan": j["measured_makespan_seconds"]}


def step_median(r):
    steps = r["steps"][1:] if len(r["steps"]) > 1 else r["steps"]
    return median(steps)


def idle_share(r, key="busy"):
    """1 - busiest rank's compute / the step's compute makespan (last step)."""
    if key not in r or not r["makespan"] > 0:
        return float("nan")
    return 1.0 - max(r[key]) / r["makespan"]


def max_rel_diff(a, b):
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


def fmt_ms(x):
    return f"{x * 1e3:.1f}" if x == x else "-"


def fmt_pct(x):
    return f"{100 * x:.1f}" if x == x else "-"


def ok_runs(runs):
    return [r for r in runs if "error" not in r]


def ratio_cell(theirs, ours):
    """PyTorch / ours: the ratio of the medians and the per-round range."""
    t, o = ok_runs(theirs), ok_runs(ours)
    if not t or not o:
        return float("nan"), [], "-"
    ratio = median([step_median(r) for r in t]) / median([step_median(r) for r in o])
    # The machine's speed drifts between rounds; each round's runs went back to back.
    per_round = [step_median(rt) / step_median(ro) for rt, ro in zip(theirs, ours)
                 if "error" not in rt and "error" not in ro]
    spread = f" ({min(per_round):.2f}-{max(per_round):.2f})" if len(per_round) > 1 else ""
    return ratio, per_round, f"{ratio:.2f}{spread}"


def render(a, settings, pairs, sides, results, load_before, load_after):
    """The tables (markdown) and the JSON summary of `results`:
    {setting: {side: {row key: [run per round]}}}, row key = PyTorch name."""
    lines = []
    summary = {"load_before": load_before, "load_after": load_after, "settings": {},
               "sides": list(sides),
               "args": {"awake_cores": a.awake_cores, "hp_p2p": a.hp_p2p, "rounds": a.rounds,
                        "steps": a.steps, "nproc": a.nproc, "lr": a.lr,
                        "weight_decay": a.weight_decay, "seed": a.seed}}
    ours = [s for s in sides if s != "torch"]
    shm = a.hp_p2p == "shm"
    for setting in settings:
        s = SETTINGS[setting]
        lines.append(f"\n**{setting}**{' (cores kept awake)' if a.awake_cores else ''}"
                     f"{', hp train point-to-point over shared memory' if shm else ''}"
                     f": gpt, {s['layers']} layers, d_model {s['d_model']}, {s['heads']} heads, "
                     f"seq {s['seq_len']}, {s['microbatches']} microbatches of "
                     f"{s['microbatch_size']}, {a.nproc} ranks, {a.steps} steps x {a.rounds} "
                     "rounds\n")
        head = ["PyTorch schedule", "hp schedule"]
        head += [f"{SIDE_NAMES[x]} step ms" for x in sides]
        if "torch" in sides:
            head += [f"PyTorch / {SIDE_NAMES[x]}" for x in ours]
        head += ["losses agree (max rel. diff)",
                 "idle % (" + " / ".join(SIDE_NAMES[x] for x in sides) + ")"]
        head += [f"{SIDE_NAMES[x]} comm wait / overhead ms" for x in ours]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        rows = []
        for theirs, name, chunks in pairs:
            runs = {x: results[setting][x][theirs] for x in sides}
            ok = {x: ok_runs(runs[x]) for x in sides}
            interleaved = chunks > 1 and name.startswith("interleaved")
            cells = [theirs, name + (f" (v {chunks})" if interleaved else "")]
            step_s = {x: median([step_median(r) for r in ok[x]]) for x in sides}
            for x in sides:
                err = next((r["error"] for r in runs[x] if "error" in r), "")
                cells.append(fmt_ms(step_s[x]) if ok[x] else f"failed: {err}")
            ratios = {}
            if "torch" in sides:
                for x in ours:
                    ratio, per_round, text = ratio_cell(runs["torch"], runs[x])
                    ratios[x] = {"ratio": ratio, "per_round": per_round}
                    cells.append(text)
            diffs = [max_rel_diff(r1["losses"], r2["losses"])
                     for i, x in enumerate(sides) for y in sides[i + 1:]
                     for r1 in ok[x] for r2 in ok[y]]
            worst = max(diffs) if diffs else None
            cells.append("-" if worst is None else
                         ("yes" if worst <= a.tolerance else "**NO**") + f" ({worst:.1e})")
            idle = {x: median([idle_share(r) for r in ok[x]]) for x in sides}
            cells.append(" / ".join(fmt_pct(idle[x]) for x in sides))
            for x in ours:
                wait = median([max(r["comm_wait"]) for r in ok[x]])
                over = median([max(r["overhead"]) for r in ok[x]])
                cells.append(f"{fmt_ms(wait)} / {fmt_ms(over)}")
            lines.append("| " + " | ".join(cells) + " |")
            rows.append({"theirs": theirs, "ours": name, "chunks": chunks,
                         "step_s": step_s, "ratios": ratios, "max_loss_rel_diff": worst,
                         "idle": idle,
                         "idle_torch_kernels": median([idle_share(r, "kernel")
                                                       for r in ok.get("torch", [])]),
                         "runs": runs})
        # The goals, per side of ours: the worst row against its bar.
        goals = {}
        if "torch" in sides:
            for x in ours:
                bar = GOALS[(x, setting)] if setting in ("compute", "overhead") else 1.0
                got = [(r["ratios"][x]["ratio"], r["theirs"]) for r in rows
                       if r["ratios"][x]["ratio"] == r["ratios"][x]["ratio"]]
                if got:
                    worst_ratio, worst_row = min(got)
                    met = worst_ratio >= bar and len(got) == len(rows)
                    goals[x] = {"bar": bar, "worst": worst_ratio, "worst_row": worst_row,
                                "met": met}
                    lines.append(f"\n{SIDE_NAMES[x]}: goal >= {bar:.1f}x on every row: "
                                 f"{'met' if met else 'NOT met'} (lowest {worst_ratio:.2f}x, "
                                 f"{worst_row}{'' if len(got) == len(rows) else '; rows failed'})")
        summary["settings"][setting] = {"spec": s, "rows": rows, "goals": goals}
    all_runs = [r for st in results.values() for side in st.values() for rs in side.values()
                for r in rs]
    noisy = sum(1 for r in all_runs if r.get("busy_before", 0) > 0.15)
    lines.append(f"\nload average before / after: {' '.join(load_before)} / "
                 f"{' '.join(load_after)}; {noisy} of {len(all_runs)} runs started while the "
                 "machine was more than 15 % busy")
    return "\n".join(lines) + "\n", summary


def results_from_json(path):
    """(settings, pairs, sides, results, load_before, load_after, args) of a --json file."""
    with open(path) as f:
        summary = json.load(f)
    sides = tuple(summary["sides"])
    settings, results, seen = [], {}, []
    for setting, st in summary["settings"].items():
        settings.append(setting)
        results[setting] = {x: {} for x in sides}
        for row in st["rows"]:
            for x in sides:
                results[setting][x][row["theirs"]] = row["runs"][x]
            if row["theirs"] not in seen:
                seen.append(row["theirs"])
    pairs = [p for p in PAIRS if p[0] in seen]
    return (settings, pairs, sides, results, summary["load_before"], summary["load_after"],
            summary.get("args", {}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first is warm-up)")
    ap.add_argument("--settings", default="compute,overhead",
                    help="comma separated: " + ", ".join(SETTINGS))
    ap.add_argument("--schedules", default="",
                    help="comma separated PyTorch schedule names (default: all): "
                         + ", ".join(p[0] for p in PAIRS))
    ap.add_argument("--sides", default=",".join(SIDES),
                    help="comma separated: torch (PyTorch's pipelining), hp (hp train), "
                         "hp-py (our Python runtime); default all three")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--tolerance", type=float, default=1e-4,
                    help="largest relative difference of a step's loss between any two runs")
    ap.add_argument("--hp", default=os.path.join(ROOT, "build", "tools", "hp", "hp"),
                    help="the hp binary (default: build/tools/hp/hp)")
    ap.add_argument("--quiet-wait", type=float, default=0,
                    help="before each run, wait up to this many seconds for the machine's "
                         "cores to be under 15 %% busy (other load disturbs pinned ranks)")
    ap.add_argument("--awake-cores", action="store_true",
                    help="keep the ranks' cores from idling during each run (a SCHED_IDLE busy "
                         "loop per core; see AwakeCores)")
    ap.add_argument("--hp-p2p", default="group", choices=["group", "shm", "auto"],
                    help="hp train's point-to-point transport between the ranks (hp train "
                         "--p2p, whose own default is auto; the Gloo group's here, as the tables in "
                         "docs/benchmarks.md were measured); PyTorch uses the Gloo group, the "
                         "Python runtime Pipeline's default p2p (auto)")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--json", default="", help="write every measurement here")
    ap.add_argument("--markdown", default="", help="write the tables here too")
    ap.add_argument("--keep", action="store_true", help="keep each run's report")
    ap.add_argument("--render", default="", help="only print the tables of an earlier --json")
    a = ap.parse_args()
    if a.render:
        settings, pairs, sides, results, lb, la, args = results_from_json(a.render)
        for k in ("awake_cores", "hp_p2p", "rounds", "steps", "nproc"):
            if k in args:
                setattr(a, k, args[k])
        text, _ = render(a, settings, pairs, sides, results, lb, la)
        print(text)
        return 0

    pairs = PAIRS
    if a.schedules:
        want = a.schedules.split(",")
        unknown = [w for w in want if w not in [p[0] for p in PAIRS]]
        if unknown:
            ap.error(f"--schedules: unknown {', '.join(unknown)}; "
                     f"use {', '.join(p[0] for p in PAIRS)}")
        pairs = [p for p in PAIRS if p[0] in want]
    sides = tuple(x for x in SIDES if x in a.sides.split(","))
    if not sides or set(a.sides.split(",")) - set(SIDES):
        ap.error(f"--sides: a comma separated list of {', '.join(SIDES)}")
    settings = a.settings.split(",")
    for s in settings:
        if s not in SETTINGS:
            ap.error(f"--settings: unknown setting {s}; use {', '.join(SETTINGS)}")
    if "hp" in sides and not os.access(a.hp, os.X_OK):
        ap.error(f"{a.hp}: not built (flock /tmp/hp-build.lock cmake --build build --target hp, "
                 "or bash scripts/build.sh)")
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]

    tmp = tempfile.mkdtemp(prefix="hp-peers-")
    results = {}
    for setting in settings:
        runs = {x: {p[0]: [] for p in pairs} for x in sides}
        for rnd in range(a.rounds):
            for theirs, name, chunks in pairs:
                order = list(sides[rnd % len(sides):] + sides[:rnd % len(sides)])
                for who in order:
                    out = os.path.join(tmp, f"{setting}-{who}-{theirs}-{rnd}.json")
                    busy = wait_quiet(a.quiet_wait) if a.quiet_wait > 0 else cpu_busy(0.2)
                    t = time.monotonic()
                    with AwakeCores(range(a.nproc) if a.awake_cores else []):
                        if who == "torch":
                            r = run_torch(a, setting, theirs, out)
                        elif who == "hp":
                            r = run_hp(a, setting, name, chunks, out)
                        else:
                            r = run_hp_python(a, setting, name, chunks, out)
                    r["busy_before"] = busy
                    runs[who][theirs].append(r)
                    msg = r.get("error") or f"{fmt_ms(step_median(r))} ms/step"
                    print(f"[{setting}] round {rnd + 1}/{a.rounds} {theirs} ({SIDE_NAMES[who]}): "
                          f"{msg} ({time.monotonic() - t:.0f} s; machine {100 * busy:.0f} % busy "
                          "before)", file=sys.stderr)
        results[setting] = runs

    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]

    text, summary = render(a, settings, pairs, sides, results, load_before, load_after)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    if a.keep:
        print(f"run reports kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    bad = [r for st in summary["settings"].values() for r in st["rows"]
           if r["max_loss_rel_diff"] is not None and r["max_loss_rel_diff"] > a.tolerance]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
