"""``pair_turns`` from Python, side by side in one run: a transformers
Mixtral (float32, 2 layers, d_model 128, 8 experts top 2) on dualpipev,
pp 1 x ep 2 over 2 real processes (Gloo, CPU, one thread each, pinned
where the machine allows; the experts over both by
``hyperparallel.moe.expert_parallel``, ``dp_group`` the same two), each
``Pipeline(..., fb_overlap=True)`` with its pairs' halves taking fixed
turns, ready turns (NOTE [Ready turns from Python] in
hyperparallel/pipeline/checks.py), and ready turns with deferred W's in 4
parts, under modelled links (``HP_LINK``) and over loopback. After one
untimed round, each round builds the three Pipelines afresh and steps them
in turn; a variant's time is the median over rounds of its steps from the
third on.

    .venv/bin/python bench/python/bench_python_pair_turns.py [--rounds 4] [--steps 8] \
        [--links loopback,300,2,1000,1]

Prints one row per link: the step with fixed turns, the others against it,
and each variant's share of the pairs' waits hidden (hidden / (hidden +
exposed), summed over its timed steps, the median over rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overlap import parse_links  # noqa: E402
from bench_pipeline_paths import join_ranks, two_ranks  # noqa: E402

VARIANTS = {
    "fixed": dict(defer_wgrad=False, pair_turns="fixed"),
    "ready": dict(defer_wgrad=False, pair_turns="ready"),
    "ready, W's in 4": dict(defer_wgrad=True, pair_turns="ready", w_parts=4),
}
M, ROWS, SEQ, VOCAB = 8, 2, 64, 256


def rank_main(rank: int, world: int, store_path: str, args, out: str) -> None:
    join_ranks(rank, world, store_path)
    import torch
    import torch.distributed as dist
    import transformers as tf

    import hyperparallel as hp

    sched = hp.pipeline.schedule("dualpipev", ranks=1, microbatches=M)
    # pp 1: each rank's pipeline group is itself (every rank makes every group).
    pp_group = [dist.new_group([r]) for r in range(world)][rank]

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels.reshape(-1))

    g = torch.Generator().manual_seed(7 + rank)  # each copy its own rows
    ids = torch.randint(0, VOCAB, (M * ROWS, SEQ + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    def run(kw, steps_wanted):
        """A fresh model and Pipeline stepped `steps_wanted` times: the
        median step from the third on, and the pairs' waits hidden."""
        torch.manual_seed(4321)
        config = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=256, num_local_experts=8,
                                  num_experts_per_tok=2, max_position_embeddings=SEQ,
                                  tie_word_embeddings=False, attn_implementation="eager")
        model = tf.MixtralForCausalLM(config)
        chunks = hp.pipeline.split_model(model, sched, 0)
        hp.moe.expert_parallel(model, dist.group.WORLD)
        pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, dp_group=dist.group.WORLD,
                                    group=pp_group, fb_overlap=True, **kw)
        steps, hid, exp = [], 0.0, 0.0
        for s in range(steps_wanted):
            model.zero_grad(set_to_none=False)
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, y)
            steps.append(time.perf_counter() - t0)
            if s >= 2:
                hid += pipe.last_stats["pair_hidden"]
                exp += pipe.last_stats["pair_exposed"]
        return statistics.median(steps[2:]), hid / max(hid + exp, 1e-12)

    for kw in VARIANTS.values():  # warm-up, not timed: the allocator, the connections
        run(kw, 3)
    results = {}
    for link in parse_links(args.links):
        if link:
            os.environ["HP_LINK"] = link  # read by the dispatchers and the Pipeline
        else:
            os.environ.pop("HP_LINK", None)
        times = {k: [] for k in VARIANTS}
        hidden = {k: [] for k in VARIANTS}
        for _ in range(args.rounds):
            for name, kw in VARIANTS.items():
                step, share = run(kw, args.steps)
                times[name].append(step)
                hidden[name].append(share)
        results[link or "loopback"] = {"times": times, "hidden": hidden}
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--links", default="loopback,300,2,1000,1")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 3:
        sys.exit("bench_python_pair_turns: --rounds >= 1 and --steps >= 3 (the first two "
                 "steps are not timed)")
    results = two_ranks(rank_main, args)
    print(f"dualpipev, pp 1 x ep 2, m = {M}, Mixtral 2 x 128 (8 experts, top 2), "
          f"fb_overlap=True, {args.rounds} rounds x {args.steps - 2} timed steps per variant")
    names = list(VARIANTS)
    print("| link | fixed: step | " + " | ".join(f"{n} / fixed" for n in names[1:])
          + " | pairs' waits hidden: " + " / ".join(names) + " |")
    print("|---" * (2 + len(names)) + "|")
    for link, r in results.items():
        med = {k: statistics.median(v) for k, v in r["times"].items()}
        hid = {k: statistics.median(v) for k, v in r["hidden"].items()}
        label = link if link == "loopback" else "{} us, {} GB/s".format(*link.split(","))
        print(f"| {label} | {med['fixed'] * 1e3:.1f} ms | "
              + " | ".join(f"{med[n] / med['fixed']:.2f}" for n in names[1:])
              + " | " + " / ".join(f"{hid[n] * 100:.0f} %" for n in names) + " |")


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
