"""The ``radixserve`` command line.

Each subcommand is one ``_cmd_*`` function (takes the parsed args, returns an exit code) plus one
``add_parser`` block in ``build_parser``. Heavy imports stay inside the ``_cmd_*`` functions so
``radixserve --help`` is instant.

    radixserve make-demo-model PATH [--arch llama|qwen2|qwen3] [--size tiny|small] [--seed N]
    radixserve serve [--model PATH|demo] [--port 8000] [--schedulers N] [-- scheduler flags]
    radixserve bench offline [--model PATH] [--num-requests N] [--input-range MIN MAX] [--quick] ...
    radixserve bench serving [--model PATH] [--rates 1 2 4 inf] [--num-requests N] [--quick] ...
    radixserve bench gpu [--device cuda] [--num-requests N] [--hf-batch-sizes B ...] [--smoke] ...
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def _cmd_make_demo_model(args: argparse.Namespace) -> int:
    from radixserve.common.demo_model import make_demo_model

    path = make_demo_model(args.path, arch=args.arch, size=args.size, seed=args.seed)
    print(path)
    return 0


_BENCH_OFFLINE_VALUE_FLAGS = (
    "model",
    "num_requests",
    "input_range",
    "output_range",
    "shared_prefix_frac",
    "prefix_len",
    "hf_batch_sizes",
    "max_running_requests",
    "check_requests",
    "repeats",
    "threads",
    "seed",
    "out",
)


def _cmd_bench_offline(args: argparse.Namespace) -> int:
    """Runs benchmarks/offline.py (a repository file, not part of the package) with the given flags."""
    return _run_bench("offline", args, _BENCH_OFFLINE_VALUE_FLAGS, ["quick", "profile"])


_BENCH_SERVING_VALUE_FLAGS = (
    "model",
    "rates",
    "num_requests",
    "concurrency",
    "requests_per_client",
    "repeats",
    "input_range",
    "output_range",
    "max_running_requests",
    "threads",
    "seed",
    "out",
)


def _cmd_bench_serving(args: argparse.Namespace) -> int:
    """Runs benchmarks/serving.py (a repository file, not part of the package) with the given flags."""
    return _run_bench("serving", args, _BENCH_SERVING_VALUE_FLAGS, ["quick"])


_BENCH_GPU_VALUE_FLAGS = (
    "device",
    "prompt_len",
    "decode_steps",
    "num_requests",
    "input_range",
    "output_range",
    "hf_batch_sizes",
    "max_running_requests",
    "seed",
    "out",
)


def _cmd_bench_gpu(args: argparse.Namespace) -> int:
    """Runs benchmarks/gpu.py (a repository file, not part of the package) with the given flags."""
    return _run_bench("gpu", args, _BENCH_GPU_VALUE_FLAGS, ["smoke"])


def _cmd_bench_routing(args: argparse.Namespace) -> int:
    """Runs benchmarks/routing.py; every flag after ``routing`` is its own (see --help there)."""
    mod = _load_bench("routing")
    return 2 if mod is None else int(mod.main(args.routing_args))


def load_benchmark(name: str):  # -> types.ModuleType
    """``benchmarks/<name>.py`` of this source checkout as a module, imported once per process
    (they are scripts, not part of the package); FileNotFoundError outside a checkout."""
    import importlib.util
    import sys
    from pathlib import Path

    key = f"radixserve_bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    script = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found (run from a source checkout)")
    spec = importlib.util.spec_from_file_location(key, script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    spec.loader.exec_module(mod)
    return mod


def _load_bench(name: str):  # -> the benchmark module, or None outside a source checkout
    try:
        return load_benchmark(name)
    except FileNotFoundError as e:
        print(f"radixserve bench {name}: {e}")
        return None


def _run_bench(
    name: str, args: argparse.Namespace, value_flags: tuple[str, ...], bool_flags: list[str]
) -> int:
    """Runs benchmarks/<name>.py's main with the parsed flags turned back into an argv."""
    mod = _load_bench(name)
    if mod is None:
        return 2
    argv: list[str] = []
    for flag, value in vars(args).items():
        if flag in value_flags and value is not None:
            values = value if isinstance(value, list) else [value]
            argv += [f"--{flag.replace('_', '-')}", *map(str, values)]
    for flag in bool_flags:
        argv += [f"--{flag}"] * bool(getattr(args, flag, False))
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

    p = sub.add_parser("bench", help="benchmarks (from a source checkout)")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    p = bench.add_parser(
        "offline",
        help="offline throughput: HF generate (static batches) vs the Engine, normal and overlap",
        description="Writes OUT/offline.json and OUT/offline.png. Unset flags take benchmarks/offline.py's "
        "defaults (full run ~11 min on 2 CPU cores: five repeats; --quick < 60 s).",
    )
    p.add_argument("--model", help="HF model folder (default: build the small demo model in a temp dir)")
    p.add_argument("--num-requests", type=int, help="default 64 (quick: 12)")
    p.add_argument("--input-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="default 64 512")
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="default 32 256")
    p.add_argument("--shared-prefix-frac", type=float, help="requests starting with the system prompt (0.3)")
    p.add_argument("--prefix-len", type=int, help="shared system-prompt length in tokens (256)")
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", help="HF static batch sizes; best is kept (16)")
    p.add_argument("--max-running-requests", type=int, help="engine's running-batch limit (128)")
    p.add_argument("--check-requests", type=int, help="requests compared with HF batch-1 greedy (3)")
    p.add_argument(
        "--repeats",
        type=int,
        help="runs of each system in alternating order, judged on the median (3; quick: 1)",
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads for every system (1)")
    p.add_argument("--seed", type=int, help="workload seed (0)")
    p.add_argument("--quick", action="store_true", help="tiny model, few short requests: smoke test < 60 s")
    p.add_argument("--profile", action="store_true", help="also profile a normal-mode engine run")
    p.add_argument("--out", help="output folder (default benchmarks/results)")
    p.set_defaults(func=_cmd_bench_offline)

    p = bench.add_parser(
        "serving",
        help="online serving: the HTTP server vs the Engine in-process, Poisson arrivals at several rates"
        " and closed loops at fixed concurrency",
        description="Writes OUT/serving.json and OUT/serving.png. Unset flags take benchmarks/serving.py's "
        "defaults (full run ~9 min on 2 CPU cores; --quick < 60 s).",
    )
    p.add_argument("--model", help="HF model folder (default: build the small demo model in a temp dir)")
    p.add_argument("--rates", nargs="+", help="request rates in req/s, inf = all at once (1 2 4 inf)")
    p.add_argument("--num-requests", type=int, help="requests per rate (32; quick: 8)")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        help="closed loop: concurrent clients, each running its requests back to back (1 8 32; quick: 4)",
    )
    p.add_argument(
        "--requests-per-client", type=int, help="closed loop: requests each client runs (5; quick: 2)"
    )
    p.add_argument(
        "--repeats", type=int, help="closed loop: paired served/in-process runs per concurrency (3; quick: 1)"
    )
    p.add_argument("--input-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="default 64 256")
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="default 32 128")
    p.add_argument("--max-running-requests", type=int, help="engine's running-batch limit (128)")
    p.add_argument("--threads", type=int, help="torch threads: the scheduler process and in-process (1)")
    p.add_argument("--seed", type=int, help="workload seed (0)")
    p.add_argument("--quick", action="store_true", help="tiny model, few short requests: smoke test < 60 s")
    p.add_argument("--out", help="output folder (default benchmarks/results)")
    p.set_defaults(func=_cmd_bench_serving)
    p = bench.add_parser(
        "gpu",
        help="GPU decode: step time vs the memory floor, kernels per step, offline throughput vs HF",
        description="Writes OUT/gpu-<device>.json and a PNG beside it. Unset flags take benchmarks/gpu.py's "
        "defaults (random-weight Qwen3-0.6B shapes, bfloat16, CUDA; --smoke: a tiny model on CPU, < 60 s).",
    )
    p.add_argument("--device", help="cuda (default) or cpu (the default with --smoke)")
    p.add_argument("--prompt-len", type=int, help="decode runs' prompt length (128)")
    p.add_argument("--decode-steps", type=int, help="tokens each decode run decodes (64)")
    p.add_argument("--num-requests", type=int, help="offline workload requests (256)")
    p.add_argument("--input-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="default 100 1024")
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="default 100 1024")
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", help="HF static batch sizes; best is kept (64)")
    p.add_argument("--max-running-requests", type=int, help="offline runs' running-batch limit (256)")
    p.add_argument("--seed", type=int, help="workload seed (0)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, tiny counts: end to end < 60 s")
    p.add_argument("--out", help="output folder (default benchmarks/results)")
    p.set_defaults(func=_cmd_bench_gpu)
    p = bench.add_parser(
        "routing",
        help="cache-aware vs least-load vs round-robin routing over 4 scheduler processes",
        description="Runs benchmarks/routing.py with the flags that follow (its own --help lists them); "
        "writes OUT/routing.json and OUT/routing.png.",
        add_help=False,
    )
    p.add_argument("routing_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench_routing)

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
    p.add_argument("--torch-threads", type=int, help="per scheduler (default: (cores - 1) / schedulers)")
    p.add_argument("--router", choices=("cache-aware", "least-load", "round-robin"), default="cache-aware")
    p.add_argument(
        "--prefix-index",
        default="memory",
        help='"memory" (in the gateway) or a redis:// URL (schedulers publish there)',
    )
    p.add_argument("scheduler_args", nargs=argparse.REMAINDER, help="-- then scheduler flags")
    p.set_defaults(func=_cmd_serve)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "routing"]:  # every flag after it is the benchmark's own (argparse
        return _cmd_bench_routing(argparse.Namespace(routing_args=argv[2:]))  # would eat --help)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
