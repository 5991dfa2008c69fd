"""FlashInfer attention backend (CUDA only): paged prefill/extend and decode straight over the KVPool.

Same two-phase contract as every backend (model/attention/__init__.py):

* ``prepare(fb, rows)`` on the scheduler thread builds flashinfer's CSR page table for the step:
  ``kv_indptr`` and ``kv_last_page_len`` on the host from the sequence lengths (B numbers), and
  ``kv_indices`` on the device, gathered from the ReqToTokenPool's device mirror with a few
  vectorised ops (``ReqToTokenPool.page_indices``; the rows and indptr arrive in the step's one
  staged copy, ``host_arrays``), so no page list crosses the bus and no Python loop runs per
  request. It then calls the wrapper's ``plan`` once for the step (every layer reuses it). A
  decode batch padded for a CUDA graph is planned later, on the device stream, into that bucket's
  fixed-buffer wrapper (``plan_graph``, called by model/graph_runner.py right before the replay).
* ``forward(layer, q, k, v, fb)`` on the device stream scatters the new tokens' K/V into the pool at
  ``fb.out_slots`` and then calls the planned wrapper's ``run`` over that layer's paged cache.

KV layout. ``KVPool.k[layer]`` is ``[num_slots, Hkv, D]`` with ``num_slots = (num_pages + 1) *
page_size`` and slot ``s = page * page_size + offset``; viewed as ``[num_pages + 1, page_size, Hkv,
D]`` it is flashinfer's "NHD" paged layout, passed as the ``(k_cache, v_cache)`` tuple. A request's
token ``i`` sits at offset ``i % page_size`` of its ``i // page_size``-th page (the allocator fills
pages in order and the radix cache shares whole pages), so its page list is
``host[row, 0:seq_len:page_size] // page_size`` and its last page holds
``seq_len - (num_pages - 1) * page_size`` tokens.

Wrappers. EXTEND (prefill, cached-prefix extend, prefill chunks) uses
``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``: ``qo_indptr`` from ``extend_lens``
and the KV over the whole sequence (prefix + the new tokens, written before ``run``). flashinfer
aligns the causal mask bottom-right (query ``i`` of ``n`` sees keys ``0 .. kv_len - n + i``), which
is exactly "the prefix plus the new tokens up to itself". DECODE uses
``BatchDecodeWithPagedKVCacheWrapper``: its CUDA-core kernel is the fast one for small GQA groups but
is compiled only for group sizes 1, 2, 3, 4 and 8, so for groups above 4 we build it with
``use_tensor_cores=True`` (the FA2 prefill kernel with one query row per request, any group size,
faster for big groups). The prefill wrapper with qo length 1 would also do, but would lose the
decode kernel's split-KV tuning for long contexts at small batch.

Plan and the device (why there are two wrapper sets). ``plan`` does its scheduling on the host from
the CPU int32 tensors we pass (``.to("cpu")`` inside it is a no-op on them) and does NOT synchronize
the device: it enqueues non-blocking host-to-device copies (the page table, indptr, last-page
lengths, and the plan's own int workspace from a pinned staging buffer) on the calling thread's
current stream. In the overlap loop (scheduler/event_loop.py) the scheduler thread's stream is the
default stream and the step runs on a side stream that first ``wait_stream``s the default one, so
step N+1's metadata lands before its kernels. Those copies are not ordered after step N, which may
still be running on the side stream, and each wrapper reuses its int workspace, pinned staging buffer
and length buffer on every plan. So plans alternate between ``num_plan_sets`` wrapper sets (2 by
default): plan N+1 fills set (N+1) % 2 while step N reads set N % 2; set N % 2 is planned again only
at step N+2, after the loop has read step N's results (the loop keeps at most one step in flight
while it prepares the next; raise ``num_plan_sets`` if that ever changes). The float workspace (the
split-KV partial outputs) is written and read only by kernels, all on one stream, so one buffer is
shared by every wrapper. The first plan of each (dtype, head_dim, kernel) JIT-compiles flashinfer
kernels (minutes) unless flashinfer's prebuilt kernels cover it.

flashinfer is imported lazily (in ``__init__`` and ``unsupported_reason``), so importing radixserve
never needs it. Written against the flashinfer-python 0.6 / 0.7 wrapper API; every optional plan
argument is passed by keyword (positional use is deprecated there).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.forward_batch import ForwardBatch

WORKSPACE_BYTES = 128 * 1024 * 1024  # float workspace (split-KV partials), flashinfer's recommended size
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # the FA2/FA3 kernels have no fp32 variant
# The FA2 prefill kernels are correct only for head dims that are multiples of 64 (flashinfer issue
# #4299: others give illegal memory accesses or silently wrong results); these are the ones it ships.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_CUDA_CORE_DECODE_GROUP = 4  # GQA groups above this decode on tensor cores


def unsupported_reason(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    flashinfer: ModuleType | None = None,
) -> str | None:
    """Why the flashinfer backend cannot serve this model here, or None if it can."""
    if device.type != "cuda":
        return "the flashinfer backend needs a CUDA device"
    if dtype not in SUPPORTED_DTYPES:
        return f"flashinfer attention needs float16 or bfloat16, not {dtype}"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"flashinfer attention supports head_dim {SUPPORTED_HEAD_DIMS}, not {head_dim}"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    if flashinfer is not None:  # a module handed in (the CPU tests' stand-in)
        return None
    try:
        importlib.import_module("flashinfer")
    except Exception as e:  # ImportError, or a broken install (CUDA / torch mismatch)
        return f"flashinfer does not import: {e!r}"
    return None


@dataclass(slots=True)
class _FlashInferMeta:
    wrapper: Any  # the wrapper planned for this step (prefill or decode); None: a graph step, planned later
    plan_set: int  # which wrapper set; -1: a CUDA-graph wrapper (graph_variants / plan_graph)
    plan_id: int  # that set's plan counter at planning time: a stale ForwardBatch is caught in forward
    graph_inputs: tuple[torch.Tensor, ...] | None = None  # (indptr, indices, last_page_len) for plan_graph


class FlashInferAttention:
    name = "flashinfer"
    reads_device_table = True  # page lists are gathered from the ReqToTokenPool's device mirror

    def __init__(
        self,
        pool: KVPool,
        req_to_token: ReqToTokenPool,
        num_heads: int,
        head_dim: int,
        page_size: int = 1,
        num_kv_heads: int | None = None,
        *,
        prefill_backend: str = "fa2",
        decode_tensor_cores: bool | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        num_plan_sets: int = 2,
        check_layout: bool = False,
        flashinfer: ModuleType | None = None,
    ) -> None:
        """``prefill_backend``: "fa2" (default, as SGLang's paged wrappers; one kernel family for
        prefill and tensor-core decode, the fewest JIT builds), "fa3" or "auto" (FA3 on Hopper).
        ``decode_tensor_cores``: None picks by GQA group size. ``check_layout``: verify in
        ``prepare`` that every row is page structured (tests; costs host time per step).
        ``flashinfer``: the module to call (None: imported); the CPU tests pass a stand-in."""
        k0 = pool.k[0]
        num_kv_heads = int(k0.shape[1]) if num_kv_heads is None else num_kv_heads
        if tuple(k0.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"KV pool is {tuple(k0.shape)}, expected [slots, {num_kv_heads}, {head_dim}]")
        reason = unsupported_reason(k0.device, k0.dtype, num_heads, num_kv_heads, head_dim, flashinfer)
        if reason is not None:
            raise ValueError(reason)
        if page_size < 1 or k0.shape[0] % page_size:
            raise ValueError(f"pool of {k0.shape[0]} slots is not whole pages of {page_size}")
        if num_plan_sets < 2:
            raise ValueError("num_plan_sets must be >= 2 (a step may run while the next is planned)")
        fi = flashinfer if flashinfer is not None else importlib.import_module("flashinfer")
        self.fi = fi
        self.pool = pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.scale = head_dim**-0.5
        self.dtype = k0.dtype
        self.device = k0.device
        self.check_layout = check_layout
        self.prefill_backend = (
            prefill_backend  # also the tensor-core decode's ("auto" would pick FA3 on Hopper)
        )
        self.flashinfer_version = str(getattr(fi, "__version__", "unknown"))
        group = num_heads // num_kv_heads
        if decode_tensor_cores is None:
            decode_tensor_cores = group > MAX_CUDA_CORE_DECODE_GROUP
        self.decode_tensor_cores = decode_tensor_cores
        # Zeroed once: flashinfer asks for a zero-initialised float workspace before its first use.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._sets = [
            (
                fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=prefill_backend),
                fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=decode_tensor_cores, backend=prefill_backend
                ),
            )
            for _ in range(num_plan_sets)
        ]
        self._plan_ids = [0] * num_plan_sets
        self._next_set = 0

    # ------------------------------------------------------------ scheduler thread
    def host_arrays(self, rows: np.ndarray, seq_lens: np.ndarray) -> dict[str, np.ndarray]:
        """What ``prepare`` needs on the device, sent in the step's one host->device copy: the rows
        and the CSR page offsets (host arithmetic on B numbers); the page lists themselves are
        gathered on the device from the table's mirror (``ReqToTokenPool.page_indices``)."""
        seq = np.asarray(seq_lens, dtype=np.int64)
        if len(seq) == 0 or seq.min() < 1:
            raise ValueError("every request of a step holds at least one token")
        num_pages = (seq + self.page_size - 1) // self.page_size
        indptr = np.zeros(len(seq) + 1, dtype=np.int64)
        np.cumsum(num_pages, out=indptr[1:])
        return {"rows": np.asarray(rows, dtype=np.int64), "kv_indptr": indptr}

    def _check_rows(self, rows: np.ndarray, seq_lens: np.ndarray) -> None:
        host, ps = self.req_to_token.host, self.page_size
        for r, s in zip(rows.tolist(), seq_lens.tolist(), strict=True):
            slots = host[r, :s].astype(np.int64)
            first = slots[::ps]
            expect = np.repeat(first, ps)[:s] + np.arange(s) % ps
            if (first % ps).any() or not np.array_equal(slots, expect):
                raise AssertionError(f"row {r} is not page structured (page size {ps}): {slots.tolist()}")

    def prepare(self, fb: ForwardBatch, rows: np.ndarray) -> None:
        rows = np.asarray(rows, dtype=np.int64)
        seq = np.asarray(fb.prefix_lens, dtype=np.int64) + np.asarray(fb.extend_lens, dtype=np.int64)
        if self.check_layout:
            self._check_rows(rows, seq)
        if "kv_indptr" not in fb.staged:
            # A caller that did not stage: kernel tests and benchmarks that build a ForwardBatch by
            # hand and may have written the host table directly, so the mirror is refreshed whole
            # (slow, exact). Serving never comes here: ModelRunner.load stages every step's arrays
            # with the table's pending writes in its one pinned non-blocking copy (a CPU test holds
            # that). So these copies stay plain blocking ones, and the GPU test that prepare never
            # waits for the device stages its batch first, as serving does, instead of timing this.
            table = self.req_to_token
            table.device_table = torch.from_numpy(table.host).to(self.device)
            fb.staged_host = self.host_arrays(rows, seq)
            fb.staged = {k: torch.from_numpy(v).to(self.device) for k, v in fb.staged_host.items()}
        indptr = fb.staged_host["kv_indptr"]
        num_pages = np.diff(indptr)
        last_page_len = torch.from_numpy((seq - (num_pages - 1) * self.page_size).astype(np.int32))
        indices = self.req_to_token.page_indices(
            fb.staged["rows"], fb.staged["kv_indptr"], int(indptr[-1]), self.page_size
        )
        indptr32 = torch.from_numpy(indptr.astype(np.int32))
        if fb.graph_bucket is not None:  # planned on the device stream right before the replay
            fb.attn = _FlashInferMeta(None, -1, 0, (indptr32, indices, last_page_len))
            return
        idx = self._next_set
        self._next_set = (idx + 1) % len(self._sets)
        prefill, decode = self._sets[idx]
        # indptr / last_page_len on the host on purpose: plan schedules from them there.
        if fb.mode is ForwardMode.DECODE:
            decode.plan(indptr32, indices, last_page_len, *self._shape(), **self._plan_args())
            wrapper = decode
        else:
            qo_indptr = np.zeros(len(seq) + 1, dtype=np.int32)
            np.cumsum(fb.extend_lens, out=qo_indptr[1:])
            prefill.plan(
                torch.from_numpy(qo_indptr),
                indptr32,
                indices,
                last_page_len,
                *self._shape(),
                causal=True,
                **self._plan_args(),
            )
            wrapper = prefill
        self._plan_ids[idx] += 1
        fb.attn = _FlashInferMeta(wrapper, idx, self._plan_ids[idx])

    def _shape(self) -> tuple[int, int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim, self.page_size

    def _plan_args(self) -> dict[str, object]:
        return dict(
            pos_encoding_mode="NONE",  # RoPE is applied by the model
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            non_blocking=True,
        )

    # ------------------------------------------------------------ CUDA graphs (graph_runner.py)
    def init_graphs(self, buckets: list[int], max_pages_per_request: int) -> None:
        """One CUDA-graph decode wrapper per bucket, over fixed index buffers sized for the largest:
        a wrapper in graph mode keeps its batch size for life."""
        fi = self.fi
        n = max(buckets)
        self._graph_indptr = torch.zeros(n + 1, dtype=torch.int32, device=self.device)
        self._graph_last = torch.ones(n, dtype=torch.int32, device=self.device)
        self._graph_indices = torch.zeros(n * max_pages_per_request, dtype=torch.int32, device=self.device)
        self._graph_wrappers = {
            b: fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.decode_tensor_cores,
                backend=self.prefill_backend,
                paged_kv_indptr_buffer=self._graph_indptr[: b + 1],
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=self._graph_last[:b],
            )
            for b in buckets
        }
        self._graph_planned: dict[int, torch.cuda.Event] = {}

    def graph_variants(self, bucket: int) -> list[tuple[int, object]]:
        """(graph key, metadata) to capture for ``bucket``: its wrapper, planned for a batch of
        scratch-only entries (one page each) so the capture runs on valid metadata."""
        wrapper = self._graph_wrappers[bucket]
        wrapper.plan(
            torch.arange(bucket + 1, dtype=torch.int32),
            torch.zeros(bucket, dtype=torch.int32, device=self.device),
            torch.ones(bucket, dtype=torch.int32),
            *self._shape(),
            **self._plan_args(),
        )
        return [(bucket, _FlashInferMeta(wrapper, -1, 0))]

    def plan_graph(self, fb: ForwardBatch) -> int:
        """Refresh the bucket's fixed buffers for this step, on the current (device) stream; returns
        the graph key to replay. A wrapper's pinned plan buffer is refilled only after the copy of
        its previous plan has run."""
        bucket = fb.graph_bucket
        assert bucket is not None and isinstance(fb.attn, _FlashInferMeta) and fb.attn.graph_inputs
        done = self._graph_planned.get(bucket)
        if done is not None:
            done.synchronize()
        indptr, indices, last_page_len = fb.attn.graph_inputs
        self._graph_wrappers[bucket].plan(indptr, indices, last_page_len, *self._shape(), **self._plan_args())
        event = torch.cuda.Event()
        event.record()
        self._graph_planned[bucket] = event
        return bucket

    # ---------------------------------------------------------------- device stream
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H * D]."""
        meta = fb.attn
        if not isinstance(meta, _FlashInferMeta) or meta.wrapper is None:
            raise RuntimeError("ForwardBatch was not prepared by the flashinfer backend")
        if meta.plan_set >= 0 and self._plan_ids[meta.plan_set] != meta.plan_id:
            raise RuntimeError(
                "stale ForwardBatch: its plan was overwritten by a later prepare "
                f"(more than {len(self._sets) - 1} step(s) prepared ahead; raise num_plan_sets)"
            )
        self.pool.write(layer, fb.out_slots, k, v)
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        paged = (self.pool.k[layer].view(shape), self.pool.v[layer].view(shape))
        out: torch.Tensor = meta.wrapper.run(q.contiguous(), paged)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
