"""The ``radixserve`` command line.

Each subcommand is one ``_cmd_*`` function (takes the parsed args, returns an exit code) plus one
``add_parser`` block in ``build_parser``. Heavy imports stay inside the ``_cmd_*`` functions so
``radixserve --help`` is instant.

    radixserve make-demo-model PATH [--arch llama|qwen2|qwen3] [--size tiny|small] [--seed N]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def _cmd_make_demo_model(args: argparse.Namespace) -> int:
    from radixserve.common.demo_model import make_demo_model

    path = make_demo_model(args.path, arch=args.arch, size=args.size, seed=args.seed)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="radixserve command line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-demo-model", help="write a random-weight HF model folder (offline)")
    p.add_argument("path", help="output folder")
    p.add_argument("--arch", choices=("llama", "qwen2", "qwen3"), default="llama")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_make_demo_model)

    # More subcommands go here, one block each, e.g.:
    #   p = sub.add_parser("bench", ...)  # with its own sub-subparsers for "offline", ...
    #   p.set_defaults(func=_cmd_bench_offline)
    #   p = sub.add_parser("serve", ...); p.set_defaults(func=_cmd_serve)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
