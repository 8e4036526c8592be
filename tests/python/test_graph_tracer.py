"""The capture contract (seed 002 §6): parameters and buffers are the
leading placeholders (no get_attr), state_fqns / state_is_param / grad_fqns,
one joint forward + backward graph whose replay under torch.no_grad() equals
eager autograd in float64; tied parameters, pytree inputs, leaf types and
set_pytree_pre_hook, and the errors for a train_fn without a scalar loss."""

import pytest
import torch
import torch.utils._pytree as pytree

from hyperparallel.compile import GraphTrainer, PassConfig, trace_model_graph

F64 = torch.float64


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(6, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 8, bias=False)
        self.register_buffer("scale", torch.tensor(0.5))
        self.frozen = torch.nn.Parameter(torch.ones(8), requires_grad=False)
        self.double()

    def forward(self, x):
        h = torch.nn.functional.gelu(self.norm(self.embed(x))) * self.scale + self.frozen
        return self.head(h)


def loss_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def data(rows=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 6, generator=g, dtype=F64), torch.randint(0, 8, (rows,), generator=g)


def replay(gm, model, *flat_inputs):
    state = [model.get_parameter(f) if p else model.get_buffer(f)
             for f, p in zip(gm.state_fqns, gm.state_is_param)]
    with torch.no_grad():
        return gm(*state, *flat_inputs)


def test_state_is_the_leading_placeholders_and_metadata():
    model = Net()
    x, y = data()
    gm = trace_model_graph(model, loss_fn, x, y)
    names = [n for n, _ in model.named_parameters()]
    assert gm.state_fqns == names + ["scale"]
    assert gm.state_is_param == [True] * len(names) + [False]
    assert gm.grad_fqns == [n for n in names if n != "frozen"]
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(ph) == len(gm.state_fqns) + 2
    assert [n.meta["hp_fqn"] for n in ph[:len(gm.state_fqns)]] == gm.state_fqns
    assert [n.meta["hp_role"] for n in ph[-2:]] == ["input", "input"]
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    # One joint graph: forward and backward operators together.
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "aten.native_layer_norm.default" in targets
    assert "aten.native_layer_norm_backward.default" in targets
    assert "aten.gelu_backward.default" in targets


@pytest.mark.parametrize("mode", ["fake", "real"])
def test_replay_equals_eager_autograd(mode):
    model = Net()
    x, y = data()
    gm = trace_model_graph(model, loss_fn, x, y, tracing_mode=mode)
    for step in range(2):  # other values through the same graph
        x, y = x + step, y.flip(0)
        out = replay(gm, model, x, y)
        loss = loss_fn(model, x, y)
        params = [model.get_parameter(f) for f in gm.grad_fqns]
        grads = torch.autograd.grad(loss, params)
        assert abs(out[0].item() - loss.item()) <= 1e-12
        for g, r in zip(out[1:], grads):
            assert (g - r).abs().max().item() <= 1e-12
        assert not out[0].requires_grad


def test_tied_parameter_has_one_placeholder_and_its_aliases():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.b = torch.nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight
            self.double()

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    model = Tied()
    x = torch.randn(3, 4, dtype=F64)
    y = torch.randint(0, 4, (3,))
    gm = trace_model_graph(model, loss_fn, x, y)
    assert gm.state_fqns == ["a.weight"] and gm.state_aliases == {"a.weight": ["b.weight"]}
    out = replay(gm, model, x, y)
    (ref,) = torch.autograd.grad(loss_fn(model, x, y), [model.a.weight])
    assert (out[1] - ref).abs().max().item() <= 1e-12


def test_pytree_inputs_with_constants_are_frozen():
    model = Net()
    x, y = data()

    def fn(m, inp, label):
        return torch.nn.functional.cross_entropy(m(inp["x"]) * inp["t"], label[0]) \
            if inp["mode"] == "train" else None

    gm = trace_model_graph(model, fn, {"x": x, "t": 2.0, "mode": "train"}, (y, None))
    assert len([n for n in gm.graph.nodes if n.op == "placeholder"]) == len(gm.state_fqns) + 2
    assert gm.input_constants == [2.0, "train", None]  # pytree order


class Box:  # not a pytree leaf type
    def __init__(self, t):
        self.t = t


def test_unsupported_leaf_type_is_a_clear_error_before_capture():
    model = Net()
    x, y = data()
    with pytest.raises(TypeError, match=r"\(input, label\)\[0\]\['b'\] is a Box.*"
                                        r"set_pytree_pre_hook"):
        trace_model_graph(model, lambda m, i, l: loss_fn(m, i["a"], l), {"a": x, "b": Box(x)}, y)


def test_set_pytree_pre_hook_registers_a_model_type():
    model = Net()
    x, y = data()
    registered = []

    def hook():
        if Box not in pytree.SUPPORTED_NODES:
            pytree.register_pytree_node(Box, lambda b: ([b.t], None), lambda c, _: Box(c[0]))
        registered.append(True)

    trainer = GraphTrainer(model, lambda m, b, l: loss_fn(m, b.t, l),
                           PassConfig(fsdp_enabled=False), device="cpu")
    trainer.set_pytree_pre_hook(hook)
    loss = trainer.train_step(Box(x), y)
    assert registered == [True]
    assert abs(loss.item() - loss_fn(model, x, y).item()) <= 1e-12


@pytest.mark.parametrize("ret, what", [
    (lambda out: out.sum(dim=1), r"tensor of shape \(4,\)"),
    (lambda out: (out.sum(), 1), "a tuple"),
    (lambda out: out.sum().long(), "torch.int64"),
])
def test_a_train_fn_without_a_scalar_loss_is_a_clear_error(ret, what):
    model = Net()
    x, y = data()
    with pytest.raises(ValueError, match="train_fn must return the loss as a floating-point "
                                         f"scalar tensor.*{what}"):
        trace_model_graph(model, lambda m, i, l: ret(m(i)), x, y)
    with pytest.raises(ValueError, match="does not depend on any trainable parameter"):
        trace_model_graph(model, lambda m, i, l: (i * 2).sum(), x, y)
