"""One rank of test_split_model.py's torchtitan test (started with torchrun's
variables): builds torchtitan's Llama 3 debug model shrunk to a tiny config,
float64, from a fixed seed (torchtitan's own init_weights), cuts it with
hyperparallel.pipeline.split_model (no wrapper: the chunks hand each block
the model's freqs_cis), trains it a few SGD steps with
hyperparallel.pipeline.Pipeline over a Gloo group for each schedule in turn
(the sequence length changing across steps, nothing declared to the
Pipeline), and saves the losses and its chunks' parameters (by the
model's names) for the test to compare with single-process training.

    titan_worker.py OUT_DIR SCHEDULES

The model, data, cut of each schedule and the reference training are here
too (the test imports them)."""

import dataclasses
import os
import sys

import torch

import hyperparallel as hp

P, MB, T, VOCAB, LAYERS, STEPS, LR = 2, 2, 5, 32, 4, 3, 0.1

# Each schedule with another way of cutting (all cut the same 4 layers).
CUTS = {
    "1f1b": dict(modules=[["tok_embeddings", "layers.0"],
                          ["layers.1", "layers.2", "layers.3", "norm", "output"]]),
    "interleaved-1f1b": dict(by="layers"),  # 4 chunks, 2 per rank
    "zb-h1": dict(by="parameters"),
    "zbv": dict(modules=[["tok_embeddings"], ["layers.0", "layers.1"], ["layers.2"],
                         ["layers.3"]]),  # the embedding alone in a chunk
    "dualpipev": dict(by="parameters"),
    "zb-auto": dict(by="layers"),
}


def microbatches(name):
    return 2 * P + 2 if name == "dualpipev" else 2 * P


def make_model():
    """torchtitan's Llama 3 "debugmodel" config, shrunk (and grouped-query
    attention: one KV head of two), built in float64 (the default dtype while
    it is built: .to(float64) would make its complex freqs_cis buffer real)
    and initialised by torchtitan's init_weights."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = dataclasses.replace(llama3_args["debugmodel"], dim=16, n_layers=LAYERS, n_heads=2,
                               n_kv_heads=1, vocab_size=VOCAB, multiple_of=8, max_seq_len=16)
    torch.manual_seed(1234)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = Transformer(args)
        with torch.no_grad():
            model.init_weights()
    finally:
        torch.set_default_dtype(dtype)
    return model


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def seq_len(step):
    """5, 7, 5: the Pipeline finds the activations' shapes again, and each
    block slices freqs_cis to the length."""
    return T + 2 * (step % 2)


def batch(step, m):
    g = torch.Generator().manual_seed(70 + step)
    ids = torch.randint(0, VOCAB, (m * MB, seq_len(step) + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def reference(m):
    """Single-process training of the whole model with its own forward (mean
    loss over m microbatches, SGD; pipeline_model's oracle): (losses, {name:
    parameter})."""
    import pipeline_model

    model = make_model()
    losses, _ = pipeline_model.train_single_process([model], batch, m, STEPS, LR, loss_fn)
    return losses, {n: q.detach().clone() for n, q in model.named_parameters()}


def main():
    import torch.distributed as dist

    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=P, microbatches=microbatches(name))
        model = make_model()  # every rank: the whole model, same seed
        chunks = hp.pipeline.split_model(model, sched, rank, **CUTS[name])
        pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, timeout=60)
        opt = torch.optim.SGD([q for c in chunks.values() for q in c.parameters()], lr=LR)
        losses = []
        for step in range(STEPS):
            x, y = batch(step, sched.num_microbatches)
            opt.zero_grad()
            losses.append(pipe.step(x, y))
            opt.step()
        results[name] = {
            "losses": losses,
            "chunks": {c: {n: q.detach().clone() for n, q in mod.named_model_parameters()}
                       for c, mod in chunks.items()},
            "names": {c: mod.module_names for c, mod in chunks.items()},
        }
        del pipe
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
