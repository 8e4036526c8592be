"""hyperparallel: pipeline parallelism at close to zero bubble, for PyTorch.

The C++ core (hyperparallel._C) is built against one torch version; importing
the package with another torch installed is an ImportError that says which
versions differ and how to fix it, never a crash while loading the extension.
"""

from __future__ import annotations

import torch

# NOTE [Which torch]
# _C links against the libraries of the torch it was built with; loaded into
# a process whose torch differs (another version, another build) it fails with
# undefined symbols or worse. So the versions are compared first, in Python.
try:
    from . import _build_info
except ImportError as e:  # a source tree that was never built
    raise ImportError(
        "hyperparallel's C++ extension has not been built in this tree: run "
        "`bash scripts/build.sh` (the project's environment) or "
        "`pip install --no-build-isolation .` (yours)"
    ) from e


def _base(version: str) -> str:
    return version.split("+")[0]


def check_torch_version(found: str, built: str) -> None:
    """Raises ImportError unless torch `found` is the version `built` against."""
    if _base(found) != _base(built):
        raise ImportError(
            f"hyperparallel was built against torch {built} but this environment has "
            f"torch {found}. Install the torch it was built for (pip install "
            f"torch=={_base(built)}) or rebuild hyperparallel against this one (pip install "
            f"--no-build-isolation . ; the project pins torch {_build_info.torch_pinned} in "
            f"requirements.txt)."
        )


check_torch_version(torch.__version__, _build_info.torch_version)

from . import _C  # noqa: E402

__version__ = "0.2.0"
__all__ = ["__version__", "check_torch_version"]

# The dx/dw split and recompute (split.py, recompute.py); the drop-in stage for
# torch.distributed.pipelining is `hyperparallel.pipelining` (imported on use:
# it imports torch.distributed.pipelining, about two seconds).
from .split import GradFunction, forward_and_gradfn  # noqa: E402
from . import recompute  # noqa: E402

__all__ += ["forward_and_gradfn", "GradFunction", "recompute"]

from . import pipeline  # noqa: E402,F401  the runtime over a torch.distributed group
from . import moe  # noqa: E402,F401  expert parallelism (hp/moe)

# Schedules as data and their export to torch.distributed.pipelining
# (schedule.py, torch_export.py; the export imports torch's pipelining on use).
from . import schedule, torch_export  # noqa: E402

__all__ += ["schedule", "torch_export"]
from . import profile  # noqa: E402,F401  measured costs, predicted schedules (profile.py)
