"""forward_and_gradfn / GradFunction from Python (seed 000, section 6): every
dx and dw is checked against torch.autograd.grad on the same data in float64,
and the split's dx + dw against one fused backward (values and FLOPs)."""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import hyperparallel as hp
from hyperparallel import forward_and_gradfn

F64 = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def param(*shape, scale=0.3):
    return (torch.randn(*shape, dtype=F64) * scale).requires_grad_(True)


def reference(fn, inputs, weights, sens=None, positions=None):
    """(out, dx list, dw list) of fn by torch.autograd.grad on fresh leaves."""
    positions = list(range(len(inputs))) if positions is None else positions
    xs = [x.detach().requires_grad_(True) if i in positions else x for i, x in enumerate(inputs)]
    out = fn(*xs)
    wrt = [xs[i] for i in positions] + list(weights)
    grads = torch.autograd.grad(out, wrt, torch.ones_like(out) if sens is None else sens,
                                allow_unused=True, materialize_grads=True)
    return out, list(grads[: len(positions)]), list(grads[len(positions):])


def close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def clear_grads(ws):
    for w in ws:
        w.grad = None


# ---------------------------------------------------------------------------------------------
# The seed's test list
# ---------------------------------------------------------------------------------------------
def mlp(ws):
    w1, b1, w2, b2 = ws

    def fn(x):
        return torch.relu(x @ w1 + b1) @ w2 + b2

    return fn


def test_basic_forward_dx_dw_and_grad_accumulation():
    ws = [param(8, 16), param(16), param(16, 4), param(4)]
    x = torch.randn(5, 8, dtype=F64)
    sens = torch.randn(5, 4, dtype=F64)
    ref_out, ref_dx, ref_dw = reference(mlp(ws), [x], ws, sens)
    out, gf = forward_and_gradfn(mlp(ws), x, weights=ws)
    close(out, ref_out, "forward")
    dx = gf.compute_input_grad(sens)
    assert isinstance(dx, torch.Tensor), "an int grad_position gives one gradient"
    close(dx, ref_dx[0], "dx")
    assert all(w.grad is None for w in ws), "dx leaves .grad alone"
    dw = gf.compute_weight_grad()
    assert isinstance(dw, tuple) and len(dw) == 4
    for i in range(4):
        close(dw[i], ref_dw[i], f"dw {i}")
        close(ws[i].grad, ref_dw[i], f".grad {i}")
    assert not x.requires_grad, "the caller's input is not modified"
    assert gf.stats.num_dx_nodes > 0 and gf.stats.num_groups >= 1


def test_keep_graph_repeats_dw_identically_and_accumulates():
    ws = [param(6, 6), param(6)]
    x = torch.randn(3, 6, dtype=F64)
    fn = lambda x: torch.tanh(x @ ws[0] + ws[1]).sum(0)  # noqa: E731
    _, _, ref_dw = reference(fn, [x], ws)
    out, gf = forward_and_gradfn(fn, x, weights=ws)
    gf.compute_input_grad()
    first = gf.compute_weight_grad(keep_graph=True)
    second = gf.compute_weight_grad(keep_graph=True)
    third = gf.compute_weight_grad()
    for i in range(2):
        assert torch.equal(first[i], second[i]) and torch.equal(first[i], third[i])
        close(first[i], ref_dw[i], f"dw {i}")
        close(ws[i].grad, 3 * ref_dw[i], f".grad accumulates three times {i}")
    with pytest.raises(RuntimeError, match="keep_graph"):
        gf.compute_weight_grad()


def test_weight_grad_into_grad_only_gives_the_same_grad_and_runs_the_hooks():
    # NOTE [dw into .grad]: return_grads=False (the Pipeline's W) puts into .grad
    # bit for bit what the returning form puts there, over several microbatches
    # whose W run late and out of order, and runs each weight's post-accumulate
    # hook as backward() does.
    ws = [param(8, 16), param(16), param(16, 4), param(4)]
    xs = [torch.randn(5, 8, dtype=F64) for _ in range(3)]
    sums = []
    for return_grads in (True, False):
        clear_grads(ws)
        pending = []
        for x in xs:
            _, gf = forward_and_gradfn(mlp(ws), x, weights=ws)
            gf.compute_input_grad()
            pending.append(gf)
        fired = []
        handles = [w.register_post_accumulate_grad_hook(lambda p, i=i: fired.append(i))
                   for i, w in enumerate(ws)]
        for k in (2, 0, 1):
            out = pending[k].compute_weight_grad(return_grads=return_grads)
            assert (out is None) == (not return_grads)
        for h in handles:
            h.remove()
        assert sorted(fired) == ([] if return_grads else sorted(list(range(4)) * 3))
        sums.append([w.grad.clone() for w in ws])
    for a, b in zip(*sums):
        assert torch.equal(a, b)
    ref = [sum(reference(mlp(ws), [x], ws)[2][i] for x in xs) for i in range(4)]
    for i in range(4):
        close(sums[1][i], ref[i], f".grad {i}")
    _, gf = forward_and_gradfn(mlp(ws), xs[0], weights=ws)
    gf.compute_input_grad()
    with pytest.raises(TypeError, match="return_grads must be a bool"):
        gf.compute_weight_grad(return_grads=0)
    clear_grads(ws)


@pytest.mark.parametrize("kind", ["split", "chunk", "unbind"])
def test_multi_output_intermediates_keep_per_slot_gradients(kind):
    w1, w2, w3 = param(4, 12), param(4, 4), param(4, 4)

    def fn(x):
        h = x @ w1
        if kind == "split":
            a, b, c = torch.split(h, 4, dim=-1)
        elif kind == "chunk":
            a, b, c = h.chunk(3, dim=-1)
        else:
            a, b, c = h.view(-1, 3, 4).unbind(1)
        # slot 0 meets a weight, slot 1 stays on the input path, slot 2 meets another weight
        return (a @ w2) * torch.sigmoid(b) + c @ w3

    x = torch.randn(5, 4, dtype=F64)
    sens = torch.randn(5, 4, dtype=F64)
    _, ref_dx, ref_dw = reference(fn, [x], [w1, w2, w3], sens)
    _, gf = forward_and_gradfn(fn, x, weights=[w1, w2, w3])
    close(gf.compute_input_grad(sens), ref_dx[0], "dx")
    for i, g in enumerate(gf.compute_weight_grad()):
        close(g, ref_dw[i], f"dw {i}")


def test_weight_only_subgraph_then_join():
    w, b, s = param(6, 6), param(6), param(6)

    def fn(x):
        # a branch of weights only (w_eff), computed before it meets the input
        w_eff = torch.tanh(w) * s.unsqueeze(0) + b.unsqueeze(1)
        return torch.relu(x @ w_eff) @ w_eff.t()

    x = torch.randn(4, 6, dtype=F64)
    _, ref_dx, ref_dw = reference(fn, [x], [w, b, s])
    _, gf = forward_and_gradfn(fn, x, weights=[w, b, s])
    close(gf.compute_input_grad(), ref_dx[0], "dx")
    for i, g in enumerate(gf.compute_weight_grad()):
        close(g, ref_dw[i], f"dw {i}")


def test_shared_intermediate_merges_groups():
    w1, w2, w3 = param(5, 5), param(5, 5), param(5, 5)

    def fn(x):
        a = torch.sin(x @ w1)
        return a @ w2 + torch.cos(a) @ w3 + a * (w2.sum())

    x = torch.randn(3, 5, dtype=F64)
    _, ref_dx, ref_dw = reference(fn, [x], [w1, w2, w3])
    _, gf = forward_and_gradfn(fn, x, weights=[w1, w2, w3])
    close(gf.compute_input_grad(), ref_dx[0], "dx")
    for i, g in enumerate(gf.compute_weight_grad()):
        close(g, ref_dw[i], f"dw {i}")


@pytest.mark.parametrize(
    "body",
    [
        lambda x, w: x @ w @ w,  # pytorch/pytorch#180952
        lambda x, w: torch.tanh(x @ w) @ w + x * w.sum(),
        lambda x, w: (x @ w) @ (w @ w) + w[0],
    ],
    ids=["x@w@w", "tanh-and-sum", "w@w"],
)
def test_shared_weight_in_several_places_is_not_double_counted(body):
    w = param(6, 6)
    x = torch.randn(4, 6, dtype=F64)
    fn = lambda x: body(x, w)  # noqa: E731
    _, ref_dx, ref_dw = reference(fn, [x], [w])
    _, gf = forward_and_gradfn(fn, x, weights=[w])
    close(gf.compute_input_grad(), ref_dx[0], "dx")
    (dw,) = gf.compute_weight_grad()
    close(dw, ref_dw[0], "dw")
    close(w.grad, ref_dw[0], ".grad once")


def test_dx_plus_dw_cost_the_flops_of_one_fused_backward():
    w1, w2 = param(64, 64), param(64, 64)
    x = torch.randn(32, 64, dtype=F64)
    fn = lambda x: torch.tanh(x @ w1 @ w1) @ w2  # noqa: E731
    _, gf = forward_and_gradfn(fn, x, weights=[w1, w2])
    with FlopCounterMode(display=False) as dx_flops:
        gf.compute_input_grad()
    with FlopCounterMode(display=False) as dw_flops:
        gf.compute_weight_grad()
    _, fused = forward_and_gradfn(fn, x, weights=[w1, w2])
    with FlopCounterMode(display=False) as fused_flops:
        fused()
    assert dx_flops.get_total_flops() + dw_flops.get_total_flops() == \
        fused_flops.get_total_flops() > 0


# ---------------------------------------------------------------------------------------------
# PyTorch's own split tests (test/distributed/pipelining/test_backward.py), restated
# ---------------------------------------------------------------------------------------------
class MLPModule(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.net1 = torch.nn.Linear(d, d)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(d, d)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class MultiInterMediateModel(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.net1 = torch.nn.Linear(d, d)
        self.net2 = torch.nn.Linear(d, d)
        self.net3 = torch.nn.Linear(d, d * 2)

    def forward(self, x):
        h = torch.relu(self.net1(x))
        a, b = torch.relu(self.net3(h)).chunk(2, dim=-1)
        return self.net2(a) * torch.sigmoid(b)


D, BATCH = 16, 8


def stage_and_reference(cls):
    mod = cls(D).to(F64)
    ref_mod = copy.deepcopy(mod)
    x = torch.randn(BATCH, D, dtype=F64)
    target = torch.randn(BATCH, D, dtype=F64)
    ref_x = x.detach().requires_grad_(True)
    torch.nn.functional.mse_loss(ref_mod(ref_x), target, reduction="sum").backward()

    def loss_of(x):
        return torch.nn.functional.mse_loss(mod(x), target, reduction="sum")

    return mod, ref_mod, x, ref_x, loss_of


def test_stage_backward_input_leaves_weight_gradients_untouched():
    mod, _, x, ref_x, loss_of = stage_and_reference(MLPModule)
    _, gf = forward_and_gradfn(loss_of, x, weights=mod.parameters())
    close(gf.compute_input_grad(), ref_x.grad, "dx")
    assert all(p.grad is None for p in mod.parameters())


@pytest.mark.parametrize("cls", [MLPModule, MultiInterMediateModel])
def test_stage_backward_weight_equals_full_backward(cls):
    mod, ref_mod, x, ref_x, loss_of = stage_and_reference(cls)
    _, gf = forward_and_gradfn(loss_of, x, weights=mod.parameters())
    close(gf.compute_input_grad(), ref_x.grad, "dx")
    gf.compute_weight_grad()
    for (name, p), q in zip(mod.named_parameters(), ref_mod.parameters()):
        close(p.grad, q.grad, name)


def test_stage_backward_weight_multiple_iters_accumulate():
    mod, ref_mod, _, _, _ = stage_and_reference(MLPModule)
    for p in ref_mod.parameters():
        p.grad = None
    target = torch.randn(BATCH, D, dtype=F64)
    for _ in range(3):
        x = torch.randn(BATCH, D, dtype=F64)
        _, gf = forward_and_gradfn(
            lambda x: torch.nn.functional.mse_loss(mod(x), target, reduction="sum"), x,
            weights=mod.parameters())
        gf.compute_input_grad()
        gf.compute_weight_grad()
        torch.nn.functional.mse_loss(ref_mod(x.requires_grad_(True)), target,
                                     reduction="sum").backward()
    for p, q in zip(mod.parameters(), ref_mod.parameters()):
        close(p.grad, q.grad, "accumulated over 3 microbatches")


def test_pytorch_stage_backward_double_counts_x_w_w_and_ours_does_not():
    """pytorch/pytorch#180952: PyTorch's stage_backward_input/weight count the
    path through the first use of w twice on `x @ w @ w` (still so in the torch
    this runs on); our dx + dw equal plain autograd."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    w = param(5, 5)
    x = torch.randn(3, 5, dtype=F64)
    fn = lambda x: x @ w @ w  # noqa: E731
    _, ref_dx, ref_dw = reference(fn, [x], [w])

    xi = x.detach().requires_grad_(True)
    y = fn(xi)
    dx, groups = stage_backward_input([y], None, [xi], iter([w]))
    stage_backward_weight(iter([w]), groups)
    close(dx[0], ref_dx[0], "PyTorch dx")
    pytorch_counts_twice = not torch.allclose(w.grad, ref_dw[0])

    w.grad = None
    _, gf = forward_and_gradfn(fn, x, weights=[w])
    close(gf.compute_input_grad(), ref_dx[0], "our dx")
    gf.compute_weight_grad()
    close(w.grad, ref_dw[0], "our dw")
    if not pytorch_counts_twice:
        pytest.fail(f"torch {torch.__version__} no longer double counts x @ w @ w: update "
                    "docs/python.md and this test (both splits are then exact)")


# ---------------------------------------------------------------------------------------------
# Frozen tensors, kwargs, has_aux, grad_position, __call__
# ---------------------------------------------------------------------------------------------
def test_frozen_weights_and_inputs():
    mod = MLPModule(D).to(F64)
    mod.net1.weight.requires_grad_(False)
    x = torch.randn(BATCH, D, dtype=F64)  # does not require grad: still gets dx when selected
    frozen_input = torch.randn(BATCH, D, dtype=F64)
    fn = lambda x, f: mod(x) * f  # noqa: E731
    live = [p for p in mod.parameters() if p.requires_grad]
    _, ref_dx, ref_dw = reference(fn, [x, frozen_input], live, positions=[0])

    _, gf = forward_and_gradfn(fn, x, frozen_input, weights=mod.parameters())
    close(gf.compute_input_grad(), ref_dx[0], "dx")
    dw = gf.compute_weight_grad()
    assert len(dw) == 4 and dw[0] is None, "a frozen weight listed explicitly gets None"
    for g, r in zip(dw[1:], ref_dw):
        close(g, r, "dw of the live weights")
    assert mod.net1.weight.grad is None
    assert frozen_input.grad is None and x.grad is None

    # Default weights of a module: its parameters that require grad, in order.
    clear_grads(mod.parameters())
    _, gf = forward_and_gradfn(mod, x)
    gf.compute_input_grad()
    dw = gf.compute_weight_grad()
    assert len(dw) == 3
    _, _, ref_dw = reference(mod, [x], live)
    for g, r in zip(dw, ref_dw):
        close(g, r, "default weights")


def test_input_that_requires_grad_is_used_as_is_and_unselected_inputs_are_left_alone():
    w = param(4, 4)
    a = torch.randn(2, 4, dtype=F64, requires_grad=True)
    b = torch.randn(2, 4, dtype=F64, requires_grad=True)
    fn = lambda a, b: (a @ w) * b  # noqa: E731
    _, ref_dx, ref_dw = reference(fn, [a, b], [w], positions=[0])
    _, gf = forward_and_gradfn(fn, a, b, weights=[w])
    close(gf.compute_input_grad(), ref_dx[0], "dx a")
    close(gf.compute_weight_grad()[0], ref_dw[0], "dw")
    assert a.grad is None and b.grad is None, "dx is returned, never accumulated"


def test_kwargs_are_passed_and_not_differentiated():
    w = param(4, 4)
    scale = torch.randn(4, dtype=F64, requires_grad=True)

    def fn(x, *, scale, mode="tanh"):
        h = x @ w
        return (torch.tanh(h) if mode == "tanh" else h) * scale

    x = torch.randn(3, 4, dtype=F64)
    _, ref_dx, ref_dw = reference(lambda x: fn(x, scale=scale, mode="tanh"), [x], [w])
    out, gf = forward_and_gradfn(fn, x, weights=[w], scale=scale, mode="tanh")
    close(out, fn(x, scale=scale), "forward with kwargs")
    close(gf.compute_input_grad(), ref_dx[0], "dx")
    close(gf.compute_weight_grad()[0], ref_dw[0], "dw")
    assert scale.grad is None, "a kwarg is not differentiated"


def test_has_aux_differentiates_only_the_first_output():
    w = param(4, 4)

    def fn(x):
        h = x @ w
        return h.pow(2).sum(), {"h": h, "note": "aux"}, h.mean()

    x = torch.randn(3, 4, dtype=F64)
    _, ref_dx, ref_dw = reference(lambda x: fn(x)[0], [x], [w])
    out, gf = forward_and_gradfn(fn, x, weights=[w], has_aux=True)
    assert isinstance(out, tuple) and len(out) == 3 and out[1]["note"] == "aux"
    close(out[1]["h"], x @ w, "aux is returned")
    close(gf.compute_input_grad(), ref_dx[0], "dx")
    close(gf.compute_weight_grad()[0], ref_dw[0], "dw")


def three_inputs():
    w = param(4, 4)
    fn = lambda a, b, c: torch.tanh(a @ w) * b + c.sum()  # noqa: E731
    xs = [torch.randn(2, 4, dtype=F64) for _ in range(3)]
    return w, fn, xs


def test_grad_position_all_none_list_tuple():
    w, fn, xs = three_inputs()
    _, ref_dx, ref_dw = reference(fn, xs, [w])

    _, gf = forward_and_gradfn(fn, *xs, weights=[w], grad_position=-1)
    dx = gf.compute_input_grad()
    assert isinstance(dx, tuple) and len(dx) == 3
    for i in range(3):
        close(dx[i], ref_dx[i], f"dx {i} (all)")

    _, gf = forward_and_gradfn(fn, *xs, weights=[w], grad_position=[2, 0])
    dx = gf.compute_input_grad()
    close(dx[0], ref_dx[2], "dx [2, 0] first")
    close(dx[1], ref_dx[0], "dx [2, 0] second")

    _, gf = forward_and_gradfn(fn, *xs, weights=[w], grad_position=(1,))
    dx = gf.compute_input_grad()
    assert isinstance(dx, tuple) and len(dx) == 1
    close(dx[0], ref_dx[1], "dx (1,)")

    w.grad = None
    _, gf = forward_and_gradfn(fn, *xs, weights=[w], grad_position=None)
    assert gf.compute_input_grad() is None
    close(gf.compute_weight_grad()[0], ref_dw[0], "dw with no input")


def test_call_returns_what_the_configuration_asks_for():
    w, fn, xs = three_inputs()
    _, ref_dx, ref_dw = reference(fn, xs, [w])
    _, gf = forward_and_gradfn(fn, *xs, grad_position=1)  # no weights: dx
    close(gf(), ref_dx[1], "dx only")
    _, gf = forward_and_gradfn(fn, *xs, weights=[w], grad_position=None)  # dw only
    (dw,) = gf()
    close(dw, ref_dw[0], "dw only")
    w.grad = None
    _, gf = forward_and_gradfn(fn, *xs, weights={"w": w}, grad_position=[0, 1])
    dx, dw = gf(keep_graph=True)
    close(dx[0], ref_dx[0], "dx 0")
    close(dx[1], ref_dx[1], "dx 1")
    assert set(dw) == {"w"}, "dw comes back in the shape of weights (a dict here)"
    close(dw["w"], ref_dw[0], "dw of a dict")
    dx2, dw2 = gf()
    assert torch.equal(dx2[0], dx[0]) and torch.equal(dw2["w"], dw["w"])
    close(w.grad, 2 * ref_dw[0], "fused backward accumulates .grad")


def test_nested_inputs_and_outputs_keep_their_shape():
    w = param(4, 4)

    def fn(pair, d):
        a, b = pair
        h = a @ w + b * d["scale"]
        return {"h": h, "steps": d["steps"], "both": (h.sum(), d["scale"] * 2)}

    pair = (torch.randn(2, 4, dtype=F64), torch.randn(2, 4, dtype=F64))
    d = {"scale": torch.randn(4, dtype=F64), "steps": torch.arange(3)}
    out, gf = forward_and_gradfn(fn, pair, d, weights=[w], grad_position=[0, 1])
    sens = {"h": torch.randn(2, 4, dtype=F64), "steps": None,
            "both": (torch.tensor(2.0, dtype=F64), None)}
    dx = gf.compute_input_grad(sens)
    assert isinstance(dx[0], tuple) and len(dx[0]) == 2
    assert set(dx[1]) == {"scale", "steps"} and dx[1]["steps"] is None

    def flat(a, b, scale):
        o = fn((a, b), {"scale": scale, "steps": d["steps"]})
        return (o["h"] * sens["h"]).sum() + 2.0 * o["both"][0]

    _, ref_dx, ref_dw = reference(flat, [pair[0], pair[1], d["scale"]], [w])
    close(dx[0][0], ref_dx[0], "dx a")
    close(dx[0][1], ref_dx[1], "dx b")
    close(dx[1]["scale"], ref_dx[2], "dx scale (None sens: that output contributes nothing)")
    close(gf.compute_weight_grad()[0], ref_dw[0], "dw")


# ---------------------------------------------------------------------------------------------
# Python inside the engine (GIL), modules
# ---------------------------------------------------------------------------------------------
class Cube(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        Cube.calls += 1
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * g


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in a Python backward")


def test_python_autograd_function_and_hooks_inside_fn():
    w1, w2 = param(4, 4), param(4, 4)
    seen = []

    def fn(x):
        h = Cube.apply(x @ w1)
        h.register_hook(lambda g: seen.append(g.shape))
        return Cube.apply(h) @ w2

    x = torch.randn(3, 4, dtype=F64)
    _, ref_dx, ref_dw = reference(fn, [x], [w1, w2])
    seen.clear()
    Cube.calls = 0
    _, gf = forward_and_gradfn(fn, x, weights=[w1, w2])
    close(gf.compute_input_grad(), ref_dx[0], "dx through Python nodes")
    for i, g in enumerate(gf.compute_weight_grad()):
        close(g, ref_dw[i], f"dw {i} through Python nodes")
    assert Cube.calls == 2, "each Python backward ran once over dx + dw"
    assert seen, "the tensor hook ran"


def test_exception_in_a_python_backward_is_raised_as_itself():
    w = param(4, 4)
    _, gf = forward_and_gradfn(lambda x: Boom.apply(x @ w) @ w, torch.randn(2, 4, dtype=F64),
                               weights=[w])
    with pytest.raises(ValueError, match="boom in a Python backward"):
        gf.compute_input_grad()


def test_exception_in_the_forward_is_raised_as_itself():
    def fn(x):
        raise KeyError("forward failed")

    with pytest.raises(KeyError, match="forward failed"):
        forward_and_gradfn(fn, torch.randn(2))


def test_transformer_block_module_with_default_weights():
    block = torch.nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32,
                                             dropout=0.0, batch_first=True).to(F64)
    ref_block = copy.deepcopy(block)
    x = torch.randn(2, 5, 16, dtype=F64)
    sens = torch.randn(2, 5, 16, dtype=F64)
    params = [p for p in ref_block.parameters() if p.requires_grad]
    _, ref_dx, ref_dw = reference(ref_block, [x], params, sens)
    out, gf = forward_and_gradfn(block, x)
    close(out, ref_block(x), "forward")
    close(gf.compute_input_grad(sens), ref_dx[0], "dx")
    dw = gf.compute_weight_grad()
    assert len(dw) == len(params)
    for (name, p), g, r in zip(block.named_parameters(), dw, ref_dw):
        close(g, r, f"dw {name}")
        close(p.grad, r, f".grad {name}")


def test_bound_method_of_a_module_uses_its_parameters():
    mod = MLPModule(D).to(F64)
    x = torch.randn(BATCH, D, dtype=F64)
    _, gf = forward_and_gradfn(mod.forward, x)
    gf.compute_input_grad()
    assert len(gf.compute_weight_grad()) == 4


def test_separate_dw_calls_give_identical_results():
    mod = MultiInterMediateModel(D).to(F64)
    x = torch.randn(BATCH, D, dtype=F64)
    _, a = forward_and_gradfn(mod, x)
    _, b = forward_and_gradfn(mod, x)
    b.separate_dw_calls(True)
    assert torch.equal(a.compute_input_grad(), b.compute_input_grad())
    for ga, gb in zip(a.compute_weight_grad(), b.compute_weight_grad()):
        assert torch.equal(ga, gb)


# ---------------------------------------------------------------------------------------------
# Bad input: a Python exception naming the problem, never a crash or a hang
# ---------------------------------------------------------------------------------------------
def simple():
    w = param(3, 3)
    return w, (lambda x: x @ w), torch.randn(2, 3, dtype=F64)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(grad_position=5), ValueError, "out of range"),
        (dict(grad_position=-2), ValueError, "out of range"),
        (dict(grad_position=[0, 0]), ValueError, "twice"),
        (dict(grad_position=[0, 3]), ValueError, "out of range"),
        (dict(grad_position="0"), TypeError, "grad_position"),
        (dict(grad_position=True), TypeError, "bool"),
        (dict(grad_position=[0.0]), TypeError, "ints"),
        (dict(weights=torch.ones(3, requires_grad=True)), TypeError, "single Tensor"),
        (dict(weights=[1.0]), TypeError, r"weights\[0\] is a float"),
        (dict(weights=42), TypeError, "weights must be"),
        (dict(has_aux=1), TypeError, "has_aux"),
        (dict(has_aux=True), TypeError, "has_aux=True needs fn to return a tuple"),
        (dict(grad_position=None), ValueError, "nothing to differentiate"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    w, fn, x = simple()
    kwargs = dict(kwargs)
    if kwargs.get("grad_position", 0) is None:
        kwargs["weights"] = []
    with pytest.raises(error, match=match):
        forward_and_gradfn(fn, x, **kwargs)


def test_bad_fn_inputs_and_outputs():
    w, fn, x = simple()
    with pytest.raises(TypeError, match="callable"):
        forward_and_gradfn("not a function", x)
    with pytest.raises(TypeError, match="no floating-point tensor"):
        forward_and_gradfn(lambda i: w.sum() * i, torch.arange(3))
    with pytest.raises(TypeError, match="no floating-point tensor"):
        forward_and_gradfn(lambda n, x: x @ w, 3, x, grad_position=-1)
    with pytest.raises(RuntimeError, match="does not require grad"):
        forward_and_gradfn(lambda x: torch.ones(2), x)
    with pytest.raises(ValueError, match="twice"):
        forward_and_gradfn(fn, x, weights=[w, w])
    with pytest.raises(ValueError, match="also one of the weights"):
        forward_and_gradfn(lambda a: a.sum() * w, w, weights=[w])


def test_bad_call_order():
    w, fn, x = simple()
    _, gf = forward_and_gradfn(fn, x, weights=[w])
    with pytest.raises(RuntimeError, match="before compute_input_grad"):
        gf.compute_weight_grad()
    gf.compute_input_grad()
    with pytest.raises(RuntimeError, match="already called"):
        gf.compute_input_grad()
    with pytest.raises(RuntimeError, match="compute_weight_grad instead of a fused"):
        gf()
    gf.compute_weight_grad()
    with pytest.raises(RuntimeError, match="keep_graph"):
        gf.compute_weight_grad()
    with pytest.raises(RuntimeError, match="freed"):
        gf()
    with pytest.raises(TypeError, match="keep_graph must be a bool"):
        forward_and_gradfn(fn, x, weights=[w])[1].compute_weight_grad(keep_graph="yes")


@pytest.mark.parametrize(
    "sens, error, match",
    [
        (torch.ones(3, 3, dtype=F64), ValueError, r"shape \(3, 3\) but the output has shape"),
        (torch.ones(2, 3, dtype=torch.float32), ValueError, "dtype"),
        ([torch.ones(2, 3, dtype=F64)], TypeError, "sens is a list of 1 but the output"),
        (1.0, TypeError, "sens is a float but the output there is a Tensor"),
    ],
)
def test_bad_sens(sens, error, match):
    w, fn, x = simple()
    _, gf = forward_and_gradfn(fn, x, weights=[w])
    with pytest.raises(error, match=match):
        gf.compute_input_grad(sens)
    with pytest.raises(error, match=match):
        gf(sens)
    # Nothing ran: the GradFunction is still usable.
    gf.compute_input_grad(torch.ones(2, 3, dtype=F64))
    gf.compute_weight_grad()


def test_sens_of_another_structure():
    w = param(3, 3)
    _, gf = forward_and_gradfn(lambda x: (x @ w, {"y": x.sum()}), torch.randn(2, 3, dtype=F64),
                               weights=[w])
    with pytest.raises(ValueError, match=r"sens must be a list/tuple of 2"):
        gf.compute_input_grad(torch.ones(2, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"sens\[1\] must be a dict with keys \['y'\]"):
        gf.compute_input_grad((torch.ones(2, 3, dtype=F64), {"z": None}))
    gf.compute_input_grad((torch.ones(2, 3, dtype=F64), {"y": torch.tensor(1.0, dtype=F64)}))


# ---------------------------------------------------------------------------------------------
# Devices: the CUDA cases skip loudly where there is no GPU; their CPU siblings run everywhere.
# ---------------------------------------------------------------------------------------------
CUDA_REASON = (
    "CUDA is not available (torch.cuda.is_available() is False): the CUDA path of the split "
    "(engine device threads taking the GIL for Python nodes) is NOT tested on this machine; "
    "run tests/python on a GPU machine"
)
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason=CUDA_REASON)),
]


@pytest.mark.parametrize("device", DEVICES)
def test_split_on_device_with_python_nodes(device):
    w1, w2 = param(8, 8).to(device).detach().requires_grad_(), \
        param(8, 8).to(device).detach().requires_grad_()

    def fn(x):
        return Cube.apply(torch.tanh(x @ w1)) @ w2 @ w2

    x = torch.randn(4, 8, dtype=F64, device=device)
    sens = torch.randn(4, 8, dtype=F64, device=device)
    _, ref_dx, ref_dw = reference(fn, [x], [w1, w2], sens)
    _, gf = forward_and_gradfn(fn, x, weights=[w1, w2])
    close(gf.compute_input_grad(sens), ref_dx[0], "dx")
    for i, g in enumerate(gf.compute_weight_grad()):
        assert g.device.type == device
        close(g, ref_dw[i], f"dw {i}")
    _, gf = forward_and_gradfn(fn, x, weights=[w1, w2])
    dx, dw = gf(sens)
    close(dx, ref_dx[0], "fused dx")


@pytest.mark.parametrize("device", DEVICES)
def test_sens_on_another_device_is_a_value_error(device):
    w = param(3, 3).to(device).detach().requires_grad_()
    _, gf = forward_and_gradfn(lambda x: x @ w, torch.randn(2, 3, dtype=F64, device=device),
                               weights=[w])
    other = "meta" if device == "cpu" else "cpu"
    with pytest.raises(ValueError, match="is on"):
        gf.compute_input_grad(torch.ones(2, 3, dtype=F64, device=other))
