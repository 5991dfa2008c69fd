"""The vocabulary the CRD schemas are written in, and the two things the operator does with a
schema itself: fill its defaults (:func:`apply_defaults`) and find what the API server would refuse
(:func:`schema_problems`), for specs that reached us without the API server's checks."""

from __future__ import annotations

import copy
from typing import TypeVar

from radixserve.operator.objects import Obj

Schema = Obj  # an OpenAPI v3 schema node
JsonT = TypeVar("JsonT")  # a JSON value: what a schema describes


def integer(minimum: int = 0, default: int | None = None, **kw: object) -> Schema:
    s: Schema = {"type": "integer", "minimum": minimum, **kw}
    if default is not None:
        s["default"] = default
    return s


def string(default: str | None = None, **kw: object) -> Schema:
    s: Schema = {"type": "string", **kw}
    if default is not None:
        s["default"] = default
    return s


def obj(props: dict[str, Schema], *, default: Obj | None = None, **kw: object) -> Schema:
    s: Schema = {"type": "object", "properties": props, **kw}
    if default is not None:
        s["default"] = default
    return s


# Container resources are the core type; preserving unknown fields keeps the CRD small and lets
# the API server (not us) validate quantities.
RESOURCES: Schema = {
    "type": "object",
    "description": "Container resources (requests/limits), as in a Pod spec.",
    "x-kubernetes-preserve-unknown-fields": True,
}
SECRET_KEY = obj(
    {"name": string(minLength=1), "key": string()},
    required=["name"],
    description="A key of a Secret in the InferenceService's namespace.",
)
ANY_OBJECTS: Schema = {
    "type": "array",
    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
}
CONDITIONS: Schema = {
    "type": "array",
    "items": obj(
        {
            "type": string(),
            "status": string(enum=["True", "False", "Unknown"]),
            "reason": string(),
            "message": string(),
            "lastTransitionTime": string(format="date-time"),
            "observedGeneration": {"type": "integer"},
        },
        required=["type", "status"],
    ),
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
}


def apply_defaults(schema: Schema, value: JsonT) -> JsonT:
    """A defaulted deep copy of ``value``, as the API server's structural defaulting would give.

    Nested defaults apply only where the parent exists, which is why the parents above carry
    ``default: {}``. The operator calls this too: objects written before a default was added, and
    API emulators that do not default, must read the same as freshly admitted ones.
    """
    return _fill_defaults(schema, copy.deepcopy(value))


def _fill_defaults(schema: Schema, value: JsonT) -> JsonT:
    """:func:`apply_defaults` in place, on a copy it owns."""
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _fill_defaults(sub, value[key])
    elif schema.get("type") == "array" and isinstance(value, list) and "items" in schema:
        value[:] = [_fill_defaults(schema["items"], v) for v in value]
    return value


def schema_problems(schema: Schema, value: object, where: str = "spec") -> list[str]:
    """What the API server's OpenAPI validation would refuse in ``value`` (types, ranges, enums,
    required fields, minProperties), and the unknown fields it would prune or, with strict field
    validation, refuse (objects that preserve unknown fields have their known ones checked): the
    operator's own check, for a spec that reached it anyway (an older CRD, a cluster without
    validation, an emulator). One message per problem, with its path."""
    if value is None:
        return [] if schema.get("nullable") else [f"{where}: must not be null"]
    kind = schema.get("type")
    ok = {
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        None: True,
    }.get(kind, True)
    if not ok:
        article = "an" if kind in ("object", "array", "integer") else "a"
        return [f"{where}: must be {article} {kind}, got {value!r}"]
    out: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: must be one of {schema['enum']}, got {value!r}")
    if "minimum" in schema and isinstance(value, (int, float)):
        low = schema["minimum"]
        if value < low or (schema.get("exclusiveMinimum") and value == low):
            out.append(f"{where}: {value!r} is below the minimum {low}")
    if "maximum" in schema and isinstance(value, (int, float)) and value > schema["maximum"]:
        out.append(f"{where}: {value!r} is above the maximum {schema['maximum']}")
    if "minLength" in schema and isinstance(value, str) and len(value) < schema["minLength"]:
        out.append(f"{where}: must not be empty")
    if kind == "array" and isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += schema_problems(schema["items"], item, f"{where}[{i}]")
    if kind == "object" and isinstance(value, dict):
        out += _object_problems(schema, value, where)
    return out


def _object_problems(schema: Schema, value: dict[str, object], where: str) -> list[str]:
    """An object's fields: the known ones checked, unknown ones named unless the schema keeps them."""
    out: list[str] = []
    props = schema.get("properties")
    extra = schema.get("additionalProperties")
    keeps_unknown_fields = schema.get("x-kubernetes-preserve-unknown-fields")
    for key, item in value.items():
        if props is not None and key in props:
            out += schema_problems(props[key], item, f"{where}.{key}")
        elif isinstance(extra, dict):
            out += schema_problems(extra, item, f"{where}.{key}")
        elif props is not None and not keeps_unknown_fields:
            out.append(f"{where}.{key}: unknown field (a typo? known: {', '.join(sorted(props))})")
    out += [f"{where}.{key}: required" for key in schema.get("required", []) if key not in value]
    if len(value) < schema.get("minProperties", 0):
        out.append(f"{where}: needs at least {schema['minProperties']} entries")
    return out
