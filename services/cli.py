"""The ``radixserve`` command line.

Each subcommand is one ``_cmd_*`` function (takes the parsed args, returns an exit code) plus one
``add_parser`` block in ``build_parser``. Heavy imports stay inside the ``_cmd_*`` functions so
``radixserve --help`` is instant.

    radixserve make-demo-model PATH [--arch llama|qwen2|qwen3] [--size tiny|small] [--seed N]
    radixserve serve [--model PATH|demo] [--port 8000] [--schedulers N] [-- scheduler flags]
    radixserve bench NAME [its flags]     (offline, serving, gpu, routing, ...; NAME --help lists them)
    radixserve fetch-model URI --cache DIR [--size-limit Q] [--sha256 HEX] | --digest DIR
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Sequence

from radixserve.common.service_config import ENGINE_DEFAULTS, ROUTERS, ROUTING_DEFAULTS


def _cmd_make_demo_model(args: argparse.Namespace) -> int:
    from radixserve.common.demo_model import make_demo_model

    path = make_demo_model(args.path, arch=args.arch, size=args.size, seed=args.seed)
    print(path)
    return 0


# Each benchmark parses its own flags (``radixserve bench NAME --help`` is the benchmark's help): the
# CLI forwards every argument after the name, so no flag or default is restated here.
BENCHMARKS = {
    "offline": "offline throughput: HF generate (static batches) vs the Engine, normal and overlap",
    "serving": "online serving: the HTTP server vs the Engine in-process, Poisson arrivals and closed loops",
    "gpu": "GPU decode: step time vs the memory floor, kernels per step, offline throughput vs HF",
    "routing": "cache-aware vs least-load vs round-robin routing over 4 scheduler processes",
    "spread": "1 vs 2 scheduler pods on prompts that share nothing",
    "policy_sim": "hit rate and queue wait of each schedule policy (cost model, virtual time)",
    "scheduler_overhead": "CPU time of one scheduling step at 64 / 256 / 1024 requests",
    "decode_attention": "the CPU decode-attention kernel against the torch reference",
    "tracing_overhead": "served throughput with every request traced and exported vs tracing off",
    "tensor_parallel": "offline throughput with the model split over 1 vs 2 processes (tensor parallelism)",
    "logits_features": "what logprobs, penalties and JSON constraints cost, and free requests beside them",
}


def load_benchmark(name: str) -> types.ModuleType:
    """``benchmarks/<name>`` of this source checkout (a package, or a single ``<name>.py``) as a
    module, imported once per process (benchmarks are not part of the installed package);
    FileNotFoundError outside a checkout."""
    import importlib.util
    import sys
    from pathlib import Path

    key = f"radixserve_bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    package = root / name / "__init__.py"
    if package.is_file():
        spec = importlib.util.spec_from_file_location(
            key, package, submodule_search_locations=[str(package.parent)]
        )
    elif (root / f"{name}.py").is_file():
        spec = importlib.util.spec_from_file_location(key, root / f"{name}.py")
    else:
        raise FileNotFoundError(f"{root / name} not found (run from a source checkout)")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[key]
        raise
    return mod


def _cmd_bench(name: str, argv: list[str]) -> int:
    """Runs ``benchmarks/<name>``'s ``main`` with every argument after the benchmark's name."""
    try:
        mod = load_benchmark(name)
    except FileNotFoundError as e:
        print(f"radixserve bench {name}: {e}")
        return 2
    return int(mod.main(argv))


def _cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from radixserve.common.config import resolve_model, served_model_name
    from radixserve.launcher import build_cluster

    extra = [a for a in args.scheduler_args if a != "--"]
    cluster = build_cluster(
        resolve_model(args.model),
        served_model_name(args),
        port=args.port,
        host=args.host,
        grpc_port=args.grpc_port,
        schedulers=args.schedulers,
        scheduler_args=extra,
        gateway_args=["--router", args.router],
        torch_threads=args.torch_threads,
        tp_size=args.tp_size,
        prefix_index=args.prefix_index,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster.start()
    print(
        f"radixserve: serving {served_model_name(args)} at {cluster.url}/v1 (gRPC Generate at "
        f"{cluster.grpc_address}); Ctrl-C stops",
        flush=True,
    )
    supervisor = cluster.supervise()  # a service that exits is restarted; the others keep serving
    while not stop.wait(0.5):
        if supervisor.gave_up is not None:
            print(f"radixserve: stopping: {supervisor.gave_up}", flush=True)
            cluster.stop()
            return 1
    print("radixserve: stopping", flush=True)
    cluster.stop()
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

    # Its flags are model_fetch's own (main() hands it every argument): listed here for --help.
    p = sub.add_parser(
        "fetch-model",
        help="download a model (hf://, s3://, gs://) once into a bounded cache; --digest DIR pins one",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("bench", help="benchmarks (from a source checkout)")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, text in BENCHMARKS.items():
        # Listed here for --help; main() hands everything after the name to the benchmark itself.
        bench.add_parser(name, help=text, add_help=False).add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser(
        "serve",
        help="run gateway, schedulers and detokenizer as local processes (OpenAI API on --port)",
        description="Starts the three services on loopback, waits until all are healthy, prints the URL; "
        "Ctrl-C / SIGTERM stops them all. Arguments after -- go to every scheduler "
        "(e.g. -- --page-size 16 --max-running-requests 128; see python -m radixserve.scheduler --help).",
    )
    p.add_argument("--model", default="demo", help='HF model folder, or "demo" (generated on first use)')
    p.add_argument(
        "--served-model-name", help="name clients use (default: folder name; demo: radixserve-demo)"
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP and gateway gRPC listen address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-port", type=int, help="gateway gRPC port for Generate (default: a free one)")
    p.add_argument("--schedulers", type=int, default=1, help="scheduler processes")
    p.add_argument(
        "--tp-size",
        type=int,
        default=ENGINE_DEFAULTS.tp_size,
        help="tensor parallelism: each scheduler splits the model over this many devices (CPU: processes)",
    )
    p.add_argument(
        "--torch-threads", type=int, help="per scheduler process (default: (cores - 1) / (schedulers x tp))"
    )
    p.add_argument("--router", choices=ROUTERS, default=ROUTING_DEFAULTS.router)
    p.add_argument(
        "--prefix-index",
        default=ROUTING_DEFAULTS.prefix_index,
        help='"memory" (in the gateway) or a redis:// URL (schedulers publish there)',
    )
    p.add_argument("scheduler_args", nargs=argparse.REMAINDER, help="-- then scheduler flags")
    p.set_defaults(func=_cmd_serve)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        return _cmd_bench(argv[1], argv[2:])  # its flags are its own (argparse here would eat --help)
    if argv and argv[0] == "fetch-model":
        from radixserve.common import model_fetch

        return model_fetch.main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
