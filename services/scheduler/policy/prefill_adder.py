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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum

import numpy as np
import numpy.typing as npt

from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.allocator import pages_for
from radixserve.scheduler.memory.manager import KVCacheManager
from radixserve.scheduler.memory.radix_cache import common_len
from radixserve.scheduler.req import Req


def decode_reserve(reqs: Iterable[Req], ratio: float, clip: int) -> int:
    """KV tokens to keep back for the decodes still ahead of ``reqs`` (an estimate)."""
    # max(0, ...): a request scoring its prompt only (max_new_tokens 0) holds a placeholder token
    return int(sum(max(0, min(r.sampling.max_new_tokens - len(r.output_ids), clip)) for r in reqs) * ratio)


class AddResult(Enum):
    ADDED = "added"
    NO_ROOM = "no_room"  # the KV budget is spent
    BATCH_FULL = "batch_full"  # prefill-token or running-request limit reached
    WAITING = "waiting"  # its cached prefix is being read from disk: the others go on meanwhile


class PrefillAdder:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, running: Sequence[Req], new_token_ratio: float
    ) -> None:
        self.config = config
        self.kv = kv
        self.ratio = new_token_ratio
        self.reserved = decode_reserve(running, new_token_ratio, config.clip_max_new_tokens)
        self.rem_prefill = config.max_prefill_tokens
        self.num_running = len(running)
        self.reqs: list[Req] = []
        self.extend_lens: list[int] = []
        # per admitted request, the slots its new tokens write
        self.out_slots: list[npt.NDArray[np.int64]] = []
        self.chunked: Req | None = None  # the request cut short in this batch, if any

    def _decode_reserve(self, req: Req) -> int:
        return decode_reserve((req,), self.ratio, self.config.clip_max_new_tokens)

    def _chunk_limit(self) -> int:
        limit = self.rem_prefill
        if self.config.chunked_prefill_size is not None:
            limit = min(limit, self.config.chunked_prefill_size)
        return limit

    def _still_needs(self, req: Req) -> int:
        """KV tokens ``req`` will still take: the unallocated rest of its prompt + its decode reserve."""
        ps = self.kv.page_size
        return (pages_for(req.seq_len, ps) - pages_for(req.alloc_len, ps)) * ps + self._decode_reserve(req)

    def _followers_need(self, req: Req, followers: Sequence[Req]) -> int:
        """KV tokens the requests held back behind ``req`` will take once its prefix is cached (as
        many as can run beside it): each one's part past the prefix it shares with ``req``, and
        its decode reserve."""
        ps = self.kv.page_size
        room = self.config.running_limit - self.num_running - len(self.reqs) - 1
        ids = req.fill_ids()
        need = 0
        for f in followers[: max(0, room)]:
            shared = common_len(ids, f.fill_ids(), ps)  # whole pages: what f will find cached
            need += (pages_for(f.seq_len, ps) - shared // ps) * ps + self._decode_reserve(f)
        return need

    def _fits(self, req: Req, keep_wanted: bool = False, followers: Sequence[Req] = ()) -> bool:
        need = self._still_needs(req)
        if self.num_running == 0 and not self.reqs:
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
            self.num_running + len(self.reqs) >= self.config.running_limit
            or self.kv.req_to_token.num_free == 0
        ):
            return AddResult.BATCH_FULL
        m = self.kv.cached_match(req)
        if m.disk_len:  # its prefix is on disk: read it (the request is admitted once it is here)
            self.kv.read_disk(req)
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
        self.kv.admit(req, m)  # locks its own prefix: not counted as wanted room below
        if req.cached_len < m.length or not self._fits(req, keep_wanted, followers):
            # (a host-tier part the device had no room to load: the request does not fit either)
            self.kv.unadmit(req)
            return AddResult.NO_ROOM
        self._take(req, n)
        return AddResult.ADDED
