#!/usr/bin/env python3
"""Train a transformers causal language model with pipeline parallelism:
the model class you would train anyway, cut into the schedule's chunks by
its module names, on hyperparallel's C++ executor over your
torch.distributed group.

    torchrun --nproc-per-node 2 examples/train_hf.py --schedule zbv

Every rank builds the same tiny model from code (a LlamaForCausalLM, or a
Qwen2 or Mistral one: random initial weights from --seed, nothing
downloaded) and keeps the chunks of its stages
(hyperparallel.pipeline.split_model: the embedding with the first chunk, the
norm and head with the last). Each step draws its own sequence length (from
--min-seq-len to --seq-len) and pads some rows (the padding mask goes to
every chunk as the model's attention_mask; padded labels are -100, left out
of the loss): the Pipeline finds the activations' shapes whenever the length
changes, without being rebuilt. Rank 0 shows the same progress bar, summary,
--report and --trace as examples/train_gpt.py. See examples/README.md.
"""

import argparse
import os
import sys
import time

from hyperparallel.train_utils import (add_pipeline_arguments, check_pipeline_arguments,
                                       positive, positive_float, require_torchrun)

MODELS = {"llama": "LlamaConfig/LlamaForCausalLM", "qwen2": "Qwen2Config/Qwen2ForCausalLM",
          "mistral": "MistralConfig/MistralForCausalLM"}


def parser():
    ap = argparse.ArgumentParser(
        description="Train a transformers causal LM with a hyperparallel pipeline schedule "
                    "(start it with torchrun --nproc-per-node N).")
    ap.add_argument("--model", default="llama", choices=sorted(MODELS),
                    help="the transformers model class (default llama)")
    add_pipeline_arguments(ap)
    ap.add_argument("--seq-len", type=positive("--seq-len"), default=32,
                    help="the longest sequence of a step (default 32)")
    ap.add_argument("--min-seq-len", type=positive("--min-seq-len"), default=8,
                    help="the shortest sequence length a step draws (default 8)")
    ap.add_argument("--layers", type=positive("--layers"), default=4)
    ap.add_argument("--hidden", type=positive("--hidden"), default=64, help="hidden size")
    ap.add_argument("--heads", type=positive("--heads"), default=4)
    ap.add_argument("--kv-heads", type=positive("--kv-heads"), default=2)
    ap.add_argument("--vocab", type=positive("--vocab"), default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--lr", type=positive_float("--lr"), default=1e-3)
    return ap


def check_args(ap, a, world):
    """What can be checked before the ranks talk (the same on every rank)."""
    if a.hidden % a.heads or a.heads % a.kv_heads:
        ap.error(f"--hidden {a.hidden} must divide by --heads {a.heads}, and --heads by "
                 f"--kv-heads {a.kv_heads}")
    if a.min_seq_len > a.seq_len:
        ap.error(f"--min-seq-len {a.min_seq_len} is more than --seq-len {a.seq_len}")
    sched = check_pipeline_arguments(ap, a, world)
    if sched.num_chunks > a.layers:  # split_model's cut: at least one layer per chunk
        ap.error(f"--schedule {a.schedule} on {world} ranks cuts the model into {sched.num_chunks} "
                 f"chunks of at least one layer each; use --layers {sched.num_chunks} or more")
    return sched


def make_model(a):
    """The model of --model, tiny, from --seed (every rank the same)."""
    import torch
    import transformers

    config_name, model_name = MODELS[a.model].split("/")
    config = getattr(transformers, config_name)(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        max_position_embeddings=max(a.seq_len, 16), tie_word_embeddings=False,
        attn_implementation="eager")
    torch.manual_seed(a.seed)
    return getattr(transformers, model_name)(config).to(getattr(torch, a.dtype))


def batch(a, step, m):
    """Step `step`'s token ids, labels and padding mask: its own sequence
    length in [--min-seq-len, --seq-len], each row's last tokens padding with
    a probability of one half (labels -100 there)."""
    import torch

    g = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
    t = int(torch.randint(a.min_seq_len, a.seq_len + 1, (1,), generator=g))
    rows = m * a.microbatch_size
    ids = torch.randint(0, a.vocab, (rows, t + 1), generator=g)
    lengths = torch.where(torch.rand(rows, generator=g) < 0.5,
                          torch.randint(max(1, t // 2), t + 1, (rows,), generator=g),
                          torch.full((rows,), t))
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    labels = ids[:, 1:].masked_fill(mask == 0, -100)
    return ids[:, :-1], labels, mask


def loss_fn(logits, labels):
    """Cross entropy over the microbatch's tokens that are not padding."""
    import torch

    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             ignore_index=-100)


def main(argv=None):
    ap = parser()
    if os.environ.get("RANK", "0") != "0":
        ap.error = lambda message: sys.exit(2)  # the same message comes from rank 0
    a = ap.parse_args(argv)
    rank, world = require_torchrun(ap, "examples/train_hf.py", argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import torch.distributed as dist

    import hyperparallel as hp
    from hyperparallel import train_utils

    sched = check_args(ap, a, world)
    model = make_model(a)
    dist.init_process_group("gloo")
    m = sched.num_microbatches
    chunks = hp.pipeline.split_model(model, sched, rank)
    pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, timeout=a.timeout)
    opt = torch.optim.AdamW([q for c in chunks.values() for q in c.parameters()], lr=a.lr)
    if rank == 0:
        print(f"train_hf: {type(model).__name__}, {a.layers} layers, hidden {a.hidden}, {world} "
              f"ranks, schedule {a.schedule} ({sched.num_chunks} chunks), {m} microbatches of "
              f"{a.microbatch_size} sequences of {a.min_seq_len}-{a.seq_len} tokens, {a.dtype}",
              file=sys.stderr)
    progress = train_utils.Progress(a.steps, enabled=rank == 0 and not a.no_progress)
    losses, step_seconds, tokens = [], [], 0
    for step in range(a.steps):
        ids, labels, mask = batch(a, step, m)
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        loss = pipe.step(ids, labels, attention_mask=mask)
        opt.step()
        seconds = time.perf_counter() - t0
        losses.append(loss)
        step_seconds.append(seconds)
        tokens += int(mask.sum())
        progress.update(step, loss, int(mask.sum()) / seconds)
    progress.close()
    train_utils.finish_run(
        pipe, chunks, what=f"trained {type(model).__name__} with {a.schedule} on {world} ranks",
        losses=losses, step_seconds=step_seconds, items_per_step=tokens // a.steps,
        report_path=a.report, trace_path=a.trace,
        report={
            "schedule": a.schedule, "ranks": world, "num_chunks": sched.num_chunks,
            "microbatches": m, "microbatch_size": a.microbatch_size, "steps": a.steps,
            "dtype": a.dtype, "seed": a.seed,
            "model": {"kind": a.model, "class": type(model).__name__, "layers": a.layers,
                      "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads,
                      "vocab": a.vocab, "seq_len": [a.min_seq_len, a.seq_len],
                      "parameters": sum(q.numel() for q in model.parameters())},
            "chunks": {c: mod.module_names for c, mod in chunks.items()},
            "optimizer": {"name": "adamw", "lr": a.lr},
            "torch": torch.__version__, "hyperparallel": hp.__version__,
        })
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # NOTE [Gloo work freed during shutdown] (bench/peers/common.py): leave
    # without the interpreter's shutdown, as examples/train_gpt.py does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
