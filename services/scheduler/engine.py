"""Engine: the offline API over one scheduler pod's engine (no servers, no gRPC).

from radixserve import Engine, SamplingParams
with Engine("path/to/hf-model", page_size=16) as engine:
    out = engine.generate(prompt=["Hello", "Hi"], sampling_params=SamplingParams(max_new_tokens=32))

``tp_size=N`` splits the model over N devices (tensor_parallel.py): this process is rank 0 and
starts the other N-1; the scheduler runs here only.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, Unpack

import numpy as np
import torch

from radixserve.common.config import load_format_problem
from radixserve.common.sampling import SamplingParams, find_stop, stop_in_output
from radixserve.common.service_config import CPU_CHUNKED_PREFILL_SIZE, CUDA_CHUNKED_PREFILL_SIZE, EngineConfig
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.engine_options import EngineOptions
from radixserve.scheduler.event_loop import EventLoop, Step
from radixserve.scheduler.memory.allocator import kv_capacity
from radixserve.scheduler.memory.disk_cache import DiskTieredCache
from radixserve.scheduler.memory.manager import MemoryConfig
from radixserve.scheduler.memory.state_pool import plan_state_memory
from radixserve.scheduler.memory.tier_setup import disk_tier, host_sizes
from radixserve.scheduler.memory.write_down import write_down
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.device import resolve_profile
from radixserve.scheduler.model.loader import load_model
from radixserve.scheduler.model.parallel import ShardLayout, TPGroup, tp_problem
from radixserve.scheduler.model.penalties import PenaltyState
from radixserve.scheduler.model.runner import ModelRunner
from radixserve.scheduler.model.weight_files import open_weights
from radixserve.scheduler.req import FinishReason, Req, TokenLogprob
from radixserve.scheduler.tensor_parallel import RunnerSpec, TPFollowers, start_followers, weight_bytes

if TYPE_CHECKING:
    from radixserve.scheduler.grammar import GrammarBackend
    from radixserve.scheduler.model.llama import CausalLM

log = logging.getLogger(__name__)
GRAMMAR_TIMEOUT_S = 60.0  # compiling one constraint (a huge schema); the gateway checked it already


def chunk_size(requested: int | None, device: str) -> int | None:
    """The scheduler's chunked_prefill_size (None: no chunking) for an engine argument."""
    if requested is None:
        return CUDA_CHUNKED_PREFILL_SIZE if device.startswith("cuda") else CPU_CHUNKED_PREFILL_SIZE
    return requested if requested > 0 else None


PROGRESS_FROM = 256  # Engine.generate shows a progress bar for more prompts than this


class GenerateMeta(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt, served from the prefix cache


class GenerateOutput(TypedDict):
    """One request's result (SGLang's offline shape)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    meta_info: GenerateMeta
    # (logprob, top ids, top logprobs) per token, as asked; a prompt's first entry is None
    output_logprobs: NotRequired[list[TokenLogprob]]
    prompt_logprobs: NotRequired[list[TokenLogprob | None]]


class Engine:
    def __init__(
        self, model_path: str | Path, config: EngineConfig | None = None, **options: Unpack[EngineOptions]
    ) -> None:
        """``config``: every setting (default: EngineConfig's defaults); ``options``: settings that
        replace the config's, by field name (``Engine(path, tp_size=2, dtype="bfloat16")``)."""
        unknown = set(options) - {f.name for f in fields(EngineConfig)}
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}")
        cfg = replace(config or EngineConfig(), **options)
        t_start = time.perf_counter()
        torch.manual_seed(cfg.seed)
        self.model_path = Path(model_path)
        self.config = cfg
        checkpoint = ModelConfig.from_pretrained(model_path, "auto", cfg.quantization)
        problem = tp_problem(checkpoint, cfg.tp_size)
        if problem is not None:
            raise ValueError(f"tensor parallelism: {problem}")
        problem = load_format_problem(self.model_path, cfg.load_format)
        if problem is not None:
            raise ValueError(problem)
        self.profile = resolve_profile(
            ShardLayout.of(checkpoint, 0, cfg.tp_size).local_config(checkpoint),  # rank 0's heads
            device=cfg.device,
            dtype=cfg.dtype,
            attention_backend=cfg.attention_backend,
            disable_cuda_graph=cfg.disable_cuda_graph,
            cuda_graph_max_bs=cfg.cuda_graph_max_bs,
            cpu_static_decode=cfg.cpu_static_decode,
            max_running_requests=cfg.max_running_requests,
        )
        for note in self.profile.notes:
            log.info("device profile: %s", note)
        dev = self.profile.device
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # kernels and libraries that use "the current device" (cuda:N)
        self.model_config = replace(checkpoint, dtype=self.profile.dtype)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self._grammars: GrammarBackend | None = None  # built on the first constrained request
        self._grammar_lock = threading.Lock()
        max_context = cfg.max_context_len or self.model_config.max_position_embeddings
        max_positions = max(max_context, self.model_config.max_position_embeddings)
        self.followers: TPFollowers | None = None
        tp: TPGroup | None = None
        if cfg.tp_size > 1:
            self.followers, tp = start_followers(
                str(model_path), self.model_config, self.profile, max_positions, size=cfg.tp_size,
                mem_fraction=cfg.mem_fraction, page_size=cfg.page_size, timeout_s=cfg.tp_timeout,
            )  # fmt: skip
        setup_s = time.perf_counter() - t_start  # the device profile, the tokenizer, TP followers
        try:
            self._start(model_path, max_context, max_positions, tp)
            self.startup: dict[str, float] = {"engine_setup": setup_s, **self.startup}
        except BaseException:
            if self.followers is not None:
                self.followers.close(1)
            raise
        p = self.profile
        log.info(
            "engine ready on %s (%s, attention %s, ops %s, decode graphs %s) in %.1f s: load %.1f s, "
            "graph capture %.1f s, warm-up %.1f s",
            p.device, str(p.dtype).removeprefix("torch."), p.attention_backend, p.ops,
            f"up to batch {p.graph_max_bs}" if p.cuda_graph else "off",
            time.perf_counter() - t_start, self.startup["weight_load"] + self.startup["kv_allocation"],
            self.startup["graph_capture"], self.startup["kernel_compilation"] + self.startup["warmup"],
        )  # fmt: skip

    def _start(
        self, model_path: str | Path, max_context: int, max_positions: int, tp: TPGroup | None
    ) -> None:
        """Load (this rank's shard of) the model, size the KV pool from the memory left, build the
        scheduler, runner and loop, capture graphs and warm up; with followers, in step with them."""
        cfg, dev, followers = self.config, self.profile.device, self.followers
        t_start = time.perf_counter()
        files = open_weights(Path(model_path))  # streamed: the time is weight_load's
        model = load_model(model_path, self.model_config, dev, max_positions, tp=tp, weights=files)
        t_loaded = time.perf_counter()
        per_token = model.local_config.kv_bytes_per_token()
        kv_tokens, weights, snapshots, kv_left = self._memory_plan(model, per_token)
        self.disk = disk_tier(cfg, model_path, model.local_config)  # None: no disk KV tier
        host = host_sizes(cfg, per_token, model.local_config)  # (KV tokens, state snapshots)
        mem = (max_context, str(dev), kv_left, snapshots, *host)
        self.scheduler = BatchScheduler(self._scheduler_config(*mem), eos_token_ids=self._eos_token_ids())
        kv = self.scheduler.kv
        host_slots = kv.host.pool_slots if kv.host is not None else 0
        self.runner = ModelRunner(
            model,
            self.scheduler.kv.req_to_token,
            self.scheduler.kv.allocator.pool_slots,
            max_batch=cfg.max_running_requests,
            profile=self.profile,
            page_size=cfg.page_size,
            step_sink=followers.send_step if followers is not None else None,
            eos_token_ids=self._eos_token_ids(),
            state_snapshots=snapshots,
            host_kv_slots=host_slots,
            host_state_snapshots=host[1],
        )
        if self.runner.host_pool is not None:
            self.runner.host_pool.disk = self.disk
        if followers is not None:
            table = kv.req_to_token
            shape = (kv.allocator.pool_slots, table.max_running, table.max_context, cfg.max_running_requests)
            followers.disk, disk_dir = self.disk, str(self.disk.store.path) if self.disk is not None else ""
            followers.build(RunnerSpec(*shape, cfg.page_size, snapshots, host_slots, disk_dir, host[1]))
        self.placement = self._placement(weights, per_token, snapshots)
        if cfg.tp_size > 1:
            log.info(
                "tensor parallelism %d: weights per rank %s MiB; KV pool %d tokens (%.1f MiB per rank; "
                "the ranks could hold %s)",
                cfg.tp_size, [round(w / 2**20, 1) for w in weights], kv.capacity,
                kv.capacity * per_token / 2**20, kv_tokens,
            )  # fmt: skip
        overlap = dev.type == "cuda" if cfg.disable_overlap is None else not cfg.disable_overlap
        self.loop = EventLoop(
            self.scheduler, self.runner, overlap=overlap, cpu_thread_min_s=cfg.cpu_overlap_thread_min_ms / 1e3
        )
        self._ids = itertools.count()
        self._closed = False
        # Seconds per start-up phase (startup.py names them; the process's own come from __main__).
        # (kv_allocation: the pool, tables, runner, loop)
        self.startup = {"weight_load": t_loaded - t_start, "kv_allocation": time.perf_counter() - t_loaded}
        self.startup |= dict.fromkeys(("graph_capture", "kernel_compilation", "warmup"), 0.0)
        if followers is not None and self.runner.graphs.capture_graphs:
            followers.capture()  # every rank captures at once: the graphs hold collectives
        self.startup["graph_capture"] = self.runner.capture_graphs()  # CUDA; nothing on CPU
        if cfg.warmup:
            self.warmup()

    def _placement(self, weights: list[int], per_token: int, snapshots: int) -> dict[str, Any]:
        """What this engine holds where, per rank (metrics, benchmarks)."""
        kv, runner = self.scheduler.kv, self.runner
        return {
            "tp_size": self.config.tp_size,
            "weight_bytes_per_rank": weights,
            "kv_tokens": kv.capacity,
            "kv_bytes_per_rank": kv.capacity * per_token,
            "state_snapshots": snapshots,
            "state_bytes_per_rank": runner.states.nbytes if runner.states is not None else 0,
            "host_kv_tokens": kv.host.capacity_tokens if kv.host is not None else 0,
            "host_kv_bytes": runner.host_pool.nbytes if runner.host_pool is not None else 0,
        }

    def _memory_plan(self, model: CausalLM, per_token: int) -> tuple[list[int], list[int], int, int]:
        """What each rank could hold (KV tokens, weight bytes), then the state snapshots and KV tokens
        every rank gets."""
        cfg, followers = self.config, self.followers
        # Rank 0's penalty tables are allocated on the first penalised request: room kept for them.
        penalties = PenaltyState.table_bytes(cfg.max_running_requests + 1, self.model_config.vocab_size)
        kv_tokens = [
            kv_capacity(self.profile.device, per_token, cfg.mem_fraction, cfg.page_size, cfg.tp_size)
            - penalties // per_token
        ]
        weights = [weight_bytes(model)]
        if followers is not None:
            for loaded in followers.loaded():
                kv_tokens.append(loaded.kv_tokens)
                weights.append(loaded.weight_bytes)
        # Every rank's pool has the same slots: the smallest any rank can hold. A hybrid's recurrent
        # states come out of it first (every rank holds the same number, of its own heads).
        snapshots, kv_left = 0, min(kv_tokens)
        local = model.local_config
        if local.hybrid is not None:
            snapshots, kv_left = plan_state_memory(
                local.hybrid.state_shape(), local.dtype, cfg.max_running_requests, kv_left, per_token,
                cfg.max_state_snapshots,
            )  # fmt: skip
        return kv_tokens, weights, snapshots, kv_left

    def attach_grammar(self, req: Req, timeout_s: float = GRAMMAR_TIMEOUT_S) -> None:
        """Give a constrained request its grammar state. Compiling runs on the grammar backend's
        threads (cached per constraint), never the engine thread: callers are the gRPC threads and
        ``generate``. Raises ValueError (a GrammarError) for an invalid constraint."""
        c = req.sampling.constraint
        if c is None:
            return
        with self._grammar_lock:  # two gRPC threads may bring the first constrained requests
            if self._grammars is None:
                from transformers import PreTrainedTokenizerFast

                from radixserve.scheduler.grammar import GrammarBackend  # llguidance: only when asked

                if not isinstance(self.tokenizer, PreTrainedTokenizerFast):
                    raise ValueError("structured outputs need the model's fast tokenizer (tokenizer.json)")
                self._grammars = GrammarBackend(
                    self.tokenizer, self.model_config.vocab_size, self._eos_token_ids()
                )
            backend = self._grammars
        try:
            compiled = backend.compile(c).result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"the constraint took over {timeout_s:g} s to prepare") from None
        req.grammar = backend.matcher(compiled)

    def check_vocab(self, ids: Sequence[int] | np.ndarray, sp: SamplingParams) -> np.ndarray:
        """The prompt as int64 token ids; ValueError for ids outside the model's vocabulary (the prompt's
        or logit_bias'). One vectorised check, for ``generate`` and the worker's every Submit."""
        vocab = self.model_config.vocab_size
        arr = np.asarray(ids)
        if arr.ndim != 1 or (
            arr.size and (arr.dtype.kind not in "iub" or arr.min() < 0 or arr.max() >= vocab)
        ):
            raise ValueError(f"input_ids must be in [0, {vocab}): integer token ids")
        if any(t >= vocab for t, _ in sp.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        return arr.astype(np.int64)

    def _eos_token_ids(self) -> list[int]:
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return sorted(eos)

    def _scheduler_config(
        self, max_context: int, device: str, kv_tokens: int, snapshots: int = 0, host_tokens: int = 0,
        host_snapshots: int = 0,
    ) -> SchedulerConfig:  # fmt: skip
        """The batch scheduler's and the KV pool's settings, resolved from the engine arguments;
        ``kv_tokens``: what the memory left after the weights holds (every rank's); ``snapshots``: a
        hybrid model's prefix state snapshots; ``host_tokens``: the host tier's size (``self.disk``: disk),
        ``host_snapshots``: its state snapshots."""
        cfg = self.config
        # No mix of requests can hold more KV than every running request at full context.
        total = cfg.max_total_tokens or min(kv_tokens, cfg.max_running_requests * max_context)
        mem = MemoryConfig(
            max_total_tokens=total,
            page_size=cfg.page_size,
            max_running_requests=cfg.max_running_requests,
            max_context_len=max_context,
            disable_radix_cache=cfg.disable_radix_cache,
            hybrid=self.model_config.hybrid is not None,
            state_snapshots=snapshots,
            snapshot_interval=cfg.snapshot_interval,
            host_kv_tokens=host_tokens,
            host_state_snapshots=host_snapshots,
            kv_write_through=cfg.kv_write_policy == "write_through",
            disk=self.disk,
        )
        return SchedulerConfig(
            memory=mem,
            policy=cfg.schedule_policy,
            fairness_timeout=cfg.fairness_timeout,
            fairness_lead=cfg.fairness_lead,
            chunked_prefill_size=chunk_size(cfg.chunked_prefill_size, device),
            max_prefill_tokens=cfg.max_prefill_tokens,
            init_new_token_ratio=cfg.init_new_token_ratio,
            min_new_token_ratio=min(0.1, cfg.init_new_token_ratio),
            max_waiting_requests=cfg.max_waiting_requests,
            defer_host_loads=device != "cpu",  # the copies run beside the forward only on CUDA
        )

    def warmup(self) -> None:
        """Pay first-use costs before serving: requests through prefill, decode and every sampling
        path (greedy; top-k, top-p and min-p; seeded), since flashinfer JIT-compiles each kernel on
        first use (minutes on a fresh machine). Their prefixes are dropped from the cache after."""
        t1 = time.perf_counter()
        vocab = self.model_config.vocab_size
        n = min(16, self.scheduler.config.memory.max_context_len - 4)
        samplings = (
            SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True),
            SamplingParams(max_new_tokens=2, temperature=0.7, top_k=20, top_p=0.9, ignore_eos=True),
            SamplingParams(max_new_tokens=2, temperature=0.7, min_p=0.05, seed=1, ignore_eos=True),
        )
        for i, sp in enumerate(samplings):  # one at a time: any queue and batch limit admits it
            ids = np.array([(7 * j + 3 + i) % vocab for j in range(n)], dtype=np.int32)
            req = Req(f"warmup-{i}", ids, sp)
            self.scheduler.check_admissible(req)
            self.scheduler.add(req)
            while not self.scheduler.idle or self.loop.busy:
                self.loop.step()
            self.loop.drain()
            if i == 0:  # the first request: kernels compiled (or loaded from the JIT cache), first uses
                if self.profile.device.type == "cuda":
                    torch.cuda.synchronize(self.profile.device)
                self.startup["kernel_compilation"] = time.perf_counter() - t1
        cache = self.scheduler.kv.cache
        # serving starts from an empty cache (block events need it), on every tier
        cache.evict(cache.evictable_size, write_back=False)
        cache.evict_host(cache.host_size)
        if isinstance(cache, DiskTieredCache):
            cache.forget_captures()  # warm-up prompts are not worth a file
        if self.profile.device.type == "cuda":
            torch.cuda.synchronize(self.profile.device)
        self.startup["warmup"] = time.perf_counter() - t1 - self.startup["kernel_compilation"]

    # ------------------------------------------------------------------ API
    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool | None = None,
        on_step: Callable[[Step], None] | None = None,
    ) -> GenerateOutput | list[GenerateOutput]:
        """Generate for one request (returns a dict) or many (returns a list, in order): any number,
        fed to the waiting queue as it has room. ``progress``: a progress bar on stderr (default: for
        more than PROGRESS_FROM prompts). ``on_step``: called with every loop step's Step (what it
        finished and which batches it processed: benchmarks and tests time and inspect them)."""
        if self._closed:
            raise RuntimeError("the engine was shut down")
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        single = isinstance(prompt, str) or (input_ids is not None and _is_ids(input_ids))
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            all_ids = [self.tokenizer.encode(p) for p in prompts]
        else:
            all_ids = [list(input_ids)] if single else [list(x) for x in input_ids]  # type: ignore[union-attr, arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(all_ids)
        else:
            params = list(sampling_params)
            if len(params) != len(all_ids):
                raise ValueError(f"{len(params)} sampling_params for {len(all_ids)} prompts")
        reqs = []
        for ids, sp in zip(all_ids, params, strict=True):
            sp = replace(sp)  # our own copy: validate() normalises fields in place
            sp.validate()
            reqs.append(Req(f"r{next(self._ids)}", self.check_vocab(ids, sp), sp))
        for r in reqs:  # validate all before queueing any: a rejected call leaves nothing behind
            self.scheduler.check_admissible(r)
            self.attach_grammar(r)
        self._run(reqs, on_step, len(reqs) > PROGRESS_FROM if progress is None else progress)
        outs = [self._output(r) for r in reqs]
        return outs[0] if single else outs

    def _run(self, reqs: list[Req], on_step: Callable[[Step], None] | None, progress: bool) -> None:
        """Step the loop until every request of ``reqs`` has finished, adding them as the waiting
        queue has room (vLLM's LLM.generate takes any number of prompts too)."""
        from tqdm import tqdm

        todo = deque(reqs)
        pending = {r.rid for r in reqs}
        stopping = {r.rid: r for r in reqs if r.sampling.stop}  # the ones stop strings can end
        with tqdm(total=len(reqs), disable=not progress, desc="generate", unit="req") as bar:
            while pending:
                room = self.scheduler.config.max_waiting_requests - len(self.scheduler.waiting)
                while todo and room > 0:
                    self.scheduler.add(todo.popleft())
                    room -= 1
                step = self.loop.step()
                ended = {r.rid for r in step.finished} | self._stopped(stopping, pending)
                if not pending - ended:
                    step = step.then(self.loop.drain())
                if on_step is not None:
                    on_step(step)
                bar.update(len(pending & ended))
                pending -= ended

    def _stopped(self, stopping: dict[str, Req], pending: set[str]) -> set[str]:
        """The requests a stop string in their text ends now (aborted here: the offline engine has
        no detokenizer to find them)."""
        stopped = set()
        for rid, r in stopping.items():
            if rid not in pending:
                continue
            known = r.output_ids[: r.known_len - r.prompt_len]
            if len(known) <= r.sampling.min_new_tokens:  # stop strings wait for min_new_tokens
                continue
            tail = str(self.tokenizer.decode(known[-64:], skip_special_tokens=True))
            if known and find_stop(tail, r.sampling.stop)[0] >= 0:
                self.scheduler.abort(rid, FinishReason.STOP)
                stopped.add(rid)
        return stopped

    def _output(self, r: Req) -> GenerateOutput:
        ids = [t for t in r.output_ids if t >= 0]
        text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        reason = r.finish_reason.value if r.finish_reason else None
        cut, matched = stop_in_output(self.tokenizer, ids, r.sampling)
        if cut >= 0:  # the text ends at the first stop string (after min_new_tokens), which ended it
            text, reason = text[: cut + len(matched) if r.sampling.include_stop_str else cut], "stop"
        meta = GenerateMeta(
            prompt_tokens=r.prompt_len, completion_tokens=len(ids), cached_tokens=r.num_cached_tokens
        )
        out = GenerateOutput(text=text, token_ids=ids, finish_reason=reason, meta_info=meta)
        if r.sampling.logprobs is not None:
            out["output_logprobs"] = r.output_logprobs[: len(ids)]
        if r.prompt_logprobs is not None:
            out["prompt_logprobs"] = r.prompt_logprobs
        return out

    # ------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.loop.close()
                host_pool, per_token = self.runner.host_pool, self.model_config.kv_bytes_per_token()
                if self.disk is not None and host_pool is not None:  # a restart starts warm
                    f, deadline = self.followers, self.config.kv_disk_write_down_s
                    to_ranks = f.send_copies if f is not None else None  # every rank runs the copies
                    write_down(
                        self.scheduler.kv, host_pool, self.runner.kv_pool, per_token, deadline, to_ranks
                    )
                if self._grammars is not None:
                    self._grammars.close()
            finally:
                if self.followers is not None:
                    self.followers.close()
                if self.disk is not None:
                    self.disk.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _is_ids(x: Sequence[int] | Sequence[Sequence[int]]) -> bool:
    return len(x) == 0 or isinstance(x[0], int)
