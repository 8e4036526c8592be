"""hyperparallel.pipeline: train your own ``nn.Module`` stages with any
hyperparallel schedule, on the C++ executor over your ``torch.distributed``
group (the usage is in runtime.py's docstring and docs/python.md).

One job per file:

* ``runtime.py``: :class:`Pipeline`, one rank's part of the pipeline, and its ``step``;
* ``stage_forward.py``: a chunk's forward as the runtime calls it, with the
  step's keyword arguments;
* ``chunk_pairs.py``: chunks that run their FB pairs themselves (DualPipe's
  ``overlapped_forward_backward``), and ``run_backward`` for them;
* ``transfers.py``: what one stage hands the next: a tensor or structure as a message;
* ``fsdp2.py``: FSDP2 (``fully_shard``) modules inside the chunks;
* ``checks.py``: what the ranks check before they run, and how they agree on it;
* ``training_mesh.py``: the process groups of pp x dp x ep, laid out as ``hp train`` does;
* ``helpers.py``: ``schedule``, ``PipelineSchedule``, the step cache's memory.

The auxiliary losses (``add_loss``, ``collect_losses``) live in
``hyperparallel/losses.py``, outside this package, so that the model code
that adds them (split_model.py, router_losses.py) never imports the runtime;
they are re-exported here, as are ``split_model`` and ``moe_aux_losses``.
"""

from __future__ import annotations

from ..losses import _LossOfMicrobatch, add_loss, collect_losses  # noqa: F401  (bench uses it)
from ..meta_init import materialize  # a meta-built transformers model made real
from ..pretrained import load_checkpoint, load_pretrained, save_checkpoint, save_pretrained
from ..router_losses import moe_aux_losses  # a transformers MoE's router loss, pipelined
from ..split_model import split_model  # cutting one model into chunks
from .helpers import PipelineSchedule, cpu_cache_bytes, empty_cpu_cache, schedule
from .training_mesh import TrainingMesh, mesh, mesh_shape
from .runtime import OVERLAP_F_B, Pipeline
from .chunk_pairs import run_backward
from .transfers import _from_message, _to_message  # noqa: F401  (tests call them)

__all__ = ["PipelineSchedule", "schedule", "Pipeline", "OVERLAP_F_B", "run_backward", "add_loss", "collect_losses",
           "cpu_cache_bytes", "empty_cpu_cache",
           "split_model", "materialize", "moe_aux_losses", "load_pretrained", "save_pretrained",
           "save_checkpoint", "load_checkpoint", "mesh", "mesh_shape", "TrainingMesh"]
