"""API keys (services/tokenizer/auth.py): loading them from the flags, the environment and a file,
checking a presented key in constant time, and the HTTP middleware's 401."""

from __future__ import annotations

import asyncio
import hmac

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from radixserve.common.config import from_args, parse_args
from radixserve.common.service_config import GatewayConfig
from radixserve.tokenizer import auth
from radixserve.tokenizer.__main__ import build_parser
from radixserve.tokenizer.auth import MISSING, WRONG, ApiKeys, RequireApiKey, presented_key, read_key_file


def config(argv: list[str]) -> GatewayConfig:
    return from_args(
        GatewayConfig, parse_args(build_parser(), ["--model", "demo", "--schedulers", "a:1", *argv])
    )


# ------------------------------------------------------------------------------------ loading
def test_no_key_configured_means_no_check():
    keys = ApiKeys.from_config(config([]))
    assert not keys.enabled and len(keys) == 0
    assert keys.refusal({}) is None
    assert keys.refusal({"authorization": "Bearer anything"}) is None


def test_keys_from_the_flag_the_environment_and_a_file_all_count(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# rotated 2024-06\n\n  sk-file-1  \nsk-file-2\n   # old: sk-gone\n")
    keys = ApiKeys.from_config(config(["--api-key", "sk-a", "sk-b", "--api-key-file", str(f)]))
    assert len(keys) == 4
    for k in ("sk-a", "sk-b", "sk-file-1", "sk-file-2"):
        assert keys.accepts(k)
    for k in ("sk-gone", "# old: sk-gone", "sk-file-1 ", "sk-", "", "SK-A"):
        assert not keys.accepts(k)
    monkeypatch.setenv("RADIXSERVE_API_KEY", "sk-env-1 sk-env-2")
    monkeypatch.setenv("RADIXSERVE_API_KEY_FILE", str(f))
    keys = ApiKeys.from_config(config([]))
    assert [keys.accepts(k) for k in ("sk-env-1", "sk-env-2", "sk-file-2", "sk-a")] == [True] * 3 + [False]


def test_a_repeated_key_counts_once(tmp_path):
    f = tmp_path / "keys"
    f.write_text("k1\nk1\n")
    assert len(ApiKeys.from_config(config(["--api-key", "k1", "--api-key-file", str(f)]))) == 1


def test_a_missing_or_empty_key_file_stops_the_start(tmp_path):
    with pytest.raises(SystemExit, match=r"--api-key-file .*nope: cannot read it \(FileNotFoundError"):
        ApiKeys.from_config(config(["--api-key-file", str(tmp_path / "nope")]))
    with pytest.raises(SystemExit, match="cannot read it"):  # a folder, not a file
        read_key_file(tmp_path)
    f = tmp_path / "keys"
    f.write_text("# nothing but comments\n\n")
    # An empty Secret must not quietly open the API: it is an error, not "no key configured".
    with pytest.raises(SystemExit, match="no key in it"):
        ApiKeys.from_config(config(["--api-key-file", str(f)]))
    f.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(SystemExit, match="cannot read it"):
        read_key_file(f)


def test_a_key_that_cannot_go_in_a_header_is_refused_without_printing_it(tmp_path):
    f = tmp_path / "keys"
    f.write_text("good\nsk-secret with-space\n")
    with pytest.raises(SystemExit, match="line 2: a key must be") as e:
        read_key_file(f)
    assert "sk-secret" not in str(e.value)
    with pytest.raises(SystemExit, match="--api-key: key 2 of 2"):
        ApiKeys.from_config(GatewayConfig(schedulers=("a:1",), api_key=("ok", "clé")))
    with pytest.raises(SystemExit, match="key 1 of 1"):
        ApiKeys.from_config(GatewayConfig(schedulers=("a:1",), api_key=("",)))


# ----------------------------------------------------------------------------------- checking
def test_every_key_is_compared_whichever_matches(monkeypatch):
    """No early exit: as many constant-time comparisons for the first key, the last, or none."""
    calls = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = ApiKeys(["k0", "a-much-longer-key-1", "k2"])
    for presented in ("k0", "k2", "wrong", "x" * 500):
        calls.clear()
        assert keys.accepts(presented) == (presented in ("k0", "k2"))
        assert len(calls) == 3
        assert set(calls) == {(32, 32)}  # digests: the compared length says nothing of the key's


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"authorization": "Bearer sk-1"}, "sk-1"),
        ({"authorization": "bearer   sk-1  "}, "sk-1"),
        ({"authorization": "BEARER sk-1"}, "sk-1"),
        ({"x-api-key": "sk-2"}, "sk-2"),
        ({"authorization": "Bearer sk-1", "x-api-key": "sk-2"}, "sk-1"),
        ({"authorization": "Basic dXNlcjpwYXNz", "x-api-key": "sk-2"}, "sk-2"),
        ({"authorization": "Basic dXNlcjpwYXNz"}, None),
        ({"authorization": "Bearer"}, None),
        ({"authorization": "Bearer   "}, None),
        ({"authorization": "sk-1"}, None),
        ({"x-api-key": "  "}, None),
        ({}, None),
    ],
)
def test_the_presented_key(headers, key):
    assert presented_key(headers) == key


def test_refusal_says_missing_or_wrong():
    keys = ApiKeys(["sk-1", "sk-2"])
    assert keys.refusal({}) == MISSING
    assert keys.refusal({}, "custom") == "custom"
    assert keys.refusal({"authorization": "Basic x"}) == MISSING
    assert keys.refusal({"authorization": "Bearer sk-3"}) == WRONG
    assert keys.refusal({"authorization": "Bearer sk-2"}) is None
    assert keys.refusal({"x-api-key": "sk-1"}) is None
    assert "sk-" not in MISSING + WRONG


# --------------------------------------------------------------------------------- middleware
def call(
    keys: ApiKeys, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[httpx.Response, list[str]]:
    """The response through RequireApiKey (only /health open), and the paths it told of refusing."""
    seen: list[str] = []
    return asyncio.run(_call(keys, method, path, headers, seen)), seen


async def _call(
    keys: ApiKeys, method: str, path: str, headers: dict[str, str] | None, seen: list[str]
) -> httpx.Response:

    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(
        routes=[Route(p, ok, methods=["GET", "POST"]) for p in ("/health", "/metrics", "/v1/models")]
    )
    wrapped = RequireApiKey(app, keys, open_paths={"/health"}, refused=seen.append)
    transport = httpx.ASGITransport(app=wrapped)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as h:
        return await h.request(method, path, headers=headers, content=b'{"prompt": "x"}')


def test_middleware_refuses_with_401_and_openai_error_body():
    keys = ApiKeys(["sk-1"])
    r, seen = call(keys, "GET", "/v1/models")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {
        "error": {
            "message": MISSING,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert seen == ["/v1/models"]
    r, _ = call(keys, "POST", "/v1/models", {"authorization": "Bearer sk-2"})
    assert (r.status_code, r.json()["error"]["message"]) == (401, WRONG)
    r, seen = call(keys, "GET", "/nowhere")  # an unknown path: a 401 too, not a 404 that maps the API
    assert r.status_code == 401
    assert seen == ["/nowhere"]


def test_middleware_passes_a_right_key_and_the_open_paths():
    keys = ApiKeys(["sk-1"])
    for headers in ({"authorization": "Bearer sk-1"}, {"x-api-key": "sk-1"}):
        r, seen = call(keys, "POST", "/v1/models", headers)
        assert (r.status_code, r.text, seen) == (200, "ok", [])
    r, seen = call(keys, "GET", "/health")
    assert (r.status_code, seen) == (200, [])
    assert call(keys, "GET", "/metrics")[0].status_code == 401  # not in open_paths here
