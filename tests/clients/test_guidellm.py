"""guidellm (a third-party benchmark nobody here wrote) runs its default streamed benchmark against the
served cluster with zero errors: it sends stream_options.continuous_usage_stats with every streamed
request, text content parts and ignore_eos, and reads TTFT and ITL from the stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.cluster import MODEL_NAME

pytestmark = pytest.mark.slow

REQUESTS = 8


@pytest.mark.parametrize("request_format", [None, "/v1/responses"], ids=["default-chat", "responses"])
def test_guidellms_streamed_benchmark_has_no_errors(served, thinking_model, tmp_path, request_format):
    out = tmp_path / "guidellm.json"
    backend = f"kind=openai_http,target={served.url},model={MODEL_NAME}"
    if request_format is not None:
        backend += f",request_format={request_format}"
    cmd = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", backend,
        "--tokenizer", f"kind=hf_auto,model={thinking_model}",  # the model folder's: nothing downloaded
        "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--output", f"kind=json,path={out}",
        "--disable-console",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    errors = [r.get("error") for r in bench["requests"].get("errored", [])][:3]
    # guidellm exits 0 whatever its requests did: the counts are the verdict
    assert totals["errored"] == 0, errors
    assert totals["successful"] == REQUESTS
