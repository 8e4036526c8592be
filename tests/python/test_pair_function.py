"""Pipeline.register_custom_function(OVERLAP_F_B, fn): a user's function runs
each FB pair (NOTE [A pair function] in hp/pipeline/overlap.cpp), checked
against plain autograd in float64 on a one-rank dualpipev (two chunks on the
rank, five FB pairs per step at 4 microbatches)."""

import pytest
import torch
from torch import nn

import hyperparallel as hp

M = 4


def chunks():
    torch.manual_seed(3)
    return {0: nn.Sequential(nn.Linear(4, 8), nn.Tanh()).double(),
            1: nn.Sequential(nn.Linear(8, 4)).double()}


def mse(out, target):
    return ((out - target) ** 2).mean()


def batch():
    g = torch.Generator().manual_seed(9)
    return (torch.randn(2 * M, 4, generator=g, dtype=torch.float64),
            torch.randn(2 * M, 4, generator=g, dtype=torch.float64))


def reference(steps):
    """Plain autograd: the mean of the microbatches' losses, SGD."""
    model = chunks()
    params = [q for c in model.values() for q in c.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    x, y = batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for mb in range(M):
            rows = slice(2 * mb, 2 * mb + 2)
            loss = mse(model[1](model[0](x[rows])), y[rows]) / M
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
    return losses, params


def train(pipe, params, steps=3):
    """`steps` SGD steps of `pipe` on batch(); their losses."""
    opt = torch.optim.SGD(params, lr=0.1)
    x, y = batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pipe.step(x, y))
        opt.step()
    return losses


def assert_matches_reference(losses, params):
    """Losses and parameters equal plain autograd's after as many steps."""
    want_losses, want = reference(len(losses))
    assert losses == pytest.approx(want_losses, rel=1e-12, abs=1e-14)
    for q, w in zip(params, want):
        assert torch.allclose(q, w, rtol=0, atol=1e-13)


def pipeline(group, **kw):
    model = chunks()
    sched = hp.pipeline.schedule("dualpipev", ranks=1, microbatches=M)
    pipe = hp.pipeline.Pipeline(model, sched, loss_fn=mse, activation_shape=(2, 8), group=group,
                                **kw)
    params = [q for c in model.values() for q in c.parameters()]
    return pipe, params


@pytest.mark.parametrize("how", ["backward-first", "overlapped", "torch-kind"])
def test_a_pair_function_runs_every_pair_exactly(one_rank_group, how):
    from torch.distributed.pipelining.schedules import _ComputationType

    pipe, params = pipeline(one_rank_group, fb_overlap=how == "overlapped")
    seen = []

    def run(pair):
        seen.append((pair.action, pair.forward_stage, pair.forward_microbatch,
                     pair.backward_stage, pair.backward_microbatch))
        if how == "overlapped":
            pair.overlapped()
        else:
            pair.backward()  # the order is the function's to choose
            pair.forward()

    kind = _ComputationType.OVERLAP_F_B if how == "torch-kind" else hp.pipeline.OVERLAP_F_B
    pipe.register_custom_function(kind, run)
    assert_matches_reference(train(pipe, params), params)
    pairs = [a for a in pipe.schedule.actions[0] if "+" in str(a)]
    assert len(pairs) == 5 and len(seen) == 3 * len(pairs)
    assert seen[0] == ("1F1+0B0", 1, 1, 0, 0), seen[0]
    assert (pipe.last_stats["pairs"] > 0) == (how == "overlapped")
    # None restores the built-in order.
    pipe.register_custom_function(hp.pipeline.OVERLAP_F_B, None)
    pipe.step(*batch())
    assert len(seen) == 3 * len(pairs)


def test_a_pair_function_that_skips_or_repeats_a_half_fails_the_step(one_rank_group):
    x, y = batch()
    cases = [(lambda p: p.forward(), "returned without running the backward half of 1F1[+]0B0"),
             (lambda p: (p.forward(), p.forward()), "ran the forward half of 1F1[+]0B0 twice"),
             (lambda p: (p.backward(), p.overlapped()), "ran overlapped[(][)] after a half"),
             (lambda p: 1 / 0, "the pair function raised ZeroDivisionError")]
    for fn, words in cases:
        pipe, _ = pipeline(one_rank_group)
        pipe.register_custom_function(hp.pipeline.OVERLAP_F_B, fn)
        with pytest.raises(RuntimeError, match=words):
            pipe.step(x, y)
    pipe, _ = pipeline(one_rank_group)
    with pytest.raises(ValueError, match="kind must be hyperparallel.pipeline.OVERLAP_F_B"):
        pipe.register_custom_function("FB", print)
    with pytest.raises(TypeError, match="a callable fn[(]pair[)] or None, got int"):
        pipe.register_custom_function(hp.pipeline.OVERLAP_F_B, 3)


def test_the_stand_in_check_needs_a_device_with_streams():
    # NOTE [An overlapped pair on a device]: scripts/gpu_check.py runs it on
    # a GPU; on the CPU it says what it needs.
    with pytest.raises(RuntimeError, match="needs a device with streams, got cpu"):
        hp._C.pipeline.stand_in_overlap("cpu")


# ---------------------------------------------------------------------------
# DualPipe's hook: chunks whose class defines overlapped_forward_backward run
# their pairs themselves (NOTE [A chunk's own pair] in
# python/hyperparallel/pipeline/chunk_pairs.py).

AUX = 0.01


class HookedChunk(nn.Module):
    """A chunk in DualPipe's style: its class runs each pair, the backward
    half first (any order is the hook's to choose); chunk 0 adds an
    auxiliary loss, which must reach the weights as the runtime's own
    forward ties it."""

    calls = []

    def __init__(self, *layers, aux=False):
        super().__init__()
        self.body, self.aux = nn.Sequential(*layers), aux

    def forward(self, x):
        y = self.body(x)
        if self.aux:
            hp.pipeline.add_loss(AUX * y.pow(2).mean())
        return y

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1,
                                    outputs1, output_grads1):
        cls.calls.append((criterion0 is not None, loss1 is not None))
        if loss1 is not None:
            loss1.backward()
        else:
            hp.pipeline.run_backward(outputs1, output_grads1)
        outputs0 = module0(*inputs0)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        return outputs0, loss0


def hooked_chunks():
    plain = chunks()  # the same values as the reference's
    return {0: HookedChunk(*plain[0], aux=True), 1: HookedChunk(*plain[1])}


def test_chunks_that_define_overlapped_forward_backward_run_every_pair_exactly(one_rank_group):
    model = hooked_chunks()
    sched = hp.pipeline.schedule("dualpipev", ranks=1, microbatches=M)
    pipe = hp.pipeline.Pipeline(model, sched, loss_fn=mse, activation_shape=(2, 8),
                                group=one_rank_group)
    params = [q for c in model.values() for q in c.parameters()]
    x, y = batch()
    HookedChunk.calls.clear()
    losses = train(pipe, params)
    # Plain autograd with the auxiliary loss, each microbatch's over M.
    ref = hooked_chunks()
    ref_params = [q for c in ref.values() for q in c.parameters()]
    ref_opt = torch.optim.SGD(ref_params, lr=0.1)
    want_losses = []
    for _ in range(3):
        ref_opt.zero_grad()
        total = 0.0
        for mb in range(M):
            rows = slice(2 * mb, 2 * mb + 2)
            with hp.pipeline.collect_losses() as aux:
                h = ref[0](x[rows])
            loss = mse(ref[1](h), y[rows]) / M
            (loss + sum(aux) / M).backward()
            total += loss.item()
        want_losses.append(total)
        ref_opt.step()
    assert losses == pytest.approx(want_losses, rel=1e-12, abs=1e-14)
    for q, w in zip(params, ref_params):
        assert torch.allclose(q, w, rtol=0, atol=1e-13)
    # Five pairs a step, every one through the hook: pairs whose forward
    # ends in the loss (criterion0 given) and pairs whose backward starts
    # from it (loss1 given) both ran.
    assert len(HookedChunk.calls) == 3 * 5
    assert {c for c, _ in HookedChunk.calls} == {True, False}
    assert {b for _, b in HookedChunk.calls} == {True, False}
    # A registered function replaces the hook; None brings it back.
    pipe.register_custom_function(hp.pipeline.OVERLAP_F_B, lambda p: (p.forward(), p.backward()))
    pipe.step(x, y)
    assert len(HookedChunk.calls) == 15
    pipe.register_custom_function(hp.pipeline.OVERLAP_F_B, None)
    pipe.step(x, y)
    assert len(HookedChunk.calls) == 20


def test_chunks_with_the_hook_refuse_what_cannot_reach_it(one_rank_group):
    sched = hp.pipeline.schedule("dualpipev", ranks=1, microbatches=M)
    mixed = {0: hooked_chunks()[0], 1: chunks()[1]}
    with pytest.raises(ValueError, match=r"chunks \[0\] define overlapped_forward_backward and "
                                         r"chunks \[1\] do not"):
        hp.pipeline.Pipeline(mixed, sched, loss_fn=mse, activation_shape=(2, 8),
                             group=one_rank_group)
    with pytest.raises(ValueError, match="fb_overlap=True runs the FB pairs .* pick one"):
        hp.pipeline.Pipeline(hooked_chunks(), sched, loss_fn=mse, activation_shape=(2, 8),
                             group=one_rank_group, fb_overlap=True)

    class Wrong(HookedChunk):
        @classmethod
        def overlapped_forward_backward(cls, *args):
            return None

    model = {0: Wrong(*chunks()[0]), 1: Wrong(*chunks()[1])}
    pipe = hp.pipeline.Pipeline(model, sched, loss_fn=mse, activation_shape=(2, 8),
                                group=one_rank_group)
    x, y = batch()
    with pytest.raises(RuntimeError, match="must return [(]outputs0, loss0[)], got NoneType"):
        pipe.step(x, y)


def test_pairs_led_by_their_backward_train_exactly(one_rank_group):
    """NOTE [The half that leads] (hp/schedule/fuse.cpp): every FB pair of the
    one-rank dualpipev rewritten as B-led ('0B0+1F1'); the overlapped runner
    starts each with the backward half, and training stays exact in float64."""
    hs = hp.schedule
    model = chunks()
    sched = hp.pipeline.schedule("dualpipev", ranks=1, microbatches=M)
    sched.actions = [[hs.Action.overlap(a.stage, a.microbatch, a.stage2, a.microbatch2,
                                        backward_first=True) if a.op == hs.Op.FB else a
                      for a in row] for row in sched.actions]
    pairs = [a for a in sched.actions[0] if a.op == hs.Op.FB]
    assert len(pairs) == 5 and all(a.backward_first for a in pairs)
    assert str(pairs[0]) == "0B0+1F1"
    pipe = hp.pipeline.Pipeline(model, sched, loss_fn=mse, activation_shape=(2, 8),
                                group=one_rank_group, fb_overlap=True)
    params = [q for c in model.values() for q in c.parameters()]
    assert_matches_reference(train(pipe, params), params)
    assert pipe.last_stats["pairs"] == len(pairs)


def deferred(pipe):
    return pipe.last_stats["deferred_w_in_waits"] + pipe.last_stats["deferred_w_at_end"]


@pytest.mark.parametrize("gain", [-1.0, 1.0, None])
def test_defer_wgrad_auto_chooses_after_the_second_step(one_rank_group, gain):
    """defer_wgrad="auto" (the default; NOTE [The deferred W's chosen in the
    run] in hp/pipeline/pipeline.cpp): after step 2 the simulator, under
    that step's fitted costs, compares the pairs with and without deferred
    W's. A gain of -1 always takes them, 1 never, the default 3 % as the
    predictions say; steps 3 and 4 run as chosen, and training stays exact."""
    pipe, params = pipeline(one_rank_group, fb_overlap=True)
    assert pipe.defer_wgrad_gain == pytest.approx(0.03)
    if gain is not None:
        pipe.defer_wgrad_gain = gain
    opt = torch.optim.SGD(params, lr=0.1)
    x, y = batch()
    losses, counts = [], []
    for step in range(4):
        opt.zero_grad()
        losses.append(pipe.step(x, y))
        opt.step()
        counts.append(deferred(pipe))
        assert (pipe.deferred_w_choice is None) == (step == 0), step
    assert_matches_reference(losses, params)
    c = pipe.deferred_w_choice
    assert c["after_step"] == 2 and c["step_with"] > 0 and c["step_without"] > 0, c
    # The queued W's hold their microbatches' activations: a peak at least as high.
    assert c["peak_with"] >= c["peak_without"] > 0, c
    want = {-1.0: True, 1.0: False}.get(gain, c["step_with"] <= 0.97 * c["step_without"])
    assert c["defer"] == want, c
    assert counts[:2] == [0, 0] and all((n > 0) == want for n in counts[2:]), counts


def test_deferred_ws_are_chosen_only_where_they_can_run(one_rank_group):
    # defer_wgrad=False, or no overlapped pairs: no choice is made. Asked
    # for one, the first chooses (and applies it), the second simulates
    # nothing.
    for kw in ({"fb_overlap": True, "defer_wgrad": False}, {}):
        pipe, params = pipeline(one_rank_group, **kw)
        with pytest.raises(RuntimeError, match="fits its costs to the last step: run one first"):
            pipe.choose_deferred_w()
        losses = train(pipe, params)
        assert pipe.deferred_w_choice is None and deferred(pipe) == 0, kw
        c = pipe.choose_deferred_w(-1.0)
        assert c["defer"] == ("fb_overlap" in kw) and (c["step_with"] > 0) == c["defer"], c
        losses += train(pipe, params, steps=1)
        assert (deferred(pipe) > 0) == c["defer"], kw
        assert_matches_reference(losses, params)
    pipe, params = pipeline(one_rank_group, fb_overlap=True, defer_wgrad=True)
    train(pipe, params, steps=1)
    assert deferred(pipe) > 0 and pipe.choose_deferred_w()["step_with"] == 0
    for bad in (1.5, -2):
        with pytest.raises(ValueError, match="from -1 to 1, got"):
            pipe.choose_deferred_w(bad)
    for bad in (True, "0.1"):
        with pytest.raises(TypeError, match="gain must be a number"):
            pipe.choose_deferred_w(bad)
    train(pipe, params, steps=1)  # still usable


@pytest.mark.parametrize("turns,defer,parts", [("ready", True, 3), ("ready", False, 1),
                                               ("auto", "auto", 1)])
def test_pairs_taking_ready_turns_train_exactly(one_rank_group, turns, defer, parts):
    """pair_turns="ready" (NOTE [Turns as messages arrive] in
    hp/pipeline/overlap.cpp), with deferred W's in parts, and "auto" (ready
    until the W's defer): the same steps as plain autograd. One rank's pairs
    wait on no message, so their order stays the code's (test_moe_ep.py
    runs them between processes)."""
    pipe, params = pipeline(one_rank_group, fb_overlap=True, defer_wgrad=defer,
                            pair_turns=turns, w_parts=parts)
    pipe.defer_wgrad_gain = -1.0  # "auto": deferred from the third step
    assert pipe.pair_turns == turns
    losses = train(pipe, params, steps=4)
    assert_matches_reference(losses, params)
    assert (deferred(pipe) > 0) == (defer is not False), deferred(pipe)
    assert pipe.last_stats["pair_reordered"] == 0


def test_pair_turns_and_w_parts_refuse_what_cannot_run(one_rank_group):
    for kw, error, text in (
            ({"fb_overlap": True, "pair_turns": "sometimes"}, ValueError,
             "pair_turns must be 'auto', 'ready' or 'fixed'"),
            ({"fb_overlap": True, "pair_turns": 1}, TypeError, "pair_turns must be a str"),
            ({"pair_turns": "ready"}, ValueError, "it needs fb_overlap=True"),
            ({"fb_overlap": True, "w_parts": 0}, ValueError, "w_parts must be 1 or more"),
            ({"fb_overlap": True, "w_parts": 2.0}, TypeError, "w_parts must be an int"),
            ({"fb_overlap": True, "defer_wgrad": True, "w_parts": 2}, ValueError,
             "needs defer_wgrad=True and pair_turns='ready'"),
            ({"fb_overlap": True, "pair_turns": "ready", "w_parts": 2}, ValueError,
             "needs defer_wgrad=True and pair_turns='ready'")):
        with pytest.raises(error, match=text):
            pipeline(one_rank_group, **kw)
    # NOTE [Ready turns from Python]: where a half exchanges over torch's
    # groups, or on a device, "auto" takes fixed turns and "ready" is refused.
    from hyperparallel.pipeline.checks import _resolve_pair_turns

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert _resolve_pair_turns("auto", cpu, None, {}) == ("auto", None)
    assert _resolve_pair_turns("ready", cpu, None, {}) == ("ready", None)
    for device, fsdp, why in ((cuda, None, "compute on cuda"),
                              (cpu, ["an FSDP2 stage"], "FSDP2 stages")):
        assert _resolve_pair_turns("auto", device, fsdp, {}) == ("fixed", None)
        turns, refused = _resolve_pair_turns("ready", device, fsdp, {})
        assert turns == "fixed" and why in refused and "use 'fixed' or 'auto'" in refused
