"""A small GPT that cuts into pipeline chunks, and the data it trains on.

The same model and data as hyperparallel's C++ reference (hp/models/models.cpp,
hp/models/data.cpp, what ``hp train --model gpt --untied`` trains): every layer
draws its initial values from its own generator seeded by (seed, layer), and
every batch depends only on (seed, step, microbatch), so a chunk built alone
on a rank equals the same layers of the whole model, and both equal the C++
model bit for bit (NOTE [Same values as the C++ GPT]).

    import hyperparallel as hp
    from hyperparallel import models

    config = models.GPTConfig(layers=4, d_model=64, heads=4, seq_len=32)
    sched = hp.pipeline.schedule("zbv", ranks=2, microbatches=8)
    chunks = models.gpt_chunks(config, sched.chunks_of_rank(rank), sched.num_chunks, seed=0)
    data = models.TextDataset(config, microbatch_size=4, seed=0)   # Debian's license texts
    inputs, targets = data.batch(step, sched.num_microbatches)
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

__all__ = [
    "GPTConfig",
    "GPT",
    "gpt_chunks",
    "layer_range",
    "layer_generator",
    "gpt_loss",
    "TextDataset",
    "RandomTokens",
    "DEFAULT_CORPUS",
    "MAX_CORPUS_BYTES",
]

# NOTE [Same values as the C++ GPT]
# hp/models builds each layer in float32 from a CPU generator seeded with
# seed * 1000003 + 7919 * (layer + 1) (mod 2^64), drawing the weights with
# normal_ in the order its modules are constructed, then casts the chunk to
# its dtype. Here the same draws on the same generator (torch.Generator is
# LibTorch's CPUGeneratorImpl) give the same bits. The text batches replay
# the C++ Dataset: std::seed_seq over (seed, step, microbatch), std::mt19937_64
# and libstdc++'s uniform_int_distribution (Lemire's method since GCC 11),
# written out below in Python. A test compares both with `hp peers export`.

DEFAULT_CORPUS = "/usr/share/common-licenses"
"""Where the text comes from when no path is given: the license texts every
Debian system ships (as ``hp train``)."""

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


@dataclass(frozen=True)
class GPTConfig:
    """The shape of the GPT (the C++ ``ModelSpec`` of kind gpt; its defaults)."""

    layers: int = 4  #: transformer blocks
    d_model: int = 64  #: width
    heads: int = 4  #: attention heads
    vocab: int = 256  #: byte-level vocabulary
    seq_len: int = 32  #: tokens per sample
    tied_head: bool = False  #: the head reuses the token embedding (see GPT)
    dtype: torch.dtype = torch.float32  #: float32 or float64

    def check(self) -> None:
        """Raises ValueError naming what to change when the shape is inconsistent."""
        for name in ("layers", "d_model", "heads", "vocab", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"GPTConfig.{name} must be an int, got {type(v).__name__}")
        if self.layers < 1:
            raise ValueError(f"the model needs at least one layer, got layers={self.layers}")
        if self.d_model < 1 or self.heads < 1 or self.d_model % self.heads != 0:
            raise ValueError(
                f"d_model {self.d_model} must be positive and divisible by the number of "
                f"heads {self.heads}"
            )
        if self.vocab < 2 or self.seq_len < 1:
            raise ValueError(
                f"the GPT needs vocab >= 2 and seq_len >= 1, got {self.vocab}, {self.seq_len}"
            )
        if self.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {self.dtype}")

    def activation_shape(self, rows: int) -> Tuple[int, int, int]:
        """What one chunk hands the next for a microbatch of ``rows`` sequences."""
        return (rows, self.seq_len, self.d_model)


def layer_generator(seed: int, layer: int) -> torch.Generator:
    """The CPU generator layer ``layer`` draws its initial values from (layer 0:
    the embedding, 1..L: the blocks, L+1: the final norm and head)."""
    return torch.Generator().manual_seed((seed * 1000003 + 7919 * (layer + 1)) & _MASK64)


def layer_range(total: int, index: int, n: int) -> Tuple[int, int]:
    """Which of ``total`` layers chunk ``index`` of ``n`` holds, ``[begin, end)``:
    as even as possible, earlier chunks take the remainder."""
    base, extra = divmod(total, n)
    begin = index * base + min(index, extra)
    return begin, begin + base + (1 if index < extra else 0)


def _normal(shape: Tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32).normal_(0, std, generator=gen)


def _linear(d_in: int, d_out: int, gen: torch.Generator, std: float) -> nn.Linear:
    lin = nn.utils.skip_init(nn.Linear, d_in, d_out, dtype=torch.float32)  # no global RNG draw
    with torch.no_grad():
        lin.weight.normal_(0.0, std, generator=gen)
        lin.bias.zero_()
    return lin


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an exact-erf GELU MLP."""

    def __init__(self, config: GPTConfig, gen: torch.Generator):
        super().__init__()
        d = config.d_model
        self.heads = config.heads
        self.ln1 = nn.LayerNorm(d, dtype=torch.float32)
        residual_std = 0.02 / math.sqrt(2.0 * config.layers)
        # Drawn in the C++ order: qkv, proj, fc, fc2 (registered ln1, qkv, proj, ln2, fc, fc2).
        self.qkv = _linear(d, 3 * d, gen, 0.02)
        self.proj = _linear(d, d, gen, residual_std)
        self.ln2 = nn.LayerNorm(d, dtype=torch.float32)
        self.fc = _linear(d, 4 * d, gen, 0.02)
        self.fc2 = _linear(4 * d, d, gen, residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        hd = D // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(D, -1)

        def split_heads(t):
            return t.view(B, T, self.heads, hd).transpose(1, 2)

        q, k, v = split_heads(q), split_heads(k), split_heads(v)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = q.matmul(k.transpose(-2, -1)).mul(1.0 / math.sqrt(hd))
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = att.matmul(v).transpose(1, 2).reshape(B, T, D)
        h = x + self.proj(y)
        return h + self.fc2(nn.functional.gelu(self.fc(self.ln2(h))))


class Embed(nn.Module):
    """Token embedding ``wte`` and, in chunk 0, position embedding ``wpe``."""

    def __init__(self, config: GPTConfig, gen: torch.Generator, with_positions: bool):
        super().__init__()
        self.wte = nn.Parameter(_normal((config.vocab, config.d_model), 0.02, gen))
        if with_positions:
            self.wpe = nn.Parameter(_normal((config.seq_len, config.d_model), 0.01, gen))


class Final(nn.Module):
    """The final LayerNorm and, untied, the output head."""

    def __init__(self, config: GPTConfig, gen: torch.Generator):
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model, dtype=torch.float32)
        if not config.tied_head:
            self.head = nn.Parameter(_normal((config.vocab, config.d_model), 0.02, gen))


class GPT(nn.Module):
    """Chunk ``chunk`` of ``num_chunks`` of the GPT (default: the whole model).

    Chunk 0 starts with the token and position embeddings (``embed``), then
    come its blocks (``block{b}``, numbered model-wide), and the last chunk
    ends with the final LayerNorm and the head (``final``), so a chunk's
    ``named_parameters()`` are the model-wide names of the C++ model. Chunk 0
    maps token ids ``(rows, T)`` to activations ``(rows, T, d_model)``; the last
    maps activations to logits ``(rows, T, vocab)``.

    With ``tied_head`` the last chunk holds its own copy of ``embed.wte`` (the
    same initial values): a pipeline must sum the two copies' gradients after
    each step (hyperparallel.pipeline sums only copies of one chunk).
    """

    def __init__(
        self,
        config: GPTConfig = GPTConfig(),
        seed: int = 0,
        *,
        chunk: int = 0,
        num_chunks: int = 1,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(
                f"config must be a hyperparallel.models.GPTConfig, got {type(config).__name__}"
            )
        config.check()
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= _MASK64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        if not (isinstance(num_chunks, int) and isinstance(chunk, int) and 0 <= chunk < num_chunks):
            raise ValueError(f"chunk {chunk!r} of {num_chunks!r} does not exist")
        if num_chunks > config.layers:
            raise ValueError(
                f"cannot cut a GPT with {config.layers} blocks into {num_chunks} chunks: use "
                f"fewer stages or more layers (layers={num_chunks})"
            )
        self.config, self.chunk, self.num_chunks = config, chunk, num_chunks
        self.first, self.last = chunk == 0, chunk == num_chunks - 1
        begin, end = layer_range(config.layers, chunk, num_chunks)
        # Layer ids: 0 embedding, 1..L blocks, L+1 final.
        if self.first or (self.last and config.tied_head):
            self.embed = Embed(config, layer_generator(seed, 0), self.first)
        self.block_ids = list(range(begin, end))
        for b in self.block_ids:
            self.add_module(f"block{b}", Block(config, layer_generator(seed, b + 1)))
        if self.last:
            self.final = Final(config, layer_generator(seed, config.layers + 1))
        self.to(device=device, dtype=config.dtype)

    def blocks(self) -> List[Block]:
        """This chunk's transformer blocks, in order."""
        return [getattr(self, f"block{b}") for b in self.block_ids]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.first:
            h = torch.embedding(self.embed.wte, x) + self.embed.wpe.narrow(0, 0, x.size(1))
        for b in self.block_ids:
            h = getattr(self, f"block{b}")(h)
        if self.last:
            head = self.embed.wte if self.config.tied_head else self.final.head
            h = torch.matmul(self.final.ln(h), head.t())
        return h


def gpt_chunks(
    config: GPTConfig,
    chunks: Iterable[int],
    num_chunks: int,
    seed: int = 0,
    *,
    device: Optional[Union[torch.device, str]] = None,
) -> Dict[int, GPT]:
    """``{c: GPT(config, seed, chunk=c, num_chunks=num_chunks)}`` for each of
    ``chunks`` (e.g. a schedule's ``chunks_of_rank(rank)``), what
    :class:`hyperparallel.pipeline.Pipeline` takes."""
    return {c: GPT(config, seed, chunk=c, num_chunks=num_chunks, device=device) for c in chunks}


def gpt_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against the next tokens, the mean over tokens."""
    return nn.functional.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


# ---------------------------------------------------------------------------
# Data: (seed, step, microbatch) -> batch, as hp/models/data.cpp.
# ---------------------------------------------------------------------------
def _seed_seq(values: List[int], n: int) -> List[int]:
    """std::seed_seq(values).generate into n 32-bit words ([rand.util.seedseq])."""
    out = [0x8B8B8B8B] * n
    s = len(values)
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    m = max(s + 1, n)

    def T(x):
        return x ^ (x >> 27)

    for k in range(m):
        r1 = (1664525 * T(out[k % n] ^ out[(k + p) % n] ^ out[(k - 1) % n])) & _MASK32
        r2 = (r1 + (s if k == 0 else (k % n + values[k - 1]) if k <= s else k % n)) & _MASK32
        out[(k + p) % n] = (out[(k + p) % n] + r1) & _MASK32
        out[(k + q) % n] = (out[(k + q) % n] + r2) & _MASK32
        out[k % n] = r2
    for k in range(m, m + n):
        r3 = (1566083941 * T((out[k % n] + out[(k + p) % n] + out[(k - 1) % n]) & _MASK32))
        r3 &= _MASK32
        r4 = (r3 - k % n) & _MASK32
        out[(k + p) % n] ^= r3
        out[(k + q) % n] ^= r4
        out[k % n] = r4
    return out


def _mix(seed: int, step: int, microbatch: int) -> int:
    """The 64-bit seed of one microbatch (data.cpp's mix)."""
    words = [seed & _MASK32, (seed >> 32) & _MASK32, step & _MASK32, microbatch & _MASK32]
    a, b = _seed_seq(words, 2)
    return (a << 32) | b


class _MT19937_64:
    """std::mt19937_64."""

    N, M = 312, 156

    def __init__(self, seed: int):
        x = [seed & _MASK64]
        for i in range(1, self.N):
            x.append((6364136223846793005 * (x[-1] ^ (x[-1] >> 62)) + i) & _MASK64)
        self.x, self.i = x, self.N

    def _twist(self):
        x, N, M = self.x, self.N, self.M
        upper, lower = 0xFFFFFFFF80000000, 0x7FFFFFFF
        for k in range(N):
            y = (x[k] & upper) | (x[(k + 1) % N] & lower)
            x[k] = x[(k + M) % N] ^ (y >> 1) ^ (0xB5026F5AA96619E9 if y & 1 else 0)
        self.i = 0

    def __call__(self) -> int:
        if self.i >= self.N:
            self._twist()
        y = self.x[self.i]
        self.i += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y


def _uniform_int(rng: _MT19937_64, a: int, b: int) -> int:
    """libstdc++'s std::uniform_int_distribution<int64_t>(a, b)(rng) for a
    64-bit generator (Lemire's nearly divisionless method, GCC >= 11)."""
    r = (b - a + 1) & _MASK64
    product = rng() * r
    low = product & _MASK64
    if low < r:
        threshold = ((-r) & _MASK64) % r
        while low < threshold:
            product = rng() * r
            low = product & _MASK64
    return (product >> 64) + a


MAX_CORPUS_BYTES = 1 << 30
"""The largest text a TextDataset loads (as the C++ trainer's kMaxCorpusBytes):
every rank holds the whole text in memory."""


def _read_corpus(path: Optional[Union[str, os.PathLike]]) -> Tuple[bytes, str]:
    p = os.fspath(path) if path is not None else DEFAULT_CORPUS
    try:
        st = os.stat(p)
    except OSError:
        raise FileNotFoundError(
            f"data path '{p}' does not exist; give a text file or a folder of text files"
        ) from None
    if stat.S_ISDIR(st.st_mode):
        files = []
        for e in os.scandir(p):
            try:
                if stat.S_ISREG(os.stat(e.path).st_mode):
                    files.append(e.name)
            except OSError:
                pass
        files = [os.path.join(p, name) for name in sorted(files)]
        what = f"{len(files)} text files in {p}"
    elif stat.S_ISREG(st.st_mode):
        files, what = [p], p
    else:
        raise ValueError(
            f"data path '{p}' is not a regular file or folder (a device, pipe or socket would "
            "never end); give a text file or a folder of text files"
        )
    if sum(os.stat(f).st_size for f in files) > MAX_CORPUS_BYTES:
        raise ValueError(
            f"the corpus '{p}' holds more than {MAX_CORPUS_BYTES >> 20} MiB of text, the limit "
            "(every rank keeps the whole text in memory); give a smaller file or folder"
        )
    parts, size = [], 0
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read(MAX_CORPUS_BYTES - size + 1)
        size += len(data)
        if size > MAX_CORPUS_BYTES:
            raise ValueError(
                f"the corpus grew past {MAX_CORPUS_BYTES >> 20} MiB while '{f}' was read"
            )
        parts.append(data)
    text = b"".join(parts)
    return text, f"{what} ({len(text) // 1024} KiB)"


class TextDataset:
    """Byte-level windows of a text: microbatch ``(step, mb)`` is ``rows`` windows
    of ``seq_len`` bytes at offsets drawn from (seed, step, mb); the target is
    the window shifted by one byte. ``path``: a text file or a folder of text
    files (read in name order); default :data:`DEFAULT_CORPUS`. The same
    batches as the C++ trainer's."""

    def __init__(
        self,
        config: GPTConfig,
        microbatch_size: int,
        seed: int = 0,
        path: Optional[Union[str, os.PathLike]] = None,
    ):
        if not isinstance(microbatch_size, int) or microbatch_size < 1:
            raise ValueError(f"microbatch_size must be a positive int, got {microbatch_size!r}")
        self.config, self.rows, self.seed = config, microbatch_size, seed
        text, self.description = _read_corpus(path)
        self.corpus_bytes = len(text)  #: bytes of text loaded
        if len(text) <= config.seq_len + 1:
            raise ValueError(
                f"the corpus {self.description} has {len(text)} bytes; it needs more "
                f"than seq_len + 1 = {config.seq_len + 1}"
            )
        self._bytes = torch.frombuffer(bytearray(text), dtype=torch.uint8)

    def get(self, step: int, microbatch: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(input, target)`` of one microbatch, int64 ``(rows, seq_len)`` each."""
        rng = _MT19937_64(_mix(self.seed, step, microbatch))
        T = self.config.seq_len
        last = self.corpus_bytes - T - 2
        offsets = torch.tensor([_uniform_int(rng, 0, last) for _ in range(self.rows)],
                               dtype=torch.int64)
        idx = offsets[:, None] + torch.arange(T + 1)
        window = self._bytes[idx].to(torch.int64) % self.config.vocab
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def batch(self, step: int, microbatches: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every microbatch of ``step`` stacked along dim 0: ``(m * rows, seq_len)``."""
        parts = [self.get(step, k) for k in range(microbatches)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


class RandomTokens:
    """Uniformly random tokens (nothing to learn; for speed runs): the input and
    target of microbatch ``(step, mb)`` come from a generator seeded by
    (seed, step, mb), the target the input shifted by one token."""

    def __init__(self, config: GPTConfig, microbatch_size: int, seed: int = 0):
        if not isinstance(microbatch_size, int) or microbatch_size < 1:
            raise ValueError(f"microbatch_size must be a positive int, got {microbatch_size!r}")
        self.config, self.rows, self.seed = config, microbatch_size, seed
        self.description = f"random tokens (vocab {config.vocab})"

    def get(self, step: int, microbatch: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(_mix(self.seed, step, microbatch))
        shape = (self.rows, self.config.seq_len + 1)
        window = torch.randint(0, self.config.vocab, shape, generator=g)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    batch = TextDataset.batch
