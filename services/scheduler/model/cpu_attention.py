"""CPU attention backend: decode attends straight over the paged KV pool with a small C kernel.

The ``torch`` backend (model/attention.py) decodes by gathering every request's whole context out
of the pool into a buffer, then calling SDPA once per request per layer. On a CPU that is two reads
and one write of all the context's K/V, plus a Python loop of tensor ops per request: for a decode
batch of 64 requests that loop alone is thousands of op dispatches per step. Decode is most of an
engine's steps, so this backend replaces exactly that case with one C call per layer that walks
each request's slots in the pool (no gather, no per-request dispatch):

    for each request b, head h (kv head h // group):
        s_j = q[b, h] . K[slot_j, kv] * scale      over b's slots j
        out[b, h] = sum_j softmax(s)_j V[slot_j, kv]

in fp32 throughout (the pool's dtype; other dtypes stay on the torch path; exp by a vectorisable
polynomial, since glibc's expf vectorises only under -ffast-math). Prefill and extend
batches keep the torch path: there SDPA's blocked kernel is already compute-bound and is one call
per request for hundreds of tokens, not per token.

The kernel is compiled on first use with the system C compiler (``cc``, ``-O3 -march=native``) into
``~/.cache/radixserve/kernels`` (keyed by the source, the flags and the CPU's feature flags; written
atomically, as several scheduler processes may compile at once) and loaded with ctypes, which
releases the GIL for the call. No compiler, or a failed build: ``unavailable_reason()`` says why
(logged once) and ``auto`` keeps the torch backend. The kernel runs on one thread: ``auto`` picks
it only when torch itself runs one intra-op thread per process (a scheduler pod pinned to one
core, as the benchmarks run), where it cannot lose parallelism.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import torch

from radixserve.scheduler.model.attention import TorchAttention, TorchMeta
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.policy.batch import ForwardMode

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* A request's rows sit in pages scattered over the pool; the hardware prefetcher does not follow
   the jumps between them (nor across 4 KiB boundaries), so ask for the row AHEAD slots on. */
#define AHEAD 4
static inline void prefetch(const float *r, int64_t n)
{
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(r + i, 0, 3);
}

/* exp(x) for x <= 0 (softmax after subtracting the max), to about 2 ulp: x = n ln2 + r, |r| <=
   ln2 / 2, exp(r) by a degree-6 polynomial, times 2^n. glibc's expf does not vectorize without
   -ffast-math, which would also reorder every sum here. */
static inline float exp_neg(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float e = 1.0f / 720.0f;
    e = e * r + 1.0f / 120.0f;
    e = e * r + 1.0f / 24.0f;
    e = e * r + 1.0f / 6.0f;
    e = e * r + 0.5f;
    e = e * r + 1.0f;
    e = e * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale2n;
    __builtin_memcpy(&scale2n, &bits, 4);
    return e * scale2n;
}

/* One request: q, out [H, D]; query head h reads KV head h / group. Each slot's K row (every KV
   head, KVH * D floats) is read once for all heads, then each V row: the context streams through
   the cache once, page by page. Inlined into call sites with a constant D (loops unroll). */
static inline __attribute__((always_inline)) void attend(
    const float *q, const float *k, const float *v, const int64_t *sl, int64_t n, int64_t H,
    int64_t group, int64_t row, const int64_t D, float scale, float *p, float *out)
{
    for (int64_t j = 0; j < n; j++) {  /* scores: p[h * n + j] */
        if (j + AHEAD < n) prefetch(k + sl[j + AHEAD] * row, row);
        const float *kr = k + sl[j] * row;
        for (int64_t h = 0; h < H; h++) {
            const float *kj = kr + (h / group) * D, *qh = q + h * D;
            float acc = 0.0f;
            #pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; d++) acc += qh[d] * kj[d];
            p[h * n + j] = acc * scale;
        }
    }
    float sum[H];
    for (int64_t h = 0; h < H; h++) {
        float *ph = p + h * n, mh = -INFINITY, s = 0.0f;
        #pragma omp simd reduction(max : mh)
        for (int64_t j = 0; j < n; j++) mh = ph[j] > mh ? ph[j] : mh;
        #pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < n; j++) {
            ph[j] = exp_neg(ph[j] - mh);
            s += ph[j];
        }
        sum[h] = s;
    }
    for (int64_t i = 0; i < H * D; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        if (j + AHEAD < n) prefetch(v + sl[j + AHEAD] * row, row);
        const float *vr = v + sl[j] * row;
        for (int64_t h = 0; h < H; h++) {
            const float *vj = vr + (h / group) * D, w = p[h * n + j];
            float *oh = out + h * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) oh[d] += w * vj[d];
        }
    }
    for (int64_t h = 0; h < H; h++) {
        const float inv = 1.0f / sum[h];
        for (int64_t d = 0; d < D; d++) out[h * D + d] *= inv;
    }
}

/* q: [B, H, D]; k, v: [num_slots, KVH, D]; slots: every request's context, concatenated;
   starts: [B + 1] offsets into slots; out: [B, H, D]. Query head h reads KV head h / (H / KVH).
   Returns 0, or -1 if out of memory. */
int decode_attention_f32(const float *q, const float *k, const float *v, const int64_t *slots,
                         const int64_t *starts, float *out, int64_t B, int64_t H, int64_t KVH,
                         int64_t D, float scale)
{
    const int64_t group = H / KVH, row = KVH * D;
    int64_t longest = 1;
    for (int64_t b = 0; b < B; b++)
        if (starts[b + 1] - starts[b] > longest) longest = starts[b + 1] - starts[b];
    float *p = (float *)malloc(sizeof(float) * H * longest);
    if (!p) return -1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t *sl = slots + starts[b];
        const int64_t n = starts[b + 1] - starts[b];
        const float *qb = q + b * H * D;
        float *ob = out + b * H * D;
        if (D == 64)
            attend(qb, k, v, sl, n, H, group, row, 64, scale, p, ob);
        else if (D == 128)
            attend(qb, k, v, sl, n, H, group, row, 128, scale, p, ob);
        else
            attend(qb, k, v, sl, n, H, group, row, D, scale, p, ob);
    }
    free(p);
    return 0;
}
"""

_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@cache
def _library() -> ctypes.CDLL | str:
    """The compiled kernel, or why there is none (logged once)."""
    lib = _build_and_load()
    if isinstance(lib, str):
        log.warning("cpu attention backend unavailable: %s", lib)
    return lib


def _build_and_load() -> ctypes.CDLL | str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler (cc) on PATH"
    key = hashlib.sha256("\0".join((_SOURCE, *_FLAGS, platform.machine(), _cpu_flags())).encode()).hexdigest()
    out_dir = Path(
        os.environ.get("RADIXSERVE_KERNEL_CACHE", Path.home() / ".cache" / "radixserve" / "kernels")
    )
    lib = out_dir / f"decode_attention-{key[:16]}.so"
    if not lib.exists():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / "decode_attention.c"
                src.write_text(_SOURCE)
                built = Path(tmp) / "kernel.so"
                subprocess.run(
                    [cc, *_FLAGS, str(src), "-o", str(built), "-lm"], check=True, capture_output=True
                )
                os.replace(built, lib)  # atomic: another process may be building the same file
        except (OSError, subprocess.CalledProcessError) as e:
            detail = (
                e.stderr.decode(errors="replace")[-500:]
                if isinstance(e, subprocess.CalledProcessError)
                else e
            )
            return f"building the decode kernel failed: {detail}"
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError as e:
        return f"loading the decode kernel failed: {e}"
    fn = dll.decode_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_float]
    return dll


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the backend can run here, else why not."""
    if device.type != "cpu":
        return f"the cpu backend runs on CPU, not {device.type}"
    if dtype != torch.float32:
        return f"the decode kernel is fp32 only, the KV pool is {dtype}"
    lib = _library()
    return lib if isinstance(lib, str) else None


class CpuAttention(TorchAttention):
    """``TorchAttention`` with decode batches run by the C kernel straight over the pool."""

    name = "cpu"

    def __init__(self, pool, req_to_token, num_heads: int, head_dim: int) -> None:
        super().__init__(pool, req_to_token, num_heads, head_dim)
        why = unavailable_reason(self.device, pool.k[0].dtype)
        if why is not None:
            raise RuntimeError(why)
        lib = _library()
        assert not isinstance(lib, str)
        self._kernel = lib.decode_attention_f32

    def prepare(self, fb: ForwardBatch, rows: np.ndarray) -> None:
        super().prepare(fb, rows)
        if fb.mode is ForwardMode.DECODE:
            meta: TorchMeta = fb.attn
            meta.starts = torch.tensor([0, *(c1 for _, c1 in meta.ctx)], dtype=torch.int64)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch):
        if fb.mode is not ForwardMode.DECODE:
            return super().forward(layer, q, k, v, fb)
        self.pool.write(layer, fb.out_slots, k, v)
        meta: TorchMeta = fb.attn
        q = q.contiguous()
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)
        rc = self._kernel(
            q.data_ptr(),
            kp.data_ptr(),
            vp.data_ptr(),
            meta.slots.data_ptr(),
            meta.starts.data_ptr(),
            out.data_ptr(),
            q.shape[0],
            q.shape[1],
            kp.shape[1],
            q.shape[2],
            self.scale,
        )
        if rc != 0:
            raise MemoryError("decode attention kernel: out of memory")
        return out
