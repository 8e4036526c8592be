"""One rank of the MoE test (test_split_model.py): a tiny float64
transformers MixtralForCausalLM cut by split_model, with its router
load-balancing loss (hyperparallel.pipeline.moe_aux_losses, in the model's
own form over all layers or per layer), trained with each schedule, the
second step with longer sequences and padding (attention_mask); saves losses, auxiliary losses
and parameters by the model's names. The model, data and single-process
references are here too.

    moe_worker.py OUT_DIR SCHEDULES FORM  (P ranks: the WORLD_SIZE)"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import hyperparallel as hp  # noqa: E402

P, MB, T, VOCAB, STEPS, LR = 2, 2, 5, 32, 2, 0.1


def microbatches(name, p=P):
    return 2 * p + 2 if name == "dualpipev" else 2 * p


def make_model(form=None):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16,
                           num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                           num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5,
                           max_position_embeddings=16, tie_word_embeddings=False,
                           attn_implementation="eager",
                           experts_implementation="eager")  # grouped_mm has no float64
    torch.manual_seed(4321)
    model = MixtralForCausalLM(config).to(torch.float64)
    if form is not None:
        hp.pipeline.moe_aux_losses(model, form=form)
    return model


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def batch(step, m):
    """Inputs, targets and, from the second step on, two tokens longer
    sequences with a padding mask (the last token of every other sequence is
    padding)."""
    g = torch.Generator().manual_seed(90 + step)
    t = T + 2 * min(step, 1)
    ids = torch.randint(0, VOCAB, (m * MB, t + 1), generator=g)
    mask = None
    if step > 0:
        mask = torch.ones(m * MB, t, dtype=torch.int64)
        mask[::2, -1] = 0
    return ids[:, :-1], ids[:, 1:], mask


def reference(m, form):
    """One process, each microbatch's loss plus the load-balancing term, the
    mean over microbatches, SGD. form "model": the model's own term
    (``output_router_logits=True``: transformers' load_balancing_loss_func
    over all layers); "layer": each layer's own (collect_losses). Returns
    (losses, auxiliary means, {name: parameter})."""
    model = make_model("layer" if form == "layer" else None)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, aux_means = [], []
    for step in range(STEPS):
        x, y, mask = batch(step, m)
        opt.zero_grad()
        total = aux_total = 0.0
        for mb in range(m):
            rows = slice(mb * MB, (mb + 1) * MB)
            kw = {} if mask is None else {"attention_mask": mask[rows]}
            with hp.pipeline.collect_losses() as added:
                out = model(x[rows], output_router_logits=form == "model", **kw)
            if form == "model":
                assert not added
                aux = model.router_aux_loss_coef * out.aux_loss
                aux_value = aux.item()
            else:
                assert len(added) == 4  # one per MoE layer
                aux = sum(added)
                aux_value = sum(a.item() for a in added)  # reported in float64, as added
            main = loss_fn(out.logits, y[rows])
            ((main + aux) / m).backward()
            total += main.item() / m
            aux_total += aux_value / m
        losses.append(total)
        aux_means.append(aux_total)
        opt.step()
    return losses, aux_means, {n: q.detach().clone() for n, q in model.named_parameters()}


def main():
    import torch.distributed as dist

    out_dir, names, form = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=microbatches(name, p))
        model = make_model(form)
        chunks = hp.pipeline.split_model(model, sched, rank)
        pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, timeout=60)
        opt = torch.optim.SGD([q for c in chunks.values() for q in c.parameters()], lr=LR)
        losses, aux = [], []
        for step in range(STEPS):
            x, y, mask = batch(step, sched.num_microbatches)
            opt.zero_grad()
            losses.append(pipe.step(x, y, **({} if mask is None else {"attention_mask": mask})))
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
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
