"""MoE offline throughput on CPU: the Engine against HF ``generate`` on a small Qwen3-MoE model, and
the MoE layer's kernel launches on the GPU path.

* Model: the demo ``qwen3_moe`` model (services/common/demo_moe.py) with random weights. "small"
  (the full run): 8 layers, hidden 512, 8 query / 4 KV heads of 64, every layer sparse with 16
  experts, 4 per token, 384 wide: a token's active expert columns (4 x 384) are as wide as the
  dense small model's MLP, the layer holds four times its weights. "tiny" with ``--quick``;
  ``--model PATH`` for another folder (any MoE architecture served).
* Throughput: ``bench offline``'s run, unchanged, on that model (benchmarks/offline: the same
  presets, seed and workload, HF ``generate`` in static left-padded batches as the baseline, ours on
  the normal and overlap loops, ``--repeats`` in alternating order judged on the median paired
  ratio, a batch-1 HF check of a few requests' greedy tokens). HF runs its own default experts
  implementation (transformers' ``grouped_mm``); ours runs the profile's choice on CPU, the torch
  reference (model/moe_ops.py). The host-bound check and ``--profile`` of bench offline are off.
* Launches (``launches``): the kernels one decode step launches per layer on the CUDA path, counted
  on fake CUDA tensors with the launch-count tests' counter (tests/helpers/launch_count.py: its
  stand-in for flashinfer's kernels, one launch each): an MoE block alone, a whole MoE decoder layer
  (Qwen3-30B-A3B's shapes, grouped GEMM experts) and, beside them, a dense Qwen3-0.6B layer.

    .venv/bin/python benchmarks/moe.py [--quick] [--out DIR] [bench offline's flags]
    radixserve bench moe [same flags]

Writes DIR/moe.json and DIR/moe.png. Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts here share benchmarks/_*.py
import _common as common
import offline  # the workload, the systems, the repeats and the report

ROOT = Path(__file__).resolve().parents[1]
ARCH = "qwen3_moe"
# bench offline's flags with these defaults first (a flag given on the command line wins): neither
# the dense model's host-bound check nor the profile, and a full run repeats three times, not five
# (the MoE model is slower than the dense one: a full run stays near 10 minutes on 2 cores).
DEFAULTS = ["--host-bound-pairs", "0"]
FULL_RUN_DEFAULTS = ["--repeats", "3"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        print((__doc__ or "").split("\n\n")[0] + "\n\nIts flags are bench offline's:\n")
    args = offline.parse_args([*DEFAULTS, *([] if "--quick" in argv else FULL_RUN_DEFAULTS), *argv])
    args.profile = False
    return args


@contextlib.contextmanager
def model_folder(args: argparse.Namespace) -> Iterator[Path]:
    """``--model``, or the MoE demo model of ``args.model_size`` built for the run."""
    if args.model is not None:
        yield Path(args.model)
        return
    from radixserve.common.demo_model import make_demo_model

    with tempfile.TemporaryDirectory(prefix="radixserve-bench-moe-") as tmp:
        yield make_demo_model(Path(tmp) / "model", arch=ARCH, size=args.model_size, seed=0)


def model_facts(path: Path) -> dict[str, Any]:
    """The model's architecture, experts and the MoE implementation our CPU engine runs."""
    from radixserve.scheduler.model.config import ModelConfig
    from radixserve.scheduler.model.device import resolve_profile

    cfg = ModelConfig.from_pretrained(path)
    if cfg.moe is None:
        raise SystemExit(f"{path}: not a mixture-of-experts model ({cfg.arch})")
    profile = resolve_profile(cfg, device="cpu")
    return {
        "arch": cfg.arch,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "moe": dataclasses.asdict(cfg.moe),
        "our_moe_experts": profile.moe,
        "profile_notes": list(profile.notes),
    }


def launches() -> dict[str, Any]:
    """Kernel launches per decode step on the CUDA path (fake CUDA tensors: no GPU needed)."""
    sys.path.append(str(ROOT))  # the checkout's tests/helpers; appended, so no folder of the
    from tests.helpers import launch_count as count  # checkout shadows a standard module
    from tests.helpers.shapes import QWEN3_30B_A3B

    block = count.moe_block_launches(8, "grouped_mm")
    moe_step, moe_layers = count.decode_step_launches(8, 40, cfg=QWEN3_30B_A3B, moe="grouped_mm")
    dense_step, dense_layers = count.decode_step_launches(8, 40)
    return {
        "method": "aten ops dispatched on fake CUDA tensors (views, allocations and casts excluded) plus "
        "one per flashinfer kernel call (a stand-in); batch 8, context 40; tests/helpers/launch_count.py",
        "moe_block": sum(block.values()),
        "moe_block_ops": dict(block),
        "moe_decoder_layer": sum(moe_step.values()) / moe_layers,
        "dense_decoder_layer": sum(dense_step.values()) / dense_layers,
        "moe_model": "Qwen3-30B-A3B shapes (4 of its 48 layers), grouped GEMM experts (grouped_mm)",
        "dense_model": "Qwen3-0.6B shapes",
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with model_folder(args) as path:
        facts = model_facts(path)
        description = (
            str(args.model) if args.model else f"demo {ARCH}/{args.model_size} (built in a temp dir)"
        )
        args.model = path  # bench offline's run on this folder
        report = offline.run(args)
    report["benchmark"] = "MoE offline throughput: HF generate (static batches) vs radixserve Engine"
    report["config"]["model"] = description
    report["config"]["model_facts"] = facts
    report["launches"] = launches()
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    results, counts = report["results"], report["launches"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    names = ["hf", "ours_normal", "ours_overlap"]
    labels = [f"HF generate\n(static B={results['hf']['batch_size']})", "ours\nnormal", "ours\noverlap"]
    tps = [results[n]["output_tok_s"] for n in names]
    bars = ax.bar(labels, tps, color=["#999999", "#4c72b0", "#55a868"])
    for b, n, v in zip(bars, names, tps, strict=True):
        txt = f"{v:.0f} tok/s" + ("" if n == "hf" else f"\n{results[n]['speedup_vs_hf']:.2f}x HF")
        ax.annotate(txt, (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, max(tps) * 1.3)
    ax.set_ylabel("useful output tokens / s")
    ax.set_title(f"MoE offline throughput, CPU ({report['config']['model']})", fontsize=9)
    kinds = [
        ("moe_block", "MoE block"),
        ("moe_decoder_layer", "MoE decoder\nlayer"),
        ("dense_decoder_layer", "dense decoder\nlayer"),
    ]
    values = [counts[k] for k, _ in kinds]
    ax2.bar([lab for _, lab in kinds], values, color=["#dd8452", "#c44e52", "#999999"])
    for i, v in enumerate(values):
        ax2.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=9)
    ax2.set_ylabel("kernel launches per decode step")
    ax2.set_title("CUDA path, counted on fake tensors", fontsize=9)
    common.save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    json_path, png_path = common.write_outputs(args.out, "moe", report, lambda path: plot(report, path))
    offline.analysis.print_summary(report)
    print(f"launches per decode step (CUDA path): {report['launches']['moe_block']} per MoE block")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
