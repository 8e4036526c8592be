"""Structures between stages (NOTE [Pytrees between stages] in
python/hyperparallel/pipeline/transfers.py): real processes train a float64 model whose
chunks hand each other tuples and dicts - a differentiable tensor, a bool
mask, a side tensor, a string, an int, a tensor the next chunk ignores, a
float table that takes no gradient (it travels forward only) - on
schedules with fused and split backwards, V shapes and DualPipeV; losses and
parameters equal single-process training."""

import os
import sys

import pytest
import torch

import hyperparallel as hp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pipeline_model as pm  # noqa: E402
import pytree_worker as tw  # noqa: E402
import ranks  # noqa: E402

SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"]


@pytest.mark.parametrize("p", [2, 4])
def test_structures_between_stages_train_equal_to_single_process(p, tmp_path):
    ranks.run_ranks(p, [os.path.join(HERE, "pytree_worker.py"), tmp_path, ",".join(SCHEDULES)])
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(p)]
    for name in SCHEDULES:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=pm.microbatches(name, p))
        n = sched.num_chunks
        chunks = [tw.TreeChunk(c, n) for c in range(n)]
        ref_losses, ref_chunks = pm.train_single_process(
            chunks, pm.batch, sched.num_microbatches, pm.STEPS, pm.LR, tw.loss_fn)
        rows = pm.MB
        for r, res in enumerate(results):
            got = res[name]
            # Only the differentiable leaves' gradient travels back: y, side and
            # the ignored 2 * side, not the mask nor the table (NOTE [Pytrees
            # between stages]).
            for s, (numel, grad_numel) in got["numel"].items():
                # The mask's rows bools travel as their bytes: rows / 8 float64s.
                assert (numel, grad_numel) == (4 * rows * pm.D + -(-rows // 8), 3 * rows * pm.D), (
                    name, p, r, s, numel, grad_numel)
            for s, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
                assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (name, p, r, s, a, b)
            for c, tensors in got["chunks"].items():
                for q, q_ref in zip(tensors, ref_chunks[c]):
                    err = (q - q_ref).abs().max().item()
                    assert err <= 1e-9 * max(1.0, q_ref.abs().max().item()), (name, p, r, c, err)


def test_a_structure_that_changes_between_microbatches_fails_every_rank_naming_it(tmp_path):
    outs = ranks.run_ranks(2, [os.path.join(HERE, "pytree_worker.py"), tmp_path, "1f1b", "bad"],
                           timeout=120, check=False)
    rc0, _, err0 = outs[0]
    assert rc0 != 0 and "stage 0 microbatch 1: the output's structure differs" in err0, err0[-3000:]
    rc1, _, err1 = outs[1]
    assert rc1 != 0 and "rank 0" in err1, err1[-3000:]


def test_a_leaf_that_requires_grad_where_the_probe_found_none_is_refused():
    from hyperparallel.pipeline import _Packing

    w = torch.ones(2, dtype=torch.float64, requires_grad=True)
    probe = (w * 2, torch.ones(2, dtype=torch.float64), 3)
    packing = _Packing.of(probe, autograd=True, dtype=torch.float64)
    assert (packing.numel, packing.grad_numel) == (4, 2)
    flat = packing.pack((w * 3, torch.full((2,), 5.0, dtype=torch.float64), 3), torch.float64, 1, 0)
    assert flat.tolist() == [3.0, 3.0, 5.0, 5.0]  # the differentiable leaf first
    back = packing.unpack(flat)
    assert back[0].requires_grad and not back[1].requires_grad and back[2] == 3
    with pytest.raises(ValueError, match="stage 1 microbatch 0: output leaf 1 .* requires grad"):
        packing.pack((w * 3, w * 5, 3), torch.float64, 1, 0)


@pytest.mark.parametrize("pipeline_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_leaves_without_a_gradient_cross_bit_for_bit(pipeline_dtype):
    # An int64 of 2^40 + 1 (rounded to 2^40 by a cast to float32), a
    # bfloat16 table, a complex tensor, odd-sized bools and an int8 with an
    # odd offset: each arrives as it was sent, beside a differentiable leaf.
    from hyperparallel.pipeline import _Packing

    w = torch.ones(3, dtype=pipeline_dtype, requires_grad=True)
    big = torch.tensor([2**40 + 1, -(2**62) - 3, 7], dtype=torch.int64)
    table = torch.tensor([1.0078125, -3.5, 1e-3], dtype=torch.bfloat16)
    cplx = torch.tensor([1 + 2j, -3.25 - 0.5j], dtype=torch.complex64)
    mask = torch.tensor([True, False, True, True, False])
    small = torch.arange(9, dtype=torch.int8)[1:]  # a view with an odd storage offset
    out = (w * 2, big, table, cplx, mask, small, "tag")
    packing = _Packing.of(out, autograd=True, dtype=pipeline_dtype)
    flat = packing.pack(out, pipeline_dtype, 0, 0)
    assert flat.dtype == pipeline_dtype and flat.numel() == packing.numel
    back = packing.unpack(flat.clone())
    for got, sent in zip(back[1:6], (big, table, cplx, mask, small)):
        assert got.dtype == sent.dtype and torch.equal(got, sent), (got, sent)
    assert back[0].requires_grad and back[6] == "tag"
    assert packing.grad_numel == 3


def test_a_complex_leaf_that_takes_a_gradient_is_refused():
    from hyperparallel.pipeline import _Packing

    z = torch.ones(2, dtype=torch.complex128, requires_grad=True)
    with pytest.raises(ValueError, match="is complex and takes a gradient"):
        _Packing.of((z * 2,), autograd=True, dtype=torch.float64)
