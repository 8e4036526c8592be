"""One rank of test_split_model.py's training test (started with torchrun's
variables): builds a tiny float64 transformers LlamaForCausalLM from a fixed
seed, cuts it with hyperparallel.pipeline.split_model, trains it a few SGD
steps with hyperparallel.pipeline.Pipeline over a Gloo group for each
schedule in turn (a padding mask given to step() as the model's
attention_mask, for every stage; the sequence length changing across steps,
nothing declared to the Pipeline), and saves the losses and its chunks' parameters (by the
model's names) for the test to compare with single-process training.

    split_model_worker.py OUT_DIR SCHEDULES

The model, data, cut of each schedule and the reference training are here
too (the test imports them)."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import hyperparallel as hp  # noqa: E402

P, MB, T, H, VOCAB, LAYERS, STEPS, LR = 2, 2, 5, 16, 32, 4, 3, 0.1

# Each schedule with another way of cutting (all cut the same 4 layers).
CUTS = {
    "1f1b": dict(modules=[["model.embed_tokens", "model.layers.0"],
                          ["model.layers.1", "model.layers.2", "model.layers.3"]]),
    "zb-h1": dict(by="parameters"),
    "zbv": dict(by="layers"),
    "dualpipe": dict(layers_per_chunk=[1, 3]),
    "interleaved-1f1b": dict(by="layers"),
    "dualpipev": dict(by="parameters"),
    "zb-auto": dict(by="layers"),
}


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=32,
                         num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=16, tie_word_embeddings=False,
                         attn_implementation="eager")
    torch.manual_seed(1234)
    return LlamaForCausalLM(config).to(torch.float64)


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def seq_len(step):
    """The sequence length changes from step to step (5, 7, 5): the messages
    between stages carry their layout (NOTE [Pytrees between stages])."""
    return T + 2 * (step % 2)


def batch(step, m):
    """Inputs, next-token labels and a padding mask: row i's last i % 3
    tokens are padding (the model's attention_mask, a keyword argument of
    every stage)."""
    g = torch.Generator().manual_seed(50 + step)
    t = seq_len(step)
    ids = torch.randint(0, VOCAB, (m * MB, t + 1), generator=g)
    mask = torch.ones(m * MB, t, dtype=torch.long)
    for i in range(m * MB):
        if i % 3:
            mask[i, t - i % 3:] = 0
    return ids[:, :-1], ids[:, 1:], mask


def reference(m):
    """Single-process training of the whole model (mean loss over m
    microbatches, SGD): (losses, {name: parameter})."""
    from one_process import train_steps

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = train_steps(model, opt, loss_fn, (batch(step, m) for step in range(STEPS)), m)
    return losses, {n: q.detach().clone() for n, q in model.named_parameters()}


def main():
    import torch.distributed as dist

    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=P, microbatches=2 * P)
        model = make_model()  # every rank: the whole model, same seed
        chunks = hp.pipeline.split_model(model, sched, rank, **CUTS[name])
        # No activation_shape: found per step (the sequence length changes).
        pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, timeout=60)
        opt = torch.optim.SGD([q for c in chunks.values() for q in c.parameters()], lr=LR)
        losses = []
        for step in range(STEPS):
            x, y, mask = batch(step, sched.num_microbatches)
            opt.zero_grad()
            losses.append(pipe.step(x, y, attention_mask=mask))
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
