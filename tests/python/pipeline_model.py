"""The small float64 model of the Python runtime tests, cut into chunks: each
chunk is a linear layer and tanh (the last one without tanh), initialised
from its own seed, so a chunk built alone on a rank equals the same chunk of
the whole model."""

import torch

D, MB, STEPS, LR = 6, 3, 2, 0.05


def make_chunk(c: int, num_chunks: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(1000 + c)
    lin = torch.nn.Linear(D, D, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(D, D, generator=g, dtype=torch.float64) / D**0.5)
        lin.bias.copy_(torch.randn(D, generator=g, dtype=torch.float64) * 0.1)
    return lin if c == num_chunks - 1 else torch.nn.Sequential(lin, torch.nn.Tanh())


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def batch(step: int, m: int):
    g = torch.Generator().manual_seed(77 + step)
    x = torch.randn(m * MB, D, generator=g, dtype=torch.float64)
    y = torch.randn(m * MB, D, generator=g, dtype=torch.float64)
    return x, y


def microbatches(name: str, p: int) -> int:
    if name == "dualpipe":
        return 2 * p
    if name == "dualpipev":
        return 2 * p + 2
    return 2 * p


def train_single_process(chunks, batch_of, m: int, steps: int, lr: float, loss_of):
    """The oracle of the pipeline tests: `chunks` (modules, in order) trained
    as one model in one process, the mean loss over the m microbatches of each
    step's batch_of(step, m) (gradient accumulation), SGD at lr. Returns (the
    step losses, {chunk index: its parameters})."""
    params = [q for c in chunks for q in c.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch_of(step, m)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            h = xm
            for c in chunks:
                h = c(h)
            loss = loss_of(h, ym) / m
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
    return losses, {k: [q.detach().clone() for q in c.parameters()] for k, c in enumerate(chunks)}


def reference(num_chunks: int, m: int):
    """Single-process training of the whole model: gradient accumulation over
    the microbatches (mean loss), SGD. Returns (losses, chunk parameters)."""
    chunks = [make_chunk(c, num_chunks) for c in range(num_chunks)]
    return train_single_process(chunks, batch, m, STEPS, LR, loss_fn)
