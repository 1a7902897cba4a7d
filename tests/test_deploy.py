"""Deployment files: Kubernetes manifests, the ECS task definition and both Dockerfiles.

Structural checks always run; schema validation runs where the validators are installed
(``kubernetes-validate`` bundles the Kubernetes schemas, botocore the ECS API model; neither
needs the network).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from bgeserve.config import Settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"  # the objects; K8S and K8S / "keda" are kustomizations built from it
ECS = ROOT / "deploy" / "ecs" / "task-definition.json"


def k8s_objects() -> dict[str, dict[str, Any]]:
    """Every object in deploy/kubernetes/base/*.yaml (kustomization aside), by kind."""
    objects = {}
    for path in sorted(BASE.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in objects, f"two {doc['kind']} objects"
            objects[doc["kind"]] = doc
    return objects


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict[str, Any]]:
    return k8s_objects()


def env_of(container: dict[str, Any], configmap: dict[str, Any]) -> dict[str, str]:
    env = dict(configmap["data"]) if container.get("envFrom") else {}
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    return env


# ------------------------------------------------------------------------------ Kubernetes
def test_the_kustomization_lists_every_manifest():
    """``kubectl apply -k deploy/kubernetes`` applies the base, which lists every file in its
    folder."""
    assert yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"] == ["base"]
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    files = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    assert set(k8s_objects()) == {"ConfigMap", "PersistentVolumeClaim", "Deployment", "Service",
                                  "HorizontalPodAutoscaler"}


def test_the_server_is_probed_on_health(k8s):
    """Startup, readiness and liveness probes GET /health on the container's HTTP port."""
    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    bind = env_of(server, k8s["ConfigMap"])["BGE_M3_BIND"]
    assert ports["http"] == int(bind.rpartition(":")[2])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        assert server[probe]["timeoutSeconds"] >= 3
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # covers loading


def test_the_pod_pauses_before_sigterm_and_its_grace_covers_the_drain(k8s):
    """A preStop pause lets the Service stop routing before SIGTERM closes the listener (a
    request routed in between met a closed port); the grace period covers the pause, the
    drain (BGE_M3_SHUTDOWN_TIMEOUT_SECS) and what the HTTP server waits after it (the 503s
    sent, the rest of a body they cut short read)."""
    from bgeserve.http.drain import ANSWER_SECS

    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    command = server["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and int(command[1]) >= 3
    drain = int(env_of(server, k8s["ConfigMap"])["BGE_M3_SHUTDOWN_TIMEOUT_SECS"])
    assert pod["terminationGracePeriodSeconds"] >= int(command[1]) + drain + ANSWER_SECS


def test_the_warmup_init_container_shares_settings_and_cache(k8s):
    """The init container: same image, settings and cache volume, plus BGE_M3_WARMUP_ONLY=1."""
    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    (init,), (server,) = pod["initContainers"], pod["containers"]
    cm = k8s["ConfigMap"]
    init_env, server_env = env_of(init, cm), env_of(server, cm)
    assert init_env.pop("BGE_M3_WARMUP_ONLY") == "1"
    assert init_env == server_env  # same profile, variant and cache → the server reuses engines
    assert Settings.from_env({**init_env, "BGE_M3_WARMUP_ONLY": "1"}).warmup_only
    assert Settings.from_env(server_env).execution_provider == "tensorrt"
    assert init["image"] == server["image"]
    assert init["volumeMounts"] == server["volumeMounts"]
    (mount,) = server["volumeMounts"]
    assert mount["mountPath"] == server_env["BGE_M3_CACHE_DIR"]
    (volume,) = pod["volumes"]
    assert volume["name"] == mount["name"]
    assert volume["persistentVolumeClaim"]["claimName"] == k8s["PersistentVolumeClaim"][
        "metadata"]["name"]
    for container in (init, server):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == int(
            server_env["BGE_M3_GPU_COUNT"])


def test_the_pod_runs_as_the_image_user(k8s):
    """runAsUser / fsGroup match the Dockerfiles' uid, so /cache is writable."""
    ctx = k8s["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    uid = re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile.cuda").read_text())[1]
    assert ctx["runAsNonRoot"] and ctx["runAsUser"] == ctx["fsGroup"] == int(uid)


def test_service_hpa_and_pvc_point_at_the_deployment(k8s):
    """The Service selects the pods, the HPA scales the Deployment, the PVC is shared (RWX)."""
    dep = k8s["Deployment"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc = k8s["Service"]["spec"]
    assert svc["selector"].items() <= labels.items()
    assert svc["ports"][0]["targetPort"] == "http"
    hpa = k8s["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    server = dep["spec"]["template"]["spec"]["containers"][0]
    assert "cpu" in server["resources"]["requests"]  # a Utilization target needs a request
    assert k8s["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_manifests_match_the_kubernetes_schemas(k8s):
    """Strict validation against Kubernetes 1.30's OpenAPI schemas (no unknown fields)."""
    kv = pytest.importorskip("kubernetes_validate")
    for obj in k8s.values():
        kv.validate(obj, "1.30", strict=True)


# ------------------------------------------------------------------------------------- ECS
@pytest.fixture(scope="module")
def task() -> dict[str, Any]:
    return json.loads(ECS.read_text())


def test_ecs_runs_the_warmup_container_first(task):
    """trt-warmup (not essential) must exit 0 before the server starts (dependsOn SUCCESS)."""
    containers = {c["name"]: c for c in task["containerDefinitions"]}
    init, server = containers["trt-warmup"], containers["bgeserve"]
    assert init["essential"] is False and server["essential"] is True
    assert server["dependsOn"] == [{"containerName": "trt-warmup", "condition": "SUCCESS"}]
    init_env = {e["name"]: e["value"] for e in init["environment"]}
    server_env = {e["name"]: e["value"] for e in server["environment"]}
    assert init_env.pop("BGE_M3_WARMUP_ONLY") == "1"
    assert init_env == server_env
    Settings.from_env(server_env)
    assert init["image"] == server["image"] and init["mountPoints"] == server["mountPoints"]
    volumes = {v["name"] for v in task["volumes"]}
    assert {m["sourceVolume"] for m in server["mountPoints"]} <= volumes
    assert server["mountPoints"][0]["containerPath"] == server_env["BGE_M3_CACHE_DIR"]
    gpus = [{"type": "GPU", "value": server_env["BGE_M3_GPU_COUNT"]}]
    assert init["resourceRequirements"] == server["resourceRequirements"] == gpus


def test_ecs_health_check_calls_the_script(task):
    """The server's container health check runs healthcheck.sh within ECS's limits."""
    (server,) = [c for c in task["containerDefinitions"] if c["essential"]]
    check = server["healthCheck"]
    assert check["command"] == ["CMD", "/usr/local/bin/healthcheck.sh"]
    assert 0 <= check["startPeriod"] <= 300 and 2 <= check["timeout"] < check["interval"]
    assert server["portMappings"][0]["containerPort"] == 8081


def test_the_task_definition_matches_the_ecs_api(task):
    """The JSON is a valid RegisterTaskDefinition request (botocore's ECS model)."""
    botocore_session = pytest.importorskip("botocore.session")
    from botocore.validate import ParamValidator

    model = botocore_session.get_session().get_service_model("ecs")
    shape = model.operation_model("RegisterTaskDefinition").input_shape
    report = ParamValidator().validate(task, shape)
    assert not report.has_errors(), report.generate_report()


# ------------------------------------------------------------------------------ Dockerfiles
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_images_run_unprivileged_with_a_cache_volume_and_a_health_check(name: str):
    """Non-root user, /cache volume, port 8081, HEALTHCHECK running healthcheck.sh."""
    steps = instructions(ROOT / name)
    final = steps[max(i for i, (word, _) in enumerate(steps) if word == "FROM"):]
    users = [arg for word, arg in final if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert ("VOLUME", '["/cache"]') in final
    assert ("EXPOSE", "8081") in final
    (health,) = [arg for word, arg in final if word == "HEALTHCHECK"]
    assert health.endswith('CMD ["/usr/local/bin/healthcheck.sh"]')
    assert int(re.search(r"--start-period=(\d+)s", health)[1]) >= 120
    assert any(word == "COPY" and "healthcheck.sh" in arg for word, arg in final)
    assert ("CMD", '["bgeserve", "serve"]') in final


def test_the_cpu_image_is_slim_python_311_installing_the_project():
    """Dockerfile: python 3.11 slim base; `pip install .` as the README installs it."""
    steps = instructions(ROOT / "Dockerfile")
    assert ("ARG", "PYTHON_IMAGE=python:3.11-slim-bookworm") in steps
    assert ("RUN", "pip install .") in steps


def test_the_cuda_image_keeps_only_onnxruntime_gpu():
    """Dockerfile.cuda: CUDA + cuDNN base, `.[gpu]` and TensorRT, CPU onnxruntime removed."""
    text = (ROOT / "Dockerfile.cuda").read_text()
    assert re.search(r"nvidia/cuda:12\.\S*cudnn-runtime", text)
    assert 'pip install ".[gpu]" "${ORT_GPU_SPEC}"' in text and "tensorrt-cu12-libs" in text
    assert "pip uninstall -y onnxruntime" in text
    assert '"onnxruntime" not in names' in text


def test_the_cuda_image_pins_onnxruntime_gpu_to_its_cuda_major():
    """onnxruntime-gpu on PyPI is a CUDA 12 build up to 1.26 and a CUDA 13 build from 1.27
    (measured: 1.26.0 links libcublas.so.12, 1.27.0 and 1.31.1 libcublas.so.13). The image's
    base, ORT_GPU_SPEC and TensorRT wheel must name the same CUDA major."""
    text = (ROOT / "Dockerfile.cuda").read_text()
    cuda = int(re.search(r"ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.", text)[1])
    ort = re.search(r'ARG ORT_GPU_SPEC="([^"]+)"', text)[1]
    trt = re.search(r'ARG TENSORRT_SPEC="([^"]+)"', text)[1]
    assert f"tensorrt-cu{cuda}-libs" in trt
    if cuda == 12:
        assert re.search(r"<\s*1\.2[0-7]\b", ort), ort  # excludes 1.27+ (CUDA 13)
    else:
        assert re.search(r">=\s*1\.(2[7-9]|[3-9]\d)", ort), ort


# -------------------------------------------------------------------- KEDA (queue depth)
KEDA = K8S / "keda"
KEDA_CRD = ROOT / "tests" / "schemas" / "keda.sh_scaledobjects.yaml"


@pytest.fixture(scope="module")
def scaled_object() -> dict[str, Any]:
    return yaml.safe_load((KEDA / "scaledobject.yaml").read_text())


def _strict(schema: Any) -> Any:
    """A CRD's schema with unknown fields refused (the API server prunes them silently,
    which hides a misspelt field): additionalProperties false wherever properties are listed."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def test_the_scaled_object_matches_kedas_crd_schema(scaled_object):
    """deploy/kubernetes/keda/scaledobject.yaml validates strictly against KEDA's own CRD."""
    import jsonschema

    crd = yaml.safe_load(KEDA_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    assert scaled_object["apiVersion"] == f"{crd['spec']['group']}/{version['name']}"
    assert scaled_object["kind"] == crd["spec"]["names"]["kind"]
    jsonschema.validate(scaled_object, _strict(version["schema"]["openAPIV3Schema"]))
    with pytest.raises(jsonschema.ValidationError):  # the strict schema does refuse typos
        bad = {**scaled_object, "spec": {**scaled_object["spec"], "maxReplicas": 3}}
        jsonschema.validate(bad, _strict(version["schema"]["openAPIV3Schema"]))


def test_the_keda_overlay_scales_the_deployment_on_queued_tokens_instead_of_the_hpa(
        k8s, scaled_object):
    """The overlay adds the ScaledObject to the base and deletes the base's HPA; its first
    trigger is a Prometheus query of bgeserve_queue_tokens with the fields KEDA requires."""
    kustomization = yaml.safe_load((KEDA / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../base", "scaledobject.yaml"]
    (patch,) = kustomization["patches"]
    deleted = yaml.safe_load(patch["patch"])
    hpa = k8s["HorizontalPodAutoscaler"]
    assert deleted["$patch"] == "delete" and deleted["kind"] == hpa["kind"]
    assert deleted["metadata"]["name"] == hpa["metadata"]["name"]
    dep = k8s["Deployment"]
    assert scaled_object["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"]}
    spec = scaled_object["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    queued = spec["triggers"][0]
    assert queued["type"] == "prometheus" and queued["metricType"] == "AverageValue"
    meta = queued["metadata"]
    assert {"serverAddress", "query", "threshold"} <= set(meta)
    assert "bgeserve_queue_tokens" in meta["query"] and float(meta["threshold"]) > 0
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == dep["spec"]["template"]["spec"][
        "containers"][0]["ports"][0]["containerPort"]


def test_no_kustomization_reads_a_folder_that_holds_it():
    """kustomize refuses a kustomization whose resources include a folder above it ("cycle
    detected: candidate root ... contains visited root"): the KEDA overlay read ``..`` and
    could not be applied. Each folder a kustomization reads is beside or below it."""
    for kustomization in K8S.rglob("kustomization.yaml"):
        here = kustomization.parent.resolve()
        for resource in yaml.safe_load(kustomization.read_text())["resources"]:
            target = (here / resource).resolve()
            assert target.exists(), f"{kustomization}: {resource} does not exist"
            assert not here.is_relative_to(target), f"{kustomization} reads {resource}, above it"


@pytest.mark.parametrize(("folder", "kinds"), [
    (K8S, {"ConfigMap", "PersistentVolumeClaim", "Deployment", "Service",
           "HorizontalPodAutoscaler"}),
    (KEDA, {"ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "ScaledObject"}),
])
def test_kubectl_builds_each_kustomization(folder, kinds):
    """What ``kubectl apply -k`` would apply, built by kubectl's own kustomize where it is
    installed: the base's objects, and the overlay's with the ScaledObject for the HPA."""
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True,
                           timeout=60, check=False)
    assert built.returncode == 0, built.stderr
    objects = list(yaml.safe_load_all(built.stdout))
    assert {o["kind"] for o in objects} == kinds and len(objects) == len(kinds)
    (dep,) = [o for o in objects if o["kind"] == "Deployment"]
    images = {c["image"] for c in dep["spec"]["template"]["spec"]["containers"]}
    assert images == {"registry.example.com/bgeserve:cuda"}  # the base's image in both


def scaling_metric_names() -> set[str]:
    """Every bgeserve_* metric the manifests name (queries, and the HPA's documented
    alternative)."""
    names = set()
    for path in [*BASE.glob("*.yaml"), *KEDA.glob("*.yaml")]:
        names |= set(re.findall(r"\bbgeserve_[a-z_]+", path.read_text()))
    return names


@pytest.mark.slow
def test_every_metric_the_manifests_scale_on_is_exported_by_a_live_server(tiny_export: Path,
                                                                          tmp_path: Path):
    """A real server's /metrics has each bgeserve_* name used in deploy/kubernetes."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tests.serverproc import ServerProc

    names = scaling_metric_names()
    assert {"bgeserve_queue_tokens", "bgeserve_requests_in_flight"} <= names
    env = {"BGE_M3_MODEL_PATH": str(tiny_export), "BGE_M3_MODEL": "fp32",
           "BGE_M3_CACHE_DIR": str(tmp_path), "BGE_M3_DISABLE_AUTO_BUDGET": "1",
           "BGE_M3_MAX_SEQ_LENGTH": "512"}
    with ServerProc(env) as proc:
        proc.wait_health(timeout=60)
        text = httpx.get(f"{proc.url}/metrics", timeout=10).text
    exported = {s.name for family in text_string_to_metric_families(text)
                for s in family.samples}
    assert names <= exported, names - exported
