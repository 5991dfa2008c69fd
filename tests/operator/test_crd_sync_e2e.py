"""helm upgrade and the CRDs: Helm never updates crds/, so the operator server-side applies the
schemas it was built with at start (operator/crd_sync.py, --apply-crds). Against kmock's emulator."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest

from radixserve.operator.crd_sync import apply_crds
from radixserve.operator.crds import CRD_REVISION, CRDS, REVISION_ANNOTATION
from radixserve.operator.kube import Kube
from tests.operator.emulator import _by_operator, access, chart_rbac, serving_emulator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

CRD = "apiextensions.k8s.io/v1/customresourcedefinitions"


async def test_an_older_crd_is_brought_to_the_operators_schema(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving_emulator(tmp_path, monkeypatch) as (emulator, _):
        # What an older chart's `helm install` left (crds/ creates both; the operator only patches):
        # an InferenceService schema without spec.template (pod templates).
        old = copy.deepcopy(CRDS["inferenceservices"])
        spec_props = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
            "properties"
        ]
        del spec_props["template"]
        tests_client = Kube(user_agent="radixserve-tests")
        await asyncio.to_thread(tests_client.create, old)
        await asyncio.to_thread(tests_client.create, copy.deepcopy(CRDS["gpunodepools"]))

        applied = await asyncio.to_thread(apply_crds, Kube())

        assert applied == [c["metadata"]["name"] for c in CRDS.values()]
        for crd in CRDS.values():
            stored = dict(emulator.objects[CRD, None, crd["metadata"]["name"]].raw)
            assert stored["spec"] == crd["spec"]  # the new field is in the cluster's schema again
        # Only what the chart's ClusterRole grants (patch on customresourcedefinitions, by name).
        used = {a for r in emulator._requests if _by_operator(r) and (a := access(r)) is not None}
        assert ("apiextensions.k8s.io", "customresourcedefinitions", "patch") in used
        assert used <= chart_rbac(), sorted(used - chart_rbac())


async def test_a_newer_crd_is_left_to_the_newer_operator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving_emulator(tmp_path, monkeypatch) as (emulator, _):
        # A newer operator's schema in the cluster (this replica is the older: a rollback).
        newer = copy.deepcopy(CRDS["inferenceservices"])
        newer["metadata"]["annotations"][REVISION_ANNOTATION] = str(CRD_REVISION + 1)
        newer["spec"]["versions"][0]["additionalPrinterColumns"] = []  # something to tell it apart
        tests_client = Kube(user_agent="radixserve-tests")
        await asyncio.to_thread(tests_client.create, newer)
        await asyncio.to_thread(tests_client.create, copy.deepcopy(CRDS["gpunodepools"]))

        applied = await asyncio.to_thread(apply_crds, Kube())

        assert applied == [CRDS["gpunodepools"]["metadata"]["name"]]
        stored = dict(emulator.objects[CRD, None, "inferenceservices.radixserve.io"].raw)
        assert stored["spec"] == newer["spec"]
