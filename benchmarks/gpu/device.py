"""The device: freeing and syncing it, its name, and the copy bandwidth that sets the memory floor."""

from __future__ import annotations

import gc
import re
import time


def release(device: str) -> None:
    """Free what a finished engine or model held (call after its last reference is gone)."""
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def flashinfer_version() -> str | None:
    try:
        import flashinfer
    except Exception:  # not installed (CPU machines), or its import failed
        return None
    return str(getattr(flashinfer, "__version__", "unknown"))


def copy_bandwidth(device: str, mib: int, rounds: int = 5, copies: int = 10) -> dict:
    """``dst.copy_(src)`` of ``mib`` MiB: 2 x bytes / time (a copy reads and writes), best round.

    CUDA: timed with ``torch.cuda.Event``s around ``copies`` back-to-back copies. CPU (--smoke): a
    host memcpy timed with ``perf_counter``.
    """
    import torch

    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    per_copy_s = []
    for _ in range(rounds):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(copies):
                dst.copy_(src)
            end.record()
            end.synchronize()
            per_copy_s.append(start.elapsed_time(end) / 1e3 / copies)
        else:
            t = time.perf_counter()
            for _ in range(copies):
                dst.copy_(src)
            per_copy_s.append((time.perf_counter() - t) / copies)
    del src, dst
    release(device)
    best = min(per_copy_s)
    return {
        "d2d_gbps": 2 * n / best / 1e9,
        "copy_bytes": n,
        "copy_ms_each_round": [1e3 * s for s in per_copy_s],
        "d2d_method": (
            f"{mib} MiB dst.copy_(src), torch.cuda.Event timing, {copies} copies a round, best of {rounds}"
            if device.startswith("cuda")
            else f"CPU memcpy stand-in: {mib} MiB dst.copy_(src), perf_counter, best of {rounds}"
        ),
    }
