"""FSDPPass on the captured graph (seed 002 §7), in one process over
torch's fake process group of two ranks (collectives are no-ops, so the
graph's structure and the live model's sharding are what is checked; the
numbers are checked on two real ranks in test_graph_distributed.py)."""

import pytest
import torch
import torch.distributed as dist

from hyperparallel.compile import FSDPPass, PassConfig, PassPipeline, PassPlan, trace_model_graph
from hyperparallel.compile.mesh import register_process_group

AG = torch.ops._c10d_functional.all_gather_into_tensor.default
RS = torch.ops._c10d_functional.reduce_scatter_tensor.default
AR = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    register_process_group("fsdp", dist.group.WORLD)
    yield
    dist.destroy_process_group()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3)).double()


def loss_fn(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


def capture(m, rows=4):
    x, y = torch.randn(rows, 6, dtype=torch.float64), torch.randint(0, 3, (rows,))
    return trace_model_graph(m, loss_fn, x, y), x, y


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def test_without_torch_distributed_the_pass_does_nothing():
    assert not dist.is_initialized()
    m = model()
    gm, _, _ = capture(m)
    before = [p.shape for p in m.parameters()]
    gm = FSDPPass().run(gm, model=m)
    assert not calls(gm, AG) and not calls(gm, RS) and gm.fsdp_fqns == []
    assert [p.shape for p in m.parameters()] == before


def test_collectives_where_the_plan_says_and_live_model_sharded_in_place(fake_world):
    m = model()
    full = {n: p.detach().clone() for n, p in m.named_parameters()}
    objects = {n: p for n, p in m.named_parameters()}
    gm, x, y = capture(m)
    plan = PassPlan().add_module("0").add_pattern("2*")  # not "4": 3 rows, replicated
    gm = FSDPPass(plan, bucket="parameter").run(gm, model=m, fsdp_group_name="fsdp")
    planned = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert gm.fsdp_fqns == planned and gm.fsdp_degree == 2
    # An all-gather (and its wait) after the placeholders, for each planned
    # parameter; the placeholder's only reader is its all-gather.
    ph = {n.meta.get("hp_fqn"): n for n in gm.graph.nodes if n.op == "placeholder"}
    gathers = calls(gm, AG)
    assert [g.args[0].meta["hp_fqn"] for g in gathers] == planned
    assert all(g.args[1:] == (2, "fsdp") for g in gathers)
    for fqn in planned:
        assert list(ph[fqn].users) == [g for g in gathers if g.args[0] is ph[fqn]]
    first_compute = next(n for n in gm.graph.nodes
                         if n.op == "call_function" and n.target not in (AG, WAIT))
    order = list(gm.graph.nodes)
    assert all(order.index(g) < order.index(first_compute) for g in gathers)
    # Gradients: reduce-scatter (averaged) for planned, all-reduce for the rest.
    out = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    kinds = [o.args[0].target for o in out[1:]]
    assert all(o.target == WAIT for o in out[1:])
    assert kinds == [RS, RS, RS, RS, AR, AR]
    assert all(c.args[1] == "avg" for c in calls(gm, RS) + calls(gm, AR))
    # The live model: same Parameter objects, this rank's (1) dim-0 half.
    for n, p in m.named_parameters():
        assert p is objects[n]
        if n in planned:
            assert torch.equal(p.detach(), full[n].chunk(2)[1])
        else:
            assert torch.equal(p.detach(), full[n])
    # The graph runs on the shards (the fake group's collectives return
    # buffers of the right shapes) and its gradients are shard-shaped.
    with torch.no_grad():
        outs = gm(*m.parameters(), x, y)
    assert [tuple(g.shape) for g in outs[1:]] == [tuple(p.shape) for p in m.parameters()]


def test_indivisible_dim0_names_the_parameter(fake_world):
    m = model()
    gm, _, _ = capture(m)
    with pytest.raises(ValueError, match=r"parameter '4.weight' has shape \(3, 8\).*divisible "
                                         r"by 2"):
        FSDPPass(None).run(gm, model=m)  # no plan: every parameter is sharded
    assert m[4].weight.shape == (3, 8) and m[0].weight.shape == (8, 6)  # nothing sharded


def test_degree_must_match_the_group(fake_world):
    m = model()
    gm, _, _ = capture(m)
    with pytest.raises(ValueError, match="fsdp_degree is 4 but the group 'fsdp' has 2 ranks"):
        FSDPPass(PassPlan().add_module("0"), degree=4).run(gm, model=m)


def test_reshard_after_forward_gathers_again_for_the_backward(fake_world):
    m = model()
    gm, _, _ = capture(m)
    plan = PassPlan().add_module("0").add_module("2")
    gm = PassPipeline.from_config(PassConfig(enable_overlap=False, reshard_after_forward=True,
                                             bucket="parameter"),
                                  plan).run(gm, model=m)
    order = list(gm.graph.nodes)
    loss = next(n for n in order if n.op == "output").args[0][0]
    boundary = min(order.index(u) for u in loss.users if u.op != "output")
    gathers = calls(gm, AG)
    by_param = {}
    for g in gathers:
        by_param.setdefault(g.args[0].meta["hp_fqn"], []).append(g)
    # 2.weight is read by the backward (dx of layer 2's input): gathered twice,
    # the second gather after the forward; 0.weight's dx is never needed.
    assert len(by_param["2.weight"]) == 2 and len(by_param["0.weight"]) == 1
    assert order.index(by_param["2.weight"][1]) > boundary
    # Nothing the backward reads comes from the forward's gather of 2.weight.
    fwd_wait = next(iter(by_param["2.weight"][0].users))
    derived, stack = set(), [fwd_wait]
    while stack:
        n = stack.pop()
        for u in n.users:
            if order.index(u) < boundary and u not in derived and len(u.all_input_nodes) == 1:
                derived.add(u)
                stack.append(u)
    for n in {fwd_wait} | derived:
        assert all(order.index(u) < boundary for u in n.users), n


def test_a_modules_parameters_share_one_gather_and_one_reduce_scatter(fake_world):
    # NOTE [FSDP buckets]: the plan's modules "0" and "2" are one bucket each.
    m = model()
    gm, x, y = capture(m)
    plan = PassPlan().add_module("0").add_pattern("2*")
    gm = PassPipeline.from_config(PassConfig(), plan).run(gm, model=m)
    assert gm.fsdp_fqns == ["0.weight", "0.bias", "2.weight", "2.bias"]
    gathers, scatters = calls(gm, AG), calls(gm, RS)
    assert len(gathers) == 2 and len(scatters) == 2 and len(calls(gm, AR)) == 2
    for g, module in zip(gathers, ("0", "2")):
        cat = g.args[0]
        assert cat.target == torch.ops.aten.cat.default
        assert [a.args[0].meta["hp_fqn"] for a in cat.args[0]] == [module + ".weight",
                                                                   module + ".bias"]
    # Every gradient output is a view of its bucket's reduce-scatter, shard-shaped.
    out = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    sources = [o.args[0].args[0] for o in out[1:5]]
    assert [s.target for s in sources] == [WAIT] * 4
    assert sources[0] is sources[1] and sources[2] is sources[3] and sources[0] is not sources[2]
    # Overlap: the reduce-scatters' waits sank to the end of the graph.
    order = list(gm.graph.nodes)
    last_issue = max(order.index(s.args[0]) for s in sources)
    assert all(order.index(s) > last_issue for s in sources)
    with torch.no_grad():
        outs = gm(*m.parameters(), x, y)
    assert [tuple(g.shape) for g in outs[1:]] == [tuple(p.shape) for p in m.parameters()]


def test_bucket_must_be_module_or_parameter():
    with pytest.raises(ValueError, match="bucket is 'layer'"):
        FSDPPass(bucket="layer")
    with pytest.raises(ValueError, match="PassConfig: bucket is 'layer'"):
        PassConfig(bucket="layer").validate()
