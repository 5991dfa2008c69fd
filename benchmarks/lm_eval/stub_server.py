"""Stand-in OpenAI /v1/completions server: appends each request (path, Authorization, JSON body) to
LOG as one JSON line and answers a well-formed completions response with fake logprobs, so one can
see exactly what lm_eval sends without a model. Stdlib only.

    python stub_server.py PORT LOG.jsonl
    ./run.sh http://127.0.0.1:PORT /path/to/tokenizer_folder
"""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LOG = open(sys.argv[2], "a") if __name__ == "__main__" else None  # noqa: SIM115


def fake_logprob(tok: int) -> float:
    """Deterministic stand-in logprob per token id."""
    return -((tok * 7919) % 13) / 2.0 - 0.1


def choice(index: int, prompt: str | list[int], body: dict[str, Any]) -> dict[str, Any]:
    if body.get("echo"):  # loglikelihood: prompt tokens echoed + max_tokens (1) generated
        ids = prompt if isinstance(prompt, list) else [ord(c) for c in prompt]
        toks = [*ids, 7]
        lps: list[float | None] = [None, *(fake_logprob(t) for t in toks[1:])]
        tops: list[dict[str, float] | None] = [None]
        tops += [{f"t{t}": max(fake_logprob(t), -0.05 if t % 2 else -99.0)} for t in toks[1:]]
        logprobs = {
            "tokens": [f"t{t}" for t in toks],
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": list(range(len(toks))),
        }
        return {"index": index, "text": "<prompt>x", "finish_reason": "length", "logprobs": logprobs}
    text = " Paris\nmore"  # generate_until: the server must cut at `stop` (lm_eval does not)
    for stop in body.get("stop") or []:
        text = text.split(stop)[0]
    return {"index": index, "text": text, "finish_reason": "stop", "logprobs": None}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _log(self, **entry: Any) -> None:
        assert LOG is not None
        LOG.write(json.dumps({"method": self.command, "path": self.path, **entry}) + "\n")
        LOG.flush()

    def do_GET(self) -> None:
        self._log()
        self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._log(auth=self.headers.get("Authorization"), body=body)
        if self.path.rstrip("/") != "/v1/completions":
            return self._send(404, {"error": "not found"})
        prompts = body["prompt"]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        self._send(
            200,
            {
                "id": "cmpl-stub",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [choice(i, p, body) for i, p in enumerate(prompts)],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            },
        )


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
