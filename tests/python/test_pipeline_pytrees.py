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
        for r, res in enumerate(results):
            got = res[name]
            for s, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
                assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (name, p, r, s, a, b)
            for c, tensors in got["chunks"].items():
                for q, q_ref in zip(tensors, ref_chunks[c]):
                    err = (q - q_ref).abs().max().item()
                    assert err <= 1e-9 * max(1.0, q_ref.abs().max().item()), (name, p, r, c, err)


def test_a_structure_without_a_tensor_fails_every_rank_naming_it(tmp_path):
    outs = ranks.run_ranks(2, [os.path.join(HERE, "pytree_worker.py"), tmp_path, "1f1b", "bad"],
                           timeout=120, check=False)
    rc0, _, err0 = outs[0]
    assert rc0 != 0 and "stage 0 microbatch 1: the forward returned a tuple holding no tensor" \
        in err0, err0[-3000:]
    rc1, _, err1 = outs[1]
    assert rc1 != 0 and "rank 0" in err1, err1[-3000:]


def test_a_message_holds_the_structure_and_each_tensor_as_it_is():
    # NOTE [Pytrees between stages]: the tensors in order, in their own
    # dtypes (an int64 of 2^40 + 1, a bfloat16, a complex, bools, an int8
    # view with an odd offset), then the structure with the other leaves.
    from hyperparallel.pipeline import _from_message, _to_message

    w = torch.ones(3, dtype=torch.float32, requires_grad=True)
    big = torch.tensor([2**40 + 1, -(2**62) - 3, 7], dtype=torch.int64)
    table = torch.tensor([1.0078125, -3.5, 1e-3], dtype=torch.bfloat16)
    cplx = torch.tensor([1 + 2j, -3.25 - 0.5j], dtype=torch.complex64)
    mask = torch.tensor([True, False, True, True, False])
    small = torch.arange(9, dtype=torch.int8)[1:]
    out = {"h": w * 2, "rest": (big, table, None, [cplx, mask]), "tag": "x", "k": 3,
           "small": small}
    message = _to_message(out, 0, 0)
    assert [t.dtype for t in message[:-1]] == [
        torch.float32, torch.int64, torch.bfloat16, torch.complex64, torch.bool, torch.int8]
    assert message[-1].dtype == torch.uint8
    # Through bytes, as a transfer moves them.
    copied = [torch.frombuffer(bytearray(t.contiguous().view(torch.uint8).numpy().tobytes()),
                               dtype=t.dtype).view(t.shape) for t in message]
    back = _from_message(copied)
    assert back["tag"] == "x" and back["k"] == 3 and back["rest"][2] is None
    for got, sent in [(back["h"], out["h"].detach()), (back["rest"][0], big),
                      (back["rest"][1], table), (back["rest"][3][0], cplx),
                      (back["rest"][3][1], mask), (back["small"], small)]:
        assert got.dtype == sent.dtype and torch.equal(got, sent), (got, sent)
    assert _to_message(w, 0, 0)[0] is w and _from_message([w]) is w  # a bare tensor
    with pytest.raises(ValueError, match="stage 2 microbatch 5: .* holding no tensor"):
        _to_message(("a", 1), 2, 5)
