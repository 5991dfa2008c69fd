"""The command line's own bad input, through the real entry points (``radixserve`` and the three
service modules): a bad argument ends the command with one line naming it and a non-zero status,
never a traceback, before anything starts; a service that refuses to start is named with its own
reason. And ``radixserve serve`` with vLLM's flags: each reaches the service it concerns (the
mapping, in process), a flag we do not serve is refused by name, and one started cluster enforces
``--api-key``, ``--dtype``, ``--max-model-len`` and ``--tensor-parallel-size``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from radixserve.cli import VLLM_UNSERVED, build_parser, main, serve_cluster
from radixserve.common.ports import free_port, free_ports

BIN = Path(sys.executable).with_name("radixserve")
RADIXSERVE = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "radixserve.cli"]


def module(name: str) -> list[str]:
    return [sys.executable, "-m", f"radixserve.{name}"]


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """What the cases name: a file, an empty folder, a port something listens on, a free port, and
    an empty cache folder (a bad start must not write the demo model there)."""
    root = tmp_path_factory.mktemp("cli")
    (root / "file").write_text("not a folder\n")
    (root / "empty").mkdir()
    (root / "cache").mkdir()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    yield {
        "file": str(root / "file"),
        "empty": str(root / "empty"),
        "cache": str(root / "cache"),
        "busy": str(busy.getsockname()[1]),
        "free": str(free_port()),
    }
    busy.close()


def run(argv: list[str], places: dict[str, str], env: dict[str, str] | None = None, timeout: float = 60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")} | (env or {})
    env["RADIXSERVE_CACHE_DIR"] = places["cache"]
    argv = [a.format(**places) for a in argv]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


SCHEDULER = ["--model", "{empty}", "--detokenizer", "127.0.0.1:1"]
# (command, what the one line must say); "{busy}" etc. are ``places``.
CASES = {
    # radixserve serve: its own flags, checked when parsed
    "schedulers 0": ([*RADIXSERVE, "serve", "--schedulers", "0"], ["--schedulers", "at least 1", "got 0"]),
    "schedulers -1": ([*RADIXSERVE, "serve", "--schedulers", "-1"], ["--schedulers", "at least 1"]),
    "port 99999": ([*RADIXSERVE, "serve", "--port", "99999"], ["--port", "1 to 65535", "99999"]),
    "port abc": ([*RADIXSERVE, "serve", "--port", "abc"], ["--port", "expected an integer", "'abc'"]),
    "tp-size 0": ([*RADIXSERVE, "serve", "--tp-size", "0"], ["--tp-size", "at least 1"]),
    "torch-threads -1": ([*RADIXSERVE, "serve", "--torch-threads", "-1"], ["--torch-threads", "at least 0"]),
    "router": ([*RADIXSERVE, "serve", "--router", "random"], ["--router", "invalid choice"]),
    "unknown flag": ([*RADIXSERVE, "serve", "--bogus"], ["radixserve serve", "unrecognized", "--bogus"]),
    # ... what only the services' configs or the machine can say, before any starts
    "port in use": ([*RADIXSERVE, "serve", "--port", "{busy}"], ["gateway", "--port {busy}", "in use"]),
    "grpc-port in use": ([*RADIXSERVE, "serve", "--grpc-port", "{busy}"], ["--grpc-port {busy}", "in use"]),
    "grpc-port = port": (
        [*RADIXSERVE, "serve", "--port", "{free}", "--grpc-port", "{free}"],
        ["--grpc-port {free}", "--port"],
    ),
    "host": ([*RADIXSERVE, "serve", "--host", "no-such-host.invalid"], ["--host no-such-host.invalid"]),
    "model missing": ([*RADIXSERVE, "serve", "--model", "/no/such/model"], ["--model /no/such/model"]),
    "model without config.json": ([*RADIXSERVE, "serve", "--model", "{empty}"], ["--model", "config.json"]),
    "page-size 0 after --": (
        [*RADIXSERVE, "serve", "--", "--page-size", "0"],
        ["scheduler-0", "--page-size", "at least 1"],
    ),
    "mem-fraction 1.5 after --": (
        [*RADIXSERVE, "serve", "--", "--mem-fraction", "1.5"],
        ["--mem-fraction", "(0, 1]", "1.5"],
    ),
    "max-running-requests 0 after --": (
        [*RADIXSERVE, "serve", "--", "--max-running-requests", "0"],
        ["--max-running-requests", "at least 1"],
    ),
    "unknown scheduler flag": ([*RADIXSERVE, "serve", "--", "--bogus"], ["scheduler-0", "--bogus"]),
    # vLLM's spellings: refused by name where we do not serve them, checked where we do
    "vllm quantization": (
        [*RADIXSERVE, "serve", "--quantization", "awq"],
        ["--quantization/-q: 'awq' is not served", "--quantization fp8 quantizes", "compressed-tensors"],
    ),
    "vllm pipeline parallel": (
        [*RADIXSERVE, "serve", "--pipeline-parallel-size=2"],
        ["vLLM's --pipeline-parallel-size is not supported by radixserve"],
    ),
    "vllm dtype": ([*RADIXSERVE, "serve", "--dtype", "int8"], ["--dtype", "invalid choice: 'int8'"]),
    "vllm max-model-len": ([*RADIXSERVE, "serve", "--max-model-len", "0"], ["--max-model-len", "at least 1"]),
    "vllm gpu-memory-utilization": (
        [*RADIXSERVE, "serve", "--gpu-memory-utilization", "1.2"],
        ["--gpu-memory-utilization", "(0, 1]"],
    ),
    "vllm tensor-parallel-size": (
        [*RADIXSERVE, "serve", "--tensor-parallel-size", "0"],
        ["--tensor-parallel-size", "at least 1"],
    ),
    "vllm served names": (
        [*RADIXSERVE, "serve", "--served-model-name", "a", "b"],
        ["--served-model-name a b", "one name"],
    ),
    # the other commands
    "make-demo-model on a file": ([*RADIXSERVE, "make-demo-model", "{file}"], ["{file}", "not a folder"]),
    "make-demo-model arch": ([*RADIXSERVE, "make-demo-model", "{empty}", "--arch", "gpt2"], ["--arch"]),
    "unknown command": ([*RADIXSERVE, "deploy"], ["radixserve: error", "'deploy'"]),
    "unknown benchmark": ([*RADIXSERVE, "bench", "fastest"], ["radixserve bench", "'fastest'"]),
    "fetch-model scheme": ([*RADIXSERVE, "fetch-model", "ftp://x/y", "--cache", "{empty}"], ["ftp"]),
    # the service modules, as a pod runs them
    "scheduler page-size 0": ([*module("scheduler"), *SCHEDULER, "--page-size", "0"], ["--page-size"]),
    "scheduler metrics-port = port": (
        [*module("scheduler"), *SCHEDULER, "--port", "{free}", "--metrics-port", "{free}"],
        ["--metrics-port {free}", "--port"],
    ),
    "scheduler port in use": (
        [*module("scheduler"), "--model", "demo", "--detokenizer", "a:1", "--port", "{busy}"],
        ["--port {busy}", "in use"],
    ),
    "scheduler model": ([*module("scheduler"), *SCHEDULER], ["--model", "config.json"]),
    "gateway grpc-port = port": (
        [
            *module("tokenizer"),
            "--model",
            "demo",
            "--schedulers",
            "a:1",
            "--port",
            "{free}",
            "--grpc-port",
            "{free}",
        ],
        ["--grpc-port {free}", "--port"],
    ),
    "gateway schedulers missing": ([*module("tokenizer"), "--model", "demo"], ["--schedulers"]),
    "detokenizer workers 0": ([*module("detokenizer"), "--model", "demo", "--workers", "0"], ["--workers"]),
    "detokenizer port in use": ([*module("detokenizer"), "--model", "demo", "--port", "{busy}"], ["in use"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_argument_ends_in_one_line_naming_it(case: str, places: dict[str, str]) -> None:
    argv, says = CASES[case]
    p = run(argv, places)
    out = (p.stdout + p.stderr).strip()
    assert p.returncode != 0, out
    assert "Traceback" not in out
    assert len(out.splitlines()) == 1, out
    for words in says:
        assert words.format(**places) in out, out
    assert not any(Path(places["cache"]).iterdir()), "a bad start wrote the demo model"


@pytest.mark.slow
def test_a_bad_setting_in_the_environment_is_named_by_its_variable(places: dict[str, str]) -> None:
    p = run([*RADIXSERVE, "serve"], places, env={"RADIXSERVE_PAGE_SIZE": "0"})
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.strip() == (
        "radixserve serve: error: scheduler-0: environment RADIXSERVE_PAGE_SIZE: must be at least 1 (got 0)"
    )


@pytest.mark.slow
def test_a_service_that_refuses_to_start_is_named_with_its_reason(model_dir, places: dict[str, str]) -> None:
    """The demo model's 4 heads do not divide by 3: the scheduler says so, the launcher stops the
    others and ends with that line (seconds: the services start)."""
    p = run(
        [*RADIXSERVE, "serve", "--model", str(model_dir), "--port", "{free}", "--tp-size", "3"],
        places,
        timeout=180,
    )
    assert p.returncode == 1
    assert "Traceback" not in p.stdout + p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("radixserve serve: error: scheduler-0 exited during start with code 1:"), last
    assert "tp_size 3 does not divide the model's 4 attention heads" in last


def test_every_vllm_flag_we_do_not_serve_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in VLLM_UNSERVED:
        assert main(["serve", "--model", "demo", flag, "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"radixserve serve: error: vLLM's {flag} is not supported by radixserve")
        assert len(err.splitlines()) == 1


def test_vllm_flags_reach_the_service_they_concern() -> None:
    """Each flag read back as its service reads its command line (``Service.checked_config``)."""
    argv = ["serve", "--api-key", "k1", "--api-key", "k2", "k3", "--dtype", "half", "--max-model-len", "4K"]
    argv += [
        "-tp",
        "2",
        "--data-parallel-size",
        "2",
        "--gpu-memory-utilization",
        "0.5",
        "--max-num-seqs",
        "8",
    ]
    argv += ["--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--enforce-eager", "--seed", "7"]
    argv += [
        "--chat-template",
        "{{ messages }}",
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "hermes",
    ]
    argv += ["--served-model-name", "m", "--trust-remote-code", "--enable-auto-tool-choice"]
    argv += ["--disable-log-requests", "--disable-log-stats", "-q", "fp8"]
    cluster = serve_cluster(build_parser().parse_args(argv))
    assert len(cluster.schedulers) == 2
    for s in cluster.schedulers:
        engine = s.checked_config().engine
        assert (engine.dtype, engine.max_context_len, engine.tp_size) == ("float16", 4096, 2)
        assert (engine.mem_fraction, engine.max_running_requests, engine.seed) == (0.5, 8, 7)
        assert engine.quantization == "fp8"
        assert engine.disable_radix_cache and engine.chunked_prefill_size == 0 and engine.disable_cuda_graph
        assert s.argv[s.argv.index("--served-model-name") + 1] == "m"
    gw = cluster.gateway.checked_config()
    assert gw.api_key == ("k1", "k2", "k3")
    assert (gw.chat_template, gw.reasoning_parser, gw.tool_call_parser) == (
        "{{ messages }}",
        "qwen3",
        "hermes",
    )


def test_vllms_api_key_variable_protects_the_server_as_in_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    for argv, keys in ((["serve"], ("from-env",)), (["serve", "--api-key", "flag"], ("flag",))):
        assert serve_cluster(build_parser().parse_args(argv)).gateway.checked_config().api_key == keys


def test_scheduler_flags_after_dashes_win_over_vllms() -> None:
    args = build_parser().parse_args(["serve", "--max-model-len", "1k", "--dtype", "float"])
    args.scheduler_args = ["--max-context-len", "2048"]  # what main() puts there from after --
    engine = serve_cluster(args).schedulers[0].checked_config().engine
    assert (engine.max_context_len, engine.dtype) == (2048, "float32")


# ------------------------------------------------------------------ one cluster, vLLM's flags
KEY = "sk-vllm-style-key"


@pytest.fixture(scope="module")
def vllm_style(model_dir, places: dict[str, str]) -> Iterator[tuple[str, Path]]:
    """``radixserve serve`` started as a vLLM user would: its URL and its stderr's file."""
    port = free_ports(1)[0]
    log = Path(places["empty"]).with_name("serve.log")
    argv = [*RADIXSERVE, "serve", "--model", str(model_dir), "--port", str(port), "--torch-threads", "1"]
    argv += ["--served-model-name", "vllm-style", "--api-key", KEY, "--dtype", "float32"]
    argv += ["--max-model-len", "1024", "--tensor-parallel-size", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # the "serving" line, once every service is ready
            assert line.startswith("radixserve: serving vllm-style at "), (line, log.read_text()[-3000:])
            yield f"http://127.0.0.1:{port}", log
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
def test_vllm_flags_are_enforced_by_the_started_cluster(vllm_style: tuple[str, Path]) -> None:
    url, log = vllm_style
    body = {"model": "vllm-style", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, timeout=60) as h:
        assert h.post("/v1/completions", json=body).status_code == 401  # --api-key
        assert (
            h.post("/v1/completions", json=body, headers={"Authorization": "Bearer other"}).status_code == 401
        )
        r = h.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        models = h.get("/v1/models", headers=auth).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("vllm-style", 1024)]  # --max-model-len
        prompt = r.json()["usage"]["prompt_tokens"]
        r = h.post("/v1/completions", json={**body, "max_tokens": 1025 - prompt}, headers=auth)
        assert r.status_code == 400 and "context length 1024" in r.json()["error"]["message"], r.text
    deadline = time.monotonic() + 10
    while "engine ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "engine ready on cpu (float32," in log.read_text()  # --dtype, as the scheduler logs it
