"""The kopf operator for InferenceService and GPUNodePool (``python -m radixserve.operator``).

    crds.py           the two CRDs (single source; the chart's crds/ are rendered from it)
    schema.py         the schemas' vocabulary, defaulting, and the operator's own schema checks
    validation.py     what a schema-valid spec can still get wrong -> Problem(reason, message)
    manifests.py      pure builders: InferenceService spec -> ConfigMap, Services, Deployments, StatefulSet
    engine_env.py     the ConfigMap's settings (RADIXSERVE_* from the spec's engine, routing, ...)
    templates.py      users' pod templates (operator defaults < spec.template < a component's): schema, merge
    volumes.py        the pods' volumes: scratch, the model (its cache and the init container that
                      fetches it: radixserve.common.model_fetch), the API keys
    netpol.py         pure builders: the service's NetworkPolicies
    redis_acl.py      one Redis user, key prefix and credentials Secret per service (chart Redis ACLs)
    nodepool.py       pure GPUNodePool logic: node membership, label/taint patches, GPU counts
    scaling.py        autoscaling modes (off/operator/external); scheduler load -> replicas, stabilized
    scheduler_scale.py  this round's scheduler count per mode (external: the StatefulSet's, handed over)
    status.py         conditions (Ready / Progressing / Degraded)
    kube.py           plain-dict calls (server-side apply, merge patch) over the official client's
                      DynamicClient (discovery finds each kind's path)
    handlers.py       the kopf handlers of InferenceServices, gluing the above to events
    pool_handlers.py  the kopf handlers of GPUNodePools and Nodes
    config.py         the operator's own settings (environment, set by the chart)
    crd_sync.py       at start (--apply-crds): server-side apply our CRDs (helm upgrade never does)
    uninstall.py      the chart's pre-delete hook: delete the services and pools, wait for release
    __main__.py       kopf.run: standalone, or peering (several replicas, one serving)

Imports only radixserve.common from the rest of the package.
"""
