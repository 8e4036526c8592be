#!/usr/bin/env python3
"""Train a transformers causal language model with pipeline parallelism:
the model class you would train anyway, cut into the schedule's chunks by
its module names, on hyperparallel's C++ executor over your
torch.distributed group.

    torchrun --nproc-per-node 2 examples/train_hf.py --schedule zbv
    torchrun --nproc-per-node 4 examples/train_hf.py --model-path DIR \
        --data corpus.jsonl --dp 2 --fsdp --save OUT      # later: --resume OUT

With --model-path DIR (a local Hugging Face folder: config.json,
safetensors weights, tokenizer), the model is built on the meta device and
each rank makes real and loads only the chunks of its stages
(hyperparallel.pipeline.split_model, load_pretrained); --data FILE (text,
one document per line, or JSONL with a "text" field) is tokenized with the
folder's tokenizer and packed into sequences of --seq-len tokens; --save OUT
writes a Hugging Face checkpoint of the trained model (from_pretrained reads
it) with the tokenizer, and a DCP checkpoint of weights, optimizer and step
that --resume OUT continues from (at any pipeline size); --dp N runs N
copies of the pipeline over the ranks (gradients averaged over the copies,
or with --fsdp each chunk fully_shard'ed over them).

Without --model-path, every rank builds the same tiny model from code (a
LlamaForCausalLM, or a Qwen2 or Mistral one: random initial weights from
--seed, nothing downloaded) and keeps the chunks of its stages
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
    ap.add_argument("--model-path", default="", metavar="DIR",
                    help="a local Hugging Face model folder (config, safetensors, tokenizer): its "
                         "model, built on meta, each rank loading its chunks' weights")
    ap.add_argument("--data", default="", metavar="FILE",
                    help="training text: one document per line, or JSONL with a \"text\" field "
                         "(needs --model-path for its tokenizer); default random tokens")
    ap.add_argument("--save", default="", metavar="DIR",
                    help="at the end: a Hugging Face checkpoint of the trained model in DIR and "
                         "a resumable one (DCP: weights, optimizer, step) in DIR/checkpoint")
    ap.add_argument("--resume", default="", metavar="DIR",
                    help="continue from DIR/checkpoint (what --save wrote) up to --steps")
    ap.add_argument("--dp", type=positive("--dp"), default=1,
                    help="copies of the pipeline (data parallel; the ranks are dp x pipeline)")
    ap.add_argument("--fsdp", action="store_true",
                    help="with --dp: each chunk fully_shard'ed (FSDP2) over the copies instead "
                         "of gradients averaged")
    return ap


def check_args(ap, a, world):
    """What can be checked before the ranks talk (the same on every rank)."""
    if a.hidden % a.heads or a.heads % a.kv_heads:
        ap.error(f"--hidden {a.hidden} must divide by --heads {a.heads}, and --heads by "
                 f"--kv-heads {a.kv_heads}")
    if a.min_seq_len > a.seq_len:
        ap.error(f"--min-seq-len {a.min_seq_len} is more than --seq-len {a.seq_len}")
    if world % a.dp:
        ap.error(f"--dp {a.dp} does not divide the {world} ranks")
    if a.fsdp and a.dp == 1:
        ap.error("--fsdp shards over the pipeline's copies: give --dp 2 or more")
    if a.data and not a.model_path:
        ap.error("--data needs --model-path (the folder's tokenizer reads it)")
    for flag, path, what in (("--model-path", a.model_path, "config.json"),
                             ("--data", a.data, None),
                             ("--resume", a.resume, "checkpoint/train_state.json")):
        if path and not os.path.exists(os.path.join(path, what) if what else path):
            ap.error(f"{flag} {path}: no {what or 'such file'} there" if what else
                     f"{flag} {path}: no such file")
    if a.model_path:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(a.model_path)
        a.layers, a.vocab = config.num_hidden_layers, config.vocab_size
    pp = world // a.dp
    sched = check_pipeline_arguments(ap, a, pp)
    if sched.num_chunks > a.layers:  # split_model's cut: at least one layer per chunk
        ap.error(f"--schedule {a.schedule} on {pp} ranks cuts the model into {sched.num_chunks} "
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


def pretrained_model(a):
    """--model-path's model on the meta device (split_model makes real and
    load_pretrained fills only this rank's chunks)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(a.model_path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, a.dtype),
                                                attn_implementation="eager")


def has_weights(path):
    return any(os.path.isfile(os.path.join(path, f))
               for f in ("model.safetensors", "model.safetensors.index.json"))


def token_rows(a, tokenizer):
    """--data tokenized and packed: [rows, --seq-len + 1] token ids (each
    document followed by the tokenizer's end-of-sequence token, if any)."""
    import json

    import torch

    docs = []
    with open(a.data, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if a.data.endswith(".jsonl"):
                try:
                    line = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError) as e:
                    raise SystemExit(f"train_hf: {a.data} line {n}: not a JSON object with a "
                                     f"\"text\" field ({e})")
            docs.append(line)
    ids = []
    for doc in docs:
        ids += tokenizer(doc)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    width = a.seq_len + 1
    if len(ids) < width:
        raise SystemExit(f"train_hf: {a.data} holds {len(ids)} tokens, fewer than one sequence "
                         f"of --seq-len {a.seq_len} + 1")
    return torch.tensor(ids[:len(ids) // width * width]).view(-1, width)


def data_batch(rows, step, count):
    """Step `step`'s `count` packed sequences (cycling through the data):
    token ids, labels and a mask of ones."""
    import torch

    pick = torch.arange(step * count, (step + 1) * count) % rows.shape[0]
    seq = rows[pick]
    return seq[:, :-1], seq[:, 1:], torch.ones_like(seq[:, :-1])


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

    import json

    import torch
    import torch.distributed as dist

    import hyperparallel as hp
    from hyperparallel import train_utils

    sched = check_args(ap, a, world)
    pp = world // a.dp
    dist.init_process_group("gloo")
    pipe_group = dp_group = None
    if a.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (a.dp, pp), mesh_dim_names=("dp", "pp"))
        pipe_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    prank, replica = rank % pp, rank // pp
    m = sched.num_microbatches
    tokenizer = rows = None
    if a.model_path:
        model = pretrained_model(a)
        chunks = hp.pipeline.split_model(model, sched, prank, seed=a.seed)
        if has_weights(a.model_path):
            hp.pipeline.load_pretrained(chunks, a.model_path)
        if a.data:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(a.model_path)
            rows = token_rows(a, tokenizer)
    else:
        model = make_model(a)
        chunks = hp.pipeline.split_model(model, sched, prank)
    plain = True  # parameters that dp_group averages (not FSDP2's)
    if a.fsdp:
        from torch.distributed.fsdp import fully_shard

        # Each unit its own FSDP2 group, but one holding a parameter that
        # another unit holds too (tied embeddings) stays plain, averaged by
        # dp_group: FSDP2 cannot shard one parameter in two groups.
        plain = False
        for c in chunks.values():
            tied = {id(q) for n, q in c.named_model_parameters() if n in c.shared_parameters}
            for unit in c.units:
                if any(id(q) in tied for q in unit.parameters()):
                    plain = True
                else:
                    fully_shard(unit, mesh=mesh["dp"])
    pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, timeout=a.timeout,
                                group=pipe_group, dp_group=dp_group if plain else None)
    params = list({id(q): q for c in chunks.values() for q in c.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=a.lr)
    first = 0
    if a.resume:
        hp.pipeline.load_checkpoint(chunks, opt, os.path.join(a.resume, "checkpoint"))
        with open(os.path.join(a.resume, "checkpoint", "train_state.json")) as f:
            first = json.load(f)["step"]
        if first >= a.steps:
            raise SystemExit(f"train_hf: {a.resume} is at step {first}; --steps {a.steps} "
                             "leaves nothing to train")
    whole = sum(q.numel() * q.element_size() for q in model.parameters())
    own = sum(getattr(q, "to_local", lambda q=q: q)().numel() * q.element_size()  # FSDP2: shard
              for q in {id(q): q for c in chunks.values() for q in c.parameters()}.values())
    if rank == 0:
        source = a.model_path or f"{a.layers} layers, hidden {a.hidden}"
        data = a.data or "random tokens"
        print(f"train_hf: {type(model).__name__} ({source}), {world} ranks = {a.dp} x {pp}-stage "
              f"pipeline, schedule {a.schedule} ({sched.num_chunks} chunks), {m} microbatches "
              f"of {a.microbatch_size} sequences, {data}, {a.dtype}"
              + (f", resumed at step {first}" if first else ""), file=sys.stderr)
        print(f"train_hf: rank 0 holds {own / 2**20:.1f} MiB of the model's "
              f"{whole / 2**20:.1f} MiB of parameters"
              + (" (built on the meta device: the rest was never allocated)" if a.model_path
                 else ""), file=sys.stderr)
    progress = train_utils.Progress(a.steps - first, enabled=rank == 0 and not a.no_progress)
    losses, step_seconds, tokens = [], [], 0
    for step in range(first, a.steps):
        if rows is not None:  # this copy's part of the step's sequences
            count = m * a.microbatch_size
            ids, labels, mask = data_batch(rows, step * a.dp + replica, count)
        else:
            ids, labels, mask = batch(a, step, m * a.dp)
            ids, labels, mask = (t.chunk(a.dp)[replica] for t in (ids, labels, mask))
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        loss = pipe.step(ids, labels, attention_mask=mask)
        if not plain:  # the step's loss is this copy's: the mean over the copies
            mean = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(mean, group=dp_group)
            loss = mean.item() / a.dp
        opt.step()
        seconds = time.perf_counter() - t0
        losses.append(loss)
        step_seconds.append(seconds)
        tokens += int(mask.sum())
        progress.update(step - first, loss, int(mask.sum()) / seconds)
    progress.close()
    if a.save:
        hp.pipeline.save_pretrained(chunks, a.save)  # a collective: every rank
        hp.pipeline.save_checkpoint(chunks, opt, os.path.join(a.save, "checkpoint"))
        if rank == 0:
            if tokenizer is not None:
                tokenizer.save_pretrained(a.save)
            with open(os.path.join(a.save, "checkpoint", "train_state.json"), "w") as f:
                json.dump({"step": a.steps}, f)
            print(f"train_hf: saved {a.save} (from_pretrained reads it; --resume {a.save} "
                  "continues)", file=sys.stderr)
    train_utils.finish_run(
        pipe, chunks, what=f"trained {type(model).__name__} with {a.schedule} on {world} ranks",
        losses=losses, step_seconds=step_seconds, items_per_step=tokens // len(losses),
        report_path=a.report, trace_path=a.trace, group=pipe_group,
        report={
            "schedule": a.schedule, "ranks": world, "dp": a.dp, "fsdp": a.fsdp,
            "num_chunks": sched.num_chunks, "first_step": first,
            "microbatches": m, "microbatch_size": a.microbatch_size, "steps": a.steps,
            "dtype": a.dtype, "seed": a.seed,
            "model": {"kind": a.model_path or a.model, "class": type(model).__name__,
                      "layers": a.layers, "hidden": model.config.hidden_size,
                      "vocab": model.config.vocab_size,
                      "seq_len": [a.min_seq_len, a.seq_len],
                      "parameters": sum(q.numel() for q in model.parameters())},
            "data": a.data or "random",
            "parameter_bytes": {"rank_0": own, "model": whole},
            "chunks": {c: mod.module_names for c, mod in chunks.items()},
            "optimizer": {"name": "adamw", "lr": a.lr},
            "torch": torch.__version__, "hyperparallel": hp.__version__,
        })
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # NOTE [Gloo work freed during shutdown] (python/hyperparallel/train_utils.py): leave
    # without the interpreter's shutdown, as examples/train_gpt.py does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
