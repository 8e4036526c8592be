"""hyperparallel.profile on the CPU: a stage measured (its activation memory
against the bytes autograd saves), predictions equal to the simulator's (1F1B's
closed form, the Zero Bubble paper's Table 5 on its own costs), errors. The
CUDA path is tests/python/test_gpu.py."""

import pytest
import torch

import hyperparallel as hp
from hyperparallel import profile

F64 = torch.float64


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w1 = torch.nn.Parameter(torch.randn(8, 16, generator=g, dtype=F64))
        self.w2 = torch.nn.Parameter(torch.randn(16, 8, generator=g, dtype=F64))

    def forward(self, x):
        return torch.tanh(x @ self.w1) @ self.w2


def saved_bytes(fn, x, exclude):
    """Bytes of the distinct storages autograd saves in a plain forward of
    `fn(x)`, leaving out those of `exclude` (the input, the weights)."""
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    sizes = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            sizes[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(sizes.values())


def test_measure_stage_times_the_split_and_its_memory():
    stage = TwoLayers()
    x = torch.randn(4, 8, dtype=F64)
    g = torch.randn(4, 8, dtype=F64)
    c = profile.measure_stage(stage, x, grad_output=g, warmup=1, repeats=3, compare_torch=True)
    assert c.f > 0 and c.i > 0 and c.w > 0 and c.b > 0
    assert c.torch_i > 0 and c.torch_w > 0 and c.torch_split_ratio > 0
    # Oracle: what autograd saves beyond the input and the weights (tanh's output).
    expected = saved_bytes(stage, x.detach().requires_grad_(), [x, stage.w1, stage.w2])
    assert expected == 4 * 16 * 8
    assert c.mem_b == expected
    assert c.mem_w >= c.mem_b, "W still needs tanh's output, and the gradient captured for w1"
    assert stage.w1.grad is None and stage.w2.grad is None, "nothing left in .grad"
    assert "(I+W)/B" in str(c) and c.device == "cpu"
    # A last stage: the loss roots the backward.
    last = profile.measure_stage(stage, x, loss_fn=lambda y: y.pow(2).sum(), warmup=0, repeats=1)
    assert last.w > 0
    # A first stage: its input is data, no dx.
    first = profile.measure_stage(stage, x, grad_output=g, input_requires_grad=False, repeats=1)
    assert first.i >= 0
    # The measurement is hp profile's (hp::train::measure_stage): per run one
    # forward for the split and one for the fused backward.
    calls = []
    counted = profile.measure_stage(lambda t: calls.append(1) or stage(t), x, grad_output=g,
                                    weights=list(stage.parameters()), warmup=1, repeats=2,
                                    measure_memory=False)
    assert len(calls) == 2 * 3 and counted.mem_b is None and counted.mem_w is None


def test_predictions_are_the_simulators():
    unit = profile.StageCosts(f=1.0, i=1.0, w=1.0, b=2.0)
    preds = profile.predict(unit, p=4, m=8, schedules=["1f1b", "zb-h1", "no-such"])
    by = {r.schedule: r for r in preds}
    assert by["1f1b"].ok and by["1f1b"].step_seconds == pytest.approx((8 + 4 - 1) * 3.0)
    assert by["zb-h1"].step_seconds < by["1f1b"].step_seconds
    assert not by["no-such"].ok and "unknown schedule" in by["no-such"].error
    assert preds[-1].schedule == "no-such", "those that cannot be built come last"
    # The same as hyperparallel.schedule's simulator on the same costs.
    sim = hp.schedule.simulate(hp.schedule.build("zb-h1", 4, 8), hp.schedule.CostModel())
    assert by["zb-h1"].step_seconds == pytest.approx(sim.makespan)
    # Every default schedule is predicted.
    assert {r.schedule for r in profile.predict(unit, p=4, m=8)} == set(
        hp._C.profile.default_schedules())


def test_the_papers_costs_give_the_papers_table_5():
    rows = profile.paper_rows(8, 24)
    assert [r["model"] for r in rows] == ["1.5B", "6.2B"]
    for row in rows:
        c = profile.StageCosts(f=row["f"], i=row["b"], w=row["w"], b=row["b"] + row["w"])
        got = {r.schedule: r.bubble_rate for r in profile.predict(
            c, p=8, m=24, comm=row["comm"], schedules=["1f1b", "zb-h1", "zb-h2"])}
        for name in ("1f1b", "zb-h1", "zb-h2"):
            assert got[name] == pytest.approx(row[name], abs=6e-4), (row["model"], name)
    assert profile.paper_rows(8, 25) == []
    text = profile.report(profile.StageCosts(f=1.0, i=1.0, w=0.5, b=1.6),
                          profile.predict(profile.StageCosts(f=1.0, i=1.0, w=0.5, b=1.6),
                                          p=8, m=24, schedules=["1f1b", "zb-h1"]), p=8, m=24)
    assert "paper 1.5B" in text and "measured" in text


def test_cost_model_per_stage():
    first = profile.StageCosts(f=2.0, i=1.0, w=1.0, b=2.0, mem_b=100, mem_w=50)
    mid = profile.StageCosts(f=1.0, i=1.0, w=1.0, b=2.0, mem_b=80, mem_w=40)
    last = profile.StageCosts(f=1.0, i=3.0, w=1.0, b=4.0, mem_b=90, mem_w=45)
    c = profile.cost_model(first, mid, last, p=4, comm=0.5)
    assert list(c.stage_f) == [2.0, 1.0, 1.0, 1.0]
    assert list(c.stage_b) == [1.0, 1.0, 1.0, 3.0]
    assert list(c.stage_mem_b) == [100, 80, 80, 90]
    assert c.comm == 0.5
    preds = profile.predict(c, p=4, m=8, schedules=["1f1b", "zbv"])
    assert all(r.ok for r in preds), [r.error for r in preds]


def test_errors_say_what_to_give():
    stage = TwoLayers()
    x = torch.randn(2, 8, dtype=F64)
    with pytest.raises(ValueError, match="exactly one of loss_fn"):
        profile.measure_stage(stage, x)
    with pytest.raises(TypeError, match="callable"):
        profile.measure_stage(3, x, grad_output=x)
    with pytest.raises(TypeError, match="pass its weights"):
        profile.measure_stage(lambda t: t * 2, x, grad_output=x)
    with pytest.raises(ValueError, match="repeats"):
        profile.measure_stage(stage, x, grad_output=x, repeats=0)
    with pytest.raises(TypeError, match="the stage must return a torch.Tensor, got <class 'tuple'>"):
        profile.measure_stage(lambda t: (t,), x, grad_output=x, weights=[])
    with pytest.raises(ValueError, match="p must be"):
        profile.predict(profile.StageCosts(1, 1, 1, 2), p=0, m=4)
    with pytest.raises(TypeError, match="StageCosts"):
        profile.cost_model({"f": 1}, p=2)


def test_each_action_of_a_step_is_a_torch_profiler_range(one_rank_group):
    # NOTE [The actions around a failure] in hp/pipeline/executor.cpp: every
    # action the C++ executor runs is a user-scope range ("hp::0F1": stage 0's
    # F of microbatch 1), and a failed one ends its error with the rank's
    # actions around it, the failed one in brackets.
    sched = hp.pipeline.schedule("1f1b", ranks=1, microbatches=2)
    lin = torch.nn.Linear(4, 4, dtype=torch.float64)
    mse = torch.nn.functional.mse_loss
    pipe = hp.pipeline.Pipeline({0: lin}, sched, loss_fn=mse, activation_shape=(2, 4),
                                group=one_rank_group)
    x = torch.randn(4, 4, dtype=torch.float64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.step(x, x)
    names = [e.name for e in prof.events() if e.name.startswith("hp::")]
    assert sorted(names) == sorted(["hp::0F0", "hp::0B0", "hp::0F1", "hp::0B1"]), names

    calls = []

    def breaks_second(t):
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("the second forward broke")
        return lin(t)

    bad = hp.pipeline.Pipeline({0: breaks_second}, sched, loss_fn=mse, activation_shape=(2, 4),
                               group=one_rank_group, parameters={0: list(lin.parameters())})
    with pytest.raises(RuntimeError) as err:
        bad.step(x, x)
    msg = str(err.value)
    assert "rank 0 action 0F1" in msg and "the second forward broke" in msg, msg
    assert "rank 0's actions 0-3 of 4: 0F0 0B0 [0F1] 0B1" in msg, msg


def test_ctrl_c_inside_a_forward_comes_out_of_step_as_keyboard_interrupt(one_rank_group):
    # Ctrl-C while the user's forward runs raises KeyboardInterrupt there; the
    # executor unwinds and step() raises that KeyboardInterrupt itself, not a
    # RuntimeError wrapping it (python/csrc/bind_pipeline.cpp, take_interrupt).
    sched = hp.pipeline.schedule("1f1b", ranks=1, microbatches=2)
    lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def interrupted(t):
        raise KeyboardInterrupt

    pipe = hp.pipeline.Pipeline({0: interrupted}, sched, loss_fn=torch.nn.functional.mse_loss,
                                activation_shape=(2, 4), group=one_rank_group,
                                parameters={0: list(lin.parameters())})
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(KeyboardInterrupt):
        pipe.step(x, x)
