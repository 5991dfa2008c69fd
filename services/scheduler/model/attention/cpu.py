"""CPU attention backend: decode attends straight over the paged KV pool with a small C kernel.

The ``torch`` backend (attention/torch_ref.py) decodes by gathering every request's whole context out
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

The kernel (``decode_attention.c`` beside this file) is compiled on first use with the system C
compiler (``cc``, ``-O3 -march=native``) into ``~/.cache/radixserve/kernels`` (keyed by the
source, the flags and the CPU's feature flags; written atomically, as several scheduler processes
may compile at once) and loaded with ctypes, which
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
from typing import cast

import numpy as np
import torch

from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.attention.torch_ref import TorchAttention, TorchMeta
from radixserve.scheduler.model.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

_SOURCE_FILE = Path(__file__).with_name("decode_attention.c")

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
    source = _SOURCE_FILE.read_text()
    key = hashlib.sha256("\0".join((source, *_FLAGS, platform.machine(), _cpu_flags())).encode()).hexdigest()
    out_dir = Path(
        os.environ.get("RADIXSERVE_KERNEL_CACHE", Path.home() / ".cache" / "radixserve" / "kernels")
    )
    lib = out_dir / f"decode_attention-{key[:16]}.so"
    if not lib.exists():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / "decode_attention.c"
                src.write_text(source)
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

    def __init__(self, pool: KVPool, req_to_token: ReqToTokenPool, num_heads: int, head_dim: int) -> None:
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
            meta = cast(TorchMeta, fb.attn)
            meta.starts = torch.tensor([0, *(c1 for _, c1 in meta.ctx)], dtype=torch.int64)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        if fb.mode is not ForwardMode.DECODE:
            return super().forward(layer, q, k, v, fb)
        self.pool.write(layer, fb.out_slots, k, v)
        meta = cast(TorchMeta, fb.attn)
        assert meta.starts is not None  # prepare sets it for decode batches
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
