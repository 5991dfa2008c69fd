"""ModelRunner: the model, its KV pool, the attention backend, the sampler and the FutureMap.

Between the model and the sampler sits ``LogitsProcessor`` (logits.py): logprobs, logit bias,
penalties and the structured-output mask, for the batches whose requests ask (``Req.special``).

``prepare`` runs on the scheduler thread (host work: tensors, attention metadata);
``forward`` runs on the device stream: it resolves placeholder input tokens from the
FutureMap, runs the model, samples, and stores the sampled tokens back into the FutureMap
so that a batch launched before this one's results were read can already feed them.

``prepare`` is two halves: ``plan`` turns the ScheduleBatch into a ``StepPlan`` (host arrays only)
and ``load`` turns a plan into the ForwardBatch. Tensor parallelism (scheduler/parallel.py) runs
``plan`` once, on rank 0, and hands the plan to ``step_sink`` (the other ranks); every rank loads
it and runs ``forward``. Rank 0 samples and broadcasts the tokens, so all ranks agree on them
(unseeded sampling draws from rank 0's generator alone).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import numpy as np
import torch

from radixserve.scheduler.batch import ForwardMode, ScheduleBatch, ScoreLayout
from radixserve.scheduler.memory.host_pool import HostKVPool, KVLoad
from radixserve.scheduler.memory.host_state_pool import HostStatePool
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.memory.state_pool import StatePool
from radixserve.scheduler.memory.tiered_cache import KVTransfers
from radixserve.scheduler.model.attention import GraphAttentionBackend, make_backend
from radixserve.scheduler.model.device import DeviceProfile
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.model.graph_runner import DecodeGraphRunner, pad_rows
from radixserve.scheduler.model.linear_kernels import make_delta_rule
from radixserve.scheduler.model.llama import CausalLM, ModelOutput
from radixserve.scheduler.model.logits import LogitsProcessor, StepScores
from radixserve.scheduler.model.ops import make_ops
from radixserve.scheduler.model.parallel import TPGroup
from radixserve.scheduler.model.quant.linear import use_gemms
from radixserve.scheduler.model.sampler import Sampler, SamplingInfo
from radixserve.scheduler.model.staging import Staging
from radixserve.scheduler.model.state_step import linear_step, run_copies, state_arrays


class FutureMap:
    """Tokens sampled on the device, named by id before they exist.

    Ids grow without bound on the host; on the device they live in a ring big enough for
    every batch that can be in flight at once (a placeholder is read only by the batch
    scheduled right after its own). The extra last entry takes tokens nobody will read
    (the discarded token of a prefill chunk).
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.tokens = torch.zeros(capacity + 1, dtype=torch.int64, device=device)

    def slots(self, future_ids: np.ndarray) -> np.ndarray:
        return np.where(future_ids >= 0, future_ids % self.capacity, self.capacity)

    def encode_inputs(self, ids: np.ndarray) -> np.ndarray:
        """Input ids with placeholders (-1 - future id) rewritten to -1 - ring slot."""
        neg = ids < 0
        if neg.any():
            ids = ids.astype(np.int64, copy=True)
            ids[neg] = -1 - ((-1 - ids[neg]) % self.capacity)
        return ids

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(ids < 0, self.tokens.index_select(0, (-1 - ids).clamp(min=0)), ids)


@dataclass(frozen=True, slots=True)
class StepResult:
    """A step's sampled tokens [B] and, when a request asked, its log-probabilities (device tensors
    until the event loop copies them to the host)."""

    tokens: torch.Tensor
    scores: StepScores | None = None


# StepPlan arrays: the KV tiers' copies (memory/tiered_cache.py, KVTransfers)
KV_TRANSFERS = ("kv_store_src", "kv_store_dst", "kv_load_src", "kv_load_dst", "kv_disk_seq", "kv_load_sync")


@dataclass(slots=True)
class StepPlan:
    """One step's inputs as host arrays: what rank 0 computes from its ScheduleBatch, and the one
    message per step it sends to the other ranks of a tensor-parallel group."""

    mode: ForwardMode
    # input_ids (placeholders as FutureMap slots), positions, out_slots, future_out, rows,
    # prefix_lens, extend_lens: padded to ``bucket`` rows when the decode runs on the static path
    arrays: dict[str, np.ndarray]
    num_real: int  # rows that are requests
    bucket: int | None
    table_writes: np.ndarray | None  # ReqToTokenPool.take_pending since the last step
    score_top_k: int = 0  # alternatives per scored prompt position (arrays score_index / score_targets)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        req_to_token: ReqToTokenPool,
        pool_slots: int,
        max_batch: int,
        profile: DeviceProfile,
        page_size: int = 1,
        flashinfer: ModuleType | None = None,
        step_sink: Callable[[StepPlan], None] | None = None,
        eos_token_ids: Sequence[int] = (),
        state_snapshots: int = 0,
        host_kv_slots: int = 0,
        host_state_snapshots: int = 0,
    ) -> None:
        """``model``: loaded on ``profile.device`` (model/loader.py), the whole model or one rank's
        shard (``model.tp``). ``flashinfer``: the module the fused ops, attention and sampling call
        (None: imported when the profile needs it); the CPU tests pass a stand-in to count the CUDA
        path's launches. ``step_sink``: rank 0 of a tensor-parallel group: gets every step's plan.
        ``eos_token_ids``: the model's end tokens (the sampler holds them back before min_new_tokens).
        ``state_snapshots``: a hybrid model's prefix snapshots beside its rows' states (StatePool).
        ``host_kv_slots``: the host KV tier's slots (HostKVPool; 0: none). ``host_state_snapshots``:
        a hybrid's host snapshot slots (HostStatePool; 0: none)."""
        self.profile = profile
        self.device = profile.device
        self.config = model.config
        mc = model.local_config  # this rank's heads (all of them without tensor parallelism)
        self.model = model
        self.tp: TPGroup | None = model.tp
        self.step_sink = step_sink
        self.model.ops = make_ops(profile.ops, flashinfer, profile.moe)
        if profile.fp8_gemms is not None:
            use_gemms(self.model, profile.fp8_gemms)  # FP8 weights: the profile's GEMM path
        self.req_to_token = req_to_token
        self.kv_pool = KVPool(
            pool_slots, mc.num_kv_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, self.device
        )
        self.host_pool = (
            HostKVPool(host_kv_slots, mc.num_kv_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, self.device)
            if host_kv_slots
            else None
        )
        self.states: StatePool | None = None  # a hybrid model's recurrent states (memory/state_pool.py)
        if mc.hybrid is not None:
            rows = req_to_token.max_running
            self.states = StatePool(mc.hybrid.state_shape(), rows, state_snapshots, mc.dtype, self.device)
            self.delta_rule = make_delta_rule(profile.linear_attention, mc.dtype)
        self.host_states = (  # the host tier's state snapshots (memory/host_state_pool.py)
            HostStatePool(mc.hybrid.state_shape(), host_state_snapshots, mc.dtype, self.device)
            if mc.hybrid is not None and host_state_snapshots
            else None
        )
        self.backend = make_backend(
            profile.attention_backend, self.kv_pool, req_to_token, mc.num_heads, mc.head_dim, page_size,
            flashinfer=flashinfer,
        )  # fmt: skip
        if self.backend.reads_device_table:
            req_to_token.attach_device(self.device)
        if step_sink is not None:
            req_to_token.log_writes()  # the other ranks replay rank 0's table writes
        fi_sampling = getattr(flashinfer, "sampling", None)
        self.sampler = Sampler(flashinfer_module=fi_sampling) if fi_sampling is not None else Sampler()
        self.logits = LogitsProcessor(
            req_to_token.scratch_row + 1, model.config.vocab_size, self.device, eos_token_ids
        )
        self.futures = FutureMap(4 * max_batch + 8, self.device)
        self.staging = Staging(self.device)
        self.graphs = DecodeGraphRunner(
            self.model, self.backend, self.device, profile.graph_max_bs, profile.cuda_graph,
            linear=(self.states, self.delta_rule) if self.states is not None else None,
        )  # fmt: skip
        if self.graphs.capture_graphs:
            max_pages = -(-req_to_token.max_context // page_size)
            cast(GraphAttentionBackend, self.backend).init_graphs(self.graphs.buckets, max_pages)

    def prepare(self, batch: ScheduleBatch) -> ForwardBatch:
        """Host side of a step (scheduler thread): plan it, hand the plan to the other ranks (tensor
        parallelism), load it; the sampling parameters stay here (rank 0 samples)."""
        plan = self.plan(batch)
        if self.step_sink is not None:
            self.step_sink(plan)
        steps = np.maximum(batch.token_index, 0).tolist()
        fb = self.load(plan, SamplingInfo.from_params([r.sampling for r in batch.reqs], steps, self.device))
        if batch.special:
            fb.logits_step = self.logits.plan(batch)
        loads = batch.kv_transfers.load_src if batch.kv_transfers is not None else ()
        if len(loads) and self.host_pool is not None:  # timed by the pool, read when the step is done
            per_token = self.host_pool.bytes_per_slot * (self.tp.size if self.tp is not None else 1)
            batch.kv_load = fb.kv_load = KVLoad(len(loads), len(loads) * per_token)
        return fb

    def plan(self, batch: ScheduleBatch) -> StepPlan:
        """The step's host arrays; a decode batch that fits a graph bucket is padded to it."""
        n = batch.size
        batch.special = any(r.special for r in batch.reqs)
        if batch.special:
            batch.scores = ScoreLayout.of(batch)
            sampled = batch.token_index >= 0  # a prefill chunk samples nothing: its grammar waits for nothing
            batch.constrained = any(
                r.grammar is not None and s for r, s in zip(batch.reqs, sampled, strict=True)
            )
        rows = np.fromiter((r.req_pool_idx for r in batch.reqs), dtype=np.int64, count=n)
        host = {
            "input_ids": self.futures.encode_inputs(batch.input_ids.astype(np.int64)),
            "positions": batch.positions,
            "out_slots": batch.out_slots,
            "future_out": self.futures.slots(batch.future_ids),
            "rows": rows,
            "prefix_lens": batch.prefix_lens,
            "extend_lens": batch.extend_lens,
        }
        bucket = self.graphs.bucket_for(n) if batch.mode is ForwardMode.DECODE else None
        if bucket is not None and bucket != n:
            pads = dict(
                input_ids=0, positions=0, out_slots=0, future_out=self.futures.capacity,
                rows=self.req_to_token.scratch_row, prefix_lens=0, extend_lens=1,
            )  # fmt: skip
            host = pad_rows(host, bucket, pads)
        if self.states is not None:
            host.update(state_arrays(batch))  # not padded: they name batch rows and slots
        if batch.kv_transfers is not None:  # not padded either: host-tier copies, slots of the pools
            host.update(zip(KV_TRANSFERS, batch.kv_transfers, strict=True))
        top_k = 0
        layout = batch.scores
        if layout is not None and layout.prompt:  # prompt positions scored (logprobs): every rank
            host["score_index"] = layout.prompt_index
            host["score_targets"] = layout.prompt_targets
            top_k = layout.prompt_top_k
        return StepPlan(batch.mode, host, n, bucket, self.req_to_token.take_pending(), top_k)

    def load(self, plan: StepPlan, sampling: SamplingInfo | None = None) -> ForwardBatch:
        """The plan's arrays on the device in one staged copy, and the attention metadata.
        ``sampling``: None on the ranks that do not sample (tensor parallelism, ranks > 0)."""
        host, mode = plan.arrays, plan.mode
        writes = plan.table_writes
        if writes is not None and self.step_sink is None and self.tp is not None:
            self.req_to_token.replay(writes)  # rank > 0: rank 0's scheduler wrote these
        sync = writes if writes is not None and self.req_to_token.mirrored else None
        rows = host["rows"]
        seq = host["prefix_lens"] + host["extend_lens"]
        staged_host = self.backend.host_arrays(rows, seq)
        names = ["input_ids", "positions", "out_slots", "future_out"]
        scored = host.get("score_index")
        if scored is not None:
            names.append("score_targets")
        arrays = [host[k] for k in names]
        if mode is not ForwardMode.DECODE:
            # the positions whose logits the model computes: each request's last token, then any
            # prompt positions scored for logprobs (the model scores those: llama.py)
            last = np.cumsum(host["extend_lens"]) - 1
            arrays.append(last if scored is None else np.concatenate([last, scored]))
        hybrid = [rows, host["state_copies"], host["state_inits"]] if self.states is not None else []
        arrays += [*hybrid, *staged_host.values(), *([sync] if sync is not None else [])]
        dev = self.staging.send(arrays)
        if sync is not None:
            self.req_to_token.apply_pending(dev[-1])
        ids, positions, out_slots, future_out = dev[:4]
        k = 4
        score_targets = None
        if scored is not None:
            score_targets, k = dev[4], 5
        last_index = dev[k] if mode is not ForwardMode.DECODE else None
        k += last_index is not None
        linear = None
        if self.states is not None:  # rows as state slots, then the copies to run first
            prefill = mode is not ForwardMode.DECODE
            linear = linear_step(self.states, self.delta_rule, dev[k : k + 3], rows, host, prefill)
            k += 3
        fb = ForwardBatch(
            mode=mode,
            input_ids=ids,
            positions=positions,
            out_slots=out_slots,
            prefix_lens=host["prefix_lens"],
            extend_lens=host["extend_lens"],
            future_out=future_out,
            sampling=sampling,
            last_index=last_index,
            staged_host=staged_host,
            staged=dict(zip(staged_host, dev[k : k + len(staged_host)], strict=True)),
            graph_bucket=plan.bucket,
            num_real=plan.num_real,
            score_rows=0 if scored is None else len(scored),
            score_targets=score_targets,
            score_top_k=plan.score_top_k,
            linear=linear,
            kv_transfers=KVTransfers(*(host[k] for k in KV_TRANSFERS)) if KV_TRANSFERS[0] in host else None,
        )
        self.backend.prepare(fb, rows)
        return fb

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> StepResult:
        """Device side of a step: the sampled tokens [B] and the scores asked for (on the device)."""
        if self.host_pool is not None:
            # An earlier step's loads (a request waited a step for them) before this forward reads them;
            # then this step's write-backs, and loads this forward waits for only if it reads them.
            self.host_pool.wait_loads()
        if fb.kv_transfers is not None:
            assert self.host_pool is not None, "host-tier copies without a host tier"
            self.host_pool.run(self.kv_pool, fb.kv_transfers, fb.kv_load)
        ids = self.futures.resolve(fb.input_ids)
        if fb.linear is not None:  # hybrid: the state copies the scheduler planned, before the step
            run_copies(fb.linear, self.host_states)
        if fb.graph_bucket is not None:
            out = ModelOutput(self.graphs.run(fb, ids))
        else:
            out = self.model(ids, fb.positions, fb, self.backend)
        if self.tp is None:
            result = self._sample(out, fb)
        else:  # rank 0 samples (its generator alone draws the unseeded rows); every rank gets them
            if fb.sampling is not None:
                result = self._sample(out, fb)
                result = StepResult(result.tokens.to(torch.int64), result.scores)
            else:
                result = StepResult(torch.empty(fb.real_size, dtype=torch.int64, device=self.device))
            self.tp.broadcast(result.tokens)
        self.futures.tokens.index_put_((fb.future_out.narrow(0, 0, fb.real_size),), result.tokens)
        return result

    def _sample(self, out: ModelOutput, fb: ForwardBatch) -> StepResult:
        assert fb.sampling is not None
        if fb.logits_step is None:
            return StepResult(self.sampler(out.logits, fb.sampling))
        tokens, scores = self.logits.sample(
            out.logits, fb.sampling, fb.logits_step, self.sampler, out.prompt_scores
        )
        return StepResult(tokens, scores)

    def capture_graphs(self) -> float:
        """Capture the decode graphs (CUDA; nothing on CPU); returns the seconds it took."""
        return self.graphs.capture()
