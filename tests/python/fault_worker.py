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
