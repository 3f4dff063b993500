"""Fixtures for the deploy/ checks: kustomize builds, rendered once per run."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.deploy.tools import DEPLOY, run

# What can be deployed: the base and each overlay. Not the components the overlays add, nor the parts of one overlay
# (overlays/cells/cell-a): neither builds alone into a deployment.
KUSTOMIZATIONS = sorted(
    path.parent
    for path in (DEPLOY / "kubernetes").rglob("kustomization.yaml")
    if path.parent.name == "base" or path.parent.parent.name == "overlays"
)


@pytest.fixture(scope="session")
def builds() -> dict[str, list[dict[str, Any]]]:
    """`kubectl kustomize` of every kustomization under deploy/kubernetes, by its path relative to that folder."""
    rendered = {}
    for directory in KUSTOMIZATIONS:
        output = run("kubectl", "kustomize", directory).stdout
        rendered[str(directory.relative_to(DEPLOY / "kubernetes"))] = [
            doc for doc in yaml.safe_load_all(output) if doc is not None
        ]
    return rendered
