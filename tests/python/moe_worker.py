"""One rank of the MoE test (test_split_model.py): a tiny float64
transformers MixtralForCausalLM cut by split_model, each MoE layer adding its
load-balancing loss (hyperparallel.pipeline.moe_aux_losses), trained with
each schedule; saves losses, auxiliary losses and parameters by the model's
names. The model, data and single-process reference are here too.

    moe_worker.py OUT_DIR SCHEDULES"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import hyperparallel as hp  # noqa: E402

P, MB, T, VOCAB, STEPS, LR = 2, 2, 5, 32, 2, 0.1


def microbatches(name):
    return 2 * P + 2 if name == "dualpipev" else 2 * P


def make_model():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16,
                           num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                           num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5,
                           max_position_embeddings=16, tie_word_embeddings=False,
                           attn_implementation="eager",
                           experts_implementation="eager")  # grouped_mm has no float64
    torch.manual_seed(4321)
    model = MixtralForCausalLM(config).to(torch.float64)
    hp.pipeline.moe_aux_losses(model)
    return model


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def batch(step, m):
    g = torch.Generator().manual_seed(90 + step)
    ids = torch.randint(0, VOCAB, (m * MB, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def reference(m):
    """One process: each microbatch's loss plus its layers' load-balancing
    terms (collect_losses), the mean over microbatches, SGD. Returns
    (losses, auxiliary means, {name: parameter})."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, aux_means = [], []
    for step in range(STEPS):
        x, y = batch(step, m)
        opt.zero_grad()
        total = aux_total = 0.0
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            with hp.pipeline.collect_losses() as aux:
                logits = model(xm).logits
            assert len(aux) == 4  # one per MoE layer
            main = loss_fn(logits, ym)
            ((main + sum(aux)) / m).backward()
            total += main.item() / m
            aux_total += sum(a.item() for a in aux) / m
        losses.append(total)
        aux_means.append(aux_total)
        opt.step()
    return losses, aux_means, {n: q.detach().clone() for n, q in model.named_parameters()}


def main():
    import torch.distributed as dist

    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=P, microbatches=microbatches(name))
        model = make_model()
        chunks = hp.pipeline.split_model(model, sched, rank)
        pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, timeout=60)
        opt = torch.optim.SGD([q for c in chunks.values() for q in c.parameters()], lr=LR)
        losses, aux = [], []
        for step in range(STEPS):
            x, y = batch(step, sched.num_microbatches)
            opt.zero_grad()
            losses.append(pipe.step(x, y))
            aux.append(pipe.last_stats["aux_loss"])
            opt.step()
        results[name] = {
            "losses": losses, "aux": aux,
            "params": {n: q.detach().clone() for mod in chunks.values()
                       for n, q in mod.named_model_parameters()},
        }
        del pipe
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
