"""The dx/dw split from Python against the same split from C++, side by side.

bench/bench_split.cpp times, on a GPT-style transformer block and a wide MLP,
a fused backward and a split one (dx, then dw) of hp::autograd::GradFunction
driven from C++. This file runs the same shapes through the Python API
(hyperparallel.forward_and_gradfn: forward in Python, then
GradFunction.compute_input_grad / compute_weight_grad, or grad_fn() fused) in
two comparisons, pinned to one core with one thread and the same malloc
settings (NOTE [glibc malloc and page faults]):

1. In one process, iteration by iteration: the split (and the fused backward)
   through the Python API, and the same split of an identical graph driven
   from C++ (`_C.autograd._time_split_from_cpp`, timed inside C++ as
   bench_split.cpp times it), in rotating order. The per-iteration ratios
   Python / C++ are paired in time, so a shared machine's noise hits both.
2. Across processes, round after round: a run of the C++ binary
   build/bench/bench_split (a C++ forward, LibTorch's C++ engine) and a run of
   this file's worker (a Python forward, the engine torch's Python module
   installs), in alternating order. Noisier on a loaded machine (each side's
   run takes tens of seconds), but it includes everything that differs.

It prints the medians and the ratios (the goal: the split from Python costs at
most 3 % more than from C++).

    python bench/python/bench_split.py [--iterations 40] [--rounds 2] [--core 1] [--nice -10]
                                       [--models TransformerBlock,WideMlp] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ["TransformerBlock", "WideMlp"]
MIN_TIME = 3.0  # seconds of fused backward per run, as the C++ benchmark's MinTime(3.0)
# hp::keep_freed_memory_mapped() (hp/core/memory.cpp) as glibc's environment tunables.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
              "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


# ---------------------------------------------------------------------------------------------
# The worker: one model, timed as bench_split.cpp's run() times it.
# ---------------------------------------------------------------------------------------------
def transformer_block(torch, batch=8, seq=128, d=256, heads=4):
    s = 1.0 / math.sqrt(d)

    def init(*shape, scale):
        return (torch.randn(*shape) * scale).requires_grad_(True)

    def const(fill, n):
        return torch.full((n,), fill).requires_grad_(True)

    w = [const(1.0, d), const(0.0, d), init(d, 3 * d, scale=s), const(0.0, 3 * d),
         init(d, d, scale=s), const(0.0, d), const(1.0, d), const(0.0, d),
         init(d, 4 * d, scale=s), const(0.0, 4 * d), init(4 * d, d, scale=s / 2), const(0.0, d)]
    x = torch.randn(batch, seq, d)
    hd = d // heads
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    F = torch.nn.functional

    def forward(x):
        a = F.layer_norm(x, (d,), w[0], w[1])
        q, k, v = (torch.matmul(a, w[2]) + w[3]).split(d, -1)

        def split_heads(t):
            return t.view(batch, seq, heads, hd).transpose(1, 2)

        q, k, v = split_heads(q), split_heads(k), split_heads(v)
        att = (q.matmul(k.transpose(-2, -1)) / math.sqrt(hd)).masked_fill(mask, -1e9)
        y = att.softmax(-1).matmul(v).transpose(1, 2).reshape(batch, seq, d)
        h = x + torch.matmul(y, w[4]) + w[5]
        f = F.layer_norm(h, (d,), w[6], w[7])
        return h + torch.matmul(F.gelu(torch.matmul(f, w[8]) + w[9]), w[10]) + w[11]

    return w, x, forward


def wide_mlp(torch, batch=256, width=1024, layers=4):
    w = []
    for _ in range(layers):
        w.append((torch.randn(width, width) / math.sqrt(width)).requires_grad_(True))
        w.append(torch.zeros(width).requires_grad_(True))
    x = torch.randn(batch, width)

    def forward(x):
        h = x
        for i in range(0, len(w), 2):
            h = torch.relu(torch.addmm(w[i + 1], h, w[i]))
        return h

    return w, x, forward


def worker(model: str, min_time: float) -> dict:
    import torch

    import hyperparallel as hp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights, inp, forward = (transformer_block if model == "TransformerBlock" else wide_mlp)(torch)
    now = time.perf_counter

    def run_forward():
        x = inp.detach().requires_grad_(True)
        return hp.forward_and_gradfn(forward, x, weights=weights)[1]

    fused, dx, dw = [], [], []
    it = 0
    while sum(fused) < min_time or it < 2:
        for order in range(2):
            gf = run_forward()
            if (order + it) % 2 == 0:
                t0 = now()
                gf()
                fused.append(now() - t0)
            else:
                t0 = now()
                gf.compute_input_grad()
                t1 = now()
                gf.compute_weight_grad()
                t2 = now()
                dx.append(t1 - t0)
                dw.append(t2 - t1)
            del gf
        run_forward()  # the C++ loop's third forward (its graph analysis), not timed
        it += 1
    split = [a + b for a, b in zip(dx, dw)]
    return {"iterations": it, "fused_ms": statistics.median(fused) * 1e3,
            "dx_ms": statistics.median(dx) * 1e3, "dw_ms": statistics.median(dw) * 1e3,
            "split_ms": statistics.median(split) * 1e3}


def inprocess(model: str, iterations: int) -> dict:
    """Comparison 1: the Python API and C++ on identical graphs, iteration by iteration, in
    wall-clock and in this thread's CPU time."""
    import torch

    import hyperparallel as hp
    from hyperparallel import _C

    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights, inp, forward = (transformer_block if model == "TransformerBlock" else wide_mlp)(torch)
    wall, cpu = time.perf_counter, time.thread_time
    kinds = ["py_fused", "py_split", "cpp_fused", "cpp_split"]
    # per kind: one (wall, cpu) of the whole backward per iteration
    t = {k: [] for k in kinds}
    for it in range(iterations + 1):  # iteration 0 warms up
        for kind in kinds[it % 4:] + kinds[: it % 4]:
            x = inp.detach().requires_grad_(True)
            if kind.startswith("py"):
                gf = hp.forward_and_gradfn(forward, x, weights=weights)[1]
                w0, c0 = wall(), cpu()
                if kind == "py_fused":
                    gf()
                else:
                    gf.compute_input_grad()
                    gf.compute_weight_grad()
                sample = (wall() - w0, cpu() - c0)
                del gf
            else:
                y = forward(x)
                s = _C.autograd._time_split_from_cpp([y], [x], weights, kind == "cpp_fused")
                sample = (s[0], s[1]) if kind == "cpp_fused" else (s[0] + s[1], s[2] + s[3])
                del y
            if it:
                t[kind].append(sample)
    med = statistics.median
    out = {"iterations": iterations}
    for clock, c in (("wall", 0), ("cpu", 1)):
        for k in kinds:
            out[f"{k}_{clock}_ms"] = med(v[c] for v in t[k]) * 1e3
        for what in ("split", "fused"):
            py, cc = t[f"py_{what}"], t[f"cpp_{what}"]
            out[f"{what}_{clock}_ratio"] = med(p[c] / q[c] for p, q in zip(py, cc))
    return out


# ---------------------------------------------------------------------------------------------
# The driver: fresh processes, pinned.
# ---------------------------------------------------------------------------------------------
def pinned(core, nice):
    """The command prefix of every run: pinned to `core`, at niceness `nice` when given."""
    return (["nice", "-n", str(nice)] if nice else []) + ["taskset", "-c", str(core)]


def run_cpp(binary, model, core, nice):
    out = subprocess.run(
        pinned(core, nice) + [binary, f"--benchmark_filter=BM_{model}$|BM_{model}/",
         "--benchmark_format=json"],
        env=dict(os.environ, **MALLOC_ENV, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        check=True)
    (b,) = json.loads(out.stdout)["benchmarks"]
    return {"iterations": b["iterations"], "fused_ms": b["fused_ms"], "dx_ms": b["dx_ms"],
            "dw_ms": b["dw_ms"], "split_ms": b["split_over_fused"] * b["fused_ms"]}


def run_worker(core, nice, *worker_args):
    env = dict(os.environ, **MALLOC_ENV, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(ROOT, "python"),
                                                      env.get("PYTHONPATH")]))
    out = subprocess.run(
        pinned(core, nice) + [sys.executable, os.path.abspath(__file__), *worker_args],
        env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=40,
                    help="in-process comparison: iterations per model (0: skip it)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="comparison with the C++ binary: rounds (0: skip it)")
    ap.add_argument("--core", type=int, default=1, help="the core every run is pinned to")
    ap.add_argument("--nice", type=int, default=0,
                    help="run everything at this niceness (e.g. -10 as root on a shared machine)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "bench", "bench_split"))
    ap.add_argument("--min-time", type=float, default=MIN_TIME,
                    help="seconds of fused backward per worker run (the binary's MinTime)")
    ap.add_argument("--json", help="write every run and the ratios here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--inprocess", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.min_time)))
        return
    if args.inprocess:
        print(json.dumps(inprocess(args.inprocess, args.iterations)))
        return
    if args.rounds and not os.path.exists(args.binary):
        sys.exit(f"{args.binary} not found: build it (cmake --build build --target bench_split)")

    models = args.models.split(",")
    result = {"core": args.core, "nice": args.nice, "inprocess": {}, "binary": {}}
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch "
          f"{_torch_version()}, core {args.core}, nice {args.nice}, one thread, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)

    if args.iterations:
        print(f"\n1. One process, {args.iterations} iterations, the Python API against C++ on "
              "identical graphs (ratios: medians of per-iteration Python / C++)")
        print(f"{'model':16s} {'clock':5s} {'C++ split ms':>12s} {'Py split ms':>12s} "
              f"{'Py/C++ split':>13s} {'C++ fused ms':>13s} {'Py fused ms':>12s} "
              f"{'Py/C++ fused':>13s}")
        for m in models:
            r = run_worker(args.core, args.nice, "--inprocess", m, "--iterations",
                           str(args.iterations))
            result["inprocess"][m] = r
            for clock in ("wall", "cpu"):
                print(f"{m:16s} {clock:5s} {r[f'cpp_split_{clock}_ms']:12.2f} "
                      f"{r[f'py_split_{clock}_ms']:12.2f} {r[f'split_{clock}_ratio']:13.3f} "
                      f"{r[f'cpp_fused_{clock}_ms']:13.2f} {r[f'py_fused_{clock}_ms']:12.2f} "
                      f"{r[f'fused_{clock}_ratio']:13.3f}", flush=True)
        print("(cpu: this thread's CPU time, which leaves out the time other processes hold "
              "the core)")

    if args.rounds:
        print(f"\n2. Fresh processes, {args.rounds} rounds: build/bench/bench_split against "
              "this file's worker")
        runs = {m: [] for m in models}
        for r in range(args.rounds):
            for m in models:
                # Alternate which side goes first, so slow drift hits both alike.
                sides = ["cpp", "py"] if (r + models.index(m)) % 2 == 0 else ["py", "cpp"]
                res = {}
                for side in sides:
                    res[side] = (run_cpp(args.binary, m, args.core, args.nice) if side == "cpp"
                                 else run_worker(args.core, args.nice, "--worker", m,
                                                 "--min-time", str(args.min_time)))
                runs[m].append(res)
                c, p = res["cpp"], res["py"]
                print(f"round {r} {m:16s} split C++ {c['split_ms']:8.2f} ms  Python "
                      f"{p['split_ms']:8.2f} ms  ({p['split_ms'] / c['split_ms']:.3f}x)   fused "
                      f"C++ {c['fused_ms']:8.2f}  Python {p['fused_ms']:8.2f}", flush=True)
        print(f"{'model':16s} {'C++ split ms':>12s} {'Py split ms':>12s} {'Py/C++ split':>13s} "
              f"{'Py/C++ split/fused':>19s} {'Py/C++ fused':>13s}")
        for m in models:
            rs = runs[m]
            med = statistics.median
            summary = {
                "cpp_split_ms": med(x["cpp"]["split_ms"] for x in rs),
                "py_split_ms": med(x["py"]["split_ms"] for x in rs),
                "split_ratio": med(x["py"]["split_ms"] / x["cpp"]["split_ms"] for x in rs),
                "split_over_fused_ratio": med((x["py"]["split_ms"] / x["py"]["fused_ms"])
                                              / (x["cpp"]["split_ms"] / x["cpp"]["fused_ms"])
                                              for x in rs),
                "fused_ratio": med(x["py"]["fused_ms"] / x["cpp"]["fused_ms"] for x in rs),
            }
            result["binary"][m] = {"runs": rs, "summary": summary}
            print(f"{m:16s} {summary['cpp_split_ms']:12.2f} {summary['py_split_ms']:12.2f} "
                  f"{summary['split_ratio']:13.3f} {summary['split_over_fused_ratio']:19.3f} "
                  f"{summary['fused_ratio']:13.3f}")
        print("(ratios: medians over rounds of Python / C++ from adjacent runs; 'split/fused' "
              "divides each side by its own fused backward first)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def _torch_version():
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    main()
