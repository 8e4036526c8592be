"""Auxiliary losses from any stage (hyperparallel.pipeline.add_loss, NOTE
[Auxiliary losses] in python/hyperparallel/losses.py): real processes train
a float64 model whose every chunk adds a router's load-balancing loss; the
losses, the auxiliary losses and every parameter equal single-process
training of loss + the auxiliary terms, on schedules with fused and split
backwards, V shapes, DualPipeV and interleaved."""

import os
import sys

import pytest
import torch

import hyperparallel as hp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import aux_worker as aw  # noqa: E402
import pipeline_model as pm  # noqa: E402
import ranks  # noqa: E402

SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev", "zb-auto",
             "graph-zb-h1", "graph-zbv"]  # graph-: GraphStage chunks (NOTE [Graph stages])


def reference(num_chunks: int, m: int):
    """One process: every microbatch's loss plus its auxiliary losses
    (collect_losses), averaged over the microbatches; SGD."""
    chunks = [aw.RoutedChunk(c, num_chunks) for c in range(num_chunks)]
    opt = torch.optim.SGD([q for c in chunks for q in c.parameters()], lr=pm.LR)
    losses, aux_means = [], []
    for step in range(pm.STEPS):
        x, y = pm.batch(step, m)
        opt.zero_grad()
        total = aux_total = 0.0
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            with hp.pipeline.collect_losses() as aux:
                h = xm
                for c in chunks:
                    h = c(h)
            assert len(aux) == num_chunks
            main = pm.loss_fn(h, ym)
            ((main + sum(aux)) / m).backward()
            total += main.item() / m
            aux_total += sum(a.item() for a in aux) / m
        losses.append(total)
        aux_means.append(aux_total)
        opt.step()
    return losses, aux_means, {k: [q.detach() for q in c.parameters()] for k, c in enumerate(chunks)}


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


@pytest.mark.parametrize("p", [2, 4])
def test_auxiliary_losses_train_equal_to_single_process(p, tmp_path):
    ranks.run_ranks(p, [os.path.join(HERE, "aux_worker.py"), tmp_path, ",".join(SCHEDULES)])
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(p)]
    for name in SCHEDULES:
        plain = name[len("graph-"):] if name.startswith("graph-") else name
        sched = hp.pipeline.schedule(plain, ranks=p, microbatches=aw.microbatches(plain, p))
        ref_losses, ref_aux, ref_chunks = reference(sched.num_chunks, sched.num_microbatches)
        assert min(ref_aux) > 0.01  # the auxiliary term is not negligible
        for r, res in enumerate(results):
            got = res[name]
            for s in range(pm.STEPS):
                assert close(got["losses"][s], ref_losses[s]), (name, p, r, s, got["losses"])
                assert close(got["aux"][s], ref_aux[s]), (name, p, r, s, got["aux"], ref_aux)
            for c, tensors in got["chunks"].items():
                for q, q_ref in zip(tensors, ref_chunks[c]):
                    err = (q - q_ref).abs().max().item()
                    assert err <= 1e-9 * max(1.0, q_ref.abs().max().item()), (name, p, r, c, err)


def test_an_auxiliary_loss_that_is_not_a_scalar_fails_every_rank_naming_it(tmp_path):
    outs = ranks.run_ranks(2, [os.path.join(HERE, "aux_worker.py"), tmp_path, "zb-h1", "bad"],
                           timeout=120, check=False)
    # Chunk 1 is rank 1's: its forward raises; rank 0 is told at once.
    rc1, _, err1 = outs[1]
    assert rc1 != 0 and "auxiliary loss must be a scalar" in err1, err1[-2000:]
    assert "action 1F0" in err1, err1[-2000:]  # stage 1, microbatch 0
    rc0, _, err0 = outs[0]
    assert rc0 != 0 and "rank 1" in err0, err0[-2000:]


def test_add_loss_outside_a_pipeline():
    with pytest.raises(RuntimeError, match="outside a Pipeline"):
        hp.pipeline.add_loss(torch.tensor(1.0))
    with pytest.raises(TypeError, match="tensor"):
        hp.pipeline.add_loss(1.0)
    with hp.pipeline.collect_losses() as outer:
        hp.pipeline.add_loss(torch.tensor(1.0))
        with hp.pipeline.collect_losses() as inner:
            hp.pipeline.add_loss(torch.tensor([2.0]))
        hp.pipeline.add_loss(torch.tensor(3.0))
    assert [t.item() for t in outer] == [1.0, 3.0] and [t.item() for t in inner] == [2.0]
    with pytest.raises(ValueError, match="scalar"):
        with hp.pipeline.collect_losses():
            hp.pipeline.add_loss(torch.ones(2))


def test_auxiliary_losses_of_checkpointed_chunks_count_once(one_rank_group):
    """Chunks checkpointed whole (torch.utils.checkpoint) on a one-rank
    dualpipev: the recompute inside I and W runs add_loss again, which adds
    nothing (NOTE [Auxiliary losses]): the same steps as the plain chunks in
    one process. Inside hyperparallel.recompute.checkpoint, whose block runs
    its forward without autograd, add_loss fails saying so."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self, c, n):
            super().__init__()
            self.inner = aw.RoutedChunk(c, n)

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    with pytest.raises(RuntimeError, match="add_loss inside hyperparallel.recompute.checkpoint"):
        with hp.pipeline.collect_losses():
            hp.recompute.checkpoint(aw.RoutedChunk(0, 2), torch.ones(2, pm.D, dtype=torch.float64))

    sched = hp.pipeline.schedule("dualpipev", ranks=1, microbatches=4)
    chunks = {c: Checkpointed(c, sched.num_chunks) for c in range(sched.num_chunks)}
    pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=pm.loss_fn, group=one_rank_group)
    opt = torch.optim.SGD([q for c in chunks.values() for q in c.parameters()], lr=pm.LR)
    losses, aux = [], []
    with pytest.warns(RuntimeWarning):
        for step in range(pm.STEPS):  # the warning: torch recomputes in I and again in W
            x, y = pm.batch(step, sched.num_microbatches)
            opt.zero_grad()
            losses.append(pipe.step(x, y))
            aux.append(pipe.last_stats["aux_loss"])
            opt.step()
    ref_losses, ref_aux, ref_chunks = reference(sched.num_chunks, sched.num_microbatches)
    assert min(ref_aux) > 0.01
    for s in range(pm.STEPS):
        assert close(losses[s], ref_losses[s]) and close(aux[s], ref_aux[s]), (s, losses, aux)
    for c, mod in chunks.items():
        for q, q_ref in zip(mod.inner.parameters(), ref_chunks[c]):
            assert (q - q_ref).abs().max().item() <= 1e-9 * max(1.0, q_ref.abs().max().item())
