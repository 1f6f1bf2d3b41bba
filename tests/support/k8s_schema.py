"""Offline validation of rendered Kubernetes manifests against the official OpenAPI schemas.

kubernetes-validate (a dev dependency) bundles the schemas of each Kubernetes release; strict
mode makes unknown fields errors, so a misspelt key fails as an API server would reject it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

# The version the manifests are checked against: conf/cluster/k8s.yaml's default k8s_version.
CONF = Path(__file__).resolve().parents[2] / "conf" / "cluster" / "k8s.yaml"
PINNED_VERSION = str(yaml.safe_load(CONF.read_text())["k8s_version"])


def validate_manifest(text: str, version: str = PINNED_VERSION) -> list[dict[str, Any]]:
    """The manifest's objects, each checked in strict mode; raises ValidationError."""
    objects = [obj for obj in yaml.safe_load_all(text) if obj is not None]
    assert objects, "the manifest holds no objects"
    for obj in objects:
        checked = kubernetes_validate.validate(obj, version, strict=True)
        # The package falls back to an older schema for a version it lacks: it must not here.
        assert checked == version, f"validated against {checked}, not {version}"
    return objects
