#!/usr/bin/env python3
"""Train a small GPT with pipeline parallelism: hyperparallel's schedules on
its C++ executor, your torch.distributed group, PyTorch's optimizer.

    torchrun --nproc-per-node 2 examples/train_gpt.py --schedule zbv

Every rank builds only the model chunks its stages compute
(hyperparallel.models.GPT, initialised per layer from (seed, layer): the same
values as the whole model, and as the C++ `hp train --untied`), reads the same
byte-level batches (Debian's license texts by default, or --data FILE, or
--random-tokens), and calls Pipeline.step once per optimizer step. Rank 0
shows a progress bar (on a terminal, unless --no-progress), prints a summary
and, with --report FILE, writes the losses, step times and the last step's
measured timings as JSON. See examples/README.md.
"""

import argparse
import os
import sys
import time

from hyperparallel.train_utils import (add_pipeline_arguments, check_pipeline_arguments,
                                       positive, positive_float, require_torchrun)


def parser():
    ap = argparse.ArgumentParser(
        description="Train a small GPT with a hyperparallel pipeline schedule "
                    "(start it with torchrun --nproc-per-node N).")
    add_pipeline_arguments(ap)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="parameters and activations (default float32)")
    ap.add_argument("--layers", type=positive("--layers"), default=4,
                    help="transformer blocks (default 4)")
    ap.add_argument("--d-model", type=positive("--d-model"), default=64, help="width (default 64)")
    ap.add_argument("--heads", type=positive("--heads"), default=4,
                    help="attention heads (default 4)")
    ap.add_argument("--seq-len", type=positive("--seq-len"), default=32,
                    help="tokens per sequence (default 32)")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--lr", type=positive_float("--lr"), default=1e-3,
                    help="learning rate (default 1e-3)")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default 0)")
    data = ap.add_mutually_exclusive_group()
    data.add_argument("--data", default=None, metavar="PATH",
                      help="a text file or a folder of text files, read as bytes "
                           "(default: /usr/share/common-licenses)")
    data.add_argument("--random-tokens", action="store_true",
                      help="uniformly random tokens instead of text (nothing to learn; for speed)")
    return ap


def check_args(ap, a, world):
    """Everything that can be checked before the ranks talk: the same answer on
    every rank, so they all stop together with one message."""
    if a.d_model % a.heads != 0:
        ap.error(f"--d-model {a.d_model} must be divisible by --heads {a.heads}")
    if a.weight_decay < 0:
        ap.error(f"--weight-decay must be >= 0, got {a.weight_decay}")
    if a.data is not None and not os.path.exists(a.data):
        ap.error(f"--data: '{a.data}' does not exist; give a text file or a folder of text files")
    sched = check_pipeline_arguments(ap, a, world)
    if sched.num_chunks > a.layers:
        ap.error(f"--schedule {a.schedule} on {world} ranks cuts the model into {sched.num_chunks} "
                 f"chunks but it has {a.layers} layers: use --layers {sched.num_chunks} or more")
    return sched


def main(argv=None):
    ap = parser()
    if os.environ.get("RANK", "0") != "0":
        ap.error = lambda message: sys.exit(2)  # the same message comes from rank 0
    a = ap.parse_args(argv)
    rank, world = require_torchrun(ap, "examples/train_gpt.py", argv)

    import torch
    import torch.distributed as dist

    import hyperparallel as hp
    from hyperparallel import models, train_utils

    sched = check_args(ap, a, world)
    dtype = getattr(torch, a.dtype)
    config = models.GPTConfig(layers=a.layers, d_model=a.d_model, heads=a.heads,
                              seq_len=a.seq_len, dtype=dtype)
    if a.random_tokens:
        data = models.RandomTokens(config, a.microbatch_size, a.seed)
    else:
        try:
            data = models.TextDataset(config, a.microbatch_size, a.seed, a.data)
        except (OSError, ValueError) as e:
            ap.error(f"--data: {e}")

    dist.init_process_group("gloo")
    m = sched.num_microbatches
    chunks = models.gpt_chunks(config, sched.chunks_of_rank(rank), sched.num_chunks, a.seed)
    pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=models.gpt_loss,
                                activation_shape=config.activation_shape(a.microbatch_size),
                                timeout=a.timeout)
    params = [q for c in chunks.values() for q in c.parameters()]
    if a.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=a.lr, weight_decay=a.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay)

    tokens_per_step = m * a.microbatch_size * a.seq_len
    if rank == 0:
        print(f"train_gpt: {a.layers} layers, d_model {a.d_model}, {world} ranks, schedule "
              f"{a.schedule} ({sched.num_chunks} chunks), {m} microbatches of "
              f"{a.microbatch_size} x {a.seq_len} tokens, {a.dtype}, data: {data.description}",
              file=sys.stderr)
    progress = train_utils.Progress(a.steps, enabled=rank == 0 and not a.no_progress)
    losses, step_seconds = [], []
    for step in range(a.steps):
        inputs, targets = data.batch(step, m)
        opt.zero_grad(set_to_none=True)
        dist.barrier()  # the ranks start the step together: the timeline's clocks line up
        t0 = time.perf_counter()
        loss = pipe.step(inputs, targets)  # forward and backward of every microbatch
        opt.step()
        seconds = time.perf_counter() - t0
        losses.append(loss)
        step_seconds.append(seconds)
        progress.update(step, loss, tokens_per_step / seconds)
    progress.close()

    whole = models.GPT(config, a.seed) if rank == 0 else None  # to count the parameters
    train_utils.finish_run(
        pipe, chunks, what=f"trained the GPT with {a.schedule} on {world} ranks",
        losses=losses, step_seconds=step_seconds, items_per_step=tokens_per_step,
        report_path=a.report, trace_path=a.trace,
        report={
            "schedule": a.schedule, "ranks": world, "num_chunks": sched.num_chunks,
            "microbatches": m, "microbatch_size": a.microbatch_size, "steps": a.steps,
            "dtype": a.dtype, "seed": a.seed, "data": data.description,
            "model": {"kind": "gpt", "layers": a.layers, "d_model": a.d_model,
                      "heads": a.heads, "seq_len": a.seq_len, "vocab": config.vocab,
                      "parameters": sum(q.numel() for q in whole.parameters()) if whole else 0},
            "optimizer": {"name": a.optimizer, "lr": a.lr, "weight_decay": a.weight_decay},
            "torch": torch.__version__, "hyperparallel": hp.__version__,
        })
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # NOTE [Gloo work freed during shutdown] (python/hyperparallel/train_utils.py): a Gloo
    # worker thread frees a finished collective (here the checksum's
    # all-reduce, a Python tensor) after the main thread has moved on; with
    # one core per rank it may run only once the interpreter is shutting
    # down, and taking the GIL then aborts the rank ("terminate called
    # without an active exception"; 1 run in 16 here under load). The work
    # is done and written, so the rank leaves without the shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
