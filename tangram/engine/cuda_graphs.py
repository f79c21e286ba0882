"""CUDA graphs for pure-decode steps: one captured forward per (batch bucket, split bucket), replayed every step.

An eager decode step of an 8B model issues ~1,500 launches from Python and took 35-45 ms on the H100 for a few
requests whose kernels need ~6 ms (reports/engine/README.md), so the engine measured its host, not the
technique. As in vLLM and nano-vllm, a decode step whose batch fits a captured bucket copies its inputs into
static device buffers (one host-to-device copy) and replays the graph, which ends with the logits and, for
greedy sampling, the sampled tokens; steps with prefill chunks stay eager.

What a graph freezes at capture, and how each mode keeps it valid:

* the batch: rows are padded to the bucket (powers of two up to ``max_bs``); a padded row reads and writes one
  token of a scratch page that the scheduler never hands out, so it cannot touch live KV;
* the table width: static ``[max_bs, T, W]`` block tables; a step copies only its rows' used pages, and a step
  needing more than ``W`` pages per table regrows the buffers (the graphs are dropped and recaptured, timed);
* the decode partition: ``aot`` takes one precomputed schedule per (batch bucket, context bucket); context
  buckets whose split maps are equal share one graph (``AotSplitTable.canonical_context``);
  ``static`` (FlashDecoding's num_splits from the longest head) gets its split count from the step's longest
  context rounded up to a power of two, so each (bucket, context bucket) is its own graph: the bucketed-split
  FlashDecoding that graph-captured engines run. ``runtime`` (a host plan per step) is not captured.

``emulate=True`` runs the same static-buffer path without capture (CPU tests): the captured callable is built
once per key and replays read only the static buffers, as a real graph does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tangram.planner import pow2_bucket

MIN_CONTEXT_BUCKET = 1024


def context_bucket(max_len: int) -> int:
    """Power-of-two bucket (>= 1024 tokens) of a step's longest head, the static partition's graph key."""
    return max(MIN_CONTEXT_BUCKET, pow2_bucket(max(1, int(max_len))))


@dataclass
class StaticBuffers:
    """Device inputs and outputs of every decode graph (graphs of smaller buckets use the leading rows)."""

    tokens: torch.Tensor  # [max_bs] int32
    pos: torch.Tensor  # [max_bs] int32 (position of the fed token = lens_after of its sequence - 1)
    tables: torch.Tensor  # [max_bs, T, W] int32
    lens: torch.Tensor  # [max_bs, L, H] int32 (slot order, after this step's token)
    logits: torch.Tensor  # [max_bs, vocab] fp32
    sampled: torch.Tensor | None  # [max_bs] int64 greedy tokens (None: the sampler runs after the replay)

    @property
    def width(self) -> int:
        return int(self.tables.shape[2])


@dataclass
class GraphStats:
    captures: int = 0
    capture_s: float = 0.0
    replays: int = 0
    regrows: int = 0
    keys: list = field(default_factory=list)


class DecodeGraphs:
    """Captured decode forwards of one executor, keyed by (batch bucket, context bucket or 0)."""

    def __init__(self, *, max_bs: int, n_tables: int, num_layers: int, num_kv_heads: int, vocab: int, greedy: bool,
                 device: torch.device, scratch_page: int, width: int,
                 body: Callable[..., tuple], emulate: bool = False, layers_per_graph: int = 0):
        self.max_bs = pow2_bucket(max_bs)
        self.buckets = [1 << i for i in range(self.max_bs.bit_length())]
        self.T, self.L, self.H, self.vocab, self.greedy = n_tables, num_layers, num_kv_heads, vocab, greedy
        self.device = device
        self.scratch = scratch_page
        # body(bufs, bs, ctx_bucket, lo, hi, carry) -> carry: layers [lo, hi) of the forward reading bufs[:bs]; the
        # first piece (carry None) embeds, the last writes bufs.logits[:bs]
        self.body = body
        n = num_layers if layers_per_graph <= 0 else max(1, int(layers_per_graph))
        self.pieces = [(lo, min(lo + n, num_layers)) for lo in range(0, num_layers, n)]
        self.emulate = emulate or device.type != "cuda"
        self.stats = GraphStats()
        self._graphs: dict[tuple[int, int], object] = {}
        self._pool = None
        self.bufs = self._alloc(max(1, int(width)))

    # ------------------------------------------------------------------ buffers
    def _alloc(self, width: int) -> StaticBuffers:
        d, n = self.device, self.max_bs
        return StaticBuffers(
            tokens=torch.zeros(n, dtype=torch.int32, device=d),
            pos=torch.zeros(n, dtype=torch.int32, device=d),
            tables=torch.full((n, self.T, width), self.scratch, dtype=torch.int32, device=d),
            lens=torch.ones((n, self.L, self.H), dtype=torch.int32, device=d),
            logits=torch.zeros((n, self.vocab), dtype=torch.float32, device=d),
            sampled=torch.zeros(n, dtype=torch.long, device=d) if self.greedy else None,
        )

    def _park_rows(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) feed token 0 at position 0 into the scratch page (a padded row, or capture warm-up)."""
        b = self.bufs
        b.tokens[lo:hi] = 0
        b.pos[lo:hi] = 0
        b.tables[lo:hi, :, 0] = self.scratch
        b.lens[lo:hi] = 1

    def bucket(self, batch: int) -> int | None:
        bs = pow2_bucket(batch)
        return bs if bs <= self.max_bs else None

    # ------------------------------------------------------------------ capture
    def _forward(self, bs: int, ctx: int) -> None:
        carry = None
        for lo, hi in self.pieces:
            carry = self.body(self.bufs, bs, ctx, lo, hi, carry)

    def _capture(self, bs: int, ctx: int) -> Callable[[], None]:
        """Capture the step as one graph per piece of layers; the carries between pieces (residual stream, its
        norm, RoPE tables) are allocated inside the shared pool during capture and kept alive with the graphs, so
        each replay writes and reads them at the same addresses."""
        t = time.perf_counter()
        self._park_rows(0, self.max_bs)  # capture runs the forward: keep its KV writes in the scratch page
        if self.emulate:
            self._forward(bs, ctx)  # what a real capture's warm-up does (compiles, fills caches)
            replay = (lambda bs=bs, ctx=ctx: self._forward(bs, ctx))
        else:
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):  # warm-up off the capture: Triton compiles, lazy schedule tables fill
                self._forward(bs, ctx)
                self._forward(bs, ctx)
            torch.cuda.current_stream(self.device).wait_stream(s)
            graphs, carry, carries = [], None, []
            for lo, hi in self.pieces:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool):
                    carry = self.body(self.bufs, bs, ctx, lo, hi, carry)
                if self._pool is None:
                    self._pool = g.pool()
                graphs.append(g)
                carries.append(carry)
            torch.cuda.synchronize(self.device)

            def replay(graphs=graphs, carries=carries):  # carries: referenced so their memory stays theirs
                for g in graphs:
                    g.replay()
            replay.graphs = graphs
        self._graphs[(bs, ctx)] = replay
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t
        self.stats.keys.append((bs, ctx))
        return replay

    def capture(self, keys) -> None:
        """Capture ahead of the run (largest batch first, so smaller graphs reuse its memory pool)."""
        for bs, ctx in sorted(set(keys), reverse=True):
            if (bs, ctx) not in self._graphs:
                self._capture(bs, ctx)

    def _regrow(self, width: int) -> None:
        """A table needs more pages than the static buffers hold: reallocate (next power of two) and drop the
        graphs, which point at the old buffers; they are recaptured on demand."""
        self._graphs.clear()
        self._pool = None
        self.bufs = self._alloc(1 << (int(width) - 1).bit_length())
        self.stats.regrows += 1

    # ------------------------------------------------------------------ step
    def run(self, tokens: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
            ctx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of ``kd = len(tokens)`` rows, every input already on the device (``tables``: their
        ``[kd, T, w]`` block tables): copies into the static buffers, replay; returns the rows' logits
        ``[kd, vocab]`` and greedy tokens ``[kd]`` (None unless greedy), valid until the next replay. A key nobody
        captured ahead is captured first (its time lands in this step), since a capture overwrites the buffers
        with scratch rows."""
        kd = int(tokens.shape[0])
        bs = self.bucket(kd)
        w = tables.shape[2]
        if w > self.bufs.width:
            self._regrow(w)
        graph = self._graphs.get((bs, ctx)) or self._capture(bs, ctx)
        b = self.bufs
        b.tokens[:kd].copy_(tokens)
        b.pos[:kd].copy_(pos)
        b.lens[:kd].copy_(lens)
        b.tables[:kd, :, :w].copy_(tables)
        if kd < bs:
            self._park_rows(kd, bs)
        graph()
        self.stats.replays += 1
        return b.logits[:kd], (b.sampled[:kd] if b.sampled is not None else None)
