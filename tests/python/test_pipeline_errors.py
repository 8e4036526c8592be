"""Bad input to the Python runtime is a Python exception naming the problem
(TypeError, ValueError, RuntimeError), never a crash or a hang: wrong types,
chunks that do not match the schedule, a group of the wrong size, a
schedule that cannot run with the given p and m, a forward or loss that
raises, targets missing where a last stage runs."""

import os
import socket

import pytest
import torch

import hyperparallel as hp



def lin():
    return torch.nn.Linear(4, 4, dtype=torch.float64)


def mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


def test_schedule_arguments():
    with pytest.raises(TypeError):
        hp.pipeline.schedule(3, ranks=2, microbatches=4)
    with pytest.raises(ValueError, match="ranks"):
        hp.pipeline.schedule("1f1b", ranks=0, microbatches=4)
    with pytest.raises(ValueError, match="microbatches"):
        hp.pipeline.schedule("1f1b", ranks=2, microbatches=-1)
    # A schedule that cannot run with this p and m says which constraint.
    with pytest.raises(ValueError, match="(?i)microbatch"):
        hp.pipeline.schedule("dualpipe", ranks=4, microbatches=2)
    # NOTE [One size rule]: refused before any work, naming the bound.
    with pytest.raises(ValueError, match="too many to schedule in seconds.*at most 2048"):
        hp.pipeline.schedule("1f1b", ranks=2, microbatches=10**9)
    with pytest.raises(ValueError):
        hp.pipeline.PipelineSchedule.from_csv("not,a,schedule\n\x00")
    with pytest.raises(TypeError):
        hp.pipeline.PipelineSchedule.from_csv(b"bytes")


def test_pipeline_arguments(one_rank_group):
    s1 = hp.pipeline.schedule("1f1b", ranks=1, microbatches=2)
    good = dict(loss_fn=mse, activation_shape=(2, 4), group=one_rank_group)
    with pytest.raises(TypeError, match="Schedule"):
        hp.pipeline.Pipeline({0: lin()}, "1f1b", **good)
    with pytest.raises(TypeError, match="chunks"):
        hp.pipeline.Pipeline([lin()], s1, **good)
    with pytest.raises(TypeError, match="callable"):
        hp.pipeline.Pipeline({0: 3}, s1, **good)
    with pytest.raises(TypeError, match="loss_fn"):
        hp.pipeline.Pipeline({0: lin()}, s1, loss_fn=None, activation_shape=(2, 4),
                             group=one_rank_group)
    with pytest.raises(ValueError, match="no module was given for chunk 0"):
        hp.pipeline.Pipeline({1: lin()}, s1, **good)
    with pytest.raises(TypeError, match="ProcessGroup"):
        hp.pipeline.Pipeline({0: lin()}, s1, loss_fn=mse, activation_shape=(2, 4), group=42)
    for bad in (-1, 1.5, "2", True, None):
        with pytest.raises(ValueError, match="receive_lookahead"):
            hp.pipeline.Pipeline({0: lin()}, s1, receive_lookahead=bad, **good)
    with pytest.raises(ValueError, match="p2p must be 'auto', 'group' or 'shm', got 'tcp'"):
        hp.pipeline.Pipeline({0: lin()}, s1, p2p="tcp", **good)
    with pytest.raises(TypeError, match="p2p must be a str"):
        hp.pipeline.Pipeline({0: lin()}, s1, p2p=None, **good)
    with pytest.raises(TypeError, match="fb_overlap must be a bool, got int"):
        hp.pipeline.Pipeline({0: lin()}, s1, fb_overlap=1, **good)
    with pytest.raises(TypeError, match="defer_wgrad must be True, False or 'auto', got 'yes'"):
        hp.pipeline.Pipeline({0: lin()}, s1, fb_overlap=True, defer_wgrad="yes", **good)
    with pytest.raises(TypeError, match="defer_wgrad must be True, False or 'auto', got 1"):
        hp.pipeline.Pipeline({0: lin()}, s1, fb_overlap=True, defer_wgrad=1, **good)
    with pytest.raises(ValueError, match="it needs fb_overlap=True"):
        hp.pipeline.Pipeline({0: lin()}, s1, defer_wgrad=True, **good)
    os.environ["HP_LINK"] = "20"  # a modelled link (docs/overlap.md), misspelled
    try:
        with pytest.raises(ValueError, match="HP_LINK '20': no comma; give LATENCY_US,GBPS"):
            hp.pipeline.Pipeline({0: lin()}, s1, **good)
    finally:
        del os.environ["HP_LINK"]
    with pytest.raises(ValueError, match="p2p='shm' moves CPU tensors"):
        hp.pipeline.Pipeline({0: lin()}, s1, p2p="shm", device="meta", **good)
    for bad in (float("nan"), float("inf"), 0, -1.0):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds"):
            hp.pipeline.Pipeline({0: lin()}, s1, **dict(good, timeout=bad))
    with pytest.raises(TypeError, match="timeout must be a number"):
        hp.pipeline.Pipeline({0: lin()}, s1, **dict(good, timeout="60"))
    with pytest.raises(TypeError, match="dtype must be a torch.dtype.*'float32'"):
        hp.pipeline.Pipeline({0: lin()}, s1, dtype="float32", **good)
    with pytest.raises(TypeError, match="activation_shape must be a shape"):
        hp.pipeline.Pipeline({0: lin()}, s1, **dict(good, activation_shape="2x4"))
    with pytest.raises(TypeError, match="keep_freed_memory"):
        hp.pipeline.Pipeline({0: lin()}, s1, keep_freed_memory="yes", **good)
    # The group has 1 rank, the schedule 2.
    s2 = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
    with pytest.raises(ValueError, match="1 ranks but the schedule has 2"):
        hp.pipeline.Pipeline({0: lin()}, s2, **good)


def test_step_errors_are_python_exceptions(one_rank_group):
    s1 = hp.pipeline.schedule("1f1b", ranks=1, microbatches=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    y = torch.randn(4, 4, dtype=torch.float64)
    model = lin()
    pipe = hp.pipeline.Pipeline({0: model}, s1, loss_fn=mse, activation_shape=(2, 4),
                                group=one_rank_group)
    with pytest.raises(ValueError, match="not divisible"):
        pipe.step(torch.randn(3, 4, dtype=torch.float64), y)
    with pytest.raises(ValueError, match="3 microbatches given"):
        pipe.step([x[:2]] * 3, y)
    with pytest.raises(ValueError, match="targets"):
        pipe.step(x, None)
    # Arguments refused before the step started leave the runtime usable; the
    # loss is the mean over the microbatches (equal sizes: the batch's mean).
    with torch.no_grad():
        expected = mse(model(x), y).item()
    assert pipe.step(x, y) == pytest.approx(expected, rel=1e-12)

    def bad_forward(t):
        raise KeyError("boom in forward")

    pipe2 = hp.pipeline.Pipeline({0: bad_forward}, s1, loss_fn=mse, activation_shape=(2, 4),
                                 group=one_rank_group, parameters={0: [torch.zeros(1, requires_grad=True)]},
                                 dtype=torch.float64)
    with pytest.raises(RuntimeError, match="boom in forward"):
        pipe2.step(x, y)
    # A step that failed inside leaves the runtime unusable, and says so.
    with pytest.raises(RuntimeError, match="a previous step failed"):
        pipe2.step(x, y)

    pipe3 = hp.pipeline.Pipeline({0: lambda t: "not a tensor"}, s1, loss_fn=mse,
                                 activation_shape=(2, 4), group=one_rank_group, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="must return a torch.Tensor"):
        pipe3.step(x, y)

    pipe4 = hp.pipeline.Pipeline({0: lin()}, s1, loss_fn=lambda o, t: (o - t) ** 2,
                                 activation_shape=(2, 4), group=one_rank_group)
    with pytest.raises(RuntimeError, match="one number"):
        pipe4.step(x, y)


def test_a_dropped_pipeline_lets_its_group_go(one_rank_group):
    # NOTE [A Pipeline's group dies with it]: no reference cycle keeps a
    # Pipeline (and the group its runtime holds) alive until the interpreter's
    # shutdown; dropping it frees it at once, after a step too.
    import weakref

    s1 = hp.pipeline.schedule("1f1b", ranks=1, microbatches=2)
    pipe = hp.pipeline.Pipeline({0: lin()}, s1, loss_fn=mse, activation_shape=(2, 4),
                                group=one_rank_group)
    x = torch.randn(4, 4, dtype=torch.float64)
    assert pipe.step(x, x.clone()) >= 0.0
    gone = weakref.ref(pipe)
    del pipe
    assert gone() is None, "a reference cycle keeps the Pipeline alive"


class _Scaled(torch.nn.Module):
    """A linear layer whose forward takes keyword arguments: a per-row
    weight (batched) and a constant shift."""

    def __init__(self):
        super().__init__()
        self.lin = lin()

    def forward(self, x, row_weight=None, shift=0.0):
        h = self.lin(x) + shift
        return h if row_weight is None else h * row_weight[:, None]


def test_keyword_arguments_reach_the_stage_split_per_microbatch(one_rank_group):
    # NOTE [Keyword arguments of every stage]: a tensor kwarg is split along
    # dim 0 like the inputs, a number goes unchanged; the loss equals the same
    # model run by hand. A key no stage takes (a misspelt name) is refused
    # (NOTE [Arguments of a step]), and the runtime stays usable.
    torch.manual_seed(0)
    chunk = _Scaled()
    sched = hp.pipeline.schedule("1f1b", ranks=1, microbatches=2)
    pipe = hp.pipeline.Pipeline({0: chunk}, sched, loss_fn=mse, activation_shape=(3, 4),
                                group=one_rank_group)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    w = torch.linspace(0.5, 2.0, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\['row_wieght'\] are taken by no stage.*'row_weight'"):
        pipe.step(x, y, row_wieght=w, shift=0.25)
    loss = pipe.step(x, y, row_weight=w, shift=0.25)
    with torch.no_grad():
        want = sum(mse(chunk(xm, row_weight=wm, shift=0.25), ym).item()
                   for xm, ym, wm in zip(x.chunk(2), y.chunk(2), w.chunk(2))) / 2
        plain = sum(mse(chunk(xm), ym).item() for xm, ym in zip(x.chunk(2), y.chunk(2))) / 2
    assert abs(loss - want) <= 1e-12 and abs(loss - plain) > 1e-3
    with pytest.raises(ValueError, match="keyword argument 'row_weight'.*not divisible"):
        pipe.step(x, y, row_weight=torch.ones(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="keyword argument 'row_weight' requires grad"):
        pipe.step(x, y, row_weight=w.clone().requires_grad_())
    with pytest.raises(ValueError, match="0-d tensor"):
        pipe.step(x, y, row_weight=torch.tensor(1.0))
