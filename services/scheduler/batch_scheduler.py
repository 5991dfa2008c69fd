"""BatchScheduler: picks each engine step's batch and folds its sampled tokens back in.

The model-free heart of the scheduler pod. An event loop calls

    batch = scheduler.schedule()            # prefill if it can, else decode
    tokens = runner.forward(batch)          # the model (or a cost model in benchmarks)
    finished = scheduler.process(batch, tokens)

Prefill goes first (new requests join the running batch soon), except that after
``max_consecutive_prefills`` prefill steps in a row one decode step runs, so a
sustained stream of (chunked) prefills never starves running decodes. When the pool
cannot hold the next token of every running request, the requests with the least
progress are retracted to the waiting queue (their written KV stays in the cache,
where it may still hit) and ``new_token_ratio`` rises; it decays back step by step.

With a ``fairness_timeout``, a request that waited longer is offered first and, when
the KV pool or the running limit keeps it out, preempts running requests that arrived
after it: it runs in the next prefill batch instead of waiting for decodes to drain.
Requests due soon (``fairness_lead``) are offered right after overdue ones: younger
requests stop taking the memory they will need, so they are not overdue and still
waiting for older decodes (which nothing preempts) to drain.

Admission keeps the cached prefixes the rest of the queue will hit, and starts a shared
prefix only with room for the requests waiting to hit it (PrefillAdder, ``keep_wanted``).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Container, Sequence
from typing import TYPE_CHECKING

import numpy as np

from radixserve.scheduler.batch import ForwardMode, ScheduleBatch, store_scores
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.allocator import pages_for
from radixserve.scheduler.memory.manager import KVCacheManager
from radixserve.scheduler.memory.radix_cache import TreeNode
from radixserve.scheduler.policy.prefill_adder import AddResult, PrefillAdder, decode_reserve
from radixserve.scheduler.policy.schedule_policy import SchedulePolicy
from radixserve.scheduler.req import FinishReason, Req

if TYPE_CHECKING:  # the scheduler itself is model-free: it only reads the host copies of the scores
    from radixserve.scheduler.model.logits import StepScores

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should answer 'overloaded'."""


class BatchScheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: Sequence[int] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(config.memory)
        self.policy = SchedulePolicy(config, self.kv)
        self.waiting: list[Req] = []  # arrival order
        self.running: list[Req] = []  # decoding
        self.chunked: Req | None = None  # prefill cut into chunks, continues next prefill step
        self.new_token_ratio = config.init_new_token_ratio
        self._ratio_decay = (config.init_new_token_ratio - config.min_new_token_ratio) / max(
            1, config.new_token_ratio_decay_steps
        )
        self.consecutive_prefills = 0
        self.num_retractions = 0
        self.num_fairness_preemptions = 0
        self.prefill_tokens = 0  # prompt tokens computed (not served from the prefix cache), all told
        self.in_flight: list[ScheduleBatch] = []  # scheduled, results not processed yet
        self._next_future = 0  # FutureMap ids, never reused (the runner maps them onto a ring)

    # ----------------------------------------------------------------- intake
    def add(self, req: Req) -> None:
        """Queue a request; raises ValueError for one that can never run, QueueFullError when full."""
        self.check_admissible(req)
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(f"waiting queue is full ({len(self.waiting)} requests)")
        self._enqueue(req)

    def check_admissible(self, req: Req) -> None:
        """Raise ValueError if ``req`` can never run here (it is not queued)."""
        mem = self.config.memory
        req.sampling.validate()
        if req.prompt_len == 0:
            raise ValueError("the prompt is empty")
        if req.prompt_len + req.sampling.max_new_tokens > mem.max_context_len:
            raise ValueError(
                f"prompt ({req.prompt_len} tokens) + max_new_tokens ({req.sampling.max_new_tokens}) "
                f"exceeds the context length {mem.max_context_len}"
            )
        if req.prompt_len + req.sampling.max_new_tokens > self.kv.capacity:
            # A request alone must always fit, or retraction could not guarantee progress.
            raise ValueError(
                f"prompt ({req.prompt_len} tokens) + max_new_tokens ({req.sampling.max_new_tokens}) "
                f"exceeds the KV capacity {self.kv.capacity}"
            )

    def _enqueue(self, req: Req) -> None:
        if not self.waiting or self.waiting[-1].arrival_time <= req.arrival_time:
            self.waiting.append(req)
        else:  # a retracted request goes back to its place in arrival order
            keys = [r.arrival_time for r in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, req.arrival_time), req)

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT) -> Req | None:
        """Drop a request wherever it is and free its KV at once.

        A request in a batch that is still running keeps its KV until ``process`` sees the
        batch's results: the forward may still be writing those slots.
        """
        for batch in self.in_flight:
            for r, epoch in zip(batch.reqs, batch.epochs.tolist(), strict=True):
                # (a request retracted since that batch lives in the waiting queue: handled below)
                if r.rid == rid and not r.finished and r.retractions == epoch:
                    r.finish_reason = reason
                    r.drop_pending()
                    if r in self.running:
                        self.running.remove(r)
                    if self.chunked is r:
                        self.chunked = None
                    return r
        for queue in (self.waiting, self.running):
            for i, r in enumerate(queue):
                if r.rid == rid:
                    del queue[i]
                    r.drop_pending()
                    return self._finish(r, reason)
        if self.chunked is not None and self.chunked.rid == rid:
            r, self.chunked = self.chunked, None
            return self._finish(r, reason)
        return None

    def _finish(self, req: Req, reason: FinishReason) -> Req:
        req.finish_reason = req.finish_reason or reason
        self.kv.release(req)
        return req

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked is None and not self.in_flight

    def live_requests(self) -> list[Req]:
        """Every request that may hold KV or wait for it (for accounting checks)."""
        live = {id(r): r for r in self.waiting + self.running}
        if self.chunked is not None:
            live[id(self.chunked)] = self.chunked
        for b in self.in_flight:  # includes requests aborted in flight: they hold KV until process()
            live.update((id(r), r) for r in b.reqs if not r.finished or r.req_pool_idx is not None)
        return list(live.values())

    # --------------------------------------------------------------- schedule
    def schedule(self) -> ScheduleBatch | None:
        """The next batch to run, or None when there is nothing to do."""
        self.kv.poll()  # the disk tier's finished reads, before anything matches
        batch = self._schedule()
        if batch is not None:
            self.in_flight.append(batch)
        return batch

    def _schedule(self) -> ScheduleBatch | None:
        decode_first = self.running and self.consecutive_prefills >= self.config.max_consecutive_prefills
        order = (self._schedule_decode, self._schedule_prefill)
        for pick in order if decode_first else order[::-1]:
            batch = pick()
            if batch is not None:
                prefill = batch.mode is ForwardMode.EXTEND
                self.consecutive_prefills = self.consecutive_prefills + 1 if prefill else 0
                if self.kv.states is not None:  # a hybrid model: its state copies and snapshots
                    batch.states = self.kv.states.plan(batch)
                # Copies the host tier queued while this batch took its pages: write-backs first (a
                # page written back may be one this batch writes), loads beside it unless it reads them
                # (only a prefill can: a decode's requests run on device paths no load writes).
                readers = batch.reqs if prefill else ()
                batch.kv_transfers, batch.kv_loads_for = self.kv.take_transfers(readers)
                self.kv.settle_hits()
                self._commit(batch)
                return batch
        self.kv.settle_hits()  # (admissions all undone: nothing)
        return None

    def _commit(self, batch: ScheduleBatch) -> None:
        """The batch is launched: its KV writes count as done from here on (the device runs batches
        in order), and every request that completes a forward gets a placeholder output token, a
        FutureMap id, that the next batch may already feed. ``process`` fills in the real token.
        """
        # Per request, per step: plain lists and local names (this loop runs for every decode).
        token_index, future_ids, epochs = [], [], []
        fid = self._next_future
        extend = batch.mode is ForwardMode.EXTEND
        if extend:
            self.prefill_tokens += int(batch.extend_lens.sum())
        for req, n in zip(batch.reqs, batch.extend_lens.tolist(), strict=True):
            epochs.append(req.retractions)
            req.kv_len += n
            out = req.output_ids
            if req.kv_len < len(req.origin_ids) + len(out):  # a chunk: no token is sampled
                token_index.append(-1)
                future_ids.append(-1)
                continue
            token_index.append(len(out))
            future_ids.append(fid)
            out.append(placeholder(fid))
            fid += 1
            if extend:
                self.running.append(req)
        self._next_future = fid
        batch.token_index = np.array(token_index, dtype=np.int64)
        batch.future_ids = np.array(future_ids, dtype=np.int64)
        batch.epochs = np.array(epochs, dtype=np.int64)

    def _schedule_prefill(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked is None:
            self.kv.want_hits_of(())  # nobody waits: no prefix is wanted
            return None
        now = self.clock()
        if self.config.fairness_timeout is not None and self.chunked is None:
            self._make_room_for_overdue(now)
        adder = PrefillAdder(self.config, self.kv, self.running, self.new_token_ratio)
        chunked, self.chunked = self.chunked, None
        if chunked is not None and adder.add_chunked(chunked) is not AddResult.ADDED:
            self.chunked = chunked  # no room this step; it keeps its KV and lock
        if self.chunked is None:
            in_prefill = [chunked] if chunked is not None else []
            ordered = self.policy.order(self.waiting, now, in_prefill)
            # Admit new work only into room that keeps the prefixes the rest of the queue will
            # hit: evicting one to run a request sooner costs its whole prefill again later.
            # Requests the fairness bound serves first are exempt (they must get room).
            self.kv.want_hits_of(self.waiting)
            for _ in range(2):  # a second pass when requests wait for loads and nothing else would run
                for req in ordered:
                    keep = not self.policy.due_soon(req, now)
                    followers = self.policy.followers.get(id(req), ())
                    added = adder.add(req, keep_wanted=keep, followers=followers)
                    if added is AddResult.WAITING:  # its prefix is read from disk or loaded: the rest go on
                        continue
                    if added is not AddResult.ADDED:
                        break
                    if followers and self.kv.states is not None:
                        self.kv.states.lead(req, followers)  # snapshot where they will resume
                    req.waited = now - req.queue_time  # queue_time already counts earlier waits
                    if req.admit_time is None:
                        req.admit_time = now
                        req.num_cached_tokens = req.cached_len
                if adder.reqs or self.running or not adder.loading:
                    break
                adder.load_now()  # waiting would idle the device: they run now, their forward waits
            self.kv.release_loads()
        if not adder.reqs:
            return None
        admitted = {id(r) for r in adder.reqs}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        self.chunked = adder.chunked
        return ScheduleBatch.extend(adder.reqs, adder.extend_lens, np.concatenate(adder.out_slots))

    def _decode_candidates(self) -> list[Req]:
        # A request whose last token is pending and will reach max_new_tokens only waits for it.
        return [r for r in self.running if len(r.output_ids) < r.sampling.max_new_tokens]

    def _schedule_decode(self) -> ScheduleBatch | None:
        reqs = self._decode_candidates()
        if not reqs:
            return None
        if not self._decode_fits(reqs):
            if not self._retract_until_fits():
                return None
            reqs = self._decode_candidates()  # retraction may have taken the last one
            if not reqs:
                return None
        self.new_token_ratio = max(self.config.min_new_token_ratio, self.new_token_ratio - self._ratio_decay)
        slots = self.kv.alloc_decode(reqs)
        return ScheduleBatch.decode(reqs, slots)

    def _retract_until_fits(self) -> bool:
        """Retract until every decode candidate's next token fits; False when it cannot fit yet.

        It cannot fit yet only while a batch in flight still holds KV that its ``process`` will
        free (a request aborted or finished in it): the caller then runs no decode this step.
        """
        timeout = self.config.fairness_timeout if self.config.fairness_timeout is not None else float("inf")
        retracted = False
        while not self._decode_fits():
            if len(self.running) > 1:
                # Least progress first; among equals the longest prompt frees the most. Under the
                # fairness bound, requests admitted as overdue go last.
                victim = min(
                    self.running, key=lambda r: (r.waited > timeout, len(r.output_ids), -r.prompt_len)
                )
                self.running.remove(victim)
            elif self.chunked is not None:
                victim, self.chunked = self.chunked, None
            elif self.in_flight:
                return False
            else:
                raise AssertionError("a lone request cannot grow: add() admits only requests that fit alone")
            self._retract(victim)
            retracted = True
        if retracted:
            self.new_token_ratio = min(1.0, self.new_token_ratio + self.config.retract_ratio_step)
        return True

    def _retract(self, req: Req) -> None:
        """Back to the waiting queue; its written KV stays in the cache (evictable).

        Tokens still pending in a batch in flight are dropped (that batch's ``process`` skips the
        request: its epoch changed); the request computes them again when it is re-admitted.
        """
        self.kv.release(req)
        req.drop_pending()
        req.queue_time = self.clock() - req.waited  # its fairness clock resumes, running time excluded
        req.retractions += 1
        self.num_retractions += 1
        self._enqueue(req)

    def _make_room_for_overdue(self, now: float) -> None:
        """The fairness bound: overdue requests preempt running requests younger than them.

        Without this an overdue request goes first in the order but can still wait for running
        decodes to drain the KV pool. Requests are served in the policy's fairness order (overdue,
        then due soon, each oldest first), each preempting only running requests that arrived
        after it, so the oldest request always progresses (well founded). Room is made for all of
        them that fit together, not just the first: a request that falls due while the first one's
        prefill runs would otherwise wait one more batch. Nothing happens until some request is
        overdue (then the due-soon ones get room too), and nothing is preempted in vain: where
        retracting every younger running request would not make room for the next one, it and
        those after it wait.

        A head's cached prefix counts against the room when nobody locks it now: it is evictable,
        so part of ``available()``, and admitting the head locks it.
        """
        overdue, due, _ = self.policy.fairness_tiers(self.waiting, now)
        if not overdue:
            return
        cfg, ps = self.config, self.kv.page_size
        ratio, clip = self.new_token_ratio, cfg.clip_max_new_tokens
        need = rows = 0  # KV tokens and table rows the requests served so far need
        paths: dict[TreeNode, None] = {}  # the served requests' matched prefix nodes

        def relocked() -> int:  # cached prefix tokens of theirs that are evictable now
            return sum(len(n) for n in paths if n.lock_ref == 0)

        def short() -> int:
            return need + relocked() + decode_reserve(self.running, ratio, clip) - self.kv.available()

        def rows_short() -> int:
            return max(len(self.running) + rows - cfg.running_limit, rows - self.kv.req_to_token.num_free)

        for head in overdue + due:
            m = self.kv.match(head)
            need += pages_for(head.seq_len - len(m.slots), ps) * ps + decode_reserve((head,), ratio, clip)
            rows += 1
            node = m.node
            while node is not None and node.parent is not None:
                paths[node] = None
                node = node.parent
            if short() <= 0 and rows_short() <= 0:
                continue
            younger = sorted(
                (r for r in self.running if r.arrival_time > head.arrival_time), key=lambda r: -r.arrival_time
            )
            gain = self._freed_by(younger, keep=paths) + decode_reserve(younger, ratio, clip)
            if short() > gain or rows_short() > len(younger):
                return
            for victim in younger:
                if short() <= 0 and rows_short() <= 0:
                    break
                self.running.remove(victim)
                self._retract(victim)
            self.num_fairness_preemptions += 1

    def _freed_by(self, victims: Sequence[Req], keep: Container[TreeNode] = ()) -> int:
        """KV tokens that retracting all of ``victims`` makes available: their private pages and
        the cached prefix nodes that only they lock (a prefix another running request shares stays;
        so do the nodes in ``keep``, which the requests being admitted will lock again).
        """
        locks: dict[TreeNode, int] = {}
        freed = 0
        for r in victims:
            freed += self.kv.private_pages(r) * self.kv.page_size
            node = r.last_node
            while node is not None and node.parent is not None:  # the root is never freed
                locks[node] = locks.get(node, 0) + 1
                node = node.parent
        return freed + sum(len(n) for n, k in locks.items() if k == n.lock_ref and n not in keep)

    def _decode_fits(self, reqs: Sequence[Req] | None = None) -> bool:
        reqs = self._decode_candidates() if reqs is None else reqs
        return self.kv.decode_pages_needed(reqs) * self.kv.page_size <= self.kv.available()

    # ---------------------------------------------------------------- results
    def process(
        self,
        batch: ScheduleBatch,
        next_token_ids: Sequence[int] | np.ndarray,
        scores: StepScores | None = None,
    ) -> list[Req]:
        """Fold one step's sampled tokens (one per request) back in, with their log-probabilities for
        the requests that asked (``batch.scores`` says which rows ``scores`` holds); returns the
        finished requests."""
        self.in_flight.remove(batch)
        tokens = next_token_ids.tolist() if isinstance(next_token_ids, np.ndarray) else list(next_token_ids)
        if len(tokens) != batch.size:
            raise ValueError(f"{len(tokens)} tokens for a batch of {batch.size}")
        finished = []
        extend = batch.mode is ForwardMode.EXTEND
        written = (batch.prefix_lens + batch.extend_lens).tolist()
        eos = self.eos_token_ids
        if scores is not None and batch.scores is not None:
            store_scores(batch, scores)
        per_request = zip(
            batch.reqs, tokens, batch.epochs.tolist(), batch.token_index.tolist(), written, strict=True
        )
        for req, tok, epoch, idx, upto in per_request:
            if req.finish_reason is not None:  # aborted while in flight: its KV can go now
                self.kv.release(req)
                continue
            if req.retractions != epoch:
                continue  # retracted since this batch was scheduled: its results are void
            if extend:  # hand what this batch wrote to the cache; keep it locked
                self.kv.cache_written(req, upto)
            if idx < 0:
                continue  # a chunk
            req.output_ids[idx] = tok  # the placeholder becomes the sampled token
            req._fill_cache = None
            sp = req.sampling
            ended = self._grammar_end(req, tok) if req.grammar is not None else None
            if ended is not None:
                req.truncate_output(idx + (ended is FinishReason.STOP))  # a refused token is not output
                self.running.remove(req)
                finished.append(self._finish(req, ended))
                continue
            if idx + 1 >= sp.max_new_tokens or tok in eos or tok in sp.stop_token_ids:  # rare: check fully
                reason = self._stop_reason(req, tok, idx)
                if reason is not None:
                    req.truncate_output(idx + 1)  # drop a token already pending behind the last one
                    self.running.remove(req)
                    finished.append(self._finish(req, reason))
        if batch.states is not None and batch.states.taken:
            assert self.kv.states is not None
            self.kv.states.settle(batch)  # the snapshots this step took, to the tree
        return finished

    def _grammar_end(self, req: Req, tok: int) -> FinishReason | None:
        """Advance ``req``'s grammar by its new token: STOP when the output is complete, ABORT when
        the grammar refused the token, None while it goes on."""
        assert req.grammar is not None
        if not req.grammar.accept(tok):
            # The mask allowed only what the grammar accepts, so this is a bug: end the request
            # (aborted, without the token) rather than let it go on unconstrained.
            log.error(
                "request %s: its grammar refused token %d (%s); ending it", req.rid, tok, req.grammar.error
            )
            return FinishReason.ABORT
        return FinishReason.STOP if req.grammar.done else None

    def _stop_reason(self, req: Req, tok: int, idx: int) -> FinishReason | None:
        sp = req.sampling
        if sp.max_new_tokens == 0:  # it only scored its prompt: the token sampled after it is not output
            req.truncate_output(0)
            return FinishReason.LENGTH
        if (not sp.ignore_eos and tok in self.eos_token_ids) or tok in sp.stop_token_ids:
            return FinishReason.STOP
        if idx + 1 >= sp.max_new_tokens:
            return FinishReason.LENGTH
        return None


def placeholder(future_id: int) -> int:
    """The output-token value that stands for FutureMap entry ``future_id`` until it is sampled."""
    return -1 - future_id
