"""Pod templates users lay over the pods the operator makes: their CRD schema and how they merge.

    operator defaults (RADIXSERVE_OPERATOR_POD_DEFAULTS)   every pod of every service
      < spec.template                                       every pod of this service
        < spec.{tokenizer,scheduler,detokenizer}.template   this component's pods

Each layer is ``{metadata: {labels, annotations}, spec: <part of a PodSpec>}``, merged over the pod
the operator built (:func:`merge_templates`), later layers over earlier ones:

- scalars (serviceAccountName, priorityClassName, a container's image) and plain lists (args)
  replace; maps (nodeSelector, labels, annotations, resources, securityContext) merge key by key;
- ``containers`` and ``initContainers`` merge by name: a container named like ours ("gateway",
  "scheduler", "detokenizer", "fetch-model") adds to ours (env, envFrom, volumeMounts, resources,
  ...), a new name adds a sidecar; one named like a container of the operator's other pods is left
  out of this pod (spec.template may carry a "gateway" and a "scheduler" entry: each lands in its pod);
- ``env``, ``volumes``, ``imagePullSecrets``, ``resourceClaims`` merge by name and ``volumeMounts`` by
  mountPath (the API's own merge keys); an entry with a key already there replaces that entry whole
  (a volume's source, an env var's value or valueFrom, are one-of);
- ``tolerations``, ``topologySpreadConstraints``, ``envFrom``, ``hostAliases`` are appended (an
  identical entry is not added twice);
- a probe that names its own handler (httpGet, exec, grpc, tcpSocket) replaces ours; one that names
  only thresholds changes those on ours.

What the operator keeps (:func:`_keep_ours`, it wins over every layer): the labels it sets (the
Deployments' and StatefulSet's selectors use them, and the pool and managed-by labels find the pods),
the config-hash annotation (a settings change must roll the pods), and on its own containers the
command, the ports, and the env variables it sets (they wire the components together: addresses,
ports, the Redis URL; settings belong in the spec's fields, or in env variables of other names, which
do win over the ConfigMap's). The pod and container ``securityContext`` is ours by default but a
template may change it (key by key), for clusters whose Pod Security profile differs: that is on the
template's author. terminationGracePeriodSeconds is not in the schema: it follows
spec.scheduler.drainTimeoutSeconds; and the scheduler's GPU count belongs in
spec.scheduler.gpusPerReplica (the tensor-parallel size follows it), not in a template's resources.
"""

from __future__ import annotations

import copy
from typing import cast

from radixserve.operator.objects import Obj
from radixserve.operator.schema import RESOURCES, Schema, obj, schema_problems, string

# ------------------------------------------------------------------------------------ schema
_STRINGS: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
_STRING_LIST: Schema = {"type": "array", "items": {"type": "string"}}


def _open(description: str = "") -> Schema:
    """An object the API server validates as its own type once it lands in a pod (not us)."""
    s: Schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return s | ({"description": description} if description else {})


def _open_list(description: str = "") -> Schema:
    s: Schema = {"type": "array", "items": _open()}
    return s | ({"description": description} if description else {})


def _named(props: dict[str, Schema] | None = None, *, open_rest: bool = False) -> Schema:
    """A list of entries with a ``name`` (required), ``props`` and, if ``open_rest``, anything else."""
    entry = obj({"name": string(minLength=1), **(props or {})}, required=["name"])
    if open_rest:
        entry["x-kubernetes-preserve-unknown-fields"] = True
    return {"type": "array", "items": entry}


TOLERATIONS: Schema = {
    "type": "array",
    "items": obj(
        {
            "key": string(),
            "operator": string(enum=["Exists", "Equal"]),
            "value": string(),
            "effect": string(enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
            "tolerationSeconds": {"type": "integer"},
        }
    ),
}
_PROBE = _open("a Probe, as in a Pod spec")
CONTAINER: Schema = obj(
    {
        "name": string(minLength=1),
        "image": string(),
        "imagePullPolicy": string(enum=["Always", "IfNotPresent", "Never"]),
        "command": _STRING_LIST,
        "args": _STRING_LIST,
        "workingDir": string(),
        "ports": _open_list(),
        "env": _named({"value": string(), "valueFrom": _open()}),
        "envFrom": _open_list("ConfigMaps or Secrets whose keys become env variables"),
        "resources": RESOURCES,
        "resizePolicy": _open_list(),
        "restartPolicy": string(description="Always: a native sidecar (initContainers only)"),
        "volumeMounts": {
            "type": "array",
            "items": obj(
                {
                    "name": string(minLength=1),
                    "mountPath": string(minLength=1),
                    "readOnly": {"type": "boolean"},
                    "subPath": string(),
                    "subPathExpr": string(),
                    "mountPropagation": string(),
                    "recursiveReadOnly": string(),
                },
                required=["name", "mountPath"],
            ),
        },
        "volumeDevices": _open_list(),
        "livenessProbe": _PROBE,
        "readinessProbe": _PROBE,
        "startupProbe": _PROBE,
        "lifecycle": _open(),
        "terminationMessagePath": string(),
        "terminationMessagePolicy": string(enum=["File", "FallbackToLogsOnError"]),
        "securityContext": _open("a container SecurityContext"),
        "stdin": {"type": "boolean"},
        "stdinOnce": {"type": "boolean"},
        "tty": {"type": "boolean"},
    },
    required=["name"],
)
POD_SPEC: Schema = obj(
    {
        "imagePullSecrets": _named(),
        "serviceAccountName": string(),
        "automountServiceAccountToken": {"type": "boolean"},
        "nodeSelector": _STRINGS,
        "tolerations": TOLERATIONS,
        "affinity": _open("node, pod and pod anti-affinity, as in a Pod spec"),
        "topologySpreadConstraints": _open_list(),
        "priorityClassName": string(),
        "runtimeClassName": string(description="e.g. nvidia, where the GPU runtime is not the default"),
        "schedulerName": string(),
        "securityContext": _open("the PodSecurityContext; replaces ours key by key"),
        "dnsPolicy": string(enum=["ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"]),
        "dnsConfig": _open(),
        "enableServiceLinks": {"type": "boolean"},
        "hostAliases": _open_list(),
        "containers": {"type": "array", "items": CONTAINER},
        "initContainers": {"type": "array", "items": CONTAINER},
        "volumes": _named(open_rest=True),
        "resourceClaims": _named(open_rest=True),
    },
    description="Part of a PodSpec, merged into the operator's (see the operator's templates.py).",
)
TEMPLATE_SCHEMA: Schema = obj(
    {
        "metadata": obj({"labels": _STRINGS, "annotations": _STRINGS}),
        "spec": POD_SPEC,
    },
    description="Merged into the pods: operator defaults < spec.template < the component's template. "
    "Maps merge key by key, containers/env/volumes by name, tolerations append; the operator keeps its "
    "labels, the config-hash annotation, and its containers' command, ports and env variables.",
)


def template_problems(template: object, where: str) -> list[str]:
    """What :data:`TEMPLATE_SCHEMA` refuses in ``template`` (one message per problem, with its path)."""
    return schema_problems(TEMPLATE_SCHEMA, template, where)


# ------------------------------------------------------------------------------------- merging
_KEYED = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "resourceClaims": "name",
    "volumeMounts": "mountPath",
}
_MERGED_ENTRIES = {"containers", "initContainers"}  # the others' entries are replaced whole
_APPENDED = {"tolerations", "topologySpreadConstraints", "envFrom", "hostAliases"}
_PROBE_HANDLERS = ("exec", "httpGet", "grpc", "tcpSocket")


def _merge(ours: object, theirs: object, field: str = "") -> object:
    """``theirs`` laid over ``ours`` (both JSON), by the rules in the module docstring."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        if field.endswith("Probe") and any(h in theirs for h in _PROBE_HANDLERS):
            ours = {k: v for k, v in ours.items() if k not in _PROBE_HANDLERS}
        out = dict(ours)
        for key, value in theirs.items():
            out[key] = _merge(out[key], value, key) if key in out else copy.deepcopy(value)
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        if field in _KEYED:
            return _merge_keyed(ours, theirs, _KEYED[field], merge_entries=field in _MERGED_ENTRIES)
        if field in _APPENDED:
            return [*ours, *(copy.deepcopy(t) for t in theirs if t not in ours)]
    return copy.deepcopy(theirs)


def _merge_keyed(ours: list[Obj], theirs: list[Obj], key: str, merge_entries: bool) -> list[Obj]:
    out = list(ours)
    index = {entry.get(key): i for i, entry in enumerate(out)}
    for entry in theirs:
        at = index.get(entry.get(key))
        if at is None:
            index[entry.get(key)] = len(out)
            out.append(copy.deepcopy(entry))
        else:
            out[at] = cast(Obj, _merge(out[at], entry)) if merge_entries else copy.deepcopy(entry)
    return out


def _keep_ours(merged: Obj, ours: Obj, protected_annotations: tuple[str, ...]) -> None:
    """Put back what the operator keeps control of (see the module docstring), in place."""
    meta = merged.setdefault("metadata", {})
    meta["labels"] = {**meta.get("labels", {}), **ours["metadata"].get("labels", {})}
    annotations = ours["metadata"].get("annotations", {})
    kept = {k: annotations[k] for k in protected_annotations if k in annotations}
    if kept or meta.get("annotations"):
        meta["annotations"] = {**meta.get("annotations", {}), **kept}
    for field in ("containers", "initContainers"):
        by_name = {c["name"]: c for c in merged["spec"].get(field, [])}
        for container in ours["spec"].get(field, []):
            target = by_name[container["name"]]
            for key in ("command", "ports"):
                if key in container:
                    target[key] = copy.deepcopy(container[key])
                else:
                    target.pop(key, None)
            if container.get("env"):
                target["env"] = _merge_keyed(target.get("env", []), container["env"], "name", False)


def _for_this_pod(layer: Obj, ours: Obj, reserved: tuple[str, ...]) -> Obj:
    """``layer``'s metadata and spec without the containers meant for the operator's other pods:
    those named in ``reserved`` (every name the operator gives a container) that ``ours`` lacks."""
    own = {c["name"] for field in ("containers", "initContainers") for c in ours["spec"].get(field, [])}
    foreign = set(reserved) - own
    spec = dict(layer.get("spec") or {})
    for field in ("containers", "initContainers"):
        if field in spec:
            spec[field] = [c for c in spec[field] if c.get("name") not in foreign]
    return {"metadata": layer.get("metadata") or {}, "spec": spec}


def merge_templates(
    ours: Obj, layers: list[Obj], protected_annotations: tuple[str, ...] = (), reserved: tuple[str, ...] = ()
) -> Obj:
    """The pod template ``ours`` (metadata + spec, as built) with each of ``layers`` merged over it in
    order, then the operator's own fields put back; ``ours`` is left as it was. ``reserved``: the
    names of the operator's containers in all its pods."""
    merged: Obj = copy.deepcopy(ours)
    if not any(layers):
        return merged
    for layer in layers:
        merged = cast(Obj, _merge(merged, _for_this_pod(layer, ours, reserved)))
    _keep_ours(merged, ours, protected_annotations)
    return merged
