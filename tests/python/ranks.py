"""Ranks as real processes for the multi-process Python tests: each one a
Python script started with torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; one intra-op thread),
the way torchrun starts a user's script."""

import os
import signal
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(p, argv, prefix=None, env=None):
    """Starts p processes of `sys.executable *argv` (argv: the script and its
    arguments) and returns them, their stdout and stderr piped as text.
    prefix(r): a command line that rank r's command is appended to; env:
    variables added to every rank's."""
    port = free_port()
    procs = []
    for r in range(p):
        rank_env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(p), LOCAL_RANK=str(r),
                        LOCAL_WORLD_SIZE=str(p), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        OMP_NUM_THREADS="1", **(env or {}))
        command = [sys.executable, *[str(a) for a in argv]]
        procs.append(subprocess.Popen((prefix(r) if prefix else []) + command, env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=_sigint_as_in_a_terminal))
    return procs


def _sigint_as_in_a_terminal():
    # A shell starts a background job with SIGINT ignored, its children
    # inherit that, and Python then installs no KeyboardInterrupt handler: a
    # test suite started in the background (nohup ... &) saw Ctrl-C to a rank
    # do nothing. Ranks start with SIGINT's default, as torchrun's in a
    # terminal do.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_ranks(procs, timeout=600, check=True):
    """Waits for every process (killing those still running after `timeout`
    seconds each). With check: fails with every failed rank's stderr, else
    returns [(stdout, stderr)]; without: [(returncode, stdout, stderr)]."""
    outs = []
    try:
        for pr in procs:
            outs.append(pr.communicate(timeout=timeout))
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
    if not check:
        return [(pr.returncode, out, err) for pr, (out, err) in zip(procs, outs)]
    failed = [(r, pr.returncode, outs[r]) for r, pr in enumerate(procs) if pr.returncode != 0]
    assert not failed, "\n".join(
        f"rank {r} exit {rc}:\n{out[-2000:]}\n{err[-4000:]}" for r, rc, (out, err) in failed)
    return outs


def run_ranks(p, argv, timeout=600, check=True, prefix=None, env=None):
    """start_ranks, then wait_ranks."""
    return wait_ranks(start_ranks(p, argv, prefix=prefix, env=env), timeout=timeout, check=check)
