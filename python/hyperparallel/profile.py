"""Costs from the real device: measure a stage, predict every schedule.

How to pick a schedule before renting the machines: measure one stage of your
model on the device it will run on (its forward F, input gradient I, weight
gradient W, a fused backward B, its activation memory), then let the
simulator predict each schedule's step at the pipeline you plan (the same
code as ``hp profile``)::

    import hyperparallel as hp
    block = MyBlock().cuda().bfloat16()
    x = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16)
    costs = hp.profile.measure_stage(block, x, grad_output=torch.randn_like(x))
    print(costs)                                   # F, I, W, B in ms, (I + W) / B, MiB
    preds = hp.profile.predict(costs, p=8, m=24)   # simulated on these costs
    print(hp.profile.report(costs, preds, p=8, m=24))

The measurement is ``hp profile``'s own (``hp::train::measure_stage``): I
and W are timed as the pipeline runs them (the split's
``compute_input_grad`` and ``compute_weight_grad``), B as one fused
backward of the same stage; on CUDA with events on the current stream. With
``compare_torch=True`` the same stage is also split by PyTorch's own
``stage_backward_input``/``stage_backward_weight``
(``torch.distributed.pipelining``), in the same run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import _C

__all__ = [
    "StageCosts",
    "Prediction",
    "measure_stage",
    "cost_model",
    "predict",
    "paper_rows",
    "report",
]


@dataclass(frozen=True)
class StageCosts:
    """One stage's measured costs per microbatch (seconds, medians) and memory (bytes).

    ``mem_b``: activation bytes held from F until I (the stage's output
    excluded: a pipeline frees it once sent); ``mem_w``: bytes still held from
    I until W. None where not measured. ``torch_i``/``torch_w``: PyTorch's
    stage_backward_input/stage_backward_weight on the same stage (when
    compared)."""

    f: float
    i: float
    w: float
    b: float
    mem_b: Optional[int] = None
    mem_w: Optional[int] = None
    device: str = "cpu"
    torch_i: Optional[float] = None
    torch_w: Optional[float] = None

    @property
    def split_ratio(self) -> float:
        """(I + W) / B: what the split costs over one fused backward (1.0 is free)."""
        return (self.i + self.w) / self.b

    @property
    def torch_split_ratio(self) -> Optional[float]:
        """The same for PyTorch's split, when measured."""
        if self.torch_i is None or self.torch_w is None:
            return None
        return (self.torch_i + self.torch_w) / self.b

    def as_dict(self) -> Dict[str, object]:
        return {"f": self.f, "i": self.i, "w": self.w, "b": self.b,
                "mem_b": self.mem_b, "mem_w": self.mem_w}

    def __str__(self) -> str:
        def mib(x):
            return "n/a" if x is None else f"{x / 2**20:.2f} MiB"
        s = (f"StageCosts on {self.device}: F {self.f * 1e3:.3f} ms, I {self.i * 1e3:.3f} ms, "
             f"W {self.w * 1e3:.3f} ms, B {self.b * 1e3:.3f} ms, (I+W)/B {self.split_ratio:.3f}, "
             f"mem_b {mib(self.mem_b)}, mem_w {mib(self.mem_w)}")
        if self.torch_split_ratio is not None:
            s += (f"; torch's split: I {self.torch_i * 1e3:.3f} ms, W {self.torch_w * 1e3:.3f} ms, "
                  f"(I+W)/B {self.torch_split_ratio:.3f}")
        return s


@dataclass(frozen=True)
class Prediction:
    """One schedule's simulated step: ``step_seconds`` (the makespan, in the
    costs' unit), the Zero Bubble paper's bubble rate, and the largest
    rank's peak activation memory (bytes when the costs carry measured
    memory). ``ok`` False: the schedule cannot be built at this p and m
    (``error`` says why)."""

    schedule: str
    ok: bool
    error: str
    num_stages: int
    step_seconds: float
    bubble_rate: float
    peak_memory: float


class _Timer:
    """Marks on the current CUDA stream (events), or the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> int:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def between(self, a: int, b: int) -> float:
        if self.cuda:
            self.marks[-1].synchronize()
            return self.marks[a].elapsed_time(self.marks[b]) / 1e3
        return self.marks[b] - self.marks[a]


def _memory_fn(device: torch.device, measure: bool) -> Optional[Callable[[], int]]:
    if not measure:
        return None
    if device.type == "cuda":
        return lambda: torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        _C.profile.install_memory_tracker()
        return _C.profile.memory_allocated
    return None


def measure_stage(
    stage: Callable[[torch.Tensor], torch.Tensor],
    example_input: torch.Tensor,
    *,
    loss_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    grad_output: Optional[torch.Tensor] = None,
    input_requires_grad: Optional[bool] = None,
    weights: Optional[Sequence[torch.Tensor]] = None,
    warmup: int = 2,
    repeats: int = 5,
    measure_memory: bool = True,
    compare_torch: bool = False,
) -> StageCosts:
    """Times F, I, W and a fused B of ``stage`` on ``example_input`` (on its device).

    The backward is rooted at ``loss_fn(output)`` (a last stage) or at the
    output with gradient ``grad_output`` (any other stage). The input gets a
    gradient (I) unless ``input_requires_grad`` is False (default: when it is
    floating point). ``weights``: default ``stage.parameters()`` that require
    grad. Weight gradients accumulate into ``.grad``, cleared before each run
    and after the last. Memory on CPU uses hyperparallel's tracking allocator
    (installed process-wide on first use), on CUDA ``torch.cuda.memory_allocated``."""
    if not callable(stage):
        raise TypeError(f"stage must be callable, got {type(stage).__name__}")
    if not isinstance(example_input, torch.Tensor):
        raise TypeError(f"example_input must be a tensor, got {type(example_input).__name__}")
    if (loss_fn is None) == (grad_output is None):
        raise ValueError("give exactly one of loss_fn (a last stage) and grad_output (any other)")
    for name, v, low in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    if weights is None:
        if not isinstance(stage, torch.nn.Module):
            raise TypeError("stage is not an nn.Module: pass its weights")
        weights = [q for q in stage.parameters() if q.requires_grad]
    weights = list(weights)
    if input_requires_grad is None:
        input_requires_grad = example_input.is_floating_point()
    device = example_input.device
    memory = _memory_fn(device, measure_memory)

    def run_stage(x):
        out = stage(x)
        return loss_fn(out) if loss_fn is not None else out

    # The measurement itself is hp profile's (hp::train::measure_stage).
    got = _C.profile.measure_stage(stage, example_input, input_requires_grad, weights, loss_fn,
                                   grad_output, warmup, repeats, memory, memory is not None)
    ti = tw = None
    if compare_torch:
        ti, tw = _torch_split(run_stage, example_input, input_requires_grad, weights,
                              grad_output, warmup, repeats)
    return StageCosts(device=str(device), torch_i=ti, torch_w=tw, **got)


def _torch_split(run_stage, example_input, input_requires_grad, weights, sens, warmup, repeats):
    """The medians of PyTorch's stage_backward_input and stage_backward_weight
    (torch.distributed.pipelining) on the same stage, in seconds."""
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    ti, tw = [], []
    for run in range(warmup + repeats):
        timer = _Timer(example_input.device)
        for q in weights:
            q.grad = None
        x = example_input.detach()
        if input_requires_grad:
            x.requires_grad_(True)
        out = run_stage(x)
        m0 = timer.mark()
        _, groups = stage_backward_input([out], None if sens is None else [sens],
                                         [x] if input_requires_grad else [], iter(weights))
        m1 = timer.mark()
        stage_backward_weight(iter(weights), groups)
        m2 = timer.mark()
        del out, x, groups
        if run >= warmup:
            ti.append(timer.between(m0, m1))
            tw.append(timer.between(m1, m2))
    for q in weights:
        q.grad = None
    return statistics.median(ti), statistics.median(tw)


def cost_model(first: StageCosts, middle: Optional[StageCosts] = None,
               last: Optional[StageCosts] = None, *, p: int, comm: float = 0.0):
    """The ``hyperparallel.schedule.CostModel`` of a pipeline of ``p`` stages:
    ``first`` for stage 0, ``last`` (default: ``middle``) for stage p-1 and
    ``middle`` (default: ``first``) for the others, ``comm`` seconds per
    transfer. Memory in bytes when measured, else in units of one stage's
    activations."""
    for name, c in (("first", first), ("middle", middle), ("last", last)):
        if c is not None and not isinstance(c, StageCosts):
            raise TypeError(f"{name} must be a StageCosts (measure_stage), got {type(c).__name__}")
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p must be a positive int, got {p!r}")
    middle = middle or first
    last = last or middle
    return _C.profile.stage_cost_model(first.as_dict(), middle.as_dict(), last.as_dict(),
                                       float(comm), p)


def predict(costs, p: int, m: int, *, schedules: Optional[Sequence[str]] = None,
            comm: float = 0.0) -> List[Prediction]:
    """Every schedule's simulated step at ``p`` ranks and ``m`` microbatches,
    sorted by step time (those that cannot be built at this p and m last).
    ``costs``: a StageCosts (every stage alike, ``comm`` seconds per transfer)
    or a ``hyperparallel.schedule.CostModel`` (e.g. :func:`cost_model`)."""
    for name, v in (("p", p), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if isinstance(costs, StageCosts):
        costs = cost_model(costs, p=p, comm=comm)
    names = [] if schedules is None else [str(s) for s in schedules]
    rows = _C.profile.predict(costs, p, m, names)
    out = [Prediction(**r) for r in rows]
    out.sort(key=lambda r: (not r.ok, r.step_seconds))
    return out


def paper_rows(p: int, m: int) -> List[Dict[str, object]]:
    """The Zero Bubble paper's Table 5 rows at ``p`` and ``m`` (its profiled
    costs and bubble rates; none when the table has no such row)."""
    return list(_C.profile.paper_rows(p, m))


def report(costs: StageCosts, predictions: Sequence[Prediction], *, p: int, m: int) -> str:
    """The measured costs, the predictions and the paper's Table 5 at p and m, as text."""
    lines = [str(costs), "", f"predicted step at p = {p}, m = {m}:",
             f"{'schedule':<18} {'step ms':>10} {'bubble':>8} {'peak act.':>12}"]
    bytes_ = costs.mem_b is not None
    for r in predictions:
        if not r.ok:
            lines.append(f"{r.schedule:<18} not at this p and m: {r.error[:100]}")
            continue
        peak = f"{r.peak_memory / 2**20:.1f} MiB" if bytes_ else f"{r.peak_memory:.2f}"
        lines.append(f"{r.schedule:<18} {r.step_seconds * 1e3:>10.3f} {100 * r.bubble_rate:>7.2f}% "
                     f"{peak:>12}")
    rows = paper_rows(p, m)
    if rows:
        ours = {r.schedule: r.bubble_rate for r in predictions if r.ok}
        lines += ["", "the Zero Bubble paper's Table 5 here (bubble rate; zb-auto is its ZB-2p):",
                  f"{'model':<12} {'1F1B':>8} {'ZB-H1':>8} {'ZB-H2':>8} {'ZB-2p':>8}"]
        for row in rows:
            lines.append(f"{'paper ' + str(row['model']):<12} {row['1f1b']:>8.4f} "
                         f"{row['zb-h1']:>8.4f} {row['zb-h2']:>8.4f} {row['zb-2p']:>8.4f}")
        cols = [ours.get(s) for s in ("1f1b", "zb-h1", "zb-h2", "zb-auto")]
        lines.append(f"{'measured':<12} " + " ".join(
            f"{c:>8.4f}" if c is not None else f"{'-':>8}" for c in cols))
    return "\n".join(lines)
