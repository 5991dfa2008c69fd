"""The kopf operator for InferenceService and GPUNodePool (Kubernetes issue).

Imports only radixserve.common.
"""
