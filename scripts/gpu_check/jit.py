"""flashinfer's JIT modules the engine and the GPU tests use, compiled in parallel before anything
needs them, and how long each took.

flashinfer compiles a module (nvcc, through ninja) the first time a process calls into it. Left to
the tests, each first use compiles its module alone, one after another; here every module's
sources go into one ninja build, which keeps all cores busy. Per module, the compile span (first
object started to last finished) and the compile time summed over its objects come from ninja's
own log. A module already built (an earlier phase on the same machine) is not built again.

Which modules: the attention backend picks them from dtype, head size and GQA group
(model/attention/flashinfer_backend.py): decode on CUDA cores for groups up to
``MAX_CUDA_CORE_DECODE_GROUP``, else on the prefill kernel with tensor cores; prefill with "fa2"
(FA3 only where a test asks for "auto" on Hopper). Norm, RoPE, SiLU-and-mul and sampling are one
module each, for every dtype.

    python -m gpu_check.jit {tests,bench} --result PATH
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MAX_CUDA_CORE_DECODE_GROUP = 4  # flashinfer_backend.py's; a test holds the two equal


@dataclass(frozen=True)
class Module:
    kind: str  # decode | prefill | norm | rope | activation | sampling
    dtype: str = ""  # bfloat16 | float16 (attention only)
    head_dim: int = 0
    backend: str = ""  # prefill: fa2 | fa3

    def label(self) -> str:
        if self.kind == "decode":
            return f"decode {self.dtype} d{self.head_dim}"
        if self.kind == "prefill":
            return f"prefill {self.backend} {self.dtype} d{self.head_dim}"
        return self.kind


COMMON = (Module("norm"), Module("rope"), Module("activation"), Module("sampling"))


def attention(dtype: str, head_dim: int, group: int, backend: str = "fa2") -> list[Module]:
    prefill = Module("prefill", dtype, head_dim, backend)
    decode = prefill if group > MAX_CUDA_CORE_DECODE_GROUP else Module("decode", dtype, head_dim)
    return [decode, prefill]


def plan(target: str, hopper: bool) -> list[Module]:
    """The modules ``target`` uses: "tests" (tests/gpu: the small demo model's head size 64, GQA 2,
    in bf16 and fp16; head size 128 with GQA 8; "auto" attention on Hopper) or "bench" (the
    benchmark: Qwen3-0.6B's head size 128, GQA 2, bf16)."""
    if target == "bench":
        mods = attention("bfloat16", 128, 2)
    else:
        mods = attention("bfloat16", 64, 2) + attention("float16", 64, 2) + attention("bfloat16", 128, 8)
        if hopper:
            mods += attention("bfloat16", 64, 2, backend="fa3")
    mods += COMMON
    return list(dict.fromkeys(mods))  # once each, in order


def spec(m: Module) -> Any:
    """flashinfer's JitSpec for ``m``, with the arguments its wrappers pass at plan time (int32
    indices, output in the input dtype, no RoPE in the kernel, no sliding window, no soft cap), so
    the module built here is the one they load."""
    import torch
    from flashinfer import jit

    if m.kind in ("decode", "prefill"):
        dt = getattr(torch, m.dtype)
        args = (dt, dt, dt, torch.int32, m.head_dim, m.head_dim, 0, False, False)
        if m.kind == "decode":
            return jit.gen_batch_decode_module(*args)
        return jit.gen_batch_prefill_module(m.backend, *args, False)
    if m.kind == "activation":
        return jit.gen_act_and_mul_module("silu")
    from flashinfer.jit import norm, rope, sampling

    gen = {
        "norm": norm.gen_norm_module,
        "rope": rope.gen_rope_module,
        "sampling": sampling.gen_sampling_module,
    }
    return gen[m.kind]()


@dataclass
class Span:
    start_s: float = float("inf")  # the module's first object started (ninja's clock: the build's start)
    end_s: float = 0.0  # its last output finished
    objects: int = 0
    compile_s: float = 0.0  # summed over its outputs (they run side by side)


def ninja_times(log: Path) -> dict[str, Span]:
    """Per module folder in ninja's log, from the latest line of each output (the log appends, so
    an output's latest line comes last; times are milliseconds from that build's start)."""
    latest: dict[str, tuple[int, int]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        parts = line.split("\t")
        if len(parts) >= 4 and not line.startswith("#"):
            latest[parts[3]] = (int(parts[0]), int(parts[1]))
    out: dict[str, Span] = {}
    for output, (start, end) in latest.items():
        span = out.setdefault(output.split("/")[0], Span())
        span.start_s = min(span.start_s, start / 1e3)
        span.end_s = max(span.end_s, end / 1e3)
        span.objects += 1
        span.compile_s += (end - start) / 1e3
    return out


def build(modules: list[Module]) -> dict[str, Any]:
    """Compile every module not built yet, in one parallel build; per module what it took."""
    from flashinfer.jit import build_jit_specs
    from flashinfer.jit import env as jit_env

    specs = {m: spec(m) for m in modules}
    todo = [m for m, s in specs.items() if not s.is_compiled]
    t0 = time.perf_counter()
    if todo:
        build_jit_specs([specs[m] for m in todo], verbose=False)
    wall = time.perf_counter() - t0
    times = ninja_times(Path(jit_env.FLASHINFER_JIT_DIR) / ".ninja_log")
    rows = []
    for m, s in specs.items():
        span = times.get(s.name, Span()) if m in todo else Span()
        rows.append(
            {**asdict(m), "module": m.label(), "uri": s.name, "built_now": m in todo,
             "compiled": bool(s.is_compiled), "objects": span.objects,
             "span_s": round(max(0.0, span.end_s - span.start_s), 1), "compile_s": round(span.compile_s, 1)}
        )  # fmt: skip
    return {"wall_s": round(wall, 1), "jit_dir": str(jit_env.FLASHINFER_JIT_DIR), "modules": rows}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("target", choices=("tests", "bench"))
    p.add_argument("--result", type=Path, required=True)
    args = p.parse_args()
    import torch

    hopper = torch.cuda.get_device_capability(0)[0] == 9
    got = build(plan(args.target, hopper))
    for r in got["modules"]:
        how = (
            f"{r['span_s']:6.1f} s span, {r['compile_s']:7.1f} s compiling, {r['objects']} outputs"
            if r["built_now"]
            else "already built"
        )
        print(f"{r['module']:28} {how}  {r['uri']}", flush=True)
    print(f"all modules in {got['wall_s']} s", flush=True)
    args.result.write_text(json.dumps(got))
    return 0 if all(r["compiled"] for r in got["modules"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
