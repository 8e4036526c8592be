"""hyperparallel.compile.GraphStage: a module run as captured FX graphs whose
backward is split into dx and dw graphs (NOTE [Graph stages] in
python/hyperparallel/compile/stage.py). Single process, float64, against the
same module run eagerly. The pipeline runs (every schedule, inductor) are in
test_stack_compile.py."""

import copy

import pytest
import torch
import transformers

import hyperparallel as hp
from hyperparallel.compile import GraphStage
from hyperparallel.split import forward_and_gradfn
from hyperparallel.split_model import split_model



@pytest.fixture(autouse=True)
def float64_by_default():
    """float64 for this file's tests only: the default dtype is process-wide,
    and the pytest process computes other files' references too."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


class Block(torch.nn.Module):
    """Two inputs (one without a gradient), a tuple output with a mask and an
    int, an unused parameter and a buffer."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.lin = torch.nn.Linear(4, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.out = torch.nn.Linear(6, 4)
        self.unused = torch.nn.Parameter(torch.ones(2))
        self.register_buffer("shift", torch.linspace(-1, 1, 6))
        with torch.no_grad():
            for p in (self.lin.weight, self.out.weight):
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x, scale, *, mode="gelu"):
        h = self.norm(self.lin(x) + self.shift)
        h = torch.nn.functional.gelu(h) if mode == "gelu" else torch.tanh(h)
        return {"y": self.out(h) * scale, "aux": (h.sum(-1), h > 0, 7)}


def grads(module):
    return {n: (p.grad.clone() if p.grad is not None else None)
            for n, p in module.named_parameters()}


def inputs(rows=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g).requires_grad_(), torch.rand(rows, 1, generator=g)


def run(module, x, scale, seeds, **kw):
    out = module(x, scale, **kw)
    loss = (out["y"] * seeds[0]).sum() + (out["aux"][0] * seeds[1]).sum()
    loss.backward()
    return out


def test_forward_and_backward_equal_the_eager_module():
    eager = Block()
    stage = GraphStage(copy.deepcopy(eager))
    x, scale = inputs()
    xe = x.detach().clone().requires_grad_()
    seeds = (torch.randn(5, 4), torch.randn(5))
    got, want = run(stage, x, scale, seeds), run(eager, xe, scale, seeds)
    assert torch.equal(got["y"], want["y"]) and torch.equal(got["aux"][0], want["aux"][0])
    assert torch.equal(got["aux"][1], want["aux"][1]) and got["aux"][2] == 7
    assert not got["aux"][1].requires_grad
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-12, atol=1e-12)
    g_stage, g_eager = grads(stage), grads(eager)
    assert g_stage.keys() == g_eager.keys()  # the module's names, no prefix
    for n in g_eager:
        if g_eager[n] is None:  # eager leaves an unused parameter's grad None
            assert torch.count_nonzero(g_stage[n]) == 0, n
        else:
            torch.testing.assert_close(g_stage[n], g_eager[n], rtol=1e-12, atol=1e-12)
    assert stage.counts == {"capture": 1, "forward": 1, "dx": 0, "dw": 0, "backward": 1}
    assert stage.state_dict().keys() == eager.state_dict().keys()


def test_dx_then_dw_is_the_fused_backward_and_each_graph_runs_once():
    eager = Block()
    stage = GraphStage(copy.deepcopy(eager))
    x, scale = inputs()
    seeds = (torch.randn(5, 4), torch.randn(5))
    # The seed's split API: I (dx) on the critical path, W (dw) later.
    out, gf = forward_and_gradfn(lambda a: stage(a, scale)["y"], x,
                                 weights=list(stage.parameters()))
    dx = gf.compute_input_grad(seeds[0])
    assert stage.counts["dx"] == 1 and stage.counts["dw"] == 0
    dw = gf.compute_weight_grad()
    assert stage.counts == {"capture": 1, "forward": 1, "dx": 1, "dw": 1, "backward": 0}
    # Only "y" was differentiated here: compare with an eager run of "y" alone.
    eager.zero_grad()
    xe = x.detach().clone().requires_grad_()
    (eager(xe, scale)["y"] * seeds[0]).sum().backward()
    torch.testing.assert_close(dx, xe.grad, rtol=1e-12, atol=1e-12)
    for (n, p), g in zip(eager.named_parameters(), dw):
        ref = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12, msg=n)


def test_a_split_graph_holds_the_halves_and_dw_reads_only_residuals():
    stage = GraphStage(Block())
    x, scale = inputs()
    run(stage, x, scale, (torch.randn(5, 4), torch.randn(5)))
    (g,) = stage.graphs()
    ops = {name: [n.target for n in getattr(g, name).graph.nodes if n.op == "call_function"]
           for name in ("forward", "dx", "dw", "backward")}
    mm = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
    count = {k: sum(t in mm for t in v) for k, v in ops.items()}
    # Forward: two linears; the fused backward: dx's two matmuls and dw's two.
    assert count["forward"] == 2 and count["backward"] == 4, count
    assert count["dx"] == 2 and count["dw"] == 2, count
    # dx returns the input's grad and, after it, what dw reads that dx
    # computed; the rest dw reads of dx's inputs directly (no output of dx
    # is one of its inputs).
    assert g.num_param_grads == 7 and g.num_input_grads == 1
    dw_reads = [n for n in g.dw.graph.nodes if n.op == "placeholder"]
    dx_returns = next(n for n in g.dx.graph.nodes if n.op == "output").args[0]
    assert len(dx_returns) - 1 + len(g.passed) == len(dw_reads) and dw_reads
    assert g.passed and not any(n.op == "placeholder" for n in dx_returns)


def test_a_new_signature_captures_again_and_no_grad_runs_eagerly():
    stage = GraphStage(Block())
    x, scale = inputs()
    seeds = (torch.randn(5, 4), torch.randn(5))
    run(stage, x, scale, seeds)
    run(stage, *inputs(seed=1), seeds)
    assert stage.counts["capture"] == 1
    x3, s3 = inputs(rows=3)
    run(stage, x3, s3, (torch.randn(3, 4), torch.randn(3)))  # a new batch size
    assert stage.counts["capture"] == 2
    run(stage, x, scale, seeds, mode="tanh")  # a new constant
    assert stage.counts["capture"] == 3
    with torch.no_grad():
        y = stage(x, scale)["y"]
    assert stage.counts["capture"] == 3 and not y.requires_grad
    torch.testing.assert_close(y, stage.module(x, scale)["y"])


def test_a_split_llama_chunk_with_its_keyword_arguments_equals_the_eager_chunk():
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=4, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16,
                                      tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
    eager = split_model(model, sched, 1)[1]  # layers 2-3, norm and head
    stage = GraphStage(copy.deepcopy(eager))
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 7, 16, generator=g).requires_grad_()
    he = h.detach().clone().requires_grad_()
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    pos = torch.arange(7).unsqueeze(0).expand(2, -1)
    seed = torch.randn(2, 7, 32, generator=g)
    out = stage(h, attention_mask=mask, position_ids=pos)
    want = eager(he, attention_mask=mask, position_ids=pos)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    (out * seed).sum().backward()
    (want * seed).sum().backward()
    torch.testing.assert_close(h.grad, he.grad, rtol=1e-10, atol=1e-12)
    for (n, p), (_, q) in zip(stage.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        GraphStage(lambda x: x)
    with pytest.raises(ValueError, match="backend is 3"):
        GraphStage(torch.nn.Linear(2, 2), backend=3)
    with pytest.raises(ValueError, match="tracing_mode"):
        GraphStage(torch.nn.Linear(2, 2), tracing_mode="guess")
    with pytest.raises(TypeError, match="GraphStage already"):
        GraphStage(GraphStage(torch.nn.Linear(2, 2)))

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            y = self.lin(x)
            return y if y.sum() > 0 else -y  # data-dependent control flow

    with pytest.raises(RuntimeError, match="capturing Branchy's forward failed"):
        GraphStage(Branchy())(torch.randn(3, 2, requires_grad=True))

    class Frozen(torch.nn.Module):
        def forward(self, x):
            return x.detach() * 2

    with pytest.raises(ValueError, match="no output of Frozen needs a gradient"):
        GraphStage(Frozen())(torch.randn(3, 2, requires_grad=True))


def test_auxiliary_losses_are_outputs_of_the_graphs():
    # NOTE [Auxiliary losses] in losses.py: a module that calls add_loss
    # (a MoE router's load-balancing term) trains through its graph stage
    # as it does eagerly.
    from hyperparallel.pipeline import add_loss, collect_losses

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            add_loss((y.softmax(-1) ** 2).mean())
            return torch.tanh(y)

    eager = Routed()
    stage = GraphStage(copy.deepcopy(eager))
    x, _ = inputs()
    xe = x.detach().clone().requires_grad_()
    seed = torch.randn(5, 4)
    for m, a in ((stage, x), (eager, xe)):
        with collect_losses() as aux:
            out = m(a)
        assert len(aux) == 1
        ((out * seed).sum() + 3.0 * aux[0]).backward()
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-12, atol=1e-12)
    for (n, p), (_, q) in zip(stage.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=n)
    with pytest.raises(RuntimeError, match="outside a Pipeline stage's forward"):
        stage(x)  # add_loss with nowhere to go: the same error as eagerly


def test_retain_graph_runs_the_fused_backward_again():
    stage = GraphStage(Block())
    x, scale = inputs()
    y = stage(x, scale)["y"]
    seed = torch.randn(5, 4)
    y.backward(seed, retain_graph=True)
    first = x.grad.clone()
    y.backward(seed)
    torch.testing.assert_close(x.grad, 2 * first, rtol=1e-12, atol=1e-12)
    assert stage.counts["backward"] == 2


def test_column_sums_become_products_equal_to_rounding():
    # NOTE [Column sums as products]: sum(g, [0]) of a 2-D CPU float tensor
    # with enough rows becomes ones(1, rows) @ g; other sums stay.
    from torch.fx.experimental.proxy_tensor import make_fx

    from hyperparallel.compile import ColumnSumsAsProducts

    def sums(g, g3, small, gi, g32):
        return (g.sum(0), g.sum(0, keepdim=True), g.sum(-2), g.sum(1), g3.sum(0), small.sum(0),
                gi.sum(0), g32.sum(0))

    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(64, 5, generator=gen), torch.randn(64, 5, 2, generator=gen),
            torch.randn(8, 5, generator=gen), torch.randint(0, 9, (64, 5), generator=gen),
            torch.randn(40, 3, generator=gen, dtype=torch.float32))
    gm = make_fx(sums, tracing_mode="fake")(*args)
    want = gm(*args)
    aten = torch.ops.aten

    def count(target):
        return sum(n.target is target for n in gm.graph.nodes)

    assert count(aten.sum.dim_IntList) == 8 and count(aten.mm.default) == 0
    ColumnSumsAsProducts().run(gm)
    # Rewritten: the float64 and float32 sums over dim 0 (or -2) of 2-D tensors
    # with >= 32 rows; kept: over dim 1, of a 3-D tensor, of 8 rows, of ints.
    assert count(aten.sum.dim_IntList) == 4 and count(aten.mm.default) == 4
    got = gm(*args)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-12 if a.dtype == torch.float64 else 1e-5,
                                   atol=1e-12 if a.dtype == torch.float64 else 1e-5)


def test_an_inductor_stage_gets_its_bias_gradients_as_products_and_equals_eager():
    torch.manual_seed(4)
    eager = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 6))
    stage = GraphStage(copy.deepcopy(eager), backend="inductor")
    replay = GraphStage(copy.deepcopy(eager))  # no backend: the graphs as they are
    x = torch.randn(48, 6)
    seed = torch.randn(48, 6)
    (eager(x.requires_grad_()) * seed).sum().backward()
    xs = x.detach().clone().requires_grad_()
    out, gf = forward_and_gradfn(stage, xs, weights=list(stage.parameters()))
    torch.testing.assert_close(gf.compute_input_grad(seed), x.grad, rtol=1e-12, atol=1e-12)
    gf.compute_weight_grad(return_grads=False)  # dw: into .grad
    xr = x.detach().clone().requires_grad_()
    (replay(xr) * seed).sum().backward()
    for (n, p), (_, q) in zip(stage.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=n)
    stage.zero_grad()
    (stage(x.detach().clone().requires_grad_()) * seed).sum().backward()  # fused
    for (n, p), (_, q) in zip(stage.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=n)
    assert stage.counts == {"capture": 1, "forward": 2, "dx": 1, "dw": 1, "backward": 1}

    def ops(g, name):
        return [n.target for n in getattr(g, name).graph.nodes if n.op == "call_function"]

    (g,), (r,) = stage.graphs(), replay.graphs()
    aten = torch.ops.aten
    # The two bias sums: in the replayed graphs as sums, in the compiled ones
    # as products (dw's two weight products and two bias products).
    assert ops(r, "dw").count(aten.sum.dim_IntList) == 2
    assert ops(g, "dw").count(aten.sum.dim_IntList) == 0
    assert ops(g, "dw").count(aten.mm.default) == 4
    assert ops(g, "backward").count(aten.sum.dim_IntList) == 0
