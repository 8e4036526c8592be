"""One rank of test_pipeline_faults.py (started with torchrun's variables):
a two-rank Pipeline over a Gloo group, with the default p2p (shared-memory
rings), in which one rank fails or is interrupted while its process lives
on. Every rank prints what happened to it as one line
"rank R: <what> after S s: <message>" on stdout and exits 0 when the line was
printed.

    fault_worker.py raise      rank 0's forward raises in step 1; rank 0
                               catches it and lives on; then step() again
    fault_worker.py raise group  the same over the group's own
                               point-to-point (p2p="group") instead of the rings
    fault_worker.py mismatch   rank 1 is built with 4 microbatches, rank 0 with 2
    fault_worker.py sigint     rank 0's forward sleeps 6 s in step 0 while
                               rank 1 waits for it; the test sends rank 1
                               SIGINT once it printed "rank 1: stepping"
    fault_worker.py badshape   rank 1's activation_shape returns a string
    fault_worker.py stop [group]  rank 0 stops itself (SIGSTOP) in step 1's
                               forward; the test reads rank 1's line, then
                               kills both
    fault_worker.py stop-dp    the same with pp 1 x dp 2: rank 1 waits for
                               it in the data-parallel gradient average
    fault_worker.py stop-ep    the same with pp 1 x ep 2 and an MoE layer
                               (expert_parallel): rank 1 waits for it in
                               the dispatch's all-to-all
    fault_worker.py strided    ZB-H1 with stages that return a strided view
                               (y.t().contiguous().t()); the gradients must
                               equal single-process autograd's
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import hyperparallel as hp


def say(rank, what, t0, message=""):
    print(f"rank {rank}: {what} after {time.monotonic() - t0:.2f} s: {message}".rstrip(), flush=True)


def main():
    scenario = sys.argv[1]
    p2p = sys.argv[2] if len(sys.argv) > 2 else "auto"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if scenario in ("stop-dp", "stop-ep"):
        stop_in_a_group(rank, scenario)
        return
    m = 4 if scenario == "mismatch" and rank == 1 else 2
    sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=m)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4, dtype=torch.float64)
    state = {"step": 0}

    def forward(x):
        if rank == 0 and scenario == "raise" and state["step"] == 1:
            raise ValueError("a bad batch on rank 0")
        if rank == 0 and scenario == "sigint" and state["step"] == 0:
            time.sleep(6)
        if rank == 0 and scenario == "stop" and state["step"] == 1:
            print("rank 0: stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)  # the test ends it
        return lin(x)

    if scenario == "strided":
        strided(rank)
        return
    t0 = time.monotonic()
    try:
        shape = (lambda stage, mb: "2x4") if scenario == "badshape" and rank == 1 else (2, 4)
        pipe = hp.pipeline.Pipeline({rank: forward}, sched, loss_fn=torch.nn.functional.mse_loss,
                                    activation_shape=shape, parameters={rank: list(lin.parameters())},
                                    dtype=torch.float64, timeout=60, p2p=p2p)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        say(rank, "construction failed", t0, str(e).splitlines()[0])
        return
    x = torch.randn(4, 4, dtype=torch.float64)
    for step in range(3):
        state["step"] = step
        if scenario == "sigint" and rank == 1:
            print("rank 1: stepping", flush=True)
        t0 = time.monotonic()
        try:
            pipe.step(x if rank == 0 else None, x if rank == 1 else None)
        except KeyboardInterrupt:
            say(rank, "KeyboardInterrupt", t0)
            break
        except Exception as e:  # noqa: BLE001
            say(rank, "step failed", t0, str(e).splitlines()[0])
            break
    else:
        say(rank, "all steps ran", t0)
        return
    try:
        pipe.step(x if rank == 0 else None, x if rank == 1 else None)
        say(rank, "a step after the failure ran", t0)
    except Exception as e:  # noqa: BLE001
        say(rank, "the next step refused", t0, str(e).splitlines()[0])
    # The process lives on (as a notebook's would) while its peer finishes.
    time.sleep(4)


class Experts(torch.nn.Module):
    """The smallest experts module of transformers' shape (3-D gate_up_proj
    and down_proj, experts(hidden, top_k_index, top_k_weights)), which
    expert_parallel converts."""

    def __init__(self, num_experts=4, hidden=4, inner=4):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.num_experts = num_experts
        self.gate_up_proj = torch.nn.Parameter(
            torch.randn(num_experts, 2 * inner, hidden, generator=g, dtype=torch.float64))
        self.down_proj = torch.nn.Parameter(
            torch.randn(num_experts, hidden, inner, generator=g, dtype=torch.float64))

    def forward(self, h, top_k_index, top_k_weights):
        out = torch.zeros_like(h)
        for e in range(self.num_experts):
            tok, slot = torch.where(top_k_index == e)
            gate, up = (h[tok] @ self.gate_up_proj[e].t()).chunk(2, -1)
            y = (torch.nn.functional.silu(gate) * up) @ self.down_proj[e].t()
            out = out.index_add(0, tok, y * top_k_weights[tok, slot, None])
        return out


def stop_in_a_group(rank, scenario):
    """pp 1 x dp 2 (stop-dp) or pp 1 x ep 2 (stop-ep): rank 0 stops itself
    in step 1's forward; rank 1 waits for it over the data-parallel or the
    expert-parallel group and must fail within seconds, naming it."""
    singles = [dist.new_group([r]) for r in range(2)]
    sched = hp.pipeline.schedule("1f1b", ranks=1, microbatches=2)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4, dtype=torch.float64)
    router = torch.nn.Linear(4, 4, dtype=torch.float64)
    model = torch.nn.ModuleList([lin, router, Experts()])
    if scenario == "stop-ep":
        hp.moe.expert_parallel(model, dist.group.WORLD)
    state = {"step": 0}

    def forward(x):
        if rank == 0 and state["step"] == 1:
            print("rank 0: stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)  # the test ends it
        h = lin(x)
        if scenario == "stop-ep":
            w, idx = torch.topk(torch.softmax(router(h), -1), 2)
            h = h + model[2](h, idx, w)
        return h

    pipe = hp.pipeline.Pipeline({0: forward}, sched, loss_fn=torch.nn.functional.mse_loss,
                                activation_shape=(2, 4), parameters={0: list(model.parameters())},
                                group=singles[rank], dp_group=dist.group.WORLD,
                                dtype=torch.float64, timeout=60)
    x = torch.randn(4, 4, dtype=torch.float64)
    for step in range(3):
        state["step"] = step
        t0 = time.monotonic()
        try:
            pipe.step(x, x)
        except Exception as e:  # noqa: BLE001 - the test reads the message
            say(rank, "step failed", t0, str(e).splitlines()[0])
            time.sleep(60)  # the test ends it
            return
    say(rank, "all steps ran", t0)


def strided(rank):
    t0 = time.monotonic()
    sched = hp.pipeline.schedule("zb-h1", ranks=2, microbatches=2)
    lins = [torch.nn.Linear(4, 4, dtype=torch.float64) for _ in range(2)]
    for c, lin in enumerate(lins):
        torch.manual_seed(c)
        lin.reset_parameters()
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    loss = torch.nn.functional.mse_loss
    # The oracle: plain autograd, the mean loss over the two microbatches.
    ref = sum(loss(lins[1](lins[0](xm)), xm) for xm in x.chunk(2)) / 2
    want = torch.autograd.grad(ref, list(lins[rank].parameters()))
    pipe = hp.pipeline.Pipeline({rank: lambda t: lins[rank](t).t().contiguous().t()}, sched,
                                loss_fn=loss, activation_shape=(2, 4),
                                parameters={rank: list(lins[rank].parameters())},
                                dtype=torch.float64, timeout=60)
    got_loss = pipe.step(x if rank == 0 else None, x if rank == 1 else None)
    err = max((q.grad - g).abs().max().item() for q, g in zip(lins[rank].parameters(), want))
    err = max(err, abs(got_loss - ref.item()))
    say(rank, "strided done", t0, f"max error {err:.3g}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
