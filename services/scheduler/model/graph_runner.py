"""Decode through static buffers, padded to a few batch sizes: CUDA-graph replay on GPU, a call on CPU.

A decode step of a small model is a few hundred short kernels; launched one by one from Python the
host takes several times longer than the GPU does to run them. A CUDA graph records the whole
forward once per batch size and replays it with one launch. Graphs read fixed addresses and have
fixed shapes, so:

* batch sizes are rounded up to a bucket (``decode_buckets``: 1, 2, 4, 8, then every 8 up to
  ``max_bs``); a batch above ``max_bs`` runs eagerly;
* the step's inputs (token ids, positions, KV write slots) are copied into static buffers that
  the graph reads; the padding rows get id 0, position 0 and the scratch KV slot 0, and attention
  metadata that names ``ReqToTokenPool.scratch_row`` (a one-token context no request owns); their
  sampled tokens go to the FutureMap's discard entry and their logits are sliced off;
* attention metadata lives in the backend's fixed buffers (flashinfer's CUDA-graph decode
  wrappers, one per bucket), refreshed by ``backend.plan_graph(fb)`` on the device stream right
  before the replay, so it is ordered after the step before it;
* the FutureMap placeholders are resolved before the copy into the static buffers, so a graph
  never depends on which step fed it.

Everything but the capture itself is device-neutral: on CPU (``capture=False``) ``run`` fills the
same static buffers and calls the same forward eagerly on the padded batch, which is how the CPU
tests prove that padding, bucketing and the static buffers give the same tokens as the dynamic path.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.model.attention import AttentionBackend, GraphAttentionBackend
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.model.linear_attention import LinearStep

if TYPE_CHECKING:
    from radixserve.scheduler.memory.state_pool import StatePool
    from radixserve.scheduler.model.linear_kernels import DeltaRule
    from radixserve.scheduler.model.llama import CausalLM, ModelOutput

log = logging.getLogger(__name__)


def decode_buckets(max_bs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then multiples of 8, ending with ``max_bs`` itself."""
    if max_bs < 1:
        return []
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8))
    return [*sizes, max_bs]


class DecodeGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        device: torch.device,
        max_bs: int,
        capture: bool,
        linear: tuple[StatePool, DeltaRule] | None = None,
    ) -> None:
        """``max_bs`` 0 turns the static path off (every decode runs eagerly, unpadded). ``linear``: a
        hybrid model's state pool and delta-rule kernels (its rows' state slots get a static buffer)."""
        self.model = model
        self.backend = backend
        self.device = device
        self.buckets = decode_buckets(max_bs)
        self.enabled = bool(self.buckets)
        self.capture_graphs = capture and self.enabled
        n = max(self.buckets, default=0)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_slots = torch.zeros(n, dtype=torch.int64, device=device)  # 0: the scratch slot
        self.linear = linear
        self.state_slots = torch.zeros(n, dtype=torch.int64, device=device)  # hybrid: rows' state slots
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by the backend's graph key
        self.logits: torch.Tensor | None = None  # [max_bs, vocab]: every graph's output (capture)
        # counters (tests, benchmarks): graph replays, eager static runs (CPU), batches that were padded
        self.replays = self.eager_static = self.padded = 0

    def bucket_for(self, batch_size: int) -> int | None:
        """The padded size a decode batch of ``batch_size`` runs at, or None: run it eagerly."""
        if not self.enabled or batch_size > self.buckets[-1] or (self.capture_graphs and not self.graphs):
            return None  # (graphs on but not captured yet: eager)
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    def _static_batch(self, bucket: int, attn: object) -> ForwardBatch:
        ones = np.ones(bucket, dtype=np.int64)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            out_slots=self.out_slots[:bucket],
            prefix_lens=ones * 0,
            extend_lens=ones,
            future_out=self.out_slots[:0],
            sampling=None,
            attn=attn,
            linear=None if self.linear is None else LinearStep(*self.linear, self.state_slots[:bucket]),
        )

    def _forward(self, bucket: int, attn: object) -> torch.Tensor:
        fb = self._static_batch(bucket, attn)
        out: ModelOutput = self.model(fb.input_ids, fb.positions, fb, self.backend)
        return out.logits

    def run(self, fb: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [real batch, vocab] of a decode batch padded to ``fb.graph_bucket``; ``input_ids``
        are its ids with FutureMap placeholders already resolved."""
        bucket = fb.graph_bucket
        assert bucket is not None and len(fb.input_ids) == bucket
        self.padded += bucket != fb.real_size
        self.input_ids[:bucket].copy_(input_ids)
        self.positions[:bucket].copy_(fb.positions)
        self.out_slots[:bucket].copy_(fb.out_slots)
        if fb.linear is not None:
            self.state_slots[:bucket].copy_(fb.linear.slots)
        if self.capture_graphs:
            key = cast(GraphAttentionBackend, self.backend).plan_graph(fb)
            self.graphs[key].replay()
            self.replays += 1
            assert self.logits is not None
            out = self.logits[:bucket]
        else:
            out = self._forward(bucket, fb.attn)
            self.eager_static += 1
        return out[: fb.num_real]

    def capture(self) -> float:
        """Record one graph per bucket (and per backend variant); returns the seconds it took."""
        if not self.capture_graphs:
            return 0.0
        t0 = time.perf_counter()
        # Every object alive now (the model, the tokenizer, the libraries' modules) is moved out of
        # the collector's generations for the capture: ``torch.cuda.graph`` may collect on entry
        # (torch's force_cudagraph_gc), and the capture's own allocations start automatic
        # collections, each of which would otherwise scan all of them again (SGLang freezes too).
        frozen_before = gc.get_freeze_count()
        gc.freeze()
        try:
            self._capture_all()
        finally:
            if not frozen_before:  # a freeze made before ours (by a server that forks) stays
                gc.unfreeze()
        took = time.perf_counter() - t0
        log.info(
            "captured %d decode graphs (batch sizes %s) in %.1f s, collector frozen",
            len(self.graphs), self.buckets, took,
        )  # fmt: skip
        return took

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        # Every graph writes its logits into this one buffer (graphs replay one at a time, and each
        # step's sampling reads them before the next replay): one [max_bs, vocab] float32 block for
        # all buckets instead of one per graph in the shared pool.
        vocab = self.model.config.vocab_size
        self.logits = torch.empty(self.buckets[-1], vocab, dtype=torch.float32, device=self.device)
        # Largest first: later (smaller) graphs reuse the shared pool's blocks.
        for bucket in reversed(self.buckets):
            for key, attn in cast(GraphAttentionBackend, self.backend).graph_variants(bucket):
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up: lazy inits and allocator state outside the capture
                        self._forward(bucket, attn)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side):
                    self.logits[:bucket].copy_(self._forward(bucket, attn))
                self.graphs[key] = graph
        torch.cuda.synchronize(self.device)


def pad_rows(arrays: dict[str, np.ndarray], bucket: int, pad_values: dict[str, int]) -> dict[str, np.ndarray]:
    """Host arrays of a decode batch padded to ``bucket`` rows with each array's pad value."""
    out = {}
    for name, a in arrays.items():
        padded = np.full(bucket, pad_values[name], dtype=a.dtype)
        padded[: len(a)] = a
        out[name] = padded
    return out
