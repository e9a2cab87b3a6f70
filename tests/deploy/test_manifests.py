"""deploy/k8s rendered offline (tests/deploy/render.py) and checked against the Kubernetes API schema and the
services' real flags: what must hold in every overlay for the pods to start, stay healthy, drain and be safe."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest

from strop.common.grpc_server import SHUTDOWN_SLACK_S
from tests.deploy.render import RenderError, apply_operation, record_parsed_options, render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
README = ROOT / "deploy" / "README.md"
# The Kubernetes versions strop supports (deploy/README.md): every minor from the oldest to the newest, each one's API
# schema bundled with kubernetes-validate. The oldest is set by the preStop `sleep` action (beta and on by default
# from 1.30) and PodDisruptionBudget's unhealthyPodEvictionPolicy (GA in 1.31); 1.37 is the newest release.
OLDEST_KUBERNETES, KUBERNETES_VERSION = "1.31.0", "1.37.0"
SUPPORTED_KUBERNETES = [f"1.{minor}.0" for minor in range(31, 38)]
KUSTOMIZATIONS = ["base", "overlays/dev", "overlays/production", "volume-init"]
SERVICE_KUSTOMIZATIONS = KUSTOMIZATIONS[:3]  # the ones that run both services
VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
# The services' gRPC names (the readiness probes ask for these; the health servicer registers them).
SERVICE_NAMES = {"trainer": "strop.v1.TrainerService", "export": "strop.v1.ExportService"}


@pytest.fixture(scope="module", params=SERVICE_KUSTOMIZATIONS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / request.param)


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def any_rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / request.param)


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(docs: list[dict]) -> dict[str, dict]:
    """The two services' workloads by service name: the trainer's StatefulSet and the exporter's Deployment."""
    return {"trainer": one(docs, "StatefulSet", "trainer"), "export": one(docs, "Deployment", "export")}


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def flag(c: dict, name: str) -> str:
    values = [a.split("=", 1)[1] for a in c["args"] if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"expected --{name}=… once in {c['args']}"
    return values[0]


def env_value(c: dict, name: str) -> dict:
    (entry,) = [e for e in c.get("env", []) if e["name"] == name]
    return entry


@pytest.mark.parametrize("version", SUPPORTED_KUBERNETES)
def test_every_document_validates_against_each_supported_kubernetes_schema_in_strict_mode(
    any_rendered, version
):
    name, docs = any_rendered
    assert len(docs) >= (1 if name == "volume-init" else 12), (
        f"{name}: expected the full set, got {len(docs)}"
    )
    for doc in docs:
        # strict: unknown fields are errors (a misspelt field would otherwise be dropped by the API server, and a
        # field newer than the cluster is refused by it)
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_supported_versions_are_bundled_and_the_readme_states_them():
    bundled = set(kubernetes_validate.utils.all_versions())
    # a version kubernetes-validate lacks would be validated against another one's schema
    assert set(SUPPORTED_KUBERNETES) <= bundled, sorted(set(SUPPORTED_KUBERNETES) - bundled)
    text = README.read_text()
    oldest, newest = (v.rsplit(".", 1)[0] for v in (OLDEST_KUBERNETES, KUBERNETES_VERSION))
    assert f"Kubernetes {oldest} to {newest}" in text, "deploy/README.md must state the supported versions"


def test_strict_validation_rejects_a_misspelt_field(rendered):
    _, docs = rendered
    broken = copy.deepcopy(workloads(docs)["trainer"])
    container(broken)["livenessProbe"]["grpc"]["servce"] = "strop.v1.TrainerService"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_args_are_the_servers_real_flags_and_bind_every_interface(rendered, monkeypatch):
    from strop.export_svc.server import parse_args as export_args
    from strop.trainer_svc.server import parse_args as trainer_args

    options = record_parsed_options(monkeypatch)
    _, docs = rendered
    for svc, parse in (("trainer", trainer_args), ("export", export_args)):
        c = container(workloads(docs)[svc])
        options.clear()
        a = parse(c["args"])  # an unknown flag or a bad value exits (SystemExit) here
        # argparse also accepts unambiguous prefixes (--grac=30); a manifest spells each flag in full
        spelled = {arg.split("=", 1)[0] for arg in c["args"]}
        assert spelled <= options, f"{svc}: {spelled - options} are not the servers' flags as spelled"
        assert a.address.startswith("0.0.0.0:"), f"{svc}: a pod must listen beyond 127.0.0.1, got {a.address}"
        assert a.model_root == "/data/models" and a.artifact_root == "/data/artifacts"
        # each pod its own state dir: $(POD_NAME) is expanded by the kubelet from the env entry of that name
        assert a.state_dir == f"/data/state/{svc}/$(POD_NAME)"
        assert env_value(c, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_environment_variables_are_ones_the_services_read(rendered):
    _, docs = rendered
    source = "\n".join(p.read_text() for p in (ROOT / "common").glob("*.py"))
    for svc, w in workloads(docs).items():
        for e in container(w)["env"]:
            if e["name"].startswith("STROP_"):
                assert f'"{e["name"]}"' in source, f"{svc}: {e['name']} is read nowhere in common/"


def test_probes_are_plaintext_grpc_health_on_the_health_port(rendered):
    _, docs = rendered
    for svc, w in workloads(docs).items():
        c = container(w)
        port = int(flag(c, "address").rpartition(":")[2])
        (grpc_port,) = [p for p in c["ports"] if p["name"] == "grpc"]
        assert grpc_port["containerPort"] == port
        # the plaintext health-only listener (common/grpc_server.build_server's health_address): it answers whatever
        # the service port speaks, and the kubelet's grpc probe speaks plaintext on every supported version
        health = int(flag(c, "health-port"))
        (health_port,) = [p for p in c["ports"] if p["name"] == "health"]
        assert health_port["containerPort"] == health != port
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c[kind]
            assert set(probe) & {"exec", "httpGet", "tcpSocket"} == set(), f"{svc} {kind}: expected only grpc"
            assert probe["grpc"]["port"] == health, (
                f"{svc} {kind}: expected port {health}, got {probe['grpc']}"
            )
            # GRPCAction.mode (TLS) is alpha in 1.37 behind a gate and unknown before: never set
            assert "mode" not in probe["grpc"], f"{svc} {kind}: {probe['grpc']}"
        # readiness asks for the service itself, which goes NOT_SERVING as soon as a drain starts
        assert c["readinessProbe"]["grpc"]["service"] == SERVICE_NAMES[svc]


def test_termination_grace_exceeds_the_pre_stop_sleep_and_the_drain_watchdog(rendered):
    _, docs = rendered
    for svc, w in workloads(docs).items():
        c = container(w)
        # the pod keeps serving while it leaves the endpoints and the clients' DNS answers; SIGTERM (which refuses
        # new work) comes after the preStop hook
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pre_stop >= 5, f"{svc}: expected a preStop sleep of 5 s or more, got {pre_stop}"
        grace = float(flag(c, "grace"))
        watchdog = 2 * grace + SHUTDOWN_SLACK_S  # common/grpc_server.serve_forever's faulthandler deadline
        period = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert period > pre_stop + watchdog, (
            f"{svc}: SIGKILL at {period}s would cut a drain the watchdog ends at {pre_stop} + {watchdog}s"
        )


def test_an_exporter_scale_down_lets_the_pods_exports_finish(rendered):
    _, docs = rendered
    export = container(workloads(docs)["export"])
    # the drain waits --grace for the pod's running and queued exports: longer than an 8B merge + K-quant
    # (minutes on the CPU; EXPORT_BUCKETS in common/metrics.py reach an hour)
    assert float(flag(export, "grace")) >= 1800


def test_pods_run_non_root_read_only_without_capabilities(rendered):
    _, docs = rendered
    for svc, w in workloads(docs).items():
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        sc = container(w)["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
        # the read-only root needs a writable /tmp (the images point every cache there)
        mounts = {m["mountPath"]: m["name"] for m in container(w)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], f"{svc}: expected an emptyDir at /tmp"


def test_every_container_has_requests_and_limits(rendered):
    _, docs = rendered
    for svc, w in workloads(docs).items():
        res = container(w)["resources"]
        for key in ("cpu", "memory"):
            assert key in res["requests"] and key in res["limits"], f"{svc}: expected {key} request and limit"


def test_trainer_requests_one_gpu_and_runs_on_gpu_nodes(rendered):
    _, docs = rendered
    trainer = workloads(docs)["trainer"]
    res = container(trainer)["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 1
    # Guaranteed QoS: requests equal limits for CPU and memory in every container (the kubelet evicts it last)
    for c in trainer["spec"]["template"]["spec"]["containers"]:
        for key in ("cpu", "memory"):
            assert c["resources"]["requests"][key] == c["resources"]["limits"][key], f"{c['name']} {key}"
    # Triton writes under TRITON_HOME (default ~/.triton): HOME is on the read-only root
    c = container(trainer)
    home = env_value(c, "TRITON_HOME")["value"]
    assert home.startswith("/tmp/"), f"TRITON_HOME {home} must be under the writable /tmp emptyDir"
    pod = trainer["spec"]["template"]["spec"]
    assert pod["nodeSelector"], "expected a node selector for GPU nodes"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    exporter = workloads(docs)["export"]
    assert "nvidia.com/gpu" not in container(exporter)["resources"]["limits"], "the exporter is CPU only"


def test_each_trainer_pod_is_addressable_through_a_headless_service(rendered):
    _, docs = rendered
    trainer = workloads(docs)["trainer"]
    svc = one(docs, "Service", trainer["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    labels = trainer["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert {p["port"] for p in svc["spec"]["ports"]} >= {50051}


def test_exporter_is_a_deployment_scaled_by_an_hpa_behind_a_service(rendered):
    _, docs = rendered
    export = workloads(docs)["export"]
    assert "replicas" not in export["spec"], "the HPA owns the replica count; applying must not reset it"
    hpa = one(docs, "HorizontalPodAutoscaler", "export")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "export"}
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    svc = one(docs, "Service", "export")
    assert svc["spec"]["selector"].items() <= export["spec"]["template"]["metadata"]["labels"].items()


def test_exports_spread_over_exporter_pods(rendered):
    from strop.common.metrics import ExportMetrics

    _, docs = rendered
    export = workloads(docs)["export"]
    labels = export["spec"]["template"]["metadata"]["labels"]
    # the SDK's round-robin target: a headless Service's name resolves to every ready pod
    headless = one(docs, "Service", "export-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= labels.items()
    assert [p["port"] for p in headless["spec"]["ports"]] == [50052]
    # plain clients of the ClusterIP Service reconnect (and round-robin clients re-resolve) within minutes
    assert 0 < float(flag(container(export), "max-connection-age")) <= 600
    # the HPA scales on the exports each pod holds, a gauge the exporter serves
    hpa = one(docs, "HorizontalPodAutoscaler", "export")
    (pods,) = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    metrics = ExportMetrics(export_counts=dict, states=["QUEUED", "RUNNING"])
    assert metrics.registry.get_sample_value(pods["metric"]["name"]) == 0, pods["metric"]["name"]
    per_pod = float(flag(container(export), "concurrent-exports"))
    assert pods["target"] == {"type": "AverageValue", "averageValue": str(int(per_pod))}


def test_shared_volume_is_read_write_many_and_mounted_by_both(rendered):
    name, docs = rendered
    pvc = one(docs, "PersistentVolumeClaim", "strop-data")
    if name == "overlays/dev":
        # one node: the default class (a one-node provisioner such as local-path offers ReadWriteOnce only, and a
        # ReadWriteMany claim on it stays Pending); ReadWriteOnce is per node, so every pod there shares it
        assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"] and "storageClassName" not in pvc["spec"]
        assert one(docs, "StatefulSet", "trainer")["spec"]["replicas"] == 1
    else:
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    if name == "overlays/production":
        assert pvc["spec"]["storageClassName"], "production names its ReadWriteMany class"
    for svc, w in workloads(docs).items():
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        claims = {
            n
            for n, v in volumes.items()
            if v.get("persistentVolumeClaim", {}).get("claimName") == "strop-data"
        }
        mounts = [m for m in container(w)["volumeMounts"] if m["name"] in claims]
        assert {m["mountPath"] for m in mounts} == {"/data", "/data/models"}, svc
        assert [m.get("readOnly", False) for m in mounts if m["mountPath"] == "/data/models"] == [True]


def test_disruption_budgets_cover_both_services_and_allow_a_drain(rendered):
    name, docs = rendered
    fewest = {
        "trainer": workloads(docs)["trainer"]["spec"]["replicas"],
        "export": one(docs, "HorizontalPodAutoscaler", "export")["spec"]["minReplicas"],
    }
    for svc, w in workloads(docs).items():
        pdb = one(docs, "PodDisruptionBudget", svc)
        assert (
            pdb["spec"]["selector"]["matchLabels"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        )
        # at the fewest pods the workload runs, a node drain may still evict one (each pod drains its own work)
        spec = pdb["spec"]
        allowed = spec["maxUnavailable"] if "maxUnavailable" in spec else fewest[svc] - spec["minAvailable"]
        assert allowed >= 1, f"{name} {svc}: {spec} blocks every eviction at {fewest[svc]} pod(s)"
        assert spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow", f"{svc}: a stuck pod must not block"


def test_network_policy_denies_by_default_and_opens_the_service_and_metrics_ports(rendered):
    _, docs = rendered
    deny = one(docs, "NetworkPolicy", "default-deny")
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    allow = one(docs, "NetworkPolicy", "strop-services")
    (expr,) = allow["spec"]["podSelector"]["matchExpressions"]
    allowed_ports = {p["port"] for rule in allow["spec"]["ingress"] for p in rule["ports"]}
    for svc, w in workloads(docs).items():
        assert w["spec"]["template"]["metadata"]["labels"][expr["key"]] in expr["values"], svc
        ports = {p["name"]: p["containerPort"] for p in container(w)["ports"]}
        # the health port is the kubelet's (node traffic, which NetworkPolicy lets through); no client needs it
        exposed = {v for k, v in ports.items() if k != "health"}
        assert exposed <= allowed_ports, f"{svc}: ports {exposed - allowed_ports} are unreachable"
        assert ports["health"] not in allowed_ports


def test_egress_is_dns_including_node_local_dns_and_the_database_only(rendered):
    _, docs = rendered
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    egress = [rule for p in policies for rule in p["spec"].get("egress", [])]
    for rule in egress:
        # a rule without `to` allows its ports to every address (the internet included)
        assert rule.get("to"), f"an egress rule open to any address: {rule}"
    dns = [r for r in egress if {p["port"] for p in r["ports"]} == {53}]
    assert {"cidr": "169.254.20.10/32"} in [t.get("ipBlock") for r in dns for t in r["to"]], (
        "NodeLocal DNSCache"
    )
    (db,) = [r for r in egress if {p["port"] for p in r["ports"]} == {5432}]
    for peer in db["to"]:
        assert "podSelector" in peer or peer.get("ipBlock", {}).get("cidr") not in ("0.0.0.0/0", None), peer


def test_metrics_port_is_exposed_and_annotated_for_prometheus(rendered):
    _, docs = rendered
    for svc, w in workloads(docs).items():
        c = container(w)
        port = int(env_value(c, "STROP_METRICS_PORT")["value"])
        assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"]
        ann = w["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(port), svc


def referenced_secrets(docs: list[dict]) -> set[str]:
    names = set()
    for w in workloads(docs).values():
        pod = w["spec"]["template"]["spec"]
        names |= {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        for e in container(w)["env"]:
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
    return names


def test_tokens_and_database_url_come_from_secrets_that_the_readme_creates(rendered):
    name, docs = rendered
    for svc, w in workloads(docs).items():
        c = container(w)
        tokens = flag(c, "auth-tokens")
        pod = w["spec"]["template"]["spec"]
        (mount,) = [m for m in c["volumeMounts"] if tokens.startswith(m["mountPath"] + "/")]
        (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert vol["secret"]["secretName"] == "strop-auth", svc
        assert env_value(c, "STROP_DATABASE_URL")["valueFrom"]["secretKeyRef"] == {
            "name": "strop-database",
            "key": "url",
        }
    readme = README.read_text()
    for secret in referenced_secrets(docs):
        assert re.search(rf"kubectl -n strop create secret \S+ {secret}\b", readme), (
            f"{name}: secret {secret} is referenced but deploy/README.md does not say how to create it"
        )


def test_production_serves_tls(rendered):
    name, docs = rendered
    for svc, w in workloads(docs).items():
        c = container(w)
        tls = any(a.startswith("--tls-cert=") for a in c["args"])
        assert tls == (name == "overlays/production"), f"{name} {svc}: TLS only in production"
        if tls:
            assert "strop-tls" in referenced_secrets(docs)


def images(docs: list[dict]) -> set[str]:
    out = set()
    for d in docs:
        pod = d.get("spec", {}).get("template", {}).get("spec", {})
        out |= {c["image"] for c in pod.get("containers", []) + pod.get("initContainers", [])}
    return out


def test_image_references_are_the_names_the_images_are_built_under(any_rendered):
    name, docs = any_rendered
    refs = images(docs)
    assert refs, name
    for ref in refs:
        registry = ref.split("/", 1)[0]
        # a short name (strop-export:0.1.0) is docker.io/library/strop-export to the container runtime
        assert "/" in ref and ("." in registry or registry == "localhost"), (
            f"{name}: {ref} is not fully qualified"
        )
        assert ref.endswith(f":{VERSION}"), f"{name}: {ref} is not pyproject's version {VERSION}"
    if name == "overlays/dev":
        # what `make test-deploy` (deploy/test-deploy.sh) and README's local buildah commands tag
        assert refs == {f"localhost/strop-{n}:{VERSION}" for n in ("trainer", "export", "gateway")}
    else:
        assert {r.rpartition(":")[0] for r in refs} <= {
            "registry.example.com/strop/trainer",
            "registry.example.com/strop/export",
            "registry.example.com/strop/gateway",
        }


def test_test_deploy_tags_the_images_the_dev_overlay_runs():
    script = (ROOT / "deploy" / "test-deploy.sh").read_text()
    # the CUDA trainer (the Containerfile's default build) and the export image, under the dev overlay's names
    assert 'TRAINER_IMAGE="localhost/strop-trainer:$TAG"' in script
    assert 'EXPORT_IMAGE="localhost/strop-export:$TAG"' in script
    assert 'build trainer-gpu trainer "$TRAINER_IMAGE"\n' in script, "the CUDA build: no CPU torch arguments"
    (default,) = re.findall(r"^TAG=\$\{DEPLOY_TAG:-(.+)\}$", script, re.M)
    assert default == "$VERSION" and "VERSION=$(" in script, "the tag is pyproject's version"


def test_training_operator_pods_run_the_trainer_image_of_base():
    base = {r for r in images(render(K8S / "base")) if "/trainer:" in r}
    ops = K8S / "training-operators"
    refs = set()
    for job in ("trainjob", "pytorchjob"):
        for d in render(ops / job):
            if d["kind"] == "TrainJob":
                refs.add(d["spec"]["trainer"]["image"])
            elif d["kind"] == "PyTorchJob":
                refs |= {
                    c["image"]
                    for spec in d["spec"]["pytorchReplicaSpecs"].values()
                    for c in spec["template"]["spec"]["containers"]
                }
    assert refs == base, f"the operator pods run {refs}, the trainer StatefulSet {base}"


def test_volume_init_owns_the_directories_the_services_write(rendered):
    _, docs = rendered
    (job,) = render(K8S / "volume-init")
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    chown = next(line for line in script.splitlines() if line.strip().startswith("chown 10001:10001"))
    owned = set(chown.split()[2:])
    for svc, w in workloads(docs).items():
        c = container(w)
        assert container(w)["securityContext"]["runAsUser"] == 10001
        # each pod creates its state dir under this parent and writes the artifact store
        state_parent = flag(c, "state-dir").rsplit("/", 1)[0]
        assert {state_parent, flag(c, "artifact-root")} <= owned, f"{svc}: {owned}"


def test_a_patch_whose_target_is_gone_fails_the_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [r.yaml]\n"
        "patches:\n  - path: p.yaml\n    target: {kind: Deployment, name: renamed}\n"
    )
    (tmp_path / "r.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: export}\nspec: {}\n"
    )
    (tmp_path / "p.yaml").write_text("- {op: add, path: /spec/replicas, value: 2}\n")
    with pytest.raises(RenderError, match="matched 0 resources"):
        render(tmp_path)


def test_json_patch_follows_rfc_6902():
    doc = {"a": [1, 3], "b": {"x/y": 1}}
    apply_operation(doc, {"op": "add", "path": "/a/1", "value": 2})
    apply_operation(doc, {"op": "add", "path": "/a/-", "value": 4})
    apply_operation(doc, {"op": "replace", "path": "/b/x~1y", "value": 5})
    apply_operation(doc, {"op": "add", "path": "/c", "value": {"d": 1}})
    assert doc == {"a": [1, 2, 3, 4], "b": {"x/y": 5}, "c": {"d": 1}}
    with pytest.raises(RenderError):
        apply_operation(doc, {"op": "replace", "path": "/missing", "value": 1})  # replace needs the member
    with pytest.raises(RenderError):
        apply_operation(doc, {"op": "move", "from": "/a", "path": "/z"})  # not used, so not implemented


def test_images_are_rewritten_where_kustomize_rewrites_them(tmp_path):
    # kubectl kustomize (v5.5.0) output for the same input: containers at any depth (a PyTorchJob's replica
    # templates) and a TrainJob's spec.trainer.image through a `configurations` field spec; nothing else
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [r.yaml]\n"
        "configurations: [images.yaml]\nimages:\n  - {name: reg/a, newName: mine/a, newTag: '2'}\n"
    )
    (tmp_path / "images.yaml").write_text("images:\n  - {path: spec/trainer/image, kind: TrainJob}\n")
    (tmp_path / "r.yaml").write_text(
        "apiVersion: kubeflow.org/v1\nkind: PyTorchJob\nmetadata: {name: p}\nspec:\n  pytorchReplicaSpecs:\n"
        "    Master: {template: {spec: {containers: [{name: c, image: 'reg/a:1'}]}}}\n"
        "  note: {image: 'reg/a:1'}\n---\n"
        "apiVersion: trainer.kubeflow.org/v1alpha1\nkind: TrainJob\nmetadata: {name: t}\n"
        "spec: {trainer: {image: 'reg/a:1'}}\n"
    )
    pj, tj = render(tmp_path)
    assert (
        pj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"]
        == "mine/a:2"
    )
    assert pj["spec"]["note"]["image"] == "reg/a:1", "an image outside containers and field specs is kept"
    assert tj["spec"]["trainer"]["image"] == "mine/a:2"
