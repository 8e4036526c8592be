"""What a sequence length never seen before costs a step, against the same
length seen before, in one run: examples/train_hf.py's model (a tiny
LlamaForCausalLM cut by split_model) and data (a padding mask as the
attention_mask), on 2 real processes (Gloo, CPU, one thread each, pinned
where the machine allows), nothing declared (the messages between stages
describe themselves: NOTE [Pytrees between stages] in
python/hyperparallel/pipeline/transfers.py).

After warm-up steps at one length, pass 1 steps once through a shuffled set
of lengths (each new to the Pipeline), then passes 2 and 3 step through the
same lengths again (each seen). A length's ratio is its pass-1 step time
over the median of its later ones; the bench prints each length and the
median ratio.

    .venv/bin/python bench/python/bench_new_lengths.py [--schedule zbv] [--lengths 8-32]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def example():
    spec = importlib.util.spec_from_file_location(
        "train_hf", os.path.join(ROOT, "examples", "train_hf.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rank_main(rank: int, world: int, store_path: str, args, lengths, out: str) -> None:
    sys.path.insert(0, os.path.join(ROOT, "python"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.distributed as dist

    import hyperparallel as hp

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    ex = example()
    a = ex.parser().parse_args(["--schedule", args.schedule, "--seq-len", str(max(lengths))])
    model = ex.make_model(a)
    sched = hp.pipeline.schedule(args.schedule, ranks=world, microbatches=a.microbatches)
    chunks = hp.pipeline.split_model(model, sched, rank)
    pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=ex.loss_fn)
    opt = torch.optim.AdamW([q for c in chunks.values() for q in c.parameters()], lr=a.lr)

    def step(t: int, no: int) -> float:
        a.min_seq_len = a.seq_len = t
        ids, labels, mask = ex.batch(a, no, sched.num_microbatches)
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(ids, labels, attention_mask=mask)
        opt.step()
        return time.perf_counter() - t0

    no = 0
    for _ in range(args.warmup):
        step(args.warmup_length, no)
        no += 1
    times = {t: [] for t in lengths}
    for _ in range(3):
        for t in lengths:
            times[t].append(step(t, no))
            no += 1
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump({str(t): v for t, v in times.items()}, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="zbv")
    ap.add_argument("--lengths", default="8-32", help="FIRST-LAST, every length between")
    ap.add_argument("--warmup", type=int, default=3, help="steps at --warmup-length first")
    ap.add_argument("--warmup-length", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="of the lengths' order")
    args = ap.parse_args()
    first, last = (int(v) for v in args.lengths.split("-"))
    lengths = [t for t in range(first, last + 1) if t != args.warmup_length]
    random.Random(args.seed).shuffle(lengths)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_pipeline_paths import two_ranks

    times = {int(t): v for t, v in two_ranks(rank_main, args, lengths).items()}
    print(f"{args.schedule}, p = 2, train_hf's Llama (4 layers, hidden 64), {len(lengths)} "
          f"lengths in {args.lengths}, warm-up at {args.warmup_length}; ms per step")
    print("| length | new (pass 1) | seen (median of passes 2, 3) | new / seen |\n|---|---|---|---|")
    ratios = []
    for t in lengths:
        new, seen = times[t][0], statistics.median(times[t][1:])
        ratios.append(new / seen)
        print(f"| {t} | {new * 1e3:.1f} | {seen * 1e3:.1f} | {new / seen:.3f} |")
    print(f"median new / seen: {statistics.median(ratios):.3f}; longer than the warm-up "
          f"(frames grow): {statistics.median([r for t, r in zip(lengths, ratios) if t > args.warmup_length]):.3f}")


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
