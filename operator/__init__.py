"""The kopf operator for InferenceService and GPUNodePool (``python -m radixserve.operator``).

    crds.py           the two CRDs (single source; the chart's crds/ are rendered from it)
    schema.py         the schemas' vocabulary, defaulting, and the operator's own schema checks
    validation.py     what a schema-valid spec can still get wrong -> Problem(reason, message)
    manifests.py      pure builders: InferenceService spec -> ConfigMap, Services, Deployments, StatefulSet
    volumes.py        the pods' volumes: scratch, the model (and its Hub download), the API keys
    netpol.py         pure builders: the service's NetworkPolicies
    redis_acl.py      one Redis user, key prefix and credentials Secret per service (chart Redis ACLs)
    nodepool.py       pure GPUNodePool logic: node membership, label/taint patches, GPU counts
    scaling.py        scheduler load (Redis heartbeats, behind LoadSource) -> replicas, stabilized
    status.py         conditions (Ready / Progressing / Degraded)
    kube.py           a small REST client (server-side apply, merge patch) over the official client
    handlers.py       the kopf handlers of InferenceServices, gluing the above to events
    pool_handlers.py  the kopf handlers of GPUNodePools and Nodes
    config.py         the operator's own settings (environment, set by the chart)

Imports only radixserve.common from the rest of the package.
"""
