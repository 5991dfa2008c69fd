"""Service flags: each also settable from RADIXSERVE_<FLAG>, the command line winning."""

from __future__ import annotations

import argparse

import pytest

from radixserve.common import service_config
from radixserve.common.config import env_name, flag_fields, from_args, parse_args
from radixserve.detokenizer.__main__ import build_parser as detokenizer_parser
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


# ------------------------------------------------------------------ one source for every default
SERVICES = {
    "scheduler": (scheduler_parser, "SchedulerPodConfig", ["--model", "m", "--detokenizer", "d:1"]),
    "gateway": (gateway_parser, "GatewayConfig", ["--model", "m", "--schedulers", "a:1"]),
    "detokenizer": (detokenizer_parser, "DetokenizerConfig", ["--model", "m"]),
}


@pytest.fixture
def no_env(monkeypatch):
    import os

    for var in [v for v in os.environ if v.startswith("RADIXSERVE_")]:
        monkeypatch.delenv(var)


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_flag_default_is_the_config_default(service, no_env):
    parser, cls_name, argv = SERVICES[service]
    cls = getattr(service_config, cls_name)
    p = parser()
    by_dest: dict[str, argparse.Action] = {}
    for a in p._actions:
        if a.option_strings:
            by_dest.setdefault(a.dest, a)  # a negation (--enable-overlap) comes after its flag
    settings = flag_fields(cls)
    for name, f in settings.items():
        action = by_dest[name]
        assert "--" + name.replace("_", "-") in action.option_strings
        if not f.metadata["required"]:
            assert action.default == f.default, name
    # and nothing else: a flag is a config setting, or the model's own two
    assert set(by_dest) - set(settings) <= {"help", "model", "served_model_name"}
    parsed = from_args(cls, parse_args(p, argv))
    required = {n: getattr(parsed, n) for n, f in settings.items() if f.metadata["required"]}
    assert parsed == cls(**required)


def test_radixserve_serve_routes_like_a_gateway_by_default():
    from radixserve.cli import build_parser

    args = build_parser().parse_args(["serve"])
    routing = service_config.RoutingConfig()
    assert (args.router, args.prefix_index) == (routing.router, routing.prefix_index)


def test_every_variable_the_operator_sets_is_a_service_setting():
    from radixserve.operator.manifests import build_all
    from tests.operator.specs import ctx

    names = set()
    for cls in (
        service_config.SchedulerPodConfig,
        service_config.GatewayConfig,
        service_config.DetokenizerConfig,
    ):
        names |= {env_name(n) for n in flag_fields(cls)}
    names |= {env_name("model"), env_name("served_model_name"), "RADIXSERVE_CACHE_DIR"}
    objs = build_all(ctx())
    data = objs[0]["data"]
    env = [e["name"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")
           for c in o["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])]  # fmt: skip
    seen = {v for v in [*data, *env] if v.startswith("RADIXSERVE_")}
    assert seen and seen <= names, seen - names


def test_engine_options_are_engine_config_fields_with_their_types() -> None:
    """``Engine(path, **options)`` is typed by EngineOptions: the same names and types as EngineConfig."""
    import typing

    from radixserve.common.service_config import EngineConfig
    from radixserve.scheduler.engine_options import EngineOptions

    assert typing.get_type_hints(EngineOptions) == typing.get_type_hints(EngineConfig)


def test_an_engine_takes_a_config_and_options_over_it(demo_model) -> None:
    from radixserve import Engine
    from radixserve.common.service_config import EngineConfig

    path = demo_model("llama")
    config = EngineConfig(max_total_tokens=256, page_size=4, warmup=False)
    with Engine(path, config, page_size=8) as engine:
        assert (engine.config.max_total_tokens, engine.config.page_size) == (256, 8)
    with pytest.raises(TypeError, match=r"unknown engine argument\(s\): \['page_sise'\]"):
        Engine(path, page_sise=8)  # type: ignore[call-arg]
