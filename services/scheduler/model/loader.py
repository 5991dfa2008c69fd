"""Load a Hugging Face model folder: config.json + *.safetensors (one file or a sharded index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.llama import CausalLM
from radixserve.scheduler.model.rope import inv_frequencies


def safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return found


def load_model(path: str | Path, cfg: ModelConfig, device: str | torch.device) -> CausalLM:
    path = Path(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device=device)
    model = model.to(cfg.dtype)
    params = dict(model.named_parameters())
    missing = set(params)
    for file in safetensor_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
                if name not in params:
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # some checkpoints store the tied head too
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    raise ValueError(f"unexpected tensor {name!r} in {file.name}")
                target = params[name]
                tensor = f.get_tensor(name)
                if tensor.shape != target.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(tensor.to(cfg.dtype))
                missing.discard(name)
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
    # Buffers built at init (rotary frequencies) were lost with the meta device: rebuild them.
    model.model.rotary.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    return model.eval()
