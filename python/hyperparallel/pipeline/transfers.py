"""What one stage hands the next: a structure of tensors as the message the
C++ runtime moves (NOTE [Pytrees between stages]), and declared shapes
(activation_shape) checked."""

from __future__ import annotations

import pickle
from typing import List, Sequence, Tuple

import torch


# NOTE [Pytrees between stages]
# Without `activation_shape` a stage may return a tensor or a tuple, list or
# dict of tensors, nested, with leaves that are no tensors (ints, None,
# strings), and the structure, shapes and dtypes may change from microbatch
# to microbatch and step to step (sequence lengths drawn per step). The
# runtime moves a message: a list of tensors, each in its own dtype and
# shape, whose layout travels with it (NOTE [Messages between stages] in
# hp/pipeline/message.h, NOTE [Messages that describe themselves] in
# hp/pipeline/frames.h), so nothing is probed or agreed on before a step. A
# bare tensor is a message of one tensor. A structure is its tensor leaves in
# order, then one uint8 tensor holding the pickled structure (its TreeSpec and
# the leaves that are no tensors); the receiving stage's forward gets the
# structure back as its first argument. Each tensor arrives bit for bit in
# its own dtype (an int64 of 2^40 + 1 stays itself, a bfloat16 stays a
# bfloat16). A leaf that requires grad arrives requiring grad and its
# gradient travels back; one that does not (a mask, ids, a rotary table)
# travels forward only. A structure needs at least one tensor.
def _to_message(out, stage: int, mb: int) -> List[torch.Tensor]:
    """`out` (a tensor or a structure of them) as a message."""
    import torch.utils._pytree as pytree

    if isinstance(out, torch.Tensor):
        return [out]
    leaves, spec = pytree.tree_flatten(out)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ValueError(
            f"stage {stage} microbatch {mb}: the forward returned a {type(out).__name__} "
            "holding no tensor; a stage hands the next at least one tensor")
    others = [(i, x) for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)]
    try:
        blob = pickle.dumps((pytree.treespec_dumps(spec), len(leaves), others))
    except Exception as e:  # noqa: BLE001
        raise ValueError(
            f"stage {stage} microbatch {mb}: the output's leaves that are no tensors must be "
            f"picklable to travel to the next stage ({e!r})") from e
    return tensors + [torch.frombuffer(bytearray(blob), dtype=torch.uint8)]


def _from_message(message: Sequence[torch.Tensor]):
    """The tensor or structure a message holds (the inverse of _to_message)."""
    import torch.utils._pytree as pytree

    if len(message) == 1:
        return message[0]
    spec_text, n, others = pickle.loads(message[-1].cpu().numpy().tobytes())
    given = dict(others)
    tensors = iter(message[:-1])
    leaves = [given[i] if i in given else next(tensors) for i in range(n)]
    return pytree.tree_unflatten(leaves, pytree.treespec_loads(spec_text))


def _declared_shape(activation_shape):
    """The shape the runtime's receives are given: None (messages describe
    themselves: NOTE [Pytrees between stages]), one shape, or a function
    whose answers are checked at each call."""
    if activation_shape is None:
        return None
    if callable(activation_shape):
        shape_fn = activation_shape

        def shape(stage: int, mb: int) -> Tuple[int, ...]:
            got = shape_fn(stage, mb)
            if isinstance(got, (str, bytes)) or not isinstance(got, Sequence) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in got
            ):
                raise TypeError(
                    f"activation_shape({stage}, {mb}) must return a sequence of ints >= 0 "
                    f"(a shape), got {got!r}"
                )
            return tuple(got)

        return shape
    if isinstance(activation_shape, (str, bytes)) or not isinstance(activation_shape, Sequence):
        raise TypeError(
            "activation_shape must be a shape (a sequence of ints) or "
            f"fn(stage, microbatch) -> shape, got {activation_shape!r}"
        )
    return tuple(int(d) for d in activation_shape)  # read once by the runtime
