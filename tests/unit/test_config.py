"""Service flags: each also settable from RADIXSERVE_<FLAG>, the command line winning."""

from __future__ import annotations

import pytest

from radixserve.common.config import parse_args
from radixserve.scheduler.__main__ import build_parser as scheduler_parser
from radixserve.tokenizer.__main__ import build_parser as gateway_parser


def test_environment_sets_flags_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_MODEL", "/models/x")
    monkeypatch.setenv("RADIXSERVE_DETOKENIZER", "detok:50052")
    monkeypatch.setenv("RADIXSERVE_PAGE_SIZE", "16")
    monkeypatch.setenv("RADIXSERVE_DISABLE_RADIX_CACHE", "true")
    monkeypatch.setenv("RADIXSERVE_PORT", "6000")
    args = parse_args(scheduler_parser(), ["--port", "7000"])
    assert (args.model, args.detokenizer, args.page_size, args.disable_radix_cache) == (
        "/models/x",
        "detok:50052",
        16,
        True,
    )
    assert args.port == 7000


def test_list_flags_come_from_space_separated_variables(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_SCHEDULERS", "a:1 b:2")
    args = parse_args(gateway_parser(), ["--model", "demo"])
    assert args.schedulers == ["a:1", "b:2"]


def test_a_required_flag_missing_everywhere_is_an_error(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_MODEL", raising=False)
    with pytest.raises(SystemExit):
        parse_args(gateway_parser(), ["--schedulers", "a:1"])


def test_every_engine_argument_is_a_scheduler_flag():
    import dataclasses

    from radixserve.scheduler.engine import EngineConfig

    dests = {a.dest for a in scheduler_parser()._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= dests
