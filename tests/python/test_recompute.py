"""hyperparallel.recompute from Python: checkpointed Python blocks recomputed
once per microbatch when dx and dw run apart (the split), prefetch handles,
sessions and their counters; every gradient against plain autograd in float64."""

import copy

import pytest
import torch

import hyperparallel as hp
from hyperparallel import forward_and_gradfn
from hyperparallel import recompute as rc

F64 = torch.float64


@pytest.fixture(autouse=True)
def _fresh():
    torch.manual_seed(1234)
    rc.clear_all_sessions()
    rc.reset_counters()
    yield
    rc.clear_all_sessions()


def param(*shape):
    return (torch.randn(*shape, dtype=F64) * 0.3).requires_grad_(True)


class Model:
    """Residual blocks x + (tanh(a) * a) W2 with a = x W1 + b1, each block's function counting
    its runs (as the C++ tests' model)."""

    def __init__(self, blocks=3, d=8, hidden=16):
        self.w = [[param(d, hidden), param(hidden), param(hidden, d)] for _ in range(blocks)]
        self.calls = 0

    def weights(self):
        return [t for ws in self.w for t in ws]

    def block(self, k):
        def fn(x):
            self.calls += 1
            a = torch.addmm(self.w[k][1], x, self.w[k][0])
            return x + (torch.tanh(a) * a) @ self.w[k][2]

        return fn

    def forward(self, x, ckpt):
        for k in range(len(self.w)):
            x = rc.checkpoint(self.block(k), x, weights=self.w[k]) if ckpt else self.block(k)(x)
        return x


def reference(model, x, sens):
    xi = x.detach().requires_grad_(True)
    out = model.forward(xi, ckpt=False)
    g = torch.autograd.grad(out, [xi] + model.weights(), sens)
    return out, g[0], list(g[1:])


def close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def check_grads(model, dx, dw, ref_dx, ref_dw, scale=1):
    close(dx, ref_dx, "dx")
    for i, (w, g, r) in enumerate(zip(model.weights(), dw, ref_dw)):
        close(g, r, f"dw {i}")
        close(w.grad, scale * r, f".grad {i} (exactly once per microbatch)")


def test_plain_backward_is_an_ordinary_checkpoint():
    m = Model()
    x, sens = torch.randn(4, 8, dtype=F64), torch.randn(4, 8, dtype=F64)
    ref_out, ref_dx, ref_dw = reference(m, x, sens)
    m.calls = 0
    xi = x.detach().requires_grad_(True)
    out = m.forward(xi, ckpt=True)
    assert m.calls == 3
    close(out, ref_out, "forward")
    out.backward(sens)
    assert m.calls == 6, "backward recomputes each block once"
    c = rc.counters()
    assert (c.recomputes, c.consumed, c.reused) == (3, 3, 0)
    close(xi.grad, ref_dx, "dx")
    for w, r in zip(m.weights(), ref_dw):
        close(w.grad, r, ".grad")
    assert rc.num_sessions() == 0


def test_split_without_session_recomputes_twice():
    m = Model(blocks=2)
    x, sens = torch.randn(4, 8, dtype=F64), torch.randn(4, 8, dtype=F64)
    _, ref_dx, ref_dw = reference(m, x, sens)
    _, gf = forward_and_gradfn(lambda x: m.forward(x, ckpt=True), x, weights=m.weights())
    dx = gf.compute_input_grad(sens)
    assert rc.counters().recomputes == 2
    dw = gf.compute_weight_grad()
    assert rc.counters().recomputes == 4, "documented: without a session dw recomputes again"
    check_grads(m, dx, dw, ref_dx, ref_dw)


def test_retaining_session_recomputes_each_block_once_per_microbatch():
    m = Model(blocks=3)
    xs = [torch.randn(4, 8, dtype=F64) for _ in range(2)]
    sens = [torch.randn(4, 8, dtype=F64) for _ in range(2)]
    refs = [reference(m, xs[i], sens[i]) for i in range(2)]
    # Two microbatches, dx and dw apart as ZB-H1 runs them: F0 F1 I0 I1 W1 W0.
    gfs = [forward_and_gradfn(lambda x: m.forward(x, ckpt=True), xs[i], weights=m.weights())[1]
           for i in range(2)]
    m.calls = 0
    dx = [None, None]
    for i in range(2):
        with rc.RecomputeSession(100 + i, retain_on_unpack=True) as s:
            assert s.id == 100 + i and s.retain_on_unpack
            dx[i] = gfs[i].compute_input_grad(sens[i])
    assert rc.counters().recomputes == 6, "one recompute per block per microbatch"
    assert rc.session_stats(100).cached_blocks == 3, "dx kept the recomputed blocks for dw"
    dw = [None, None]
    for i in (1, 0):
        with rc.RecomputeSession(100 + i, retain_on_unpack=True):
            dw[i] = gfs[i].compute_weight_grad()
    c = rc.counters()
    assert (c.recomputes, c.consumed, c.reused, c.cleared) == (6, 12, 6, 0)
    assert m.calls == 6, "the Python block ran once per block per microbatch in backward"
    s = rc.session_stats(100)
    assert s.exists and s.cached_blocks == 0
    assert (s.counters.recomputes, s.counters.consumed, s.counters.reused) == (3, 6, 3)
    assert s.counters.as_dict()["recomputes"] == 3
    for i in range(2):
        close(dx[i], refs[i][1], f"dx mb {i}")
        for j, (g, r) in enumerate(zip(dw[i], refs[i][2])):
            close(g, r, f"dw mb {i} weight {j}")
    for j, w in enumerate(m.weights()):
        close(w.grad, refs[0][2][j] + refs[1][2][j], ".grad sums both microbatches once")
    assert rc.clear_session(100) == 0 and rc.clear_session(101) == 0
    assert not rc.session_stats(100).exists
    assert rc.num_sessions() == 0


def test_prefetched_handles_serve_dx_and_dw():
    m = Model(blocks=3)
    x, sens = torch.randn(4, 8, dtype=F64), torch.randn(4, 8, dtype=F64)
    _, ref_dx, ref_dw = reference(m, x, sens)
    with rc.HandleCollector() as collector:
        _, gf = forward_and_gradfn(lambda x: m.forward(x, ckpt=True), x, weights=m.weights())
        assert len(collector.handles) == 3
    handles = collector.take()
    assert len(handles) == 3 and collector.handles == []
    assert len({h.block_id for h in handles}) == 3
    m.calls = 0
    with rc.RecomputeSession(42, retain_on_unpack=True):
        assert not any(h.is_recomputed() for h in handles)
        rc.prefetch(handles)
        rc.prefetch(handles)  # a second prefetch finds the results waiting
        assert all(h.is_recomputed() for h in handles)
    assert m.calls == 3 and rc.session_stats(42).counters.prefetches == 3
    with rc.RecomputeSession(42, retain_on_unpack=True):
        dx = gf.compute_input_grad(sens)
    with rc.RecomputeSession(42, retain_on_unpack=True):
        dw = gf.compute_weight_grad()
    assert m.calls == 3, "backward ran no recompute of its own"
    assert rc.counters().reused == 6
    check_grads(m, dx, dw, ref_dx, ref_dw)
    rc.clear_session(42)
    assert not any(h.alive() for h in handles)
    with pytest.raises(RuntimeError, match="graph is gone"):
        handles[0].recompute()


def test_handle_prefetched_outside_sessions_serves_a_plain_backward():
    m = Model(blocks=2)
    x, sens = torch.randn(4, 8, dtype=F64), torch.randn(4, 8, dtype=F64)
    _, ref_dx, ref_dw = reference(m, x, sens)
    xi = x.detach().requires_grad_(True)
    with rc.HandleCollector() as collector:
        out = m.forward(xi, ckpt=True)
    collector.handles[0].recompute()
    collector.handles[1].recompute()
    assert collector.handles[1].is_recomputed()
    m.calls = 0
    out.backward(sens)
    assert m.calls == 0 and rc.counters().reused == 2
    close(xi.grad, ref_dx, "dx")


def test_module_block_default_weights_rng_replay_and_kwargs():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.frozen = torch.nn.Linear(8, 8)
            self.frozen.requires_grad_(False)
            self.drop = torch.nn.Dropout(0.3)

        def forward(self, x, *, scale, tag="t"):
            return {"y": self.drop(torch.tanh(self.lin(x))) * scale + self.frozen(x), "tag": tag}

    blocks = [Block().to(F64) for _ in range(2)]
    ref_blocks = copy.deepcopy(blocks)
    x = torch.randn(4, 8, dtype=F64)
    scale = torch.randn(8, dtype=F64)
    sens = torch.randn(4, 8, dtype=F64)

    def run(bs, ckpt, x_in):
        h = x_in
        for b in bs:
            out = rc.checkpoint(b, h, scale=scale, tag="k") if ckpt else b(h, scale=scale, tag="k")
            assert out["tag"] == "k"
            h = out["y"]
        return x_in, h

    torch.manual_seed(7)
    ref_x, ref_out = run(ref_blocks, False, x.detach().requires_grad_(True))
    ref_out.backward(sens)
    torch.manual_seed(7)
    _, gf = forward_and_gradfn(lambda x: run(blocks, True, x)[1], x,
                               weights=[p for b in blocks for p in b.parameters()])
    torch.manual_seed(99)  # the recompute must replay the forward's dropout masks, not these
    with rc.RecomputeSession(1, retain_on_unpack=True):
        dx = gf.compute_input_grad(sens)
    with rc.RecomputeSession(1, retain_on_unpack=True):
        dw = gf.compute_weight_grad()
    assert rc.counters().recomputes == 2
    close(dx, ref_x.grad, "dx")
    ref_params = [p for b in ref_blocks for p in b.parameters()]
    for g, p, r in zip(dw, [p for b in blocks for p in b.parameters()], ref_params):
        if r.requires_grad:
            close(g, r.grad, "dw")
            close(p.grad, r.grad, ".grad")
        else:
            assert g is None and p.grad is None, "a frozen parameter gets no gradient"


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_python_autograd_function_inside_a_recomputed_block():
    w = param(6, 6)
    x, sens = torch.randn(3, 6, dtype=F64), torch.randn(3, 6, dtype=F64)
    block = lambda h: Square.apply(h @ w) @ w  # noqa: E731
    xi = x.detach().requires_grad_(True)
    ref = torch.autograd.grad(block(block(xi)), [xi, w], sens)

    def fwd(h):
        for _ in range(2):
            h = rc.checkpoint(block, h, weights=[w])
        return h

    _, gf = forward_and_gradfn(fwd, x, weights=[w])
    with rc.RecomputeSession(5, retain_on_unpack=True):
        close(gf.compute_input_grad(sens), ref[0], "dx")
    with rc.RecomputeSession(5, retain_on_unpack=True):
        close(gf.compute_weight_grad()[0], ref[1], "dw")
    assert rc.counters().recomputes == 2


def test_exception_in_the_recompute_is_raised_as_itself_and_clear_leaves_nothing():
    m = Model(blocks=2)
    x = torch.randn(4, 8, dtype=F64)
    failing = {"on": False}
    inner = m.block(1)

    def block1(h):
        if failing["on"]:
            raise ArithmeticError("recompute failed")
        return inner(h)

    def fwd(h):
        h = rc.checkpoint(m.block(0), h, weights=m.w[0])
        return rc.checkpoint(block1, h, weights=m.w[1])

    _, gf = forward_and_gradfn(fwd, x, weights=m.weights())
    failing["on"] = True
    with rc.RecomputeSession(9, retain_on_unpack=True):
        with pytest.raises(ArithmeticError, match="recompute failed"):
            gf.compute_input_grad()
    rc.clear_session(9)
    assert rc.num_sessions() == 0


def test_in_place_change_before_backward_is_a_clear_error():
    w = param(4, 4)
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    out = rc.checkpoint(lambda h: torch.tanh(h @ w), x, weights=[w])
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_bad_input_and_guard_misuse():
    w = param(4, 4)
    x = torch.randn(2, 4, dtype=F64, requires_grad=True)
    with pytest.raises(TypeError, match="callable"):
        rc.checkpoint(3, x)
    with pytest.raises(TypeError, match="not a Tensor"):
        rc.checkpoint(lambda h: h @ w, x, weights=w)
    with pytest.raises(TypeError, match=r"weights\[0\] is a str"):
        rc.checkpoint(lambda h: h @ w, x, weights=["w"])
    with pytest.raises(TypeError):
        rc.RecomputeSession(-1)

    s = rc.RecomputeSession(3)
    with pytest.raises(RuntimeError, match="without __enter__"):
        s.__exit__(None, None, None)
    a, b = rc.RecomputeSession(1), rc.RecomputeSession(2)
    a.__enter__()
    with pytest.raises(RuntimeError, match="already open"):
        a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="innermost first"):
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)

    c1, c2 = rc.HandleCollector(), rc.HandleCollector()
    c1.__enter__()
    c2.__enter__()
    with pytest.raises(RuntimeError, match="innermost first"):
        c1.__exit__(None, None, None)
    c2.__exit__(None, None, None)
    c1.__exit__(None, None, None)

    # A guard dropped while open is closed when it is innermost, never a crash.
    g = rc.RecomputeSession(4)
    g.__enter__()
    del g

    flip = {"n": 0}

    def changing(h):
        flip["n"] += 1
        return (h @ w,) if flip["n"] == 1 else [h @ w]

    out = rc.checkpoint(changing, x, weights=[w])
    with pytest.raises(RuntimeError, match="another structure"):
        out[0].sum().backward()


def test_sessions_are_thread_local():
    import threading

    m = Model(blocks=1)
    x = torch.randn(4, 8, dtype=F64)
    _, gf = forward_and_gradfn(lambda x: m.forward(x, ckpt=True), x, weights=m.weights())
    seen = {}

    def other_thread():
        seen["stats"] = rc.session_stats(77).exists  # sessions are process-wide records

    with rc.RecomputeSession(77, retain_on_unpack=True):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        gf.compute_input_grad()
    assert seen["stats"] is True
    # dw on another thread, under its own guard of the same session, reuses the retained block.
    err = []

    def dw_thread():
        try:
            with rc.RecomputeSession(77, retain_on_unpack=True):
                gf.compute_weight_grad()
        except Exception as e:  # pragma: no cover - reported below
            err.append(e)

    t = threading.Thread(target=dw_thread)
    t.start()
    t.join()
    assert not err, err
    assert rc.session_stats(77).counters.recomputes == 1
    assert rc.session_stats(77).counters.reused == 1


def test_no_grad_checkpoint_is_just_the_call():
    w = param(4, 4)
    with torch.no_grad():
        out = rc.checkpoint(lambda h, n: (h @ w, n), torch.randn(2, 4, dtype=F64), 5)
    assert out[1] == 5 and not out[0].requires_grad
    assert hp.recompute.counters().recomputes == 0


CUDA_REASON = (
    "CUDA is not available (torch.cuda.is_available() is False): checkpointed Python blocks "
    "recomputed on the engine's CUDA device thread are NOT tested on this machine; run "
    "tests/python on a GPU machine"
)
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason=CUDA_REASON)),
]


@pytest.mark.parametrize("device", DEVICES)
def test_split_through_checkpointed_python_blocks_on_device(device):
    w = [param(8, 8).to(device).detach().requires_grad_() for _ in range(2)]
    x = torch.randn(4, 8, dtype=F64, device=device)
    sens = torch.randn(4, 8, dtype=F64, device=device)
    block = lambda h, v: Square.apply(torch.tanh(h @ v)) @ v  # noqa: E731
    xi = x.detach().requires_grad_(True)
    ref = torch.autograd.grad(block(block(xi, w[0]), w[1]), [xi, *w], sens)

    def fwd(h):
        for v in w:
            h = rc.checkpoint(block, h, v, weights=[v])  # a weight passed as an argument
        return h

    _, gf = forward_and_gradfn(fwd, x, weights=w)
    with rc.RecomputeSession(11, retain_on_unpack=True):
        close(gf.compute_input_grad(sens), ref[0], "dx")
    with rc.RecomputeSession(11, retain_on_unpack=True):
        for g, r in zip(gf.compute_weight_grad(), ref[1:]):
            close(g, r, "dw")
    # On CUDA the blocks' backward runs on the engine's device thread, which the session
    # reaches (hp/recompute, NOTE [Sessions reach the engine's threads]).
    assert rc.counters().recomputes == 2, "one recompute per block"


def test_weights_passed_as_arguments():
    """A tensor argument listed in weights, or an nn.Parameter, is a weight of the block (one
    recompute for dx and dw); a plain tensor argument is an input (dx and dw recompute apart)."""
    x, sens = torch.randn(4, 8, dtype=F64), torch.randn(4, 8, dtype=F64)
    block = lambda h, v: torch.tanh(h @ v) @ v  # noqa: E731
    for kind, expected in (("listed", 1), ("parameter", 1), ("plain", 2)):
        rc.reset_counters()
        v = param(8, 8)
        if kind == "parameter":
            v = torch.nn.Parameter(v.detach())
        xi = x.detach().requires_grad_(True)
        ref = torch.autograd.grad(block(xi, v), [xi, v], sens)
        extra = {"weights": [v]} if kind == "listed" else {}
        _, gf = forward_and_gradfn(lambda h: rc.checkpoint(block, h, v, **extra), x, weights=[v])
        with rc.RecomputeSession(21, retain_on_unpack=True):
            close(gf.compute_input_grad(sens), ref[0], f"dx ({kind})")
        with rc.RecomputeSession(21, retain_on_unpack=True):
            close(gf.compute_weight_grad()[0], ref[1], f"dw ({kind})")
        close(v.grad, ref[1], f".grad once ({kind})")
        assert rc.counters().recomputes == expected, kind
        rc.clear_session(21)
