"""deploy/: the RayJob and its NetworkPolicy agree, and the job server is never on the pod network without
Ray token auth. Read as YAML only: no Kubernetes here, so what a cluster would do with them is untested."""

from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(name: str) -> list[dict]:
    return [document for document in yaml.safe_load_all((DEPLOY / name).read_text()) if document]


def ray_groups(rayjob: dict) -> list[dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def token_auth(rayjob: dict, group: dict) -> bool:
    """KubeRay's authOptions, or RAY_AUTH_MODE=token with a token from a Secret on every container."""
    if rayjob["spec"]["rayClusterSpec"].get("authOptions", {}).get("mode") == "token":
        return True
    for container in group["template"]["spec"]["containers"]:
        env = {item["name"]: item for item in container.get("env", [])}
        if env.get("RAY_AUTH_MODE", {}).get("value") != "token" or "secretKeyRef" not in env.get(
                "RAY_AUTH_TOKEN", {}).get("valueFrom", {}):
            return False
    return True


def test_dashboard_on_the_pod_network_only_with_token_auth():
    (rayjob,) = load("rayjob.yaml")
    assert rayjob["kind"] == "RayJob"
    for group in ray_groups(rayjob):
        if group["rayStartParams"].get("dashboard-host", "127.0.0.1") not in ("127.0.0.1", "localhost"):
            assert token_auth(rayjob, group), group["rayStartParams"]
    assert rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["serviceType"] == "ClusterIP"


def test_network_policy_covers_every_ray_pod_and_only_lets_them_talk_to_each_other():
    (rayjob,) = load("rayjob.yaml")
    (policy,) = load("networkpolicy.yaml")
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    assert policy["metadata"]["namespace"] == rayjob["metadata"]["namespace"]
    spec = policy["spec"]
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}  # both denied unless a rule allows
    selector = spec["podSelector"]["matchLabels"]
    assert selector, "an empty selector would apply to every pod of the namespace"
    for group in ray_groups(rayjob):
        labels = group["template"].get("metadata", {}).get("labels", {})
        assert selector.items() <= labels.items(), (selector, labels)

    # Ingress: all ports from the job's own pods; from anyone else, only the job server's port.
    for rule in spec["ingress"]:
        own = all(peer == {"podSelector": {"matchLabels": selector}} for peer in rule["from"])
        assert own or [port["port"] for port in rule["ports"]] == [8265], rule
        assert all("ipBlock" not in peer and "namespaceSelector" not in peer for peer in rule["from"]), rule
    # Egress: the job's own pods, the MLflow server's port, DNS; no rule without a destination.
    assert all(rule.get("to") for rule in spec["egress"])
    ports = {(port["protocol"], port["port"]) for rule in spec["egress"] for port in rule.get("ports", [])}
    assert ports == {("TCP", 5000), ("UDP", 53), ("TCP", 53)}
    mlflow = rayjob["metadata"]["namespace"] + ".svc:5000"
    assert mlflow in (DEPLOY / "rayjob.yaml").read_text()
