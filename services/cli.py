"""The ``radixserve`` command line.

Each subcommand is one ``_cmd_*`` function (takes the parsed args, returns an exit code) plus one
``add_parser`` block in ``build_parser``. Heavy imports stay inside the ``_cmd_*`` functions so
``radixserve --help`` is instant.

    radixserve make-demo-model PATH [--arch llama|qwen3|qwen3_moe|qwen3_5|qwen3_next|... (--help)]
        [--size tiny|small] [--seed N]
    radixserve serve [--model PATH|demo] [--schedulers N] [--detokenizers N] [vLLM's flags] [-- flags]
    radixserve bench NAME [its flags]     (offline, serving, gpu, routing, ...; NAME --help lists them)
    radixserve fetch-model URI --cache DIR [--size-limit Q] [--sha256 HEX] | --digest DIR

A bad argument ends the command with one line naming it (``radixserve serve: error: ...``) and a
non-zero status, before anything starts: every setting is checked against the services' own
configs (``service_config``), the ports for being free, and a service that still fails to start
is named with its own last error line.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixserve.bench_index import BENCHMARKS, load_benchmark
from radixserve.common.config import Bounds, ConfigError, OneLineParser, flag_type, number_type
from radixserve.common.demo_hybrid import HYBRID_ARCHS
from radixserve.common.demo_model import ARCHS
from radixserve.common.demo_moe import MOE_ARCHS
from radixserve.common.service_config import (
    ENGINE_DEFAULTS,
    ROUTERS,
    ROUTING_DEFAULTS,
    TORCH_SEED,
    EngineConfig,
    GatewayConfig,
    SchedulerPodConfig,
)
from radixserve.scheduler.model.quant.formats import SERVED

if TYPE_CHECKING:
    from radixserve.launcher import Cluster


def _fail(command: str, message: object, status: int) -> int:
    """The one line a failed command ends with."""
    print(f"radixserve {command}: error: {message}", file=sys.stderr, flush=True)
    return status


def _cmd_make_demo_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    if Path(args.path).exists() and not Path(args.path).is_dir():
        return _fail("make-demo-model", f"{args.path}: not a folder (a file is there)", 2)
    from radixserve.common.demo_model import make_demo_model

    try:
        path = make_demo_model(args.path, arch=args.arch, size=args.size, seed=args.seed)
    except OSError as e:  # a folder that cannot be made or written
        return _fail("make-demo-model", f"{e.filename or args.path}: {e.strerror or e}", 1)
    print(path)
    return 0


def _cmd_bench(name: str, argv: list[str]) -> int:
    """Runs ``benchmarks/<name>``'s ``main`` with every argument after the benchmark's name."""
    try:
        mod = load_benchmark(name)
    except FileNotFoundError as e:
        return _fail(f"bench {name}", e, 2)
    return int(mod.main(argv))


def _cmd_serve(args: argparse.Namespace) -> int:
    from radixserve.common.config import resolve_model
    from radixserve.common.stop_signal import StopSignal
    from radixserve.launcher import StartFailed

    stop = StopSignal().install()  # its handler takes no lock (stop_signal.py says why)
    try:
        cluster = serve_cluster(args)
        cluster.check()  # every service's settings and ports: nothing has started yet
    except ConfigError as e:
        return _fail("serve", e, 2)
    resolve_model(args.model)  # the demo model, written on first use (checked above otherwise)
    try:
        cluster.start()
    except StartFailed as e:
        return _fail("serve", e, 1)
    print(
        f"radixserve: serving {args.served_model_name} at {cluster.url}/v1 (gRPC Generate at "
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


def serve_cluster(args: argparse.Namespace) -> Cluster:
    """The services ``radixserve serve`` runs, built (not started) from its flags; ConfigError for
    what a flag's own type cannot say (the model folder, several served names)."""
    from radixserve.common.config import model_path, model_problem, served_model_name
    from radixserve.launcher import build_cluster

    if args.model_tag is not None:  # vLLM's `vllm serve MODEL`
        if args.model not in ("demo", args.model_tag):
            raise ConfigError(f"the model twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    problem = model_problem(args.model, weights=True)  # the schedulers load them
    if problem is not None:
        raise ConfigError(problem)
    names = args.served_model_name or []
    if len(names) > 1:
        raise ConfigError(f"--served-model-name {' '.join(names)}: radixserve serves one name per model")
    args.served_model_name = served_model_name(
        argparse.Namespace(model=args.model, served_model_name=names[0] if names else None)
    )
    return build_cluster(
        model_path(args.model),
        args.served_model_name,
        port=args.port,
        host=args.host,
        grpc_port=args.grpc_port,
        schedulers=args.schedulers,
        detokenizers=args.detokenizers,
        scheduler_args=[*_vllm_scheduler_args(args), *args.scheduler_args],  # after --: they win
        gateway_args=["--router", args.router, *_vllm_gateway_args(args)],
        torch_threads=args.torch_threads,
        tp_size=args.tp_size,
        prefix_index=args.prefix_index,
    )


# ------------------------------------------------------------------ vLLM's `vllm serve` flags
# Where each of vLLM's flags that radixserve serves goes: (dest, scheduler flag). Those with a
# gateway flag are in _vllm_gateway_args; --tensor-parallel-size and --data-parallel-size are
# serve's own --tp-size and --schedulers.
VLLM_SCHEDULER_FLAGS = {
    "dtype": "--dtype",
    "max_model_len": "--max-context-len",
    "gpu_memory_utilization": "--mem-fraction",
    "max_num_seqs": "--max-running-requests",
    "seed": "--seed",
    "quantization": "--quantization",
}
VLLM_DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16"}
VLLM_DTYPES |= {"float": "float32", "float32": "float32"}

# vLLM's flags radixserve does not serve, refused by name at start: ignoring any of them would
# serve something other than what was asked (another precision, layout, tokenizer, API, model).
# The text after the name says what to use instead, where there is something.
VLLM_UNSERVED = {
    "--kv-cache-dtype": "the KV cache is kept in the model's --dtype",
    "--pipeline-parallel-size": "--tensor-parallel-size splits the model instead",
    "-pp": "--tensor-parallel-size splits the model instead",
    "--enable-expert-parallel": "",
    "--distributed-executor-backend": "",
    "--enable-lora": "",
    "--lora-modules": "",
    "--max-loras": "",
    "--max-lora-rank": "",
    "--speculative-config": "",
    "--cpu-offload-gb": "",
    "--tokenizer": "the tokenizer is the model folder's",
    "--revision": "radixserve fetch-model hf://ORG/NAME@REVISION --cache DIR, then --model FOLDER",
    "--tokenizer-revision": "the tokenizer is the model folder's",
    "--download-dir": "radixserve fetch-model URI --cache DIR, then --model FOLDER",
    "--load-format": "s3:// and gs:// weights stream: fetch-model --skip-weights, -- --load-format stream",
    "--hf-overrides": "",
    "--max-num-batched-tokens": "see -- --max-prefill-tokens and --chunked-prefill-size",
    "--block-size": "the KV page size is -- --page-size N",
    "--ssl-keyfile": "terminate TLS in front of the server (an ingress or a proxy)",
    "--ssl-certfile": "terminate TLS in front of the server (an ingress or a proxy)",
    "--root-path": "",
    "--allowed-origins": "",
    "--limit-mm-per-prompt": "text-only models are served",
}


def unserved_vllm_flag(argv: Sequence[str]) -> str | None:
    """The one line refusing the first of vLLM's flags in ``argv`` that radixserve does not serve."""
    for arg in argv:
        name = arg.split("=", 1)[0]
        if name in VLLM_UNSERVED:
            hint = VLLM_UNSERVED[name]
            return f"vLLM's {name} is not supported by radixserve" + (f" ({hint})" if hint else "")
    return None


def vllm_quantization(raw: str) -> str:
    """vLLM's ``--quantization``: ``fp8``; other methods (awq, gptq, ...) are refused naming ours."""
    if raw.lower() == "fp8":
        return "fp8"
    raise argparse.ArgumentTypeError(
        f"{raw!r} is not served: --quantization fp8 quantizes a bf16/fp32 checkpoint at load, and FP8"
        f" checkpoints load as they are ({', '.join(SERVED)})"
    )


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")


def model_len(raw: str) -> int:
    """vLLM's ``--max-model-len``: tokens, as ``2048``, ``1k`` (1000) or ``1K`` (1024), within
    the engine's ``--max-context-len`` range."""
    m = _SIZE.fullmatch(raw.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected tokens (e.g. 4096, 4k, 4K), got {raw!r}")
    number, unit = m.groups()
    scale = (1000 if unit.islower() else 1024) ** " kmg".index(unit.lower() or " ")
    value = float(number) * scale
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {raw!r}")
    flag_type(EngineConfig, "max_context_len")(str(int(value)))  # its range: ArgumentTypeError
    return int(value)


def _vllm_scheduler_args(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for dest, flag in VLLM_SCHEDULER_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            out += [flag, str(VLLM_DTYPES[value] if dest == "dtype" else value)]
    if args.enable_prefix_caching is False:
        out.append("--disable-radix-cache")
    if args.enable_chunked_prefill is False:
        out += ["--chunked-prefill-size", "0"]
    if args.enforce_eager:
        out.append("--disable-cuda-graph")
    return out


def _vllm_gateway_args(args: argparse.Namespace) -> list[str]:
    import os

    # vLLM reads VLLM_API_KEY when --api-key is not given: ignored, it would leave the server open.
    keys = args.api_key or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else [])
    out = ["--api-key", *keys] if keys else []
    for flag in ("--chat-template", "--reasoning-parser", "--tool-call-parser"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, value]
    return out


def _add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's ``vllm serve`` flags that radixserve serves, each passed to the service it concerns."""
    g = p.add_argument_group(
        "vLLM's flags",
        "vllm serve's spelling, each passed to the service it concerns; vLLM's flags radixserve does"
        " not serve (--pipeline-parallel-size, --enable-lora, --kv-cache-dtype, ...) are refused by name",
    )
    g.add_argument("model_tag", nargs="?", metavar="MODEL", help="as --model (vllm serve MODEL)")
    g.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=[],
        help="clients must send one (Authorization: Bearer KEY); repeatable; default: VLLM_API_KEY if set"
        " (gateway --api-key)",
    )
    g.add_argument(
        "--dtype", choices=VLLM_DTYPES, help="weights and activations (scheduler --dtype; half: float16)"
    )
    g.add_argument(
        "--max-model-len",
        type=model_len,
        help="longest prompt + output in tokens; 1k = 1000, 1K = 1024 (scheduler --max-context-len)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        dest="tp_size",
        metavar="N",
        type=flag_type(EngineConfig, "tp_size"),
        help="as --tp-size",
    )
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        dest="schedulers",
        metavar="N",
        type=number_type(int, Bounds(1)),
        help="as --schedulers",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=flag_type(EngineConfig, "mem_fraction"),
        help="share of the memory left after the weights for the KV cache (scheduler --mem-fraction)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=flag_type(EngineConfig, "max_running_requests"),
        help="requests decoding at once (scheduler --max-running-requests)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="the radix prefix cache, on by default (--no-enable-prefix-caching: scheduler"
        " --disable-radix-cache)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        help="on by default; --no-enable-chunked-prefill: scheduler --chunked-prefill-size 0",
    )
    g.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (scheduler --disable-cuda-graph)"
    )
    g.add_argument("--seed", type=flag_type(EngineConfig, "seed"), help="torch's seed (scheduler --seed)")
    g.add_argument(
        "--quantization", "-q", type=vllm_quantization, metavar="fp8",
        help="fp8: weights quantized to FP8 at load (scheduler --quantization); FP8 checkpoints need no flag",
    )  # fmt: skip
    _add_vllm_gateway_and_inert_flags(g)


def _add_vllm_gateway_and_inert_flags(g: argparse._ArgumentGroup) -> None:
    """vLLM's flags that go to the gateway as they are, and those accepted that change nothing."""
    for flag in ("chat_template", "reasoning_parser", "tool_call_parser"):
        meta = GatewayConfig.__dataclass_fields__[flag].metadata
        g.add_argument(
            "--" + flag.replace("_", "-"), choices=meta["choices"], help=f"{meta['help']} (gateway)"
        )
    for flag, why in (
        (
            "--trust-remote-code",
            "no code from the model folder runs; a model that needs its own fails to load",
        ),
        (
            "--enable-auto-tool-choice",
            'tool_choice "auto" is served whenever the model has a tool-call format',
        ),
        ("--disable-log-requests", "requests are not logged"),
        ("--disable-log-stats", "no periodic stats are logged (see /metrics)"),
    ):
        g.add_argument(flag, action="store_true", help=f"accepted, changes nothing: {why}")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="radixserve", description="radixserve command line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-demo-model", help="write a random-weight HF model folder (offline)")
    p.add_argument("path", help="output folder")
    p.add_argument("--arch", choices=ARCHS + MOE_ARCHS + HYBRID_ARCHS, default="llama")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--seed", type=number_type(int, TORCH_SEED), default=0)
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
        usage="radixserve serve [-h] [--model PATH|demo] [options] [vLLM's flags] [-- scheduler flags]",
        description="Starts the three services on loopback, waits until all are healthy, prints the URL; "
        "Ctrl-C / SIGTERM stops them all. Arguments after -- go to every scheduler "
        "(e.g. -- --page-size 16 --max-running-requests 128; see python -m radixserve.scheduler --help). "
        "Every setting is checked, and the ports, before anything starts.",
    )
    p.add_argument("--model", default="demo", help='HF model folder, or "demo" (generated on first use)')
    p.add_argument(
        "--served-model-name",
        nargs="+",
        help="name clients use (default: folder name; demo: radixserve-demo); one",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP and gateway gRPC listen address")
    p.add_argument("--port", type=flag_type(GatewayConfig, "port"), default=8000, help="HTTP port")
    p.add_argument(
        "--grpc-port",
        type=flag_type(GatewayConfig, "grpc_port"),
        help="gateway gRPC port for Generate (default: a free one)",
    )
    p.add_argument("--schedulers", type=number_type(int, Bounds(1)), default=1, help="scheduler processes")
    p.add_argument("--detokenizers", type=number_type(int, Bounds(1)), default=1, help="detokenizer replicas")
    p.add_argument(
        "--tp-size",
        type=flag_type(EngineConfig, "tp_size"),
        default=ENGINE_DEFAULTS.tp_size,
        help="tensor parallelism: each scheduler splits the model over this many devices (CPU: processes)",
    )
    p.add_argument(
        "--torch-threads",
        type=flag_type(SchedulerPodConfig, "torch_threads"),
        help="per scheduler process (default: (cores - 1) / (schedulers x tp); 0: torch's default)",
    )
    p.add_argument("--router", choices=ROUTERS, default=ROUTING_DEFAULTS.router)
    p.add_argument(
        "--prefix-index",
        default=ROUTING_DEFAULTS.prefix_index,
        help='"memory" (in the gateway) or a redis:// URL (schedulers publish there)',
    )
    _add_vllm_flags(p)
    p.set_defaults(func=_cmd_serve, scheduler_args=[])  # main() puts what follows -- there

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        return _cmd_bench(argv[1], argv[2:])  # its flags are its own (argparse here would eat --help)
    if argv and argv[0] == "fetch-model":
        from radixserve.common import model_fetch

        return model_fetch.main(argv[1:])
    schedulers: list[str] = []
    if argv and argv[0] == "serve":
        if "--" in argv:  # every scheduler's flags: checked as the scheduler would, by Cluster.check
            argv, schedulers = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
        if (refused := unserved_vllm_flag(argv)) is not None:
            return _fail("serve", refused, 2)
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # named by the command, not by radixserve's top level
        return _fail(args.command, f"unrecognized arguments: {' '.join(unknown)}", 2)
    if args.command == "serve":
        args.scheduler_args = schedulers
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
