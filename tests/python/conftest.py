"""Shared pytest setup: the package under test and helpers for multi-process tests."""

import os
import sys

import pytest

# The package lives in python/ of the work tree (scripts/setup_python.sh also
# puts it on the environment's path); tests also run from a bare checkout.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank Gloo group of this process (a FileStore rendezvous)."""
    import datetime
    import tempfile

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroupGloo

    path = tempfile.mktemp()
    store = dist.FileStore(path, 1)
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=20)
    backend = ProcessGroupGloo(store, 0, 1, opts)
    pg = dist.ProcessGroup(store, 0, 1)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    yield pg
    if os.path.exists(path):
        os.remove(path)
