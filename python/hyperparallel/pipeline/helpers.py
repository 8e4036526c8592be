"""What a training script calls beside :class:`Pipeline`: the schedule it
runs (``schedule``, ``PipelineSchedule``) and the step cache's memory
(``cpu_cache_bytes``, ``empty_cpu_cache``)."""

from __future__ import annotations

from .. import _C


#: The schedule a :class:`Pipeline` runs: hyperparallel's one ``Schedule``
#: type (``hyperparallel.schedule.Schedule``, the C++ ``hp::schedule::Schedule``
#: bound), with ``chunks_of_rank``, ``needs_inputs``, ``needs_targets`` and
#: ``has_split`` for the runtime's callers. No copy, no text between them.
PipelineSchedule = _C.schedule.Schedule


def cpu_cache_bytes() -> int:
    """Bytes of free blocks the step cache holds: memory that CPU tensors of
    earlier steps freed, kept for the next steps' tensors
    (``Pipeline(keep_freed_memory)``)."""
    return _C.pipeline.cpu_cache_bytes()


def empty_cpu_cache() -> None:
    """Hands every free block of the step cache back to malloc (like
    ``torch.cuda.empty_cache()`` for the CUDA allocator's cache). Blocks still
    in use go back to the cache when their tensors die."""
    _C.pipeline.empty_cpu_cache()


def schedule(name: str, ranks: int, microbatches: int, chunks: int = 2) -> PipelineSchedule:
    """The named hyperparallel schedule (``1f1b``, ``zb-h1``, ``zbv``,
    ``dualpipev``, ``zb-auto``, ...; ``chunks`` is the virtual stages per rank
    of the interleaved ones): ``hyperparallel.schedule.build`` for the
    Pipeline. The model is cut into ``num_chunks`` consecutive chunks. Any
    other ``Schedule`` (``read_csv``, ``recommend``, your own) runs too."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    for arg, value in (("ranks", ranks), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    return _C.schedule.build(name, ranks, microbatches, chunks=chunks)
