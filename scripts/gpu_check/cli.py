"""The command line: prepare, phase1, phase2, --rehearse."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .phases import BUDGET_S, phase1, phase2

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/gpu-check", description=(sys.modules[__package__].__doc__ or "")
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("command", nargs="?", choices=("prepare", "phase1", "phase2"))
    p.add_argument("--rehearse", action="store_true", help="both phases on CPU with the tiny model")
    p.add_argument(
        "--out", type=Path, default=None, help="result folder (default $OUT; rehearsal: a temp dir)"
    )
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="a phase's time, start to summary")
    p.add_argument(
        "--arch",
        choices=("qwen3", "qwen3_moe"),
        default="qwen3",
        help="phase2's model: Qwen3-0.6B, or its MoE counterpart (decode stages only)",
    )
    args = p.parse_args(argv)
    if args.rehearse == (args.command is not None):
        p.error("give one of prepare, phase1, phase2, or --rehearse")
    if args.command in ("phase1", "phase2") and args.out is None:
        if not os.environ.get("OUT"):
            p.error("--out DIR, or $OUT (the device tool sets it)")
        args.out = Path(os.environ["OUT"])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "prepare":
        from .wheels import prepare  # needs packaging and network: only here

        return prepare(REPO)
    if args.command == "phase1":
        return phase1(REPO, args.out, budget_s=args.budget_s)
    if args.command == "phase2":
        return phase2(REPO, args.out, budget_s=args.budget_s, arch=args.arch)
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-rehearsal-"))
    print(f"rehearsal: results in {out}", flush=True)
    rc1 = phase1(REPO, out / "phase1", rehearse=True, budget_s=args.budget_s)
    rc2 = phase2(REPO, out / "phase2", rehearse=True, budget_s=args.budget_s)
    return rc1 or rc2
