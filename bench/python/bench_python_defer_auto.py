"""``defer_wgrad`` from Python, side by side in one run: the GPT of
hyperparallel.models on dualpipev over 2 real processes (Gloo, CPU, one
thread each, pinned where the machine allows), ``Pipeline(...,
fb_overlap=True)`` with the W's never deferred (``defer_wgrad=False``),
always (``True``) and as the Pipeline chooses after its second step
(``"auto"``, the default: NOTE [The deferred W's chosen in the run] in
hp/pipeline/pipeline.cpp), under modelled links (``HP_LINK``) and over
loopback. Each round builds the three Pipelines afresh (so ``auto``
chooses again) and steps them in turn; a variant's time is the median over
rounds of its steps from the third on (after the choice).

    .venv/bin/python bench/python/bench_python_defer_auto.py [--rounds 4] [--steps 8] \
        [--links loopback,1000,1,3000,0.2]

Prints one row per link: the step with ``False``, ``True`` and ``"auto"``
against it, how often ``auto`` chose the deferred W's, the gain it
predicted (the median of 1 - with / without) and the predicted peak
activations with them against without.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overlap import parse_links  # noqa: E402
from bench_pipeline_paths import gpt_rank, two_ranks  # noqa: E402

MODES = {"off": False, "on": True, "auto": "auto"}


def rank_main(rank: int, world: int, store_path: str, args, out: str) -> None:
    config, m, rows, sched, chunks, data = gpt_rank(rank, world, store_path, "dualpipev")
    import torch.distributed as dist

    import hyperparallel as hp
    from hyperparallel import models

    params = {c: list(mod.parameters()) for c, mod in chunks.items()}
    results = {}
    for link in parse_links(args.links):
        if link:
            os.environ["HP_LINK"] = link
        else:
            os.environ.pop("HP_LINK", None)
        times = {k: [] for k in MODES}
        choices = []
        for _ in range(args.rounds):
            for mode, defer in MODES.items():
                pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=models.gpt_loss,
                                            parameters=params,
                                            activation_shape=config.activation_shape(rows),
                                            fb_overlap=True, defer_wgrad=defer)
                steps = []
                for s in range(args.steps):
                    x, y = data.batch(s, m)
                    for c in chunks.values():
                        c.zero_grad(set_to_none=False)
                    dist.barrier()
                    t0 = time.perf_counter()
                    pipe.step(x, y)
                    steps.append(time.perf_counter() - t0)
                times[mode].append(statistics.median(steps[2:]))
                if mode == "auto":
                    choices.append(pipe.deferred_w_choice)
                del pipe
        results[link or "loopback"] = {"times": times, "choices": choices}
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--links", default="loopback,1000,1,3000,0.2")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 3:
        sys.exit("bench_python_defer_auto: --rounds >= 1 and --steps >= 3 (auto chooses after "
                 "step 2)")
    results = two_ranks(rank_main, args)
    print(f"dualpipev, p = 2, m = 8, GPT 4 x 64, fb_overlap=True, {args.rounds} rounds x "
          f"{args.steps - 2} timed steps per variant")
    print("| link | off: step | on / off | auto / off | auto chose on | predicted gain "
          "| predicted peak, on / off |")
    print("|---|---|---|---|---|---|---|")
    for link, r in results.items():
        med = {k: statistics.median(v) for k, v in r["times"].items()}
        cs = r["choices"]
        chose = sum(1 for c in cs if c["defer"])
        gain = statistics.median(1 - c["step_with"] / c["step_without"] for c in cs)
        peak = statistics.median(c["peak_with"] / c["peak_without"] for c in cs)
        name = link if link == "loopback" else "{} us, {} GB/s".format(*link.split(","))
        print(f"| {name} | {med['off'] * 1e3:.1f} ms | {med['on'] / med['off']:.2f} "
              f"| {med['auto'] / med['off']:.2f} | {chose} of {len(cs)} | {gain * 100:.1f} % "
              f"| {peak:.2f} |")


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
