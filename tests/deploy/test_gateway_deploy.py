"""The HTTP gateways' image and the Tinker gateway's manifests, checked offline: the image installs the gateways'
part of the lock without torch (and the gateways import without it), every image copies every package directory
pyproject names, and the rendered Deployment runs the gateway's real flags with plaintext HTTP probes, a drain that
fits its grace period, TLS in production and network access to the trainer alone."""

from __future__ import annotations

import re
import subprocess
import sys

import kubernetes_validate
import pytest

from tests.deploy.render import record_parsed_options, render
from tests.deploy.test_images import BUILD_TOOLS, CONTAINERFILES, PYPROJECT, ROOT, names, stages
from tests.deploy.test_manifests import (
    K8S,
    OLDEST_KUBERNETES,
    README,
    SERVICE_KUSTOMIZATIONS,
    VERSION,
    container,
    flag,
    one,
)

GATEWAY_FILE = ROOT / "deploy" / "Containerfile.gateway"
ALL_CONTAINERFILES = {**CONTAINERFILES, "gateway": GATEWAY_FILE}


@pytest.fixture(scope="module", params=SERVICE_KUSTOMIZATIONS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / request.param)


def tinker(docs: list[dict]) -> dict:
    return one(docs, "Deployment", "tinker")


def package_dirs() -> set[str]:
    """The top-level directories pyproject maps strop's packages to (setuptools refuses a missing one)."""
    dirs = PYPROJECT["tool"]["setuptools"]["package-dir"].values()
    return {d.split("/")[0] for d in dirs}


@pytest.mark.parametrize("role", sorted(ALL_CONTAINERFILES))
def test_every_image_copies_every_package_directory(role):
    builder, _ = stages(ALL_CONTAINERFILES[role].read_text())
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", builder, flags=re.M))
    assert package_dirs() <= copied, f"{role}: `pip install .` fails without {package_dirs() - copied}"


def test_test_deploy_stages_every_package_directory():
    script = (ROOT / "deploy" / "test-deploy.sh").read_text()
    (paths,) = re.findall(r"^PATHS=\((.*)\)$", script, flags=re.M)
    assert package_dirs() <= set(paths.split())
    assert 'GATEWAY_IMAGE="localhost/strop-gateway:$TAG"' in script
    assert 'build gateway gateway "$GATEWAY_IMAGE"\n' in script, "no torch arguments: the image has none"


def test_gateway_image_installs_the_gateways_part_of_the_lock_without_torch():
    gw = names(["tinker", "openai"], torch=False)
    assert {"tinker", "openai", "fastapi", "uvicorn", "zstandard", "grpcio", "protobuf"} <= gw
    heavy = {"torch", "triton", "bitsandbytes", "peft", "trl", "accelerate", "llama-cpp-python", "gguf"}
    assert gw & heavy == set(), f"the gateway image would pull {gw & heavy}"
    assert gw & {"pytest", "ruff", "grpcio-tools", "kubernetes-validate"} == set()
    builder, _ = stages(GATEWAY_FILE.read_text())
    assert (
        "deploy/lock_subset.py requirements/lock.txt pyproject.toml --extra tinker --extra openai --no-torch"
        in builder
    )
    assert "--also setuptools" in builder, "strop's build backend (only torch pulls it in otherwise)"
    assert "pip install -q --no-deps --require-hashes -r" in builder and "pip check" in builder
    assert "torch" not in " ".join(re.findall(r"pip install[^\n]*", builder)).replace("--no-torch", "")


def test_the_gateways_import_without_torch():
    # what the image's Python does: torch absent (an import of it fails), and nothing that needs it is loaded
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import strop.cli.main, strop.gateways.tinker.app, strop.gateways.tinker.server, strop.gateways.health\n"
        "from strop.gateways.tinker.gateway import Gateway, GatewayConfig\n"
        "Gateway(GatewayConfig()).close()\n"
        "print(sorted(m for m in ('transformers', 'triton', 'peft', 'safetensors') if sys.modules.get(m)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_gateway_containerfile_runs_strop_serve_as_a_numeric_non_root_user_without_build_tools():
    text = GATEWAY_FILE.read_text()
    assert re.findall(r"^FROM (\S+)", text, flags=re.M) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, flags=re.M)
    assert base == "docker.io/library/debian:bookworm-slim"
    _, final = stages(text)
    assert "COPY --from=builder /opt/strop /opt/strop" in final
    assert re.findall(r"^USER (\d+):(\d+)$", final, flags=re.M) == [("10001", "10001")]
    assert re.findall(r"^ENTRYPOINT (.+)$", final, flags=re.M) == ['["/opt/strop/bin/strop", "serve"]']
    installs = " ".join(re.findall(r"apt-get install[^;]*", final))
    assert not [t for t in (*BUILD_TOOLS, "gcc") if t in installs + " "], installs
    assert "HF_HUB_OFFLINE=1" in final and "HF_HOME=/tmp/" in final


def test_tinker_args_are_the_gateways_real_flags(rendered, monkeypatch):
    from strop.gateways.tinker.server import build_parser

    options = record_parsed_options(monkeypatch)
    name, docs = rendered
    c = container(tinker(docs))
    assert c["args"][0] == "tinker", (
        "the image's entrypoint is `strop serve`: the first argument picks the gateway"
    )
    a = build_parser().parse_args(c["args"][1:])  # an unknown flag exits here
    spelled = {arg.split("=", 1)[0] for arg in c["args"][1:]}
    assert spelled <= options, f"{spelled - options} are not the gateway's flags as spelled"
    assert a.listen.startswith("0.0.0.0:") and a.model_root == "/data/models"
    # trainer-0 holds the shared bases and every run on them (sessions live on one pod's GPU)
    trainer = one(docs, "StatefulSet", "trainer")
    assert (
        a.trainer
        == f"{trainer['metadata']['name']}-0.{trainer['spec']['serviceName']}.strop.svc.cluster.local:50051"
    )
    assert (a.tls_cert is not None) == (a.tls_key is not None) == (name == "overlays/production")
    assert (a.trainer_tls_ca is not None) == (name == "overlays/production"), (
        "TLS to the trainer where it serves TLS"
    )
    # the admin token (loads each base once as a shared session) comes from a secret README says how to create
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in tinker(docs)["spec"]["template"]["spec"]["volumes"]}
    for path in filter(None, (a.admin_token_file, a.tls_cert, a.trainer_tls_ca)):
        secret = vols[mounts[path.rsplit("/", 1)[0]]]["secret"]["secretName"]
        assert re.search(rf"kubectl -n strop create secret \S+ {secret}\b", README.read_text()), secret


def test_tinker_probes_are_plaintext_http_on_the_health_port(rendered):
    _, docs = rendered
    c = container(tinker(docs))
    port = int(flag(c, "listen").rpartition(":")[2])
    health = int(flag(c, "health-port"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": port, "health": health} and health != port
    for kind, path in (
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        probe = c[kind]
        assert set(probe) & {"exec", "grpc", "tcpSocket"} == set(), kind
        # scheme HTTP (the default): the health port is plaintext whatever --listen speaks
        assert probe["httpGet"] == {"path": path, "port": health}, f"{kind}: {probe['httpGet']}"


def test_tinker_drains_within_its_grace_period(rendered):
    from strop.gateways.tinker.server import build_parser

    _, docs = rendered
    w = tinker(docs)
    c = container(w)
    a = build_parser().parse_args(c["args"][1:])
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    # uvicorn's graceful shutdown (gateways/common.serve: 10 s) after the preStop sleep, a long poll (--poll-ms) at most
    period = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert period > pre_stop + 10 + a.poll_ms / 1000, period


def test_tinker_pods_are_restricted_and_read_only(rendered):
    _, docs = rendered
    w = tinker(docs)
    pod, c = w["spec"]["template"]["spec"], container(w)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsUser"] == 10001
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in vols[mounts["/tmp"]["name"]]
    assert mounts["/data/models"]["readOnly"] is True and "/data" not in mounts, (
        "it reads the model root only"
    )
    for key in ("cpu", "memory"):
        assert key in c["resources"]["requests"] and key in c["resources"]["limits"]
    pdb = one(docs, "PodDisruptionBudget", "tinker")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    svc = one(docs, "Service", "tinker")
    assert svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    assert [p["port"] for p in svc["spec"]["ports"]] == [int(flag(c, "listen").rpartition(":")[2])]


def test_tinker_network_access_is_clients_in_and_the_trainer_and_dns_out(rendered):
    _, docs = rendered
    w = tinker(docs)
    labels = w["spec"]["template"]["metadata"]["labels"]
    c = container(w)
    pol = one(docs, "NetworkPolicy", "strop-gateways")
    (expr,) = pol["spec"]["podSelector"]["matchExpressions"]
    assert labels[expr["key"]] in expr["values"]
    ingress_ports = {p["port"] for r in pol["spec"]["ingress"] for p in r["ports"]}
    listen = {
        int(flag(container(one(docs, "Deployment", g)), "listen").rpartition(":")[2])
        for g in ("tinker", "openai")
    }
    # the gateways' HTTP ports and nothing else: the health port is the kubelet's only
    assert ingress_ports == listen and int(flag(c, "health-port")) not in ingress_ports
    egress = pol["spec"]["egress"]
    assert all(r.get("to") for r in egress), "no egress rule open to every address"
    by_port = {frozenset(p["port"] for p in r["ports"]): r for r in egress}
    assert set(by_port) == {frozenset({50051}), frozenset({53})}
    trainer_labels = one(docs, "StatefulSet", "trainer")["spec"]["template"]["metadata"]["labels"]
    (peer,) = by_port[frozenset({50051})]["to"]
    assert peer["podSelector"]["matchLabels"].items() <= trainer_labels.items()
    # and the trainer lets the gateway in (the services' own policy admits strop.dev/client pods only)
    back = one(docs, "NetworkPolicy", "strop-trainer-from-gateways")
    assert back["spec"]["podSelector"]["matchLabels"].items() <= trainer_labels.items()
    (rule,) = back["spec"]["ingress"]
    (src,) = rule["from"]
    (sel,) = src["podSelector"]["matchExpressions"]
    assert labels[sel["key"]] in sel["values"] and [p["port"] for p in rule["ports"]] == [50051]
    assert "strop.dev/client" not in labels, "that label would open the exporter to the gateway too"


def test_gateway_image_names_follow_the_overlays(rendered):
    name, docs = rendered
    image = container(tinker(docs))["image"]
    want = "localhost/strop-gateway" if name == "overlays/dev" else "registry.example.com/strop/gateway"
    assert image == f"{want}:{VERSION}"
    for doc in (tinker(docs), one(docs, "NetworkPolicy", "strop-gateways")):
        kubernetes_validate.validate(doc, OLDEST_KUBERNETES, strict=True)


# ---- the OpenAI gateway (base/openai.yaml): one pod, its state in PostgreSQL and on the shared volume -------------


def openai(docs: list[dict]) -> dict:
    return one(docs, "Deployment", "openai")


def test_openai_args_are_the_gateways_real_flags_and_its_state_is_shared(rendered, monkeypatch):
    from strop.gateways.openai.server import build_parser

    options = record_parsed_options(monkeypatch)
    name, docs = rendered
    w = openai(docs)
    c = container(w)
    assert c["args"][0] == "openai"
    a = build_parser().parse_args(c["args"][1:])
    assert {arg.split("=", 1)[0] for arg in c["args"][1:]} <= options
    assert a.listen.startswith("0.0.0.0:") and a.model_root == "/data/models"
    assert a.trainer == container(tinker(docs))["args"][2].split("=", 1)[1], (
        "the trainer pod the Tinker one calls"
    )
    assert (a.tls_cert is not None) == (a.trainer_tls_ca is not None) == (name == "overlays/production")
    # its jobs and files in PostgreSQL (the services' secret; read by its server as --database-url's default) and the
    # files' bytes on the shared volume, in a directory volume-init gives to 10001
    (db,) = [e for e in c["env"] if e["name"] == "STROP_OPENAI_DATABASE_URL"]
    assert db["valueFrom"]["secretKeyRef"] == {"name": "strop-database", "key": "url"}
    assert '"STROP_OPENAI_DATABASE_URL"' in (ROOT / "gateways" / "openai" / "server.py").read_text()
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert a.state_dir.startswith("/data/state/") and "readOnly" not in mounts["/data"]
    (job,) = render(K8S / "volume-init")
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    chown = next(line for line in script.splitlines() if line.strip().startswith("chown 10001:10001"))
    assert a.state_dir in chown.split()
    # in-process job followers: one pod at a time, never two during a rollout
    assert w["spec"]["replicas"] == 1 and w["spec"]["strategy"] == {"type": "Recreate"}
    pdb = one(docs, "PodDisruptionBudget", "openai")
    assert pdb["spec"]["maxUnavailable"] == 1, "one pod: a drain must still be able to evict it"


def test_openai_probes_ask_healthz_over_what_its_port_speaks(rendered):
    name, docs = rendered
    c = container(openai(docs))
    port = int(flag(c, "listen").rpartition(":")[2])
    assert c["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    scheme = "HTTPS" if name == "overlays/production" else "HTTP"
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[kind]["httpGet"]
        # the kubelet's HTTPS probe does not check the certificate: valid on every supported version
        assert (get["path"], get["port"], get.get("scheme", "HTTP")) == ("/healthz", port, scheme), kind


@pytest.mark.parametrize("gateway", ["tinker", "openai"])
def test_gateway_pods_are_restricted_and_reach_only_the_trainer_dns_and_their_database(rendered, gateway):
    _, docs = rendered
    w = one(docs, "Deployment", gateway)
    pod, c = w["spec"]["template"]["spec"], container(w)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    period = pod["terminationGracePeriodSeconds"]
    assert period > c["lifecycle"]["preStop"]["sleep"]["seconds"] + 10, "preStop, then uvicorn's 10 s drain"
    labels = w["spec"]["template"]["metadata"]["labels"]
    pol = one(docs, "NetworkPolicy", "strop-gateways")
    (expr,) = pol["spec"]["podSelector"]["matchExpressions"]
    assert labels[expr["key"]] in expr["values"]
    port = int(flag(c, "listen").rpartition(":")[2])
    assert port in {p["port"] for r in pol["spec"]["ingress"] for p in r["ports"]}
    back = one(docs, "NetworkPolicy", "strop-trainer-from-gateways")
    (sel,) = back["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"]
    assert labels[sel["key"]] in sel["values"]
    db = one(docs, "NetworkPolicy", "strop-database")["spec"]["podSelector"]["matchExpressions"][0]
    uses_db = any(e["name"].endswith("DATABASE_URL") for e in c.get("env", []))
    assert (labels[db["key"]] in db["values"]) == uses_db, (
        f"{gateway}: database egress exactly when it has one"
    )
