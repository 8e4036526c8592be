"""DualPipe's hook: a chunk whose class defines ``overlapped_forward_backward``
runs each ``FB`` pair of the schedule itself (NOTE [A chunk's own pair]);
``run_backward`` for the backward half inside it."""

from __future__ import annotations

import inspect
from typing import Dict, Mapping, Optional, Sequence

import torch

from ..losses import _LossOfMicrobatch
from .stage_forward import _StageForward, collecting_aux


# NOTE [A chunk's own pair]
# deepseek-ai/DualPipe calls, for each paired step, the classmethod
#     type(module0).overlapped_forward_backward(module0, inputs0, criterion0, labels0,
#                                               module1, loss1, outputs1, output_grads1)
# which returns (outputs0, loss0): the model runs the forward of module0 on
# inputs0 (and criterion0(*outputs0, *labels0) where that is the last stage)
# and the backward of module1 (loss1.backward() on a last stage, else from
# outputs1 with output_grads1), interleaving their parts so that one's
# communication hides behind the other's compute. A Pipeline whose chunks'
# class defines it runs each FB pair through it: a pair function (NOTE [A
# pair function] in hp/pipeline/overlap.cpp) that calls PairCall.computed
# (NOTE [A pair that computes itself] in hp/pipeline/stage.cpp) once both
# halves' inputs arrived, with
#  - inputs0 = [x], x the activation the chunk's forward takes (a structure
#    rebuilt from its message, NOTE [Pytrees between stages]): a chunk's
#    forward takes one activation, so module0(*inputs0) is its call;
#  - criterion0, labels0: the Pipeline's loss_fn and [the microbatch's
#    target] where module0 runs a last stage, else None;
#  - on a last stage loss1, the loss times the loss scale (1 / microbatches),
#    so that loss1.backward() gives what the runtime's own B gives (the
#    multiplication's backward hands the loss the scale, bit for bit); else
#    outputs1 (the output's tensors that take a gradient) and output_grads1.
#    A sent output has given its storage back (NOTE [Releasing a sent
#    output] in hp/pipeline/stage.cpp): outputs1 keep their autograd history
#    and an empty storage, so their backward goes through run_backward (or
#    DualPipe's own), which calls the engine without comparing shapes, not
#    torch.autograd.backward;
#  - outputs0 read as DualPipe's example returns them: a list or tuple of one
#    tensor stands for that tensor.
# The auxiliary losses added during the call (add_loss) are tied to the
# forward's output, or to its loss on a last stage. A register_custom_function
# replaces the hook, and None brings it back; fb_overlap with such chunks is
# refused (two runners for one pair). The step's keyword arguments (an
# attention mask: NOTE [Keyword arguments of every stage]) cannot reach
# DualPipe's module0(*inputs0): a hook that also takes `kwargs0` is given
# those module0 takes, to call module0(*inputs0, **kwargs0); a step that
# gives some to a hook without it fails naming the pair. Tested exact
# against autograd in tests/python/test_pair_function.py (one rank) and
# test_moe_ep.py (case "mixtral+hook:dualpipev": pp 2 x ep 2, released
# outputs, all-to-alls inside both halves, a mask).


def run_backward(tensors: Sequence[torch.Tensor], grad_tensors: Sequence[torch.Tensor]) -> None:
    """The backward from ``tensors`` with ``grad_tensors``, accumulated into
    the leaves' ``.grad``, calling the autograd engine without comparing the
    tensors' shapes with the gradients' (as DualPipe's ``run_backward``):
    inside ``overlapped_forward_backward``, ``outputs1`` have given their
    storage back after their send (NOTE [A chunk's own pair])."""
    torch.autograd.Variable._execution_engine.run_backward(
        tuple(tensors), tuple(grad_tensors), False, False, (), True, True)


def pair_hook(chunk) -> Optional[object]:
    """The chunk's ``overlapped_forward_backward`` classmethod, if its class
    defines one."""
    return getattr(type(chunk), "overlapped_forward_backward", None)


def takes_kwargs0(hook) -> bool:
    """Whether the hook takes the step's keyword arguments (``kwargs0``)."""
    try:
        params = inspect.signature(hook).parameters
    except (TypeError, ValueError):
        return False
    return "kwargs0" in params or any(q.kind is q.VAR_KEYWORD for q in params.values())


class _ChunkPairs:
    """The pair function that hands each FB pair to the chunks' own
    ``overlapped_forward_backward`` (NOTE [A chunk's own pair])."""

    def __init__(self, chunks: Mapping[int, torch.nn.Module], forwards: Dict[int, _StageForward],
                 loss: _LossOfMicrobatch):
        self.chunks, self.forwards, self.loss = dict(chunks), forwards, loss

    def __call__(self, pair) -> None:
        fs, fmb = pair.forward_stage, pair.forward_microbatch
        module0, module1 = self.chunks[fs], self.chunks[pair.backward_stage]
        sf = self.forwards[fs]

        def compute(p):
            extra = {}
            kwargs0 = sf.kwargs.of(fmb, sf.accepts)
            if takes_kwargs0(pair_hook(module0)):
                extra["kwargs0"] = kwargs0
            elif kwargs0:
                raise ValueError(
                    f"pair {pair.action}: chunk {fs} runs its pairs through "
                    f"{type(module0).__name__}.overlapped_forward_backward, which calls "
                    f"module0(*inputs0): the step's keyword arguments ({sorted(kwargs0)}) cannot "
                    "reach it; a hook that takes kwargs0 is given them")
            x = sf.argument(list(p.forward_input) if sf.messages else p.forward_input[0])
            criterion0 = labels0 = None
            if p.forward_is_last:
                criterion0, labels0 = self.loss.loss_fn, [self.loss.target(fmb)]
            roots, grads = list(p.backward_roots), list(p.backward_grads)
            loss1 = outputs1 = output_grads1 = None
            if p.backward_is_last:
                loss1 = roots[0] * grads[0] if grads else roots[0]
            else:
                outputs1, output_grads1 = roots, grads
            with collecting_aux() as added:
                got = pair_hook(module0)(module0, [x], criterion0, labels0, module1, loss1,
                                         outputs1, output_grads1, **extra)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                raise TypeError(
                    f"pair {pair.action}: {type(module0).__name__}.overlapped_forward_backward "
                    f"must return (outputs0, loss0), got {type(got).__name__}")
            outputs0, loss0 = got
            if p.forward_is_last:
                if not isinstance(loss0, torch.Tensor):
                    raise TypeError(
                        f"pair {pair.action}: stage {fs} is a last stage, so "
                        f"{type(module0).__name__}.overlapped_forward_backward must return "
                        f"loss0 = criterion0(*outputs0, *labels0), got {type(loss0).__name__}")
                message = [loss0]
                sf.tie_aux(message, added)
                return message
            if (isinstance(outputs0, (tuple, list)) and len(outputs0) == 1
                    and isinstance(outputs0[0], torch.Tensor)):
                outputs0 = outputs0[0]
            message = sf.message(outputs0, fmb, fs, added)
            return message if sf.messages else [message]

        pair.computed(compute)
