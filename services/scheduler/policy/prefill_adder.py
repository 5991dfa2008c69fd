"""PrefillAdder: admit waiting requests into one prefill batch within its budgets.

Budgets, all in tokens:

* total: free + evictable KV, minus what is promised: a reserve for the decodes of
  running requests (``remaining max_new_tokens * new_token_ratio`` each) and, for every
  request admitted, the rest of its prompt not yet allocated plus its own decode reserve;
* prefill: at most ``max_prefill_tokens`` new tokens computed in the batch;
* chunk: a request with more uncached tokens than fit is cut to a chunk and finishes
  in later steps (one chunked request at a time).

A request is admitted only when its whole uncached prompt fits, not just its first
chunk, and the rest stays promised to it: a chunked prefill never stalls half way for
memory that later admissions took (and while stalled, blocks every admission).

Only the uncached suffix of a request counts: its cached prefix costs nothing but a
lock.

Two more things are kept out of the total (``keep_wanted``: for every request the fairness
bound does not serve first, unless the engine is idle); they bind only when memory is short:

* cached prefixes that other waiting requests matched and nobody locks: evicting one to
  admit a request now costs its whole prefill again later (a multi-tenant pod with room
  for few system prompts recomputed one tenant's 600-token prompt per burst);
* for a request that computes a prefix other waiting requests were held back to hit
  (de-duplication, ``SchedulePolicy.followers``), their room too: starting a prefix whose
  requests cannot run beside what runs pins it in memory and shrinks every decode batch
  until its tenant is done (in that burst: 73 decode steps at a mean batch of 14.6 without
  this rule, 68 at 15.7 with it).

Requests are taken in the policy's order and admission stops at the first one that
does not fit, so a large request at the head (an overdue one, say) is not overtaken
forever by smaller ones behind it.

A request whose cached prefix is not on the device yet waits (``AddResult.WAITING``) while the
others go on: one on disk until its read lands (then it is on the host), one on the host for a
step: its load is started (device pages, the copies queued to run with this step, beside its
batch: ``KVCacheManager.start_load``) and it is admitted at the next step, when the copies are
done, into the room kept for it now. So is a request whose prefix such a load brings. With
``defer_loads`` off (the scheduler's second pass, when the first admitted nothing and nothing
runs: waiting would idle the device; or ``SchedulerConfig.defer_host_loads`` off: CPU) they are
admitted at once and the step's forward waits for the loads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum

import numpy as np
import numpy.typing as npt

from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.allocator import pages_for
from radixserve.scheduler.memory.manager import KVCacheManager
from radixserve.scheduler.memory.radix_cache import MatchResult, common_len
from radixserve.scheduler.req import Req


def decode_reserve(reqs: Iterable[Req], ratio: float, clip: int) -> int:
    """KV tokens to keep back for the decodes still ahead of ``reqs`` (an estimate)."""
    # max(0, ...): a request scoring its prompt only (max_new_tokens 0) holds a placeholder token
    return int(sum(max(0, min(r.sampling.max_new_tokens - len(r.output_ids), clip)) for r in reqs) * ratio)


class AddResult(Enum):
    ADDED = "added"
    NO_ROOM = "no_room"  # the KV budget is spent
    BATCH_FULL = "batch_full"  # prefill-token or running-request limit reached
    # its cached prefix is being read from disk or loaded from the host, or a hybrid's snapshot waits
    # for a device slot: the others go on
    WAITING = "waiting"


class PrefillAdder:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, running: Sequence[Req], new_token_ratio: float
    ) -> None:
        self.config = config
        self.kv = kv
        self.ratio = new_token_ratio
        self.reserved = self._running_reserve = decode_reserve(
            running, new_token_ratio, config.clip_max_new_tokens
        )
        self.rem_prefill = config.max_prefill_tokens
        self.num_running = len(running)
        self.reqs: list[Req] = []
        self.extend_lens: list[int] = []
        # per admitted request, the slots its new tokens write
        self.out_slots: list[npt.NDArray[np.int64]] = []
        self.chunked: Req | None = None  # the request cut short in this batch, if any
        self.defer_loads = config.defer_host_loads  # one whose prefix is on the host waits a step
        self.loading = 0  # requests waiting for loads started this step (admitted next step)

    def load_now(self) -> None:
        """For a second pass after one that admitted nothing while requests waited for loads, and
        with nothing running: waiting would idle the device, so they are admitted at once (the
        step's forward waits for their loads)."""
        assert not self.reqs
        self.defer_loads, self.loading, self.reserved = False, 0, self._running_reserve

    def _decode_reserve(self, req: Req) -> int:
        return decode_reserve((req,), self.ratio, self.config.clip_max_new_tokens)

    def _chunk_limit(self) -> int:
        limit = self.rem_prefill
        if self.config.chunked_prefill_size is not None:
            limit = min(limit, self.config.chunked_prefill_size)
        return limit

    def _still_needs(self, req: Req, alloc: int | None = None) -> int:
        """KV tokens ``req`` will still take: the unallocated rest of its prompt + its decode reserve
        (``alloc``: as if its first ``alloc`` tokens had slots, a prefix it is loading)."""
        ps, alloc = self.kv.page_size, req.alloc_len if alloc is None else alloc
        return (pages_for(req.seq_len, ps) - pages_for(alloc, ps)) * ps + self._decode_reserve(req)

    def _followers_need(self, req: Req, followers: Sequence[Req]) -> int:
        """KV tokens the requests held back behind ``req`` will take once its prefix is cached (as
        many as can run beside it): each one's part past the prefix it shares with ``req``, and
        its decode reserve."""
        ps = self.kv.page_size
        room = self.config.running_limit - self.num_running - len(self.reqs) - self.loading - 1
        ids = req.fill_ids()
        need = 0
        for f in followers[: max(0, room)]:
            shared = common_len(ids, f.fill_ids(), ps)  # whole pages: what f will find cached
            need += (pages_for(f.seq_len, ps) - shared // ps) * ps + self._decode_reserve(f)
        return need

    def _fits(
        self, req: Req, keep_wanted: bool = False, followers: Sequence[Req] = (), alloc: int | None = None
    ) -> bool:
        need = self._still_needs(req, alloc)
        if self.num_running == 0 and not self.reqs and not self.loading:
            # The decode reserve is an estimate; on an idle engine it must not keep a request
            # out for good (retraction covers a wrong estimate). Nor may wanted prefixes or
            # followers: with nothing running, nothing would ever free room for it.
            need -= self._decode_reserve(req)
            keep_wanted = False
        if keep_wanted:
            need += self._followers_need(req, followers)
        available = self.kv.available_keeping_wanted() if keep_wanted else self.kv.available()
        return available - self.reserved >= need

    def _take(self, req: Req, n: int) -> None:
        req.load_started = False
        self.out_slots.append(self.kv.alloc_extend(req, n))
        self.reserved += self._still_needs(req)  # promised to it from now on
        if n < req.remaining_prefill:
            self.chunked = req
        self.reqs.append(req)
        self.extend_lens.append(n)
        self.rem_prefill -= n

    def add_chunked(self, req: Req) -> AddResult:
        """Continue a request whose prefill was cut into chunks (it already holds KV)."""
        n = min(req.remaining_prefill, self._chunk_limit())
        if n <= 0:
            return AddResult.BATCH_FULL
        if not self._fits(req):  # only fails when decodes outgrew their reserve
            return AddResult.NO_ROOM
        self._take(req, n)
        return AddResult.ADDED

    def add(self, req: Req, keep_wanted: bool = False, followers: Sequence[Req] = ()) -> AddResult:
        """Try to admit a waiting request.

        ``keep_wanted``: only into room that evicts no cached prefix another waiting request will
        hit (``KVCacheManager.want_hits_of``), and, when ``req`` is the first of ``followers``
        (requests held back to hit the prefix it computes), only with room for them too: a prefix
        started without room for its requests is wanted memory that runs nothing.
        """
        if (
            self.num_running + len(self.reqs) + self.loading >= self.config.running_limit
            or self.kv.req_to_token.num_free <= self.loading
        ):
            return AddResult.BATCH_FULL
        if req.load_started:  # its room was checked when its load started, the wanted prefixes' too
            keep_wanted, followers = False, ()
        m = self.kv.cached_match(req)
        if self.kv.read_disk(req, m):  # its prefix is on disk: read (it is admitted once here)
            return AddResult.WAITING
        if self.defer_loads and self.kv.reads_loading(m.node):
            # A load this step brings its prefix: it joins the next step. Counted as loading: when
            # nothing else runs, the second pass admits it now (else no batch would ever carry
            # the load: one queued by an admission undone in a step that ran nothing waited forever).
            self.loading += 1
            return AddResult.WAITING
        extend = req.seq_len - m.length  # a host-tier part is loaded back, not computed
        n = extend
        limit = self._chunk_limit()
        if n > limit:
            if self.config.chunked_prefill_size is not None and self.chunked is None and limit > 0:
                n = limit
            elif not self.reqs and self.config.chunked_prefill_size is None:
                pass  # no chunking: a request larger than the prefill budget still runs alone
            else:
                return AddResult.BATCH_FULL
        if not self.kv.cache.can_resume(m):  # a hybrid's host snapshot with no device slot to go to
            return AddResult.WAITING
        if self.defer_loads and m.host_node is not None:
            return self._wait_for_load(req, m, keep_wanted, followers)
        self.kv.admit(req, m)  # locks its own prefix: not counted as wanted room below
        if req.cached_len < m.length or not self._fits(req, keep_wanted, followers):
            # (a host-tier part the device had no room to load: the request does not fit either)
            self.kv.unadmit(req)
            return AddResult.NO_ROOM
        self._take(req, n)
        return AddResult.ADDED

    def _wait_for_load(
        self, req: Req, m: MatchResult, keep_wanted: bool, followers: Sequence[Req]
    ) -> AddResult:
        """Start the load of ``m``'s host part for ``req`` if it fits as if admitted now: it waits,
        and the room it needs stays kept from this step's others. Checked as an admission is, once
        its path is locked and loading: a load started for a request that then does not fit runs all
        the same (its hits count at its admission)."""
        if not self.kv.start_load(req, m) or not self._fits(req, keep_wanted, followers, alloc=m.length):
            return AddResult.NO_ROOM
        self.reserved += self._still_needs(req, m.length)
        self.loading += 1
        req.load_started = True
        return AddResult.WAITING
