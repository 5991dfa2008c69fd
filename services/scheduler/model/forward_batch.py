"""ForwardBatch: one engine step's inputs as device tensors, plus what the attention backend needs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixserve.scheduler.batch import ForwardMode

if TYPE_CHECKING:
    from radixserve.scheduler.memory.host_pool import KVLoad
    from radixserve.scheduler.memory.tiered_cache import KVTransfers
    from radixserve.scheduler.model.linear_attention import LinearStep
    from radixserve.scheduler.model.logits import LogitsStep
    from radixserve.scheduler.model.sampler import SamplingInfo


@dataclass(slots=True, eq=False)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64; negative ids name FutureMap entries not yet sampled
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: where each token's K/V is written
    prefix_lens: np.ndarray  # [B] host
    extend_lens: np.ndarray  # [B] host
    future_out: torch.Tensor  # [B] int64: FutureMap entries the sampled tokens go to
    sampling: SamplingInfo | None  # None: a batch for attention alone, or a graph capture
    # [B (+E)] each request's last token in the batch, then the E prompt positions scored (device)
    last_index: torch.Tensor | None = None
    # The backend's own metadata (TorchMeta, ...), built by AttentionBackend.prepare on the scheduler thread.
    attn: object = None
    all_logits: bool = False  # return logits for every token (tests), not just each request's last
    # Arrays the backend asked to have on the device (AttentionBackend.host_arrays), host and device.
    staged_host: dict[str, np.ndarray] = field(default_factory=dict)
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    graph_bucket: int | None = None  # decode padded to this many rows for the static path (graph_runner)
    num_real: int | None = None  # rows that are requests (the rest is padding); None: all
    logits_step: LogitsStep | None = None  # bias, penalties, mask, logprobs (model/logits.py); rank 0
    # Prompt scoring (logprobs of prompt tokens): the last ``score_rows`` of ``last_index`` are
    # positions whose next prompt token (``score_targets``) is scored with ``score_top_k``
    # alternatives (the model returns them: ModelOutput.prompt_scores).
    score_rows: int = 0
    score_targets: torch.Tensor | None = None
    score_top_k: int = 0
    linear: LinearStep | None = None  # a hybrid model's state slots and snapshots (linear_attention.py)
    kv_transfers: KVTransfers | None = None  # host-tier copies to run before the forward (HostKVPool)
    kv_load: KVLoad | None = None  # rank 0: where the pool times this step's loads (the batch's too)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def real_size(self) -> int:
        return self.batch_size if self.num_real is None else self.num_real

    @classmethod
    def for_attention(
        cls,
        mode: ForwardMode,
        prefix_lens: Sequence[int] | np.ndarray,
        extend_lens: Sequence[int] | np.ndarray,
        out_slots: Sequence[int] | np.ndarray,
        device: str | torch.device = "cpu",
    ) -> ForwardBatch:
        """A batch for an attention backend alone (tests, benchmarks): request ``i`` adds
        ``extend_lens[i]`` tokens after ``prefix_lens[i]`` cached ones, written to ``out_slots``;
        no token ids, no sampling. The runner builds its batches in ``ModelRunner.prepare``."""
        prefix = np.asarray(prefix_lens, dtype=np.int64)
        extend = np.asarray(extend_lens, dtype=np.int64)
        positions = np.concatenate([np.arange(p, p + n) for p, n in zip(prefix, extend, strict=True)])
        return cls(
            mode,
            torch.zeros(int(extend.sum()), dtype=torch.int64, device=device),
            torch.from_numpy(positions).to(device),
            torch.as_tensor(np.asarray(out_slots, dtype=np.int64)).to(device),
            prefix,
            extend,
            torch.zeros(len(extend), dtype=torch.int64, device=device),
            None,
        )
