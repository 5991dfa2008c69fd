"""One rank of tiny models by hand (test_tensor_parallel.py starts it as a process per rank; each
process runs every model the test names, so the interpreters start once)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.parallel import ShardLayout

if TYPE_CHECKING:
    from radixserve.scheduler.tensor_parallel import TPGroup


def run_rank(rank: int, size: int, port: int, *paths_and_outs: str) -> None:
    """One rank of each model (``path out path out ...``) on the torch attention backend: the
    logits of a prefill, a cached extend and four decodes (every position), saved to its ``out``."""
    import torch.distributed as dist

    from radixserve.scheduler.tensor_parallel import TPGroup, init_group

    torch.set_num_threads(1)
    group = None
    for path, out in zip(paths_and_outs[::2], paths_and_outs[1::2], strict=True):
        layout = ShardLayout.of(ModelConfig.from_pretrained(path), rank, size)
        if size > 1 and group is None:
            group = init_group(layout, port, torch.device("cpu"), 60)
        tp = TPGroup(layout, dist.group.WORLD) if group is not None else None
        _run_model(path, out, tp)


def _run_model(path: str, out: str, tp: TPGroup | None) -> None:
    from radixserve.scheduler.batch import ForwardMode
    from radixserve.scheduler.memory.kv_pool import KVPool
    from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
    from radixserve.scheduler.model.attention import TorchAttention
    from radixserve.scheduler.model.forward_batch import ForwardBatch
    from radixserve.scheduler.model.loader import load_model
    from radixserve.scheduler.tensor_parallel import weight_bytes

    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, cfg, "cpu", tp=tp)
    local = model.local_config
    pool = KVPool(256, cfg.num_layers, local.num_kv_heads, cfg.head_dim, cfg.dtype, "cpu")
    table = ReqToTokenPool(2, 128)
    backend = TorchAttention(pool, table, local.num_heads, cfg.head_dim)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))

    def run(start: int, n: int, mode: ForwardMode) -> torch.Tensor:
        slots = np.arange(start, start + n) * 3 + 5
        table.host[1, start : start + n] = slots
        fb = ForwardBatch(
            mode, ids[start : start + n], torch.arange(start, start + n), torch.from_numpy(slots),
            np.array([start]), np.array([n]), torch.zeros(1, dtype=torch.int64), None, all_logits=True,
        )  # fmt: skip
        backend.prepare(fb, np.array([1]))
        return model(fb.input_ids, fb.positions, fb, backend).logits

    logits = torch.cat(
        [run(0, 25, ForwardMode.EXTEND), run(25, 11, ForwardMode.EXTEND)]
        + [run(i, 1, ForwardMode.DECODE) for i in range(36, 40)]
    )
    np.save(out, logits.numpy())
    Path(out + ".json").write_text(json.dumps({"weight_bytes": weight_bytes(model), "ids": ids.tolist()}))
