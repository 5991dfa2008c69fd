"""Step program: does the GPU path work at all, before minutes go into compiling and testing it?

One flashinfer op the engine uses (SiLU-and-multiply, the smallest JIT module: compiling it checks
nvcc, ninja and the carried tvm-ffi), captured in a CUDA graph on a side stream as the decode graphs
are (model/graph_runner.py), replayed on new input, and compared with an eager call on that input
(the same kernel: equal bit for bit) and with torch (within bf16 rounding).

    python -m gpu_check.probe --result PATH
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def probe() -> dict[str, Any]:
    import flashinfer
    import torch

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(64, 2 * 1024, device=dev, dtype=torch.bfloat16, generator=g)
    t0 = time.perf_counter()
    flashinfer.activation.silu_and_mul(x)  # the first call builds (or loads) the module
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    static_in = x.clone()
    side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]  # unannotated in torch
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the capture, as graph_runner does
            flashinfer.activation.silu_and_mul(static_in)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_out = flashinfer.activation.silu_and_mul(static_in)
    fresh = torch.randn(x.shape, device=dev, dtype=x.dtype, generator=g)
    static_in.copy_(fresh)
    graph.replay()
    eager = flashinfer.activation.silu_and_mul(fresh)
    ref = torch.nn.functional.silu(fresh[:, :1024].float()) * fresh[:, 1024:].float()
    torch.cuda.synchronize()
    return {
        "op": "flashinfer.activation.silu_and_mul, bf16 [64, 2048]",
        "module_build_or_load_s": round(build_s, 2),
        "capture_replay_s": round(time.perf_counter() - t0, 3),
        "replay_equals_eager": bool(torch.equal(static_out, eager)),
        "max_abs_diff_vs_torch": float((static_out.float() - ref).abs().max()),
        "close_to_torch": bool(torch.allclose(static_out.float(), ref, atol=2e-2, rtol=2e-2)),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--result", type=Path, required=True)
    args = p.parse_args()
    got = probe()
    print(json.dumps(got, indent=1), flush=True)
    args.result.write_text(json.dumps(got))
    return 0 if got["replay_equals_eager"] and got["close_to_torch"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
