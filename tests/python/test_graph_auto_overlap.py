"""AutoOverlapPass (seed 002 §8): every wait_tensor sinks to just before its
first reader, all-gathers are issued `prefetch` ahead (or all at the top),
and reduce-scatters stay where their gradient is produced, so compute runs
between each collective and its wait. On torch's fake process group of two
ranks (the overlapped training is checked on real ranks in
test_graph_distributed.py)."""

import pytest
import torch
import torch.distributed as dist

from hyperparallel.compile import AutoOverlapPass, PassConfig, PassPipeline, trace_model_graph
from hyperparallel.compile.mesh import register_process_group

AG = torch.ops._c10d_functional.all_gather_into_tensor.default
RS = torch.ops._c10d_functional.reduce_scatter_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    register_process_group("fsdp", dist.group.WORLD)
    yield
    dist.destroy_process_group()


def fsdp_graph(overlap, prefetch=1, layers=4, bucket="parameter"):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    m = torch.nn.Sequential(*mods).double()
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 8, (4,))
    gm = trace_model_graph(m, lambda mm, a, b: torch.nn.functional.cross_entropy(mm(a), b), x, y)
    cfg = PassConfig(enable_overlap=overlap, prefetch=prefetch, bucket=bucket)
    return PassPipeline.from_config(cfg).run(gm, model=m), m, x, y


def waits(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == WAIT]


def test_fsdp_places_each_wait_right_after_its_collective(fake_world):
    gm, *_ = fsdp_graph(overlap=False)
    for w in waits(gm):
        assert w.prev is w.args[0] or w.prev.target == torch.ops.aten.contiguous.default


def test_waits_sink_to_their_first_use(fake_world):
    gm, m, x, y = fsdp_graph(overlap=True)
    order = list(gm.graph.nodes)
    ws = waits(gm)
    assert len(ws) == 16
    for w in ws:
        first = min(w.users, key=order.index)
        # Only other waits stand between a wait and its first reader.
        between = order[order.index(w) + 1:order.index(first)]
        assert all(n.target == WAIT for n in between), (w, between)
    # Reduce-scatters: issued where the gradient is produced, waited at the
    # output, with backward compute in between for all but the last.
    hidden = 0
    for rs in [n for n in order if n.op == "call_function" and n.target == RS]:
        w = next(iter(rs.users))
        span = order[order.index(rs) + 1:order.index(w)]
        hidden += any(n.target not in (WAIT, RS, AG, torch.ops.aten.contiguous.default)
                      for n in span if n.op == "call_function")
    assert hidden >= 6
    with torch.no_grad():  # still a valid program
        gm(*m.parameters(), x, y)


@pytest.mark.parametrize("prefetch", [1, 2, None])
def test_all_gathers_are_issued_prefetch_ahead(fake_world, prefetch):
    gm, *_ = fsdp_graph(overlap=True, prefetch=prefetch)
    order = list(gm.graph.nodes)
    in_flight, most = 0, 0
    first_compute = None
    for n in order:
        if n.op != "call_function":
            continue
        if n.target == AG:
            in_flight += 1
            most = max(most, in_flight)
        elif n.target == WAIT and n.args[0].target == AG:
            in_flight -= 1
        elif first_compute is None and n.target not in (WAIT, RS):
            first_compute = n
    assert most == (8 if prefetch is None else prefetch + 1)  # at most prefetch ahead
    # Issued before the first compute: the first prefetch + 1 (the one waited
    # for and those ahead of it), or all eight.
    gathers = [n for n in order if n.op == "call_function" and n.target == AG]
    early = [g for g in gathers if order.index(g) < order.index(first_compute)]
    assert len(early) == (8 if prefetch is None else prefetch + 1)


def test_pass_on_a_graph_without_collectives_is_the_identity():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 2, (3,))
    gm = trace_model_graph(m, lambda mm, a, b: torch.nn.functional.cross_entropy(mm(a), b), x, y)
    before = [n.name for n in gm.graph.nodes]
    gm = AutoOverlapPass().run(gm)
    assert [n.name for n in gm.graph.nodes] == before
