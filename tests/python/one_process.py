"""The oracle of the multi-process training tests: the whole model trained
in one process with plain autograd, each step the mean over its microbatches
of each one's loss (as a pipeline step is)."""


def train_steps(model, opt, loss_fn, batches, m):
    """Trains `model` one optimizer step per (inputs, labels, attention_mask)
    of `batches`, each cut into `m` microbatches; returns the steps' losses."""
    losses = []
    for x, y, mask in batches:
        opt.zero_grad()
        total = 0.0
        for xm, ym, mm in zip(x.chunk(m), y.chunk(m), mask.chunk(m)):
            loss = loss_fn(model(xm, attention_mask=mm).logits, ym) / m
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
    return losses
