"""deploy/kubernetes/ checked without a cluster.

Every manifest validates against the Kubernetes API schemas shipped in `kubernetes-validate` (strict: unknown
fields are errors) for the oldest release with native gRPC probes (1.27) and the newest. The wiring is checked
statically (selectors, Service ports, probes on the listen ports, $(VAR)s from the ConfigMap named after
their flags, defaults equal to the command line's and compose's), then the commands the manifests run are
started as local processes: two executors from the StatefulSet on 127.0.0.1 and 127.0.0.2 and the scheduler
from the Deployment, whose dns:/// name for the headless Service is answered by --executor-hosts-file (the
test's stand-in for cluster DNS). The probes are run as the kubelet would, and a generation streams through
the Service's port.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.flags import env_name
from client.lib import PagedServeClient
from client.port_file import wait_ports
from executor_service.config import build_parser as executor_parser
from executor_service.startup import MeasureCache
from protos.pagedserve.v1 import generation_pb2
from scheduler_service.config import build_parser as scheduler_parser
from tests.deploy.test_compose_wiring import COMPOSE, VARIABLE, load
from tests.support.pool_procs import Pool
from tests.support.procs import ROOT, free_port, start, stop, wait_until

K8S = ROOT / "deploy" / "kubernetes"
BASE = [K8S / "config.yaml", K8S / "executor-service.yaml", K8S / "executor.yaml", K8S / "scheduler.yaml"]
GPU = K8S / "gpu" / "executor.yaml"
TIERS = [K8S / "tiers" / "engine-core.yaml", K8S / "tiers" / "frontend.yaml"]  # the three-tier layout (#28)
VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
PARSERS = {"executor_service": executor_parser, "scheduler_service": scheduler_parser}
# Flags whose manifest value deliberately differs from the command-line default (addresses, paths in the pod).
NETWORK_FLAGS = {"listen", "http_listen", "executor", "metrics_host", "metrics_port", "executor_drain_file",
                 "startup_cache_dir"}
REF = re.compile(r"\$\((\w+)\)")


def documents(*paths: Path) -> list[dict[str, Any]]:
    return [doc for path in paths for doc in yaml.safe_load_all(path.read_text()) if doc]


def one(docs: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (component is None or
             d["metadata"]["labels"].get("app.kubernetes.io/component") == component)]
    assert len(found) == 1, f"expected one {kind} {component or ''}, found {len(found)}"
    return found[0]


def config_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return dict(one(docs, "ConfigMap")["data"])


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def argv(workload: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The container's command line as the kubelet runs it: $(VAR) from env, a missing one left as is."""
    c = container(workload)
    local = {**env, **{e["name"]: e.get("value", "") for e in c.get("env", [])}}
    refs = {m for arg in c["args"] for m in REF.findall(arg)}
    assert refs <= local.keys(), f"$(VAR)s missing from the ConfigMap: {refs - local.keys()}"
    return [*c["command"], *(REF.sub(lambda m: local[m.group(1)], a) for a in c["args"])]


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} given {len(values)} times in {args}"
    return values[0]


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# ---------------------------------------------------------------------------------------------- schema


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", [*BASE, GPU, *TIERS], ids=lambda p: str(p.relative_to(K8S)))
def test_manifests_validate_against_the_kubernetes_schemas(path: Path, version: str) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_catches_a_wrong_field() -> None:
    doc = documents(K8S / "executor.yaml")[0]
    container(doc)["readinessProbe"]["grpc"]["port"] = "grpc"  # gRPC probes take a number, not a name
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


# ---------------------------------------------------------------------------------------------- wiring


def emptydir(path: Path) -> Path:
    """A stand-in for the kubelet's emptyDir: a root-owned directory every user may write (0777; 2777 with an
    fsGroup), not sticky."""
    path.mkdir()
    path.chmod(0o2777)
    return path


def startup_volume(executor: dict[str, Any], env: dict[str, str]) -> tuple[str, str]:
    """The executor's --startup-cache-dir and the mount of the emptyDir it lies in."""
    cache_dir = flag(argv(executor, env), "--startup-cache-dir")
    volumes = {v["name"]: v for v in executor["spec"]["template"]["spec"].get("volumes", [])}
    mounts = [m for m in container(executor).get("volumeMounts", []) if Path(cache_dir).is_relative_to(m["mountPath"])]
    assert len(mounts) == 1, f"--startup-cache-dir={cache_dir} is on no volume: a restarted container measures again"
    assert not mounts[0].get("readOnly") and "emptyDir" in volumes[mounts[0]["name"]]
    return cache_dir, mounts[0]["mountPath"]


def test_the_executor_keeps_its_startup_cache_below_an_emptydir(tmp_path: Path) -> None:
    """The start-up cache survives the executor container's restarts on an emptyDir volume; in a directory below
    its mount (the executor makes it, as its user): the mount itself, which every user may write, is not trusted."""
    docs = documents(*BASE)
    cache_dir, mount = startup_volume(one(docs, "StatefulSet"), config_env(docs))
    assert Path(cache_dir) != Path(mount)
    volume = emptydir(tmp_path / "volume")
    below = MeasureCache(volume / Path(cache_dir).relative_to(mount))
    key, value = {"cpu": {"flags": "avx2"}}, {"gemm": "mkl", "skinny_rows": 8}
    assert below.put("packing", key, value) == "" and below.get("packing", key) == value
    on_the_mount = MeasureCache(volume)
    assert on_the_mount.put("packing", key, value) == "" and on_the_mount.get("packing", key) is None


def test_static_wiring() -> None:
    docs = documents(*BASE)
    env = config_env(docs)
    scheduler, executor = one(docs, "Deployment", "scheduler"), one(docs, "StatefulSet", "executor")
    headless, public = one(docs, "Service", "executor"), one(docs, "Service", "scheduler")
    pdb = one(docs, "PodDisruptionBudget")
    for workload in (scheduler, executor):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        c = container(workload)
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert {"configMapRef": {"name": one(docs, "ConfigMap")["metadata"]["name"]}} in c["envFrom"]
        listen = port_of(flag(argv(workload, env), "--listen"))
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == listen
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == listen, f"{probe} must be a gRPC probe on the listen port"
    assert container(scheduler)["image"] == container(executor)["image"]

    ex_labels = executor["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["clusterIP"] == "None" and executor["spec"]["serviceName"] == headless["metadata"]["name"]
    assert headless["spec"]["selector"].items() <= ex_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= ex_labels.items()
    policy = one(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= ex_labels.items()
    allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert allowed.items() <= scheduler["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["ingress"][0]["ports"][0]["port"] in {p["name"] for p in container(executor)["ports"]}
    assert public["spec"]["selector"].items() <= scheduler["spec"]["template"]["metadata"]["labels"].items()
    assert {p["targetPort"] for p in public["spec"]["ports"]} <= {p["name"] for p in container(scheduler)["ports"]}
    assert container(executor)["lifecycle"]["preStop"], "an executor leaves DNS before it stops"

    sc_args = argv(scheduler, env)
    executor_port = next(p["port"] for p in headless["spec"]["ports"] if p["name"] == "grpc")
    assert flag(sc_args, "--executor") == f"dns:///{headless['metadata']['name']}:{executor_port}"
    assert flag(sc_args, "--metrics-host") == "0.0.0.0"
    drain_dir = str(Path(flag(sc_args, "--executor-drain-file")).parent)
    assert any(m["mountPath"] == drain_dir for m in container(scheduler)["volumeMounts"]), "drain file not writable"
    assert port_of("x:" + flag(sc_args, "--metrics-port")) == next(
        p["containerPort"] for p in container(scheduler)["ports"] if p["name"] == "metrics")
    http = flag(sc_args, "--http-listen")
    assert http.startswith("0.0.0.0:"), "the HTTP API must listen on the pod's network"
    assert port_of(http) == next(p["containerPort"] for p in container(scheduler)["ports"] if p["name"] == "http")
    assert "http" in {p["targetPort"] for p in public["spec"]["ports"]}, "the Service must carry the HTTP API"


def test_gpu_variant() -> None:
    cpu, gpu = one(documents(*BASE), "StatefulSet"), one(documents(GPU), "StatefulSet")
    assert gpu["metadata"]["name"] == cpu["metadata"]["name"], "the GPU StatefulSet replaces the CPU one"
    assert gpu["spec"]["template"]["metadata"]["labels"] == cpu["spec"]["template"]["metadata"]["labels"]
    c = container(gpu)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    args = executor_parser().parse_args(argv(gpu, config_env(documents(*BASE)))[3:])
    assert args.device == "cuda" and args.model == "/model"
    assert any(m["mountPath"] == "/model" for m in c["volumeMounts"])


def test_config_variables_are_named_after_their_flags_and_match_compose() -> None:
    docs = documents(*BASE, GPU)
    pairs = 0
    for workload in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        for arg in container(workload)["args"]:
            m = re.fullmatch(r"--([\w-]+)=\$\((\w+)\)", arg)
            if m:
                pairs += 1
                assert m.group(2) == env_name(m.group(1).replace("-", "_")), arg
    assert pairs >= 20
    compose_defaults: dict[str, str] = {}
    for svc in load(COMPOSE)["services"].values():
        for m in VARIABLE.finditer(svc["command"]):
            if m.group(1) and m.group(2) == ":-":
                compose_defaults[m.group(1)] = m.group(3)
    env = config_env(docs)
    drift = {k: (env[k], v) for k, v in compose_defaults.items() if k in env and env[k] != v
             and k != "EXECUTOR"}
    assert not drift, f"ConfigMap and compose.yaml defaults differ: {drift}"


@pytest.mark.parametrize("component", ["executor", "scheduler"])
def test_config_defaults_match_the_command_line_defaults(component: str) -> None:
    docs = documents(*BASE)
    workload = one(docs, "StatefulSet" if component == "executor" else "Deployment", component)
    cmd = argv(workload, config_env(docs))
    parser = PARSERS[cmd[2]]()
    got, want = vars(parser.parse_args(cmd[3:])), vars(parser.parse_args([]))
    drift = {k: (got[k], want[k]) for k in want if k not in NETWORK_FLAGS and got[k] != want[k]}
    assert not drift, f"deploy/kubernetes {component} defaults (manifest, flag) differ: {drift}"


# ------------------------------------------------------------------------------------- the pods, locally


def probe_passes(address: str, spec: dict[str, Any]) -> bool:
    """The kubelet's gRPC probe: grpc.health.v1 Check(service) on the pod's port; only SERVING passes."""
    with grpc.insecure_channel(address) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=spec.get("service", "")),
                timeout=spec.get("timeoutSeconds", 1)).status
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING


def local(args: list[str], replace: dict[str, str]) -> list[str]:
    out = []
    for a in args:
        name = a.partition("=")[0]
        out.append(f"{name}={replace[name]}" if name in replace else a)
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    docs = documents(*BASE)
    env = config_env(docs)
    tmp = tmp_path_factory.mktemp("kubernetes")
    executor, scheduler = one(docs, "StatefulSet"), one(docs, "Deployment")
    headless = one(docs, "Service", "executor")["metadata"]["name"]
    pool = Pool(tmp, free_port(), [], tmp / "hosts", tmp / "drain", name=headless)
    procs = []
    try:
        ex_cmd = argv(executor, env)
        cache_dir, mount = startup_volume(executor, env)
        for n in (1, 2):  # each pod's emptyDir
            volume = emptydir(tmp / f"ex{n}-volume") / Path(cache_dir).relative_to(mount)
            args = local(ex_cmd[3:], {"--listen": pool.executor_address(n), "--startup-cache-dir": str(volume)})
            proc = start(ex_cmd[2], args, tmp / f"ex{n}.log")
            procs.append(proc)
            pool.executors[pool.executor_address(n)] = proc
        probe = container(executor)["startupProbe"]["grpc"]
        for n in (1, 2):
            wait_until(partial(probe_passes, pool.executor_address(n), probe), 180, "executor startup probe")
        pool.publish([pool.executor_address(1), pool.executor_address(2)])
        sc_cmd = argv(scheduler, env)
        sc_args = local(sc_cmd[3:], {"--listen": "127.0.0.1:0", "--http-listen": "127.0.0.1:0",
                                     "--metrics-host": "127.0.0.1",
                                     "--metrics-port": "0", "--executor-resolve-interval": "0.2",
                                     "--executor": f"dns:///{headless}:{pool.port}",
                                     "--executor-drain-file": str(pool.drain_file)})
        proc = start(sc_cmd[2], [*sc_args, "--executor-hosts-file", str(pool.hosts_file), "--port-file",
                                 str(tmp / "scheduler.ports")], tmp / "scheduler.log")
        procs.append(proc)
        ports = wait_ports(tmp / "scheduler.ports", ("listen", "http_listen"), proc)
        listen, http = ports["listen"], ports["http_listen"]
        readiness = container(scheduler)["readinessProbe"]["grpc"]
        wait_until(lambda: probe_passes(f"127.0.0.1:{listen}", readiness), 120, "scheduler readiness probe")
        pool.scheduler = proc
        pool.metrics_port = wait_ports(tmp / "scheduler.ports", ("metrics_port",), proc)["metrics_port"]
        yield {"pool": pool, "listen": listen, "http": http, "scheduler": scheduler, "executor": executor,
               "startup_caches": [tmp / f"ex{n}-volume" / Path(cache_dir).relative_to(mount) for n in (1, 2)]}
    finally:
        for proc in reversed(procs):
            stop(proc)


def test_pods_serve_through_the_service_and_use_both_executors(cluster: dict[str, Any]) -> None:
    pool: Pool = cluster["pool"]
    pool.wait_serving({pool.executor_address(1), pool.executor_address(2)}, timeout=60)
    public = one(documents(*BASE), "Service", "scheduler")
    target = next(p for p in public["spec"]["ports"] if p["name"] == "grpc")["targetPort"]
    assert target == "grpc"  # -> the scheduler's containerPort "grpc" == its --listen port, checked above

    async def run() -> list[tuple[int, int]]:
        async with PagedServeClient(f"127.0.0.1:{cluster['listen']}") as client:
            async def gen(i: int) -> tuple[int, int]:
                n, reason = 0, 0
                async for r in client.generate(f"pod {i} says", max_tokens=6, temperature=0.0, ignore_eos=True):
                    n += len(r.token_ids)
                    reason = r.finish_reason or reason
                return n, reason
            return await asyncio.gather(*(gen(i) for i in range(8)))

    results = asyncio.run(run())
    assert results == [(6, generation_pb2.FINISH_REASON_LENGTH)] * 8
    steps = pool.per_executor("pagedserve:executor_step_seconds_count")
    assert len(steps) == 2 and all(v > 0 for v in steps.values()), steps


def test_the_http_api_serves_on_the_http_port(cluster: dict[str, Any]) -> None:
    public = one(documents(*BASE), "Service", "scheduler")
    assert next(p for p in public["spec"]["ports"] if p["name"] == "http")["targetPort"] == "http"
    body = json.dumps({"prompt": "pod says", "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{cluster['http']}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 4


def test_probes_pass_as_the_kubelet_runs_them(cluster: dict[str, Any]) -> None:
    liveness = container(cluster["scheduler"])["livenessProbe"]["grpc"]
    assert probe_passes(f"127.0.0.1:{cluster['listen']}", liveness)
    pool: Pool = cluster["pool"]
    for probe in ("readinessProbe", "livenessProbe"):
        spec = container(cluster["executor"])[probe]["grpc"]
        assert all(probe_passes(a, spec) for a in pool.executors)


def test_a_scheduler_without_executors_is_live_but_not_ready(tmp_path: Path) -> None:
    """Kubernetes must not restart the scheduler while the executors' StatefulSet is scaled to zero."""
    docs = documents(*BASE)
    scheduler = one(docs, "Deployment")
    cmd = argv(scheduler, config_env(docs))
    (tmp_path / "hosts").write_text("")
    args = local(cmd[3:], {"--listen": "127.0.0.1:0", "--http-listen": "127.0.0.1:0", "--metrics-port": "-1",
                           "--executor-resolve-interval": "0.2",
                           "--executor": "dns:///pagedserve-executor.invalid:50061",
                           "--executor-drain-file": str(tmp_path / "drain")})
    proc = start(cmd[2], [*args, "--executor-hosts-file", str(tmp_path / "hosts"), "--port-file",
                          str(tmp_path / "scheduler.ports")], tmp_path / "scheduler.log")
    try:
        address = f"127.0.0.1:{wait_ports(tmp_path / 'scheduler.ports', ('listen',), proc)['listen']}"
        c = container(scheduler)
        wait_until(lambda: probe_passes(address, c["livenessProbe"]["grpc"]), 60, "liveness passing")
        assert not probe_passes(address, c["readinessProbe"]["grpc"])
    finally:
        stop(proc)


def test_each_pod_keeps_its_measured_packing_choice_on_its_volume(cluster: dict[str, Any]) -> None:
    """The executors measure their packing choice after ready and keep it below their emptyDir's mount, where the
    next start of the container reads it back."""
    for cache_dir in cluster["startup_caches"]:
        wait_until((cache_dir / "packing.json").is_file, 300, f"the packing choice kept in {cache_dir}")
        entry = json.loads((cache_dir / "packing.json").read_text())
        assert MeasureCache(cache_dir).get("packing", entry["key"]) == entry["value"]
