"""Each service's settings as one typed config: the single source of every default.

A field declared with ``setting(default, help)`` is a command-line flag (``page_size`` ->
``--page-size``) and an environment variable (``RADIXSERVE_PAGE_SIZE``, what the operator's
manifests set); a field whose type is another config contributes that config's flags. The
services' ``__main__`` modules build their parsers from these classes (``config.add_flags``), the
operator names its variables through ``config.env_var``, and the benchmarks read the defaults from
here, so a default is written once. Pure data: it imports no service code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.common.block_hash import DEFAULT_BLOCK_SIZE
from radixserve.common.config import Bounds, ConfigError, setting
from radixserve.common.kv_tier import TierWeights

# A prefill step delays every other request's next token (and a new request's first) until it is
# done, so its size is a latency bound: milliseconds for 2048 tokens on a GPU, seconds on a CPU core,
# where smaller chunks cut TTFT for the same work (measured: docs/benchmarks.md, routing).
CUDA_CHUNKED_PREFILL_SIZE = 2048
CPU_CHUNKED_PREFILL_SIZE = 256

# At SIGTERM a scheduler finishes its running requests for this long; a gateway gives its open
# responses as long (they are the same requests).
DRAIN_TIMEOUT_S = 30.0

SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")
QUANTIZATIONS = ("none", "fp8")  # --quantization (scheduler/model/quant/)
KV_WRITE_POLICIES = ("write_back", "write_through")  # --kv-write-policy (the host KV tier)
LOAD_FORMATS = ("auto", "stream")  # --load-format (scheduler/model/weight_files.py)

# The ranges settings admit (config.Bounds): a value outside is refused when the flag or variable
# is parsed, naming it, before the service starts anything.
AT_LEAST_0 = Bounds(0)
AT_LEAST_1 = Bounds(1)
ABOVE_0 = Bounds(0, low_open=True)
FRACTION = Bounds(0, 1, low_open=True)  # a share of something that cannot be nothing
SHARE = Bounds(0, 1)
PORT = Bounds(1, 65535)
PORT_OR_0 = Bounds(0, 65535)  # 0: off
TORCH_SEED = Bounds(-(2**63), 2**64 - 1)  # what torch.manual_seed takes

# Every Redis key of the prefix index starts with this (the operator gives each InferenceService
# its own, "rs:<namespace>/<name>:", which its Redis ACL user is limited to).
INDEX_KEY_PREFIX = "radixserve:"
# Held requests (--hold-timeout): a gateway waits for a scheduler at most as long as an OpenAI SDK
# client waits for its answer by default (a longer hold answers nobody); the queue's bound keeps a
# burst at zero schedulers from holding memory without limit.
CLIENT_DEADLINE_S = 600.0
MAX_HELD_REQUESTS = 100_000
ROUTERS = ("cache-aware", "least-load", "round-robin")
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # tokenizer/text/reasoning.py's (a test holds them equal)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine arguments: ``Engine(model_path, config)``, or any field as a keyword (typed by
    ``EngineOptions``, scheduler/engine_options.py)."""

    page_size: int = setting(1, "tokens per KV page", bounds=AT_LEAST_1)
    max_total_tokens: int | None = setting(
        None,
        "KV capacity in tokens (default: mem_fraction of free device memory)",
        bounds=AT_LEAST_1,
    )
    mem_fraction: float = setting(
        0.85,
        "share of free memory after the weights for the KV (CUDA); of available RAM x 0.25 on CPU",
        bounds=FRACTION,
    )
    max_running_requests: int = setting(
        64, "requests decoding at once (the req->token table's rows)", bounds=AT_LEAST_1
    )
    max_waiting_requests: int = setting(
        4096, "beyond it new requests are refused (the server's 429)", bounds=AT_LEAST_1
    )
    max_context_len: int | None = setting(
        None, "longest prompt + output (default: the model's)", bounds=AT_LEAST_1
    )
    chunked_prefill_size: int | None = setting(
        None,
        f"tokens of one prompt per prefill step; default by device (CUDA {CUDA_CHUNKED_PREFILL_SIZE},"
        f" CPU {CPU_CHUNKED_PREFILL_SIZE}); 0: no chunking",
        bounds=AT_LEAST_0,
    )
    max_prefill_tokens: int = setting(8192, "new tokens per prefill batch", bounds=AT_LEAST_1)
    schedule_policy: str = setting("lpm", "waiting-queue order", choices=SCHEDULE_POLICIES)
    fairness_timeout: float | None = setting(
        None,
        "seconds after which a waiting request goes first whatever its prefix (default: off)",
        bounds=AT_LEAST_0,
    )
    fairness_lead: float = setting(
        0.1, "requests within this fraction of the timeout go first already", bounds=SHARE
    )
    init_new_token_ratio: float = setting(
        0.7,
        "decode reserve estimate; lower admits more (retraction covers it)",
        bounds=SHARE,
    )
    disable_radix_cache: bool = setting(False, "no prefix cache")
    # Hybrid models (Qwen3-Next, Qwen3.5): the radix cache resumes a prefix from a snapshot of the
    # linear layers' recurrent state at a tree node (scheduler/memory/hybrid_cache.py).
    max_state_snapshots: int | None = setting(
        None,
        "hybrid models: recurrent-state snapshots the prefix cache holds (default: a tenth of the memory,"
        " at most 4 per running request); 0: no prefix hits on hybrids",
        bounds=AT_LEAST_0,
    )
    snapshot_interval: int = setting(
        0,
        "hybrid models: also snapshot every this many tokens of a prefill (0: at branch points, chunk"
        " ends and prompt ends only)",
        bounds=AT_LEAST_0,
    )
    # The host KV tier (docs/architecture.md, "KV tiers"): prefixes evicted from the device pool are
    # written back to host memory (pinned on CUDA) and loaded back when a request hits them.
    host_kv_cache_gb: float = setting(
        0.0, "GiB of host memory for KV evicted from the device (0: no host tier)", bounds=AT_LEAST_0
    )
    host_state_snapshots: int | None = setting(
        None,
        "hybrid models with the host tier: recurrent-state snapshots the host holds for those the device"
        " evicts, out of host_kv_cache_gb (default: half of it); 0: none",
        bounds=AT_LEAST_0,
    )
    kv_write_policy: str = setting(
        "write_back",
        "host tier: copy KV to the host when the device evicts it (write_back) or when it is cached"
        " (write_through: eviction costs no copy, every cached prefix costs one)",
        choices=KV_WRITE_POLICIES,
    )
    # The disk KV tier under the host tier (docs/architecture.md, "KV tiers"): blocks the host tier
    # drops are written to files named by their chained hashes; a restart, or another scheduler
    # sharing the directory, loads them back.
    kv_disk_cache_dir: str | None = setting(
        None, "directory of KV blocks written down from the host tier (needs --host-kv-cache-gb; default off)"
    )
    kv_disk_cache_gb: float = setting(
        16.0, "GiB the disk KV tier's files may take (least recently used go first)", bounds=ABOVE_0
    )
    kv_disk_write_down_s: float = setting(
        10.0,
        "seconds a graceful stop may spend writing the device and host tiers' KV to the disk tier, so"
        " that a restart on the directory starts warm (0: none)",
        bounds=AT_LEAST_0,
    )
    # None: overlap on CUDA, the normal loop on CPU. On CPU the "stream" is a worker thread, and
    # the host's Python and the worker's op dispatch share one GIL: the overlap can hide host work
    # only behind long kernels, which a CPU forward of our models rarely has, so it is opt-in there.
    disable_overlap: bool | None = setting(
        None,
        "the normal loop (default on CPU)",
        negation=("--enable-overlap", "the overlap loop (default on CUDA)"),
    )
    # CPU overlap: forwards whose recent average is shorter than this run inline instead of on the
    # worker thread, whose hand-offs cost more than such a forward (docs/benchmarks.md). 0: always
    # the worker thread (the tests, to exercise it).
    cpu_overlap_thread_min_ms: float = setting(
        10.0,
        "CPU overlap: forwards shorter than this on average run inline, not on the worker thread",
        bounds=AT_LEAST_0,
    )
    attention_backend: str = setting("auto", "auto | torch | cpu | flashinfer")
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    # model/device.py decides, and logs what it decided.
    dtype: str = setting(
        "auto",
        "auto (the checkpoint's, but float32 serves in bfloat16 on CUDA) | float32 | bfloat16 | float16",
    )
    # model/quant/: an FP8 checkpoint's weights stay FP8 whatever this says; device.py picks the GEMM.
    quantization: str = setting(
        "none",
        "fp8: quantize the linear layers' weights to FP8 at load, per output channel (a bf16/fp32"
        " checkpoint; FP8 checkpoints load as FP8 without it)",
        choices=QUANTIZATIONS,
    )
    # stream: the weights come from the s3:// or gs:// store the model folder's manifest names
    # (fetch-model --skip-weights), never written to the cache volume (model/weight_stream.py).
    load_format: str = setting(
        "auto",
        "auto: the model folder's weights (or, fetched with --skip-weights, streamed from its store);"
        " stream: insist on streaming from s3:// or gs://",
        choices=LOAD_FORMATS,
    )
    seed: int = setting(0, "torch's seed (requests with their own seed keep it)", bounds=TORCH_SEED)
    # CUDA: decode batches of up to cuda_graph_max_bs requests replay a graph captured at start
    # (model/graph_runner.py); larger ones, and every prefill, launch eagerly.
    disable_cuda_graph: bool = setting(False, "CUDA: launch decode eagerly, no graphs")
    cuda_graph_max_bs: int = setting(
        160, "CUDA: largest decode batch replayed from a graph", bounds=AT_LEAST_1
    )
    # CPU: run decode through the same padded static-buffer path the graphs use, eagerly (tests: it
    # proves the padding gives the same tokens). No speed benefit on CPU.
    cpu_static_decode: bool = setting(False, "CPU: decode through the graphs' padded static buffers")
    # A short request through every path (prefill, decode, sampling) before the engine is ready, so
    # JIT compilation and first-use costs are paid at start, not by the first user.
    warmup: bool = setting(True, "run warm-up requests before reporting ready")
    # Tensor parallelism (scheduler/parallel/): rank 0 is the scheduler's own process, ranks 1..N-1
    # worker processes it starts; one device each (cuda:0..N-1 from --device's index; CPU: gloo).
    tp_size: int = setting(
        1, "tensor parallelism: devices (one process each) the model is split across", bounds=AT_LEAST_1
    )
    tp_timeout: float = setting(
        120.0,
        "tensor parallelism: seconds a collective may wait for a rank before the scheduler fails",
        bounds=ABOVE_0,
    )


ENGINE_DEFAULTS = EngineConfig()


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """gRPC between the pods (every service both listens and dials): TLS when ``tls_cert``,
    ``tls_key`` and ``tls_ca`` are set (all three, e.g. one Secret mounted in every pod), plaintext
    when none is. The files are read once, at start (rpc.load_tls checks them)."""

    tls_cert: str | None = setting(
        None,
        "PEM certificate chain of this process's gRPC port, also presented when it dials (needs"
        " --tls-key and --tls-ca; default: plaintext gRPC)",
    )
    tls_key: str | None = setting(None, "PEM private key of --tls-cert")
    tls_ca: str | None = setting(
        None, "PEM CA bundle that verifies the servers this process dials (--tls-client-auth: clients too)"
    )
    tls_client_auth: bool = setting(
        False, "mutual TLS: the gRPC port refuses clients without a certificate signed by --tls-ca"
    )
    tls_server_name: str | None = setting(
        None,
        "name to check in the servers' certificates instead of the host dialed (one certificate for"
        " every pod, dialed by IP; default: the host dialed)",
    )


@dataclass(frozen=True, slots=True)
class SchedulerPodConfig:
    """``python -m radixserve.scheduler``: the engine plus its gRPC server, Redis publisher, metrics."""

    detokenizer: str = setting(
        "",
        "HOST:PORT of the detokenizer; several, comma-separated: replicas, the next one used while one"
        " is down",
        required=True,
    )
    host: str = setting("0.0.0.0", "listen address")
    port: int = setting(50051, "gRPC port", bounds=PORT)
    advertise_address: str | None = setting(
        None, "HOST:PORT others reach this pod at (default localhost:PORT)"
    )
    torch_threads: int = setting(0, "torch intra-op threads (0: torch's default)", bounds=AT_LEAST_0)
    drain_timeout: float = setting(
        DRAIN_TIMEOUT_S, "seconds to finish requests at SIGTERM", bounds=AT_LEAST_0
    )
    prefix_index: str = setting(
        "",
        "redis:// or rediss:// URL to publish KV block events and heartbeats to (default: none;"
        " gateways with an in-memory index get them over Watch)",
    )
    metrics_port: int = setting(9400, "Prometheus /metrics port (0: off)", bounds=PORT_OR_0)
    index_key_prefix: str = setting(
        INDEX_KEY_PREFIX, "prefix of every Redis key this pod writes (the operator: one per InferenceService)"
    )
    block_size: int = setting(
        DEFAULT_BLOCK_SIZE, "tokens per hashed block (0: no block events)", bounds=AT_LEAST_0
    )
    heartbeat_interval: float = setting(1.0, "seconds between heartbeats (Redis)", bounds=ABOVE_0)
    heartbeat_ttl: float = setting(5.0, "seconds a heartbeat stays valid (Redis)", bounds=ABOVE_0)
    stall_timeout: float = setting(
        120.0,
        "liveness: the health service reports NOT_SERVING once the engine thread has work and has not"
        " stepped for this many seconds (a hung engine; the kubelet then restarts the pod); 0: off",
        bounds=AT_LEAST_0,
    )
    engine: EngineConfig = field(default_factory=EngineConfig)
    tls: TLSConfig = field(default_factory=TLSConfig)

    def listens(self) -> dict[str, int]:
        """The ports it listens on, by flag (0: off)."""
        return {"--port": self.port, "--metrics-port": self.metrics_port}

    def check(self) -> None:
        distinct_ports(self.listens())


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    router: str = setting("cache-aware", "routing policy", choices=ROUTERS)
    prefix_index: str = setting(
        "memory",
        '"memory" (fed by the schedulers\' Watch streams; one gateway) or a redis:// / rediss:// URL'
        " (password in the URL)",
    )
    block_size: int = setting(
        DEFAULT_BLOCK_SIZE, "tokens per hashed block (as the schedulers)", bounds=AT_LEAST_0
    )
    index_key_prefix: str = setting(INDEX_KEY_PREFIX, "prefix of the Redis keys read (as the schedulers')")
    balance_abs_threshold: int = setting(
        16,
        "cache-aware: route to the least loaded pod when loads differ by more than this ...",
        bounds=AT_LEAST_0,
    )
    balance_rel_threshold: float = setting(1.5, "... and by more than this factor", bounds=ABOVE_0)
    recent_ttl: float = setting(
        10.0, "seconds a prefix counts as held by the pod it was just routed to", bounds=AT_LEAST_0
    )
    working_set_window: float = setting(
        60.0,
        "cache-aware: a new prefix goes to the pod sent the fewest prefix blocks in this many seconds",
        bounds=ABOVE_0,
    )
    kv_fill: float = setting(
        0.9,
        "cache-aware: a new prefix goes first to pods where those blocks + the prompt stay within this"
        " share of the pod's KV capacity",
        bounds=FRACTION,
    )
    tier_weight_device: float = setting(
        1.0, "cache-aware: what a matched prefix block is worth on a pod's device", bounds=SHARE
    )
    tier_weight_host: float = setting(
        0.8, "... on its host memory (--host-kv-cache-gb); at most the device's", bounds=SHARE
    )
    tier_weight_disk: float = setting(
        0.5, "... on its disk, or the disk directory it shares; at most the host's", bounds=SHARE
    )
    sweep_s: float = 1.0  # Redis: how often expired pods are looked for (and removed); not a flag

    def check(self) -> None:
        if self.router == "cache-aware" and self.block_size < 1:
            raise ConfigError(
                f"--block-size {self.block_size}: the cache-aware router hashes prompts in blocks of at"
                " least 1 token (0 suits --router least-load or round-robin)"
            )
        try:
            self.tier_weights()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def tier_weights(self) -> TierWeights:
        """The router's weights of a matched block by tier (ValueError: out of order or range)."""
        return TierWeights(self.tier_weight_device, self.tier_weight_host, self.tier_weight_disk)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """``python -m radixserve.tokenizer``: OpenAI HTTP + gRPC Generate, routing, fan-in."""

    schedulers: tuple[str, ...] = setting(
        (),
        'scheduler pods, HOST:PORT each, or "discover": every scheduler whose heartbeat is live in the'
        " Redis prefix index (under --index-key-prefix), so schedulers come and go without a restart",
        required=True,
    )
    host: str = setting("0.0.0.0", "listen address (HTTP and gRPC)")
    port: int = setting(8000, "HTTP port (OpenAI API)", bounds=PORT)
    grpc_port: int = setting(50050, "gRPC port (Generate; the detokenizer's Deliver)", bounds=PORT)
    advertise_address: str | None = setting(
        None, "HOST:PORT the detokenizer reaches the gRPC port at (default localhost:GRPC_PORT)"
    )
    drain_timeout: float = setting(
        DRAIN_TIMEOUT_S,
        "at SIGTERM, seconds open responses get to finish (match the schedulers')",
        bounds=AT_LEAST_0,
    )
    lost_response_check: float = setting(
        10.0,
        "seconds without news of a request before asking its scheduler whether it still holds it"
        " (one it ended whose response never came is failed with 503, not left hanging); 0: off",
        bounds=AT_LEAST_0,
    )
    max_failovers: int = setting(
        2,
        "times a stream whose scheduler or detokenizer died mid-way is continued on another one (from"
        " the tokens its client has) before it fails with 503; 0: never",
        bounds=AT_LEAST_0,
    )
    scheduler_stale_after: float = setting(
        5.0,
        "seconds without a load report after which a scheduler counts as down: its requests move"
        " to another scheduler (no text yet) or fail with 503, not left hanging (at least 5 reports)",
        bounds=ABOVE_0,
    )
    api_key: tuple[str, ...] = setting(
        (), "API keys a client must send (Authorization: Bearer KEY); several allowed; none: no check"
    )
    api_key_file: str | None = setting(None, "a file of API keys, one per line (e.g. a mounted Secret)")
    protect_metrics: bool = setting(False, "/metrics needs an API key too (/health never does)")
    tool_call_parser: str | None = setting(
        None,
        "the model's tool-call format for chat requests with tools (hermes, llama3_json);"
        " default: the one its chat template shows, if any (else such requests get a 400)",
    )
    reasoning_parser: str | None = setting(
        None,
        "split the model's <think>...</think> into reasoning_content; default: off (the reasoning stays"
        " in content)",
        choices=REASONING_PARSERS,
    )
    chat_template: str | None = setting(
        None, "a Jinja chat template (a file, or the template itself) instead of the model folder's"
    )
    response_store_entries: int = setting(
        10000,
        "responses kept for previous_response_id and GET /v1/responses/{id} (in memory: the latest;"
        " in the prefix index's Redis: each for --response-ttl)",
        bounds=AT_LEAST_1,
    )
    response_store_mb: int = setting(256, "in memory: the stored responses' size bound", bounds=AT_LEAST_1)
    response_ttl: float = setting(86400.0, "seconds a stored response is kept", bounds=ABOVE_0)
    hold_timeout: float = setting(
        0.0,
        "seconds a request waits for a scheduler when none serves (scale to zero: the first one is"
        " starting) before a 503; 0: no waiting, an immediate 503",
        bounds=AT_LEAST_0,
    )
    max_held_requests: int = setting(
        256,
        "requests waiting for a scheduler at once (--hold-timeout); beyond it a 429",
        bounds=Bounds(0, MAX_HELD_REQUESTS),
    )
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    tls: TLSConfig = field(default_factory=TLSConfig)

    def listens(self) -> dict[str, int]:
        """The ports it listens on, by flag."""
        return {"--port": self.port, "--grpc-port": self.grpc_port}

    def check(self) -> None:
        distinct_ports(self.listens())
        if self.hold_timeout > CLIENT_DEADLINE_S:
            raise ConfigError(
                f"--hold-timeout {self.hold_timeout:g}: over {CLIENT_DEADLINE_S:g} s, the OpenAI clients'"
                " default deadline, a held request outlives its client; set it below the clients' timeout"
            )
        if self.hold_timeout > 0 and self.max_held_requests == 0:
            raise ConfigError("--hold-timeout holds requests, --max-held-requests 0 holds none: set it >= 1")


ROUTING_DEFAULTS = RoutingConfig()
GATEWAY_DEFAULTS = GatewayConfig()


@dataclass(frozen=True, slots=True)
class DetokenizerConfig:
    """``python -m radixserve.detokenizer``."""

    host: str = setting("0.0.0.0", "listen address")
    port: int = setting(50052, "gRPC port", bounds=PORT)
    metrics_port: int = setting(9401, "Prometheus /metrics port (0: off)", bounds=PORT_OR_0)
    workers: int = setting(64, "gRPC threads (one per connected scheduler + spare)", bounds=AT_LEAST_1)
    tls: TLSConfig = field(default_factory=TLSConfig)

    def listens(self) -> dict[str, int]:
        """The ports it listens on, by flag (0: off)."""
        return {"--port": self.port, "--metrics-port": self.metrics_port}

    def check(self) -> None:
        distinct_ports(self.listens())


def distinct_ports(ports: dict[str, int]) -> None:
    """ConfigError when two of a service's listening ports (by flag; 0: off) are the same one."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port and port in seen:
            raise ConfigError(f"{flag} {port}: {seen[port]} is that port too (each needs its own)")
        seen[port] = flag
