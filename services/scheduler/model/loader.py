"""Load a Hugging Face model folder: config.json + *.safetensors (one file or a sharded index).

Checkpoints store q_proj / k_proj / v_proj and gate_proj / up_proj apart; our layers hold them
merged (``qkv_proj``, ``gate_up_proj``: model/llama.py). ``merged_target`` maps a checkpoint name to
its merged parameter and the rows it fills; every row of every parameter must be filled exactly once.

Tensor parallelism (model/parallel.py): a rank reads only its slice of each sharded tensor
(``checkpoint_slice``), through safetensors' lazy slices, so no process ever holds the whole model.

FP8 weights (model/quant/): ``quant.load.plan`` makes the FP8 projections ``Fp8Linear`` (and FP8
experts ``Fp8Experts``) before the model gets memory, and ``Fp8Loading`` takes the tensors that are
FP8's business (FP8 weights, their scales, weights quantized while loading), placed and sliced by
the functions here and model/expert_weights.py's.

Mixture-of-experts checkpoints store every expert's matrices apart: model/expert_weights.py places
them (and Mixtral's router, named apart from ours) into each layer's stacked tensors. Qwen2-MoE's
shared expert is a dense MLP to the functions here, gate and up merged, its columns split. A hybrid's
linear-attention tensors are placed by model/linear_weights.py.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.expert_weights import Placement, missing_tensor, moe_placement
from radixserve.scheduler.model.hybrid import causal_lm
from radixserve.scheduler.model.linear_weights import linear_placement
from radixserve.scheduler.model.llama import CausalLM
from radixserve.scheduler.model.parallel import ShardLayout, TPGroup
from radixserve.scheduler.model.quant.checkpoint import fill
from radixserve.scheduler.model.quant.load import Fp8Loading, plan
from radixserve.scheduler.model.weight_files import Shard, WeightFiles, open_weights

log = logging.getLogger(__name__)


def merged_target(name: str, cfg: ModelConfig) -> tuple[str, int, int] | None:
    """(our parameter, first row, row count) for a checkpoint tensor that is one part of a merged
    projection (weight or bias: both stack along dim 0), else None."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    q *= 2 if cfg.hybrid is not None else 1  # a hybrid's q_proj also holds each head's output gate
    shared = cfg.moe.shared_intermediate_size if cfg.moe is not None else 0  # Qwen2-MoE's shared expert
    parts = {
        ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0, q),
        ".self_attn.k_proj.": (".self_attn.qkv_proj.", q, kv),
        ".self_attn.v_proj.": (".self_attn.qkv_proj.", q + kv, kv),
        ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0, inter),
        ".mlp.up_proj.": (".mlp.gate_up_proj.", inter, inter),
        ".mlp.shared_expert.gate_proj.": (".mlp.shared_expert.gate_up_proj.", 0, shared),
        ".mlp.shared_expert.up_proj.": (".mlp.shared_expert.gate_up_proj.", shared, shared),
    }
    for part, (merged, start, rows) in parts.items():
        if part in name:
            return name.replace(part, merged), start, rows
    return None


def checkpoint_slice(name: str, cfg: ModelConfig, layout: ShardLayout) -> tuple[int, int, int] | None:
    """(dim, start, stop) of checkpoint tensor ``name`` that ``layout``'s rank holds; None: all of it."""
    if not layout.sharded:
        return None
    hd = cfg.head_dim
    qd = 2 * hd if cfg.hybrid is not None else hd  # a hybrid's query heads carry their output gate
    shared = layout.share(cfg.moe.shared_intermediate_size) if cfg.moe is not None else (0, 0)
    rows = {  # column-parallel: output rows (weights and biases)
        ".self_attn.q_proj.": (layout.q_head_start * qd, layout.q_heads * qd),
        ".self_attn.k_proj.": (layout.kv_head_start * hd, layout.kv_heads * hd),
        ".self_attn.v_proj.": (layout.kv_head_start * hd, layout.kv_heads * hd),
        ".mlp.gate_proj.": (layout.intermediate_start, layout.intermediate),
        ".mlp.up_proj.": (layout.intermediate_start, layout.intermediate),
        ".mlp.shared_expert.gate_proj.": shared,
        ".mlp.shared_expert.up_proj.": shared,
    }
    for part, (start, n) in rows.items():
        if part in name:
            return 0, start, start + n
    columns = {  # row-parallel: input columns (weights: a bias is added once, after the all-reduce)
        ".self_attn.o_proj.weight": (layout.q_head_start * hd, layout.q_heads * hd),
        ".mlp.down_proj.weight": (layout.intermediate_start, layout.intermediate),
        ".mlp.shared_expert.down_proj.weight": shared,
    }
    for part, (start, n) in columns.items():
        if name.endswith(part):
            return 1, start, start + n
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, layout.vocab_start, layout.vocab_end(cfg)
    return None  # norms, and the row-parallel biases (added once, after the all-reduce)


def load_model(
    path: str | Path,
    cfg: ModelConfig,
    device: str | torch.device,
    max_positions: int | None = None,
    tp: TPGroup | None = None,
    weights: WeightFiles | None = None,
) -> CausalLM:
    """``max_positions``: the longest context served (the rotary table's length); default the
    model's max_position_embeddings. ``tp``: load this rank's shard only. ``weights``: where the
    checkpoint's files come from (model/weight_files.py; default: ``--load-format auto``'s: the
    folder's own, or streamed where the folder was fetched without them)."""
    files = weights if weights is not None else open_weights(Path(path))
    try:
        return _load(files, cfg, device, max_positions, tp)
    finally:
        files.close()


def _load(
    weights: WeightFiles,
    cfg: ModelConfig,
    device: str | torch.device,
    max_positions: int | None,
    tp: TPGroup | None,
) -> CausalLM:
    with torch.device("meta"):
        model = causal_lm(cfg, max_positions, tp)
    # The dtype set on the meta device: memory is allocated once, in it (a conversion on the device
    # would leave the first copy in torch's cache, where the KV sizing cannot see it as free).
    model = model.to(cfg.dtype)
    layout, local = model.layout, model.local_config

    def place(name: str) -> tuple[str, int, int | None]:
        return merged_target(name, local) or (name, 0, None)

    def place_moe(name: str) -> Placement | None:
        return moe_placement(name, cfg, layout)

    fp8 = plan(model, weights.headers(), cfg, place, place_moe)  # FP8 projections: Fp8Linear (on meta)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    unfilled = _still_to_fill(params, layout.vocab_end(cfg) - layout.vocab_start)
    loading = (
        None
        if fp8 is None
        else Fp8Loading(
            fp8, params, unfilled, place, lambda n: checkpoint_slice(n, cfg, layout), read_part, place_moe
        )
    )
    # Tensors taken whole: read from the files straight into their parameters (CPU ones mapped
    # where the files may outlive the load), one file at a time (a streamed one is then released).
    reads = ParallelReads(params if weights.mappable else None)
    for shard in weights.shards():
        with safe_open(str(shard.path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
                if loading is None or not loading.load(f, name):
                    _load_tensor(f, name, shard, cfg, layout, place, params, unfilled, reads)
        reads.run()
        reads.forget_files()
    if reads.mapped_bytes:
        log.info(
            "weights: %.1f MiB mapped from the checkpoint's files (read at first use)",
            reads.mapped_bytes / 2**20,
        )
    missing = sorted({missing_tensor(name, rows, cfg.arch) for name, rows in unfilled.items() if rows.any()})
    if missing:
        raise ValueError(f"checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.init_rope()  # buffers built on the meta device are empty: rebuild on the real one
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # what loading left in torch's cache is free memory for the KV pool
    return model.eval()


def _load_tensor(
    f: Any,
    name: str,
    shard: Shard,
    cfg: ModelConfig,
    layout: ShardLayout,
    place: Callable[[str], tuple[str, int, int | None]],
    params: dict[str, torch.nn.Parameter],
    unfilled: dict[str, torch.Tensor],
    reads: ParallelReads,
) -> None:
    """Checkpoint tensor ``name`` of open file ``f`` into its place: filled now, or queued on ``reads``."""
    # an MoE expert's (or Mixtral's router), or a hybrid's linear-attention tensor
    placed = moe_placement(name, cfg, layout) or linear_placement(name, cfg, layout)
    if placed is not None:
        tensor = placed.read(name, f.get_slice(name))
        _fill(name, tensor, placed.param, placed.index, params, unfilled, shard.name)
        return
    target_name, start, rows = place(name)
    if target_name not in params:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return  # some checkpoints store the tied head too
        if name.endswith("rotary_emb.inv_freq"):
            return
        raise ValueError(f"unexpected tensor {name!r} in {shard.name}")
    part = checkpoint_slice(name, cfg, layout)
    if rows is None and part is not None and part[0] == 0:
        rows = part[2] - part[1]  # a vocabulary slice: the last rank's is short
    index = () if rows is None else (slice(start, start + rows),)
    claim = partial(fill, params, unfilled, target_name, index, name=name, copy=False)
    if part is not None or not reads.queue(shard.path, name, claim):  # else: read with the others
        _fill(name, read_part(f, name, part), target_name, index, params, unfilled, shard.name)


def _still_to_fill(params: dict[str, torch.nn.Parameter], vocab_rows: int) -> dict[str, torch.Tensor]:
    """Each output row (1-D, 2-D), each expert's rows (3-D expert stacks) and each scale still to
    fill; the last rank's vocabulary padding rows (past ``vocab_rows``) are zeroed and count as filled."""
    unfilled = {
        name: torch.ones(
            p.shape if name.endswith(".weight_scale") else p.shape[: max(1, p.dim() - 1)], dtype=torch.bool
        )
        for name, p in params.items()
    }
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in params and vocab_rows < params[name].shape[0]:
            with torch.no_grad():
                params[name][vocab_rows:].zero_()
            unfilled[name][vocab_rows:] = False
    return unfilled


# ----------------------------------------------------------------------------- reading the files
# safetensors' mmap path copies each tensor from the page cache into its parameter one page fault at a
# time, on one thread (docs/reliability.md, cold start, has the figures against `cat`). A tensor this
# rank takes whole is instead read with pread straight into its parameter (on a GPU through a pinned
# buffer), in chunks spread over a few threads: pread releases the GIL and the kernel copies into the
# final memory.
READ_CHUNK_BYTES = 64 << 20
READ_THREADS = 4

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where a tensor lies in a .safetensors file: its bytes at ``offset`` (from the file's start)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def empty(self) -> torch.Tensor:
        """A meta tensor of its shape (what ``fill`` checks against the parameter)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors of a .safetensors file whose dtype torch has (8-byte little-endian header length,
    the JSON header, then the data); others are left to safetensors' own reader."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for name, t in header.items():
        dtype = _DTYPES.get(t.get("dtype", "")) if name != "__metadata__" else None
        if dtype is not None:
            begin, end = t["data_offsets"]
            out[name] = StoredTensor(dtype, tuple(t["shape"]), 8 + n + begin, end - begin)
    return out


_Job = tuple[Path, StoredTensor, torch.Tensor]  # (file, where the tensor lies in it, its place)


class ParallelReads:
    """Reads queued tensors from their files into their targets on ``READ_THREADS`` threads: into a
    CPU parameter directly, into a device parameter through a pinned buffer per thread (reused, so
    its pages are faulted in once, and host memory stays bounded). A tensor stored in another dtype
    than its parameter's is read at once, into a buffer converted into its place: one such buffer at
    a time, as safetensors' own path held.

    A CPU parameter of ``params`` whose every byte is queued from one run of one file, in order (a
    tensor taken whole; gate and up stored side by side, as checkpoints sort them, for the merged
    ``gate_up_proj``), is not read at all: it becomes a private (copy-on-write) mapping of the file,
    the page cache's own pages. Filling new memory is what bounds a CPU loader (docs/reliability.md,
    cold start); the mapping costs a minor fault per few pages when the weights are first used."""

    def __init__(self, params: Mapping[str, torch.Tensor] | None = None) -> None:
        self._jobs: list[_Job] = []
        self._staging = threading.local()
        self._headers: dict[Path, dict[str, StoredTensor]] = {}
        self._params = params or {}
        self._mappings: dict[Path, torch.Tensor] = {}
        self.mapped_bytes = 0  # parameters that are file mappings (read when first used)

    def add(self, file: Path, stored: StoredTensor, target: torch.Tensor) -> None:
        if target.dtype == stored.dtype and target.is_contiguous():
            self._jobs.append((file, stored, target))
            return
        buffer = torch.empty(stored.shape, dtype=stored.dtype)
        fd = os.open(file, os.O_RDONLY)
        try:
            _pread_fully(fd, _bytes(buffer.reshape(-1).view(torch.uint8)), stored.offset)
        finally:
            os.close(fd)
        with torch.no_grad():
            target.copy_(buffer)

    def queue(self, file: Path, name: str, claim: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """Queue tensor ``name`` of ``file`` for its place, ``claim(a meta tensor of its shape and
        dtype)`` (which checks it); False, nothing queued, for a dtype torch has not."""
        if file not in self._headers:
            self._headers[file] = read_header(file)
        stored = self._headers[file].get(name)
        if stored is None:
            return False
        self.add(file, stored, claim(stored.empty()))
        return True

    def run(self) -> None:
        self._map_whole_parameters()
        if not self._jobs:
            return
        files = sorted({file for file, _, _ in self._jobs})
        fds = {file: os.open(file, os.O_RDONLY) for file in files}
        chunks: list[tuple[int, int, torch.Tensor]] = []  # (fd, file offset, destination bytes)
        try:
            for file, stored, target in self._jobs:
                raw = target.detach().reshape(-1).view(torch.uint8)  # the bytes, written in place
                for at in range(0, stored.nbytes, READ_CHUNK_BYTES):
                    chunks.append((fds[file], stored.offset + at, raw[at : at + READ_CHUNK_BYTES]))
            with ThreadPoolExecutor(READ_THREADS) as pool:
                list(pool.map(self._read_chunk, chunks))
        finally:
            for fd in fds.values():
                os.close(fd)
        self._jobs.clear()

    def forget_files(self) -> None:
        """Drop what is known of the files read so far (a streamed shard's /proc/self/fd path may
        name the next shard once its descriptor is reused); mappings live on in their parameters."""
        self._headers.clear()
        self._mappings.clear()

    def _map_whole_parameters(self) -> None:
        """Every CPU parameter that one in-order run of one file fills becomes a mapping of it."""
        by_storage: dict[int, list[_Job]] = {}
        for job in self._jobs:
            if job[2].device.type == "cpu":
                by_storage.setdefault(job[2].untyped_storage().data_ptr(), []).append(job)
        mapped: set[int] = set()
        for param in self._params.values():
            if param.device.type != "cpu" or not param.is_contiguous() or not param.numel():
                continue
            jobs = by_storage.get(param.untyped_storage().data_ptr(), [])
            at = _file_run(param, jobs)
            if at is None:
                continue
            file, offset = at
            with torch.no_grad():
                raw = self._mapping(file)[offset : offset + param.nbytes]
                param.data = raw.view(param.dtype).view(param.shape)
            mapped.update(id(job) for job in jobs)
            self.mapped_bytes += param.nbytes
        self._jobs = [job for job in self._jobs if id(job) not in mapped]

    def _mapping(self, file: Path) -> torch.Tensor:
        """``file``'s bytes, mapped private: writes (none expected) would copy a page, never reach
        the file. Read-ahead is asked for at once, so a cold page cache fills while the rest loads."""
        if file not in self._mappings:
            with open(file, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            m.madvise(mmap.MADV_WILLNEED)
            self._mappings[file] = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive
        return self._mappings[file]

    def _read_chunk(self, chunk: tuple[int, int, torch.Tensor]) -> None:
        fd, offset, dest = chunk
        if dest.device.type == "cpu":
            _pread_fully(fd, _bytes(dest), offset)
            return
        staging: torch.Tensor | None = getattr(self._staging, "buffer", None)
        if staging is None:
            staging = self._staging.buffer = torch.empty(READ_CHUNK_BYTES, dtype=torch.uint8).pin_memory()
        part = staging[: dest.numel()]
        _pread_fully(fd, _bytes(part), offset)
        dest.copy_(part)  # synchronous: the buffer is this thread's next chunk's


def _file_run(param: torch.Tensor, jobs: list[_Job]) -> tuple[Path, int] | None:
    """(file, offset) of the bytes that ``jobs`` fill ``param`` with, when they are all of its bytes,
    one run of one file in the parameter's order, aligned for its dtype and inside the file (a
    mapping past a truncated file's end would fault at first use, not fail here)."""
    if not jobs or len({job[0] for job in jobs}) != 1:
        return None
    size = param.element_size()
    base = param.storage_offset()
    ordered = sorted(jobs, key=lambda job: job[2].storage_offset())
    file, first, _ = ordered[0]
    offset = first.offset - (ordered[0][2].storage_offset() - base) * size
    for _, stored, target in ordered:
        if stored.offset != offset + (target.storage_offset() - base) * size:
            return None
    if sum(stored.nbytes for _, stored, _ in jobs) != param.nbytes or offset % size:
        return None
    if offset < 0 or offset + param.nbytes > file.stat().st_size:
        return None
    return file, int(offset)


def _bytes(t: torch.Tensor) -> memoryview:
    """A uint8 CPU tensor's memory, writable in place."""
    array: Any = t.numpy()  # numpy's stubs do not say ndarray is a Buffer
    return memoryview(array)


def _pread_fully(fd: int, into: memoryview, offset: int) -> None:
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"checkpoint file ended {len(into) - done} bytes early (truncated?)")
        done += n


def _fill(
    name: str,
    tensor: torch.Tensor,
    target_name: str,
    index: tuple[int | slice, ...],
    params: dict[str, torch.nn.Parameter],
    unfilled: dict[str, torch.Tensor],
    file: str,
) -> None:
    """Copy checkpoint tensor ``name`` into ``params[target_name][index]``, once."""
    if target_name not in params:
        raise ValueError(f"unexpected tensor {name!r} in {file}")
    fill(params, unfilled, target_name, index, tensor, name)  # in the model's dtype


def read_part(f: object, name: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    """Tensor ``name`` of open file ``f``, or only its rows (dim 0) or columns (dim 1) ``start:stop``."""
    if part is None:
        whole: torch.Tensor = f.get_tensor(name)  # type: ignore[attr-defined]
        return whole
    dim, start, stop = part
    lazy = f.get_slice(name)  # type: ignore[attr-defined]
    rows_or_columns: torch.Tensor = lazy[start:stop] if dim == 0 else lazy[:, start:stop]
    return rows_or_columns
