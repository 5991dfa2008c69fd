"""NoCache: the prefix cache turned off (``disable_radix_cache``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from radixserve.scheduler.memory.radix_cache import _EMPTY_SLOTS, InsertResult, MatchResult, RadixCache

if TYPE_CHECKING:
    from radixserve.scheduler.req import Req


class NoCache(RadixCache):
    """The cache turned off, same interface: nothing is shared, a request owns all its pages."""

    disabled = True

    def match_prefix(self, tokens: npt.NDArray[np.integer]) -> MatchResult:
        return MatchResult(_EMPTY_SLOTS, self.root)

    def insert(self, tokens: npt.NDArray[np.integer], slots: npt.NDArray[np.integer]) -> InsertResult:
        raise RuntimeError("the prefix cache is disabled")

    def evict(self, num_tokens: int, write_back: bool = True) -> int:
        return 0

    def cache_unfinished_req(self, req: Req, upto: int) -> None:
        return None

    def cache_finished_req(self, req: Req) -> None:
        assert req.req_pool_idx is not None
        self._free_private(req)
        self._drop_row(req)
