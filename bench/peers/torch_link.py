"""PyTorch's pipeline transfers through a modelled link, the one HP_LINK gives
ours (NOTE [The link model] in hp/distributed/link_model.cpp): a send posted
at t leaves when this process's link is free, occupies it bytes /
bandwidth, and is handed to Gloo `latency` later, by one thread per process
that sleeps until then (no CPU), in posting order; receives are posted at
once and complete when the delayed data arrives. Installed by replacing
torch.distributed.pipelining.schedules._batch_p2p, through which every
schedule's sends and receives go (torch 2.11); the stages' one-time shape
handshake and every collective are not delayed.

The link is this module's own, beside our C++ one that the expert
dispatchers pay: the pipeline transfers of PyTorch's side and the
all-to-alls leave through two links where ours share one (a second
interface), which favours PyTorch a little.
"""

from __future__ import annotations

import collections
import threading
import time


class _DelayedSend:
    """A send's Work: posted by the link's thread when it is due."""

    def __init__(self):
        self._posted = threading.Event()
        self._work = None
        self._error = None

    def _set(self, work, error=None):
        self._work, self._error = work, error
        self._posted.set()

    def wait(self, timeout=None):
        self._posted.wait()
        if self._error is not None:
            raise self._error
        return self._work.wait() if timeout is None else self._work.wait(timeout)

    def is_completed(self):
        return self._posted.is_set() and (self._error is not None or self._work.is_completed())


class _Link:
    def __init__(self, latency_s: float, bytes_per_s: float):
        self.latency_s, self.bytes_per_s = latency_s, bytes_per_s
        self.free_at = 0.0
        self.sent = 0
        self.queue = collections.deque()
        self.cv = threading.Condition()
        threading.Thread(target=self._loop, daemon=True, name="torch-link").start()

    def send(self, op):
        import torch.distributed as dist

        n = op.tensor.numel() * op.tensor.element_size()
        work = _DelayedSend()
        with self.cv:
            leave = max(time.monotonic(), self.free_at)
            self.free_at = leave + (n / self.bytes_per_s if self.bytes_per_s > 0 else 0.0)
            self.queue.append((self.free_at + self.latency_s, dist.isend, op, work))
            self.sent += 1
            self.cv.notify()
        return work

    def _loop(self):
        while True:
            with self.cv:
                while not self.queue:
                    self.cv.wait()
                due, post, op, work = self.queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # the head stays the head: due times only grow
            with self.cv:
                self.queue.popleft()
            try:
                work._set(post(op.tensor, group=op.group, group_dst=op.group_peer, tag=op.tag))
            except Exception as e:  # noqa: BLE001 - raised by the send's wait
                work._set(None, e)


_installed = []  # the link, once installed


def sends() -> int:
    """How many sends have paid the link in this process (0: not installed)."""
    return _installed[0].sent if _installed else 0


def install(latency_us: float, gbps: float) -> None:
    """Every later send of torch's pipelining schedules pays the link."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    link = _Link(latency_us * 1e-6, gbps * 1e9)
    _installed.append(link)

    def batch_p2p(p2p_ops, desc=None):
        works = []
        for op in p2p_ops:
            if op.op is dist.isend:
                works.append(link.send(op))
            else:
                works.append(dist.irecv(op.tensor, group=op.group, group_src=op.group_peer,
                                        tag=op.tag))
        return works

    schedules._batch_p2p = batch_p2p
