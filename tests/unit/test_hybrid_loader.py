"""A hybrid checkpoint whose config.json does not match its tensors fails at load, in one line that
names the layer and the tensor (model/hybrid_config.py, model/linear_weights.py)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.loader import load_model

LINEAR, FULL = "linear_attention", "full_attention"
SHAPE = r"checkpoint shape \(.*\) != \(.*\) \(config.json's linear_\* heads and sizes\)$"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (
            {"layer_types": [FULL, LINEAR, LINEAR, LINEAR]},
            r"^model\.layers\.0\.linear_attn\.\w+: layer 0 is full_attention in config.json's layer_types, "
            r"but the checkpoint has linear_attention tensors there$",
        ),
        (
            {"linear_num_value_heads": 8},
            r"^model\.layers\.0\.linear_attn\.(A_log|dt_bias|in_proj_\w+)\S*: ",
        ),
        ({"linear_num_key_heads": 4}, r"^model\.layers\.0\.linear_attn\.(conv1d|in_proj_\w+)\.weight: "),
        ({"linear_conv_kernel_dim": 3}, r"^model\.layers\.0\.linear_attn\.conv1d\.weight: "),
        ({"linear_value_head_dim": 8}, r"^model\.layers\.0\.linear_attn\.\w+(\.weight)?: "),
        ({"num_attention_heads": 2}, r"^model\.layers\.3\.self_attn\.[qo]_proj\.weight: checkpoint shape"),
        (
            {"layer_types": [LINEAR] * 3},
            r"^config.json: `num_hidden_layers` \(4\) must be .* \(3\)$",
        ),
        ({"layer_types": [LINEAR] * 4}, r"^config.json: layer_types has no full_attention layer$"),
        ({"linear_num_value_heads": 3}, r"^config.json: linear_num_value_heads 3 is not a multiple of .* 2$"),
    ],
)
def test_a_checkpoint_that_does_not_match_its_config_fails_at_load_naming_layer_and_tensor(
    demo_model, tmp_path, change, error
):
    src = demo_model("qwen3_5")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(change)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        load_model(bad, ModelConfig.from_pretrained(bad), "cpu")
    message = str(err.value)
    assert "\n" not in message and re.search(error, message), message
    if "linear_attn" in error and "layer_types" not in error:  # the tensor's shape against config.json's
        assert re.search(SHAPE, message), message
