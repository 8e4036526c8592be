"""PassPipeline (seed 002 §5): the fixed order dce -> canonicalize -> [fsdp]
-> [auto_overlap] chosen by PassConfig, the passes it is made of (DCE keeps
mutations, canonicalize drops detach/alias), and the compiler backend slot
(a callable, and torch.compile's aot_eager or HP_TEST_COMPILE_BACKEND)."""

import os

import pytest
import torch

from hyperparallel.compile import (AutoOverlapPass, CanonicalizeGraph, DeadCodeElimination,
                                   FSDPPass, GraphTrainer, PassConfig, PassPipeline, PassPlan,
                                   trace_model_graph)

F64 = torch.float64


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(),
                               torch.nn.Linear(6, 3)).double()


def loss_fn(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


def data(step=0):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 5, generator=g, dtype=F64), torch.randint(0, 3, (4,), generator=g)


@pytest.mark.parametrize("overlap, fsdp, names", [
    (True, True, ["dce", "canonicalize", "fsdp", "auto_overlap"]),
    (False, True, ["dce", "canonicalize", "fsdp"]),
    (True, False, ["dce", "canonicalize", "auto_overlap"]),
    (False, False, ["dce", "canonicalize"]),
])
def test_from_config_fixed_order(overlap, fsdp, names):
    plan = PassPlan().add_module("0")
    pipe = PassPipeline.from_config(
        PassConfig(enable_overlap=overlap, fsdp_enabled=fsdp, fsdp_degree=2, prefetch=3,
                   reshard_after_forward=True), plan)
    assert pipe.names == names
    kinds = [type(p) for p in pipe.passes]
    assert kinds[:2] == [DeadCodeElimination, CanonicalizeGraph]
    if fsdp:
        f = pipe.passes[2]
        assert isinstance(f, FSDPPass) and f.plan is plan and f.degree == 2
        assert f.reshard_after_forward
    if overlap:
        assert isinstance(pipe.passes[-1], AutoOverlapPass) and pipe.passes[-1].prefetch == 3
    assert pipe.backend is None


def test_from_config_validates():
    with pytest.raises(ValueError, match="tp_size is 0"):
        PassPipeline.from_config(PassConfig(tp_size=0))


def test_dce_drops_unread_nodes_and_keeps_mutations():
    m = net()
    gm = trace_model_graph(m, loss_fn, *data())
    graph = gm.graph
    x = next(n for n in graph.nodes if n.meta.get("hp_role") == "input")
    out = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(out):
        dead = graph.call_function(torch.ops.aten.mul.Tensor, (x, x))
        graph.call_function(torch.ops.aten.neg.default, (dead,))
        buf = graph.call_function(torch.ops.aten.zeros.default, ([2],), {"dtype": F64})
        graph.call_function(torch.ops.aten.add_.Tensor, (buf, 1.0))
    gm.recompile()
    n_before = len(graph.nodes)
    gm = DeadCodeElimination().run(gm)
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.neg.default not in targets and torch.ops.aten.mul.Tensor not in targets
    assert torch.ops.aten.add_.Tensor in targets and torch.ops.aten.zeros.default in targets
    assert len(gm.graph.nodes) == n_before - 2


def test_canonicalize_drops_detach_and_keeps_the_numbers():
    m = net()
    x, y = data()
    gm = trace_model_graph(m, loss_fn, x, y)
    detach = torch.ops.aten.detach.default
    assert any(n.target == detach for n in gm.graph.nodes)
    with torch.no_grad():
        before = gm(*m.parameters(), x, y)
    gm = CanonicalizeGraph().run(gm)
    assert not any(n.target == detach for n in gm.graph.nodes)
    with torch.no_grad():
        after = gm(*m.parameters(), x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_backend_slot_compiles_the_transformed_graph():
    seen = []

    def backend(gm, example_inputs):
        seen.append([n.op for n in gm.graph.nodes].count("placeholder"))
        return gm.forward

    plain, compiled = net(), net()
    a = GraphTrainer(plain, loss_fn, PassConfig(), device="cpu")
    b = GraphTrainer(compiled, loss_fn, PassConfig(backend=backend), device="cpu")
    for s in range(2):
        la, lb = a.train_step(*data(s)), b.train_step(*data(s))
        a.optimizer_step()
        b.optimizer_step()
        assert la.item() == lb.item()
    assert seen == [6]  # once: 4 parameters, input, label
    for p, q in zip(plain.parameters(), compiled.parameters()):
        assert torch.equal(p, q)
    # A backend name is looked up as torch.compile does and compiles the ATen
    # graph directly, with no dynamo frame around it (NOTE [Graphs compiled
    # without dynamo]); the compiled graph computes what the graph does.
    pipe = PassPipeline.from_config(PassConfig(backend="aot_eager"))
    model = net()
    gm = pipe.run(trace_model_graph(model, loss_fn, *data()))
    fn = pipe.compile(gm)
    assert fn is not gm and getattr(fn, "_orig_mod", None) is None
    args = [p.detach() for p in model.parameters()] + list(data())
    with torch.no_grad():
        want, got = gm(*args), fn(*args)
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))


def test_backend_through_torch_compile_trains_equal():
    # HP_TEST_COMPILE_BACKEND=inductor checks inductor itself (about 30 s on
    # two cores, equal to 1e-15); aot_eager goes the same way through dynamo.
    backend = os.environ.get("HP_TEST_COMPILE_BACKEND", "aot_eager")
    plain, compiled = net(), net()
    a = GraphTrainer(plain, loss_fn, PassConfig(), device="cpu")
    b = GraphTrainer(compiled, loss_fn, PassConfig(backend=backend), device="cpu")
    for s in range(3):
        la, lb = a.train_step(*data(s)), b.train_step(*data(s))
        a.optimizer_step()
        b.optimizer_step()
        assert abs(la.item() - lb.item()) <= 1e-12
    for p, q in zip(plain.parameters(), compiled.parameters()):
        assert (p - q).abs().max().item() <= 1e-12
