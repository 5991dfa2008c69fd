"""``mypy --strict`` is clean on the strict set: ``services/common`` (its generated pb stubs aside),
the scheduler's ``memory/`` and ``policy/`` packages, the core types they share (``req``, ``batch``,
``config``), the ``EngineWorker`` (``worker``), tensor parallelism (``tensor_parallel``,
``model.parallel``), FP8 weights (``model.quant``), the mixture-of-experts modules (``model.moe``,
``model.moe_config``, ``model.moe_ops``, ``model.expert_weights``), what runs between the model and
the sampler (``model.logits``, ``model.penalties``, ``grammar``), the tool-call parsers, the OpenAI
front end (its field table, requests, reasoning and tool output, the Responses API) and the
detokenizer's incremental decoding.
pyproject.toml's ``[tool.mypy]`` names the set; the modules they import are read for their types,
their own errors not reported.

mypy cannot follow the editable install's import hook (``radixserve`` is ``services/`` through
setuptools' package-dir), so it runs in a folder where ``radixserve`` is a link to ``services/``.
Its cache lives on in the temp dir: a cold run reads torch and transformers (~40 s), a warm one
takes a second. One run at a time uses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # mypy reads torch and transformers cold in about 40 s

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "radixserve.common",
    "radixserve.scheduler.memory",
    "radixserve.scheduler.policy",
    "radixserve.scheduler.model.quant",  # FP8 weights: formats, numbers, the layer, its GEMMs, loading
)
MODULES = (
    "radixserve.scheduler.req",
    "radixserve.scheduler.batch",
    "radixserve.scheduler.config",
    "radixserve.scheduler.worker",  # the engine thread and request lifecycle behind the servicer
    "radixserve.scheduler.tensor_parallel",  # rank 0's followers and the followers' loop
    "radixserve.scheduler.model.parallel",  # the shard layout and the collectives
    "radixserve.scheduler.model.logits",  # logprobs, bias, penalties, the grammar mask
    "radixserve.scheduler.model.penalties",
    # mixture of experts: the block, its config, the op's two implementations, the checkpoint's experts
    "radixserve.scheduler.model.moe",
    "radixserve.scheduler.model.moe_config",
    "radixserve.scheduler.model.moe_ops",
    "radixserve.scheduler.model.expert_weights",
    "radixserve.scheduler.grammar",  # structured outputs (llguidance)
    "radixserve.tokenizer.text.tool_calls",
    "radixserve.tokenizer.text.tool_grammar",
    # the OpenAI front end: field policy, requests, reasoning and tool output, the Responses API
    "radixserve.tokenizer.openai_api.fields",
    "radixserve.tokenizer.openai_api.field_policy",
    "radixserve.tokenizer.text.reasoning",
    "radixserve.tokenizer.openai_api.chat_plan",
    "radixserve.tokenizer.openai_api.chat_request",
    "radixserve.tokenizer.openai_api.requests",
    "radixserve.tokenizer.openai_api.choices",
    "radixserve.tokenizer.openai_api.bodies",
    "radixserve.tokenizer.openai_api.responses",
    "radixserve.tokenizer.openai_api.responses_route",
    "radixserve.tokenizer.openai_api.response_store",
    "radixserve.tokenizer.openai_api.http_util",
    "radixserve.tokenizer.errors",
    "radixserve.tokenizer.text.model_text",
    "radixserve.tokenizer.text.tool_call_text",
    "radixserve.detokenizer.incremental",
)


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Hold ``lock`` while mypy writes the shared cache (a no-op where there is no flock)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.mark.timeout(600)
def test_strict_set_passes_mypy_strict(tmp_path: Path) -> None:
    from radixserve.common import protogen

    protogen.ensure()  # the messages' types are the generated .pyi's
    (tmp_path / "radixserve").symlink_to(ROOT / "services", target_is_directory=True)
    state = Path(tempfile.gettempdir()) / f"radixserve-mypy-{hashlib.sha1(bytes(ROOT)).hexdigest()[:12]}"
    state.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    cmd += ["--cache-dir", str(state / "cache"), "--strict"]
    cmd += [arg for p in PACKAGES for arg in ("-p", p)] + [arg for m in MODULES for arg in ("-m", m)]
    with _exclusive(state / "lock"):
        proc = subprocess.run(
            cmd,
            cwd=tmp_path,
            env={**os.environ, "MYPYPATH": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=540,
        )
    assert proc.returncode == 0, f"mypy --strict (rc {proc.returncode}):\n{proc.stdout}{proc.stderr}"
