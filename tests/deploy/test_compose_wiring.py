"""compose.yaml wiring, checked without a Docker engine.

`docker-compose config -q` validates compose.yaml (and compose.yaml + compose.gpu.yaml) offline. Then the
services are run the way compose would run them, as local processes: each service's command and environment
from compose.yaml, ${VAR:-default} replaced by its default, compose service names resolved to 127.0.0.1 and
every container port replaced by a free loopback port. Services start in depends_on order, each waits for
the healthcheck command from compose.yaml to pass, and a generation streams through the scheduler's
published port.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from client.flags import env_name
from client.lib import PagedServeClient
from executor_service.config import build_parser as executor_parser
from protos.pagedserve.v1 import generation_pb2
from scheduler_service.config import build_parser as scheduler_parser
from tests.support.procs import ROOT, free_port, stop

COMPOSE = ROOT / "compose.yaml"
COMPOSE_GPU = ROOT / "compose.gpu.yaml"
COMPOSE_TIERS = ROOT / "compose.tiers.yaml"  # executor, engine-core, frontend (#28)
TIER_MODULES = {"executor": "executor_service", "engine-core": "scheduler_service",
                "frontend": "scheduler_service.frontend"}
# The tier flags compose sets on purpose: the core link and who listens where.
TIER_FLAGS = {"api_server_count", "engine_core_listen", "engine_core", "engine_core_secret_file"}
MODULES = {"executor": "executor_service", "scheduler": "scheduler_service"}
PARSERS = {"executor_service": executor_parser, "scheduler_service": scheduler_parser}
LOCAL_HOSTS = {"0.0.0.0", "127.0.0.1", "localhost", "::", ""}
RESTART_POLICIES = {"always", "unless-stopped", "on-failure"}
# Flags whose compose value deliberately differs from the command-line default (addresses inside containers).
NETWORK_FLAGS = {"listen", "http_listen", "executor", "metrics_host", "metrics_port"}
# Flags compose sets to paths inside the containers (the executor secret on a shared volume).
CONTAINER_FLAGS = {"executor_secret_file"}
SECRET_FLAG = "--executor-secret-file"
VARIABLE = re.compile(r"\$(?:\$|\{(\w+)(?:(:?[-?])([^}]*))?\}|(\w+))")
START_TIMEOUT_S = 90.0


# ---------------------------------------------------------------------------------------------- compose model


def load(path: Path) -> dict[str, Any]:
    with path.open() as f:
        data = yaml.safe_load(f)
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), f"{path.name}: no services"
    return data


def interpolate(text: str) -> str:
    """Compose's ${VAR:-default} / ${VAR-default} with every variable unset; $$ is a literal $."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3)
        if op in (":-", "-"):
            return default
        raise AssertionError(f"${{{name}}} has no default: `docker compose up` would need it set")

    return VARIABLE.sub(one, text)


def command_of(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    return shlex.split(interpolate(cmd)) if isinstance(cmd, str) else [interpolate(str(x)) for x in cmd]


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, os.environ.get(item, "")) for item in env)
    return {str(k): interpolate("" if v is None else str(v)) for k, v in env.items()}


def container_port(entry: object) -> int:
    """The container side of a `ports:`/`expose:` entry: "HOST_IP:HOST:CONTAINER/tcp", "8000", 8000."""
    text = interpolate(str(entry)).split("/", 1)[0]
    return int(text.rsplit(":", 1)[-1])


def container_ports(service: dict[str, Any]) -> set[int]:
    return {container_port(p) for p in [*(service.get("expose") or []), *(service.get("ports") or [])]}


def flag_value(cmd: list[str], flag: str) -> str | None:
    for i, token in enumerate(cmd):
        if token == flag and i + 1 < len(cmd):
            return cmd[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def start_order(services: dict[str, Any]) -> list[str]:
    order: list[str] = []

    def visit(name: str, seen: tuple[str, ...]) -> None:
        assert name not in seen, f"depends_on cycle through {name}"
        if name in order:
            return
        deps = services[name].get("depends_on") or {}
        for dep in deps if isinstance(deps, list) else deps.keys():
            visit(dep, (*seen, name))
        order.append(name)

    for name in services:
        visit(name, ())
    return order


def find_compose() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


# ------------------------------------------------------------------------------------------- static checks


def test_docker_compose_config_validates() -> None:
    compose = find_compose()
    if compose is None:
        if os.environ.get("CI") == "true":
            pytest.fail("docker-compose is not installed; CI must install it (apt-get install -y docker-compose)")
        pytest.skip("docker-compose is not installed (apt-get install -y docker-compose); CI requires it")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    gpu = {"MODEL_DIR": "/srv/models/example"}
    for files, extra in (([COMPOSE], {}), ([COMPOSE, COMPOSE_GPU], gpu), ([COMPOSE_TIERS], {}),
                         ([COMPOSE_TIERS, COMPOSE_GPU], gpu)):
        args = [*compose, "--project-directory", str(ROOT)]
        for f in files:
            args += ["-f", str(f)]
        r = subprocess.run([*args, "config", "-q"], cwd=ROOT, env={**env, **extra}, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, f"{' '.join(f.name for f in files)}: {r.stderr or r.stdout}"


def test_static_wiring() -> None:
    services = load(COMPOSE)["services"]
    assert set(services) == {"executor", "scheduler"}
    ex, sc = services["executor"], services["scheduler"]
    for name, svc in services.items():
        assert svc.get("build"), f"{name} must be built from the Dockerfile"
        assert svc.get("restart") in RESTART_POLICIES, f"{name} needs a restart policy, has {svc.get('restart')!r}"
        test = svc["healthcheck"]["test"]
        assert test[:1] == ["CMD"] and test[1:6] == ["python", "-m", "client", "health", "--server"], test
        cmd = command_of(svc)
        assert cmd[:3] == ["python", "-m", MODULES[name]], cmd
    assert ex["build"] == sc["build"] and ex["image"] == sc["image"], "both services come from one image"

    ex_cmd, sc_cmd = command_of(ex), command_of(sc)
    assert "ports" not in ex, "the executor must not publish a port: only the compose network reaches it"
    assert flag_value(ex_cmd, "--listen") == "0.0.0.0:50061", "the executor must listen on the compose network"
    assert 50061 in container_ports(ex)
    assert "--model" not in ex_cmd and "--simulated" not in ex_cmd, "the default runs the embedded model"

    assert flag_value(sc_cmd, "--executor") == "dns:///executor:50061", \
        "the scheduler finds every executor replica (--scale executor=N) through the service's DNS name"
    assert sc["depends_on"]["executor"]["condition"] == "service_healthy"
    published = {container_port(p) for p in sc["ports"]}
    listen_port = int((flag_value(sc_cmd, "--listen") or "").rsplit(":", 1)[-1])
    metrics_port = int(flag_value(sc_cmd, "--metrics-port") or -1)
    http = flag_value(sc_cmd, "--http-listen") or ""
    assert http.startswith("0.0.0.0:"), "the HTTP API must listen on the compose network"
    http_port = int(http.rsplit(":", 1)[-1])
    assert {listen_port, http_port, metrics_port} <= published, f"scheduler publishes {published}"
    assert flag_value(sc_cmd, "--metrics-host") == "0.0.0.0"

    secret = flag_value(ex_cmd, SECRET_FLAG)
    assert secret and flag_value(sc_cmd, SECRET_FLAG) == secret, "both services use the same executor secret"
    ex_mounts, sc_mounts = named_mounts(ex), named_mounts(sc)
    volume = next(v for v, (path, _) in ex_mounts.items() if secret.startswith(path + "/"))
    assert sc_mounts[volume] == (ex_mounts[volume][0], True), "the scheduler mounts the secret read-only"
    assert volume in load(COMPOSE).get("volumes", {}), "the secret lives on a named volume"
    gpu_cmd = command_of(load(COMPOSE_GPU)["services"]["executor"])
    assert flag_value(gpu_cmd, SECRET_FLAG) == secret, "the GPU executor requires the secret too"


def named_mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Named volumes of a service: volume -> (mount path, read-only)."""
    out: dict[str, tuple[str, bool]] = {}
    for entry in service.get("volumes") or []:
        parts = str(entry).split(":")
        if len(parts) >= 2 and not parts[0].startswith(("/", ".", "$")):
            out[parts[0]] = (parts[1], parts[2:3] == ["ro"])
    return out


def runtime_stage(dockerfile: Path) -> str:
    """The Dockerfile's last stage (the image compose runs), continuation lines joined."""
    text = dockerfile.read_text().replace("\\\n", " ")
    return re.split(r"^FROM .*$", text, flags=re.MULTILINE)[-1]


def test_the_executor_may_write_its_startup_cache_on_a_volume_and_nothing_else() -> None:
    """The image's start-up cache directory (the packing choice, the converted weights) belongs to the user the
    executor runs as, and every compose file's executor keeps it on a named volume (re-created containers and
    replicas reuse it); the rest of /opt stays root's."""
    stage = runtime_stage(ROOT / "Dockerfile")
    user = re.findall(r"^USER (\S+)", stage, flags=re.MULTILINE)[-1]
    cache_dir = re.findall(r"PAGEDSERVE_CACHE_DIR=(\S+)", stage)[-1]
    startup = f"{cache_dir}/startup"
    assert re.search(rf"install -d -o {user} -g {user} -m 700 {re.escape(startup)}\b", stage), stage
    assert not re.search(r"chown|chmod", stage.replace("/var/lib/pagedserve/secret", "")), "nothing else is given away"
    for path in (COMPOSE, COMPOSE_TIERS):
        compose = load(path)
        mounts = {name: mount for name, mount in named_mounts(compose["services"]["executor"]).items()
                  if mount[0] == startup}
        assert len(mounts) == 1 and not next(iter(mounts.values()))[1], f"{path.name}: {startup} on no volume"
        assert next(iter(mounts)) in compose.get("volumes", {}), f"{path.name}: the volume is not declared"
        for name, svc in compose["services"].items():
            assert name == "executor" or startup not in {m for m, _ in named_mounts(svc).values()}, name


def test_env_variables_are_named_after_their_flags() -> None:
    """`--max-num-seqs ${MAX_NUM_SEQS:-256}`: the variable is the flag in upper snake case."""
    pairs = 0
    for path in (COMPOSE, COMPOSE_GPU, COMPOSE_TIERS):
        for name, svc in load(path)["services"].items():
            raw = svc.get("command") or ""
            text = raw if isinstance(raw, str) else " ".join(map(str, raw))
            for flag, var in re.findall(r"--([\w-]+)[ =]\$\{(\w+)", text):
                pairs += 1
                assert var == env_name(flag.replace("-", "_")), f"{path.name} {name}: --{flag} is set from ${var}"
    assert pairs >= 10


@pytest.mark.parametrize("name", ["executor", "scheduler"])
def test_compose_defaults_match_the_command_line_defaults(name: str) -> None:
    """With no variables set, compose runs each service like its bare command line (addresses aside)."""
    cmd = command_of(load(COMPOSE)["services"][name])
    parser = PARSERS[cmd[2]]()
    got, want = vars(parser.parse_args(cmd[3:])), vars(parser.parse_args([]))
    drift = {k: (got[k], want[k]) for k in want if k not in NETWORK_FLAGS | CONTAINER_FLAGS and got[k] != want[k]}
    assert not drift, f"compose.yaml {name} defaults (compose, flag) differ: {drift}"


def test_tiers_wiring() -> None:
    """compose.tiers.yaml stands alone (docker-compose v1 loads it): the front-ends find the engine core by its
    service name on its core-link port, over CURVE with the executor's secret, and publish the public ports."""
    services = load(COMPOSE_TIERS)["services"]
    assert set(services) == set(TIER_MODULES)
    for name, svc in services.items():
        assert command_of(svc)[:3] == ["python", "-m", TIER_MODULES[name]], name
        assert svc.get("restart") in RESTART_POLICIES and svc.get("healthcheck"), name
    core, frontend = command_of(services["engine-core"]), command_of(services["frontend"])
    listen = flag_value(core, "--engine-core-listen") or ""
    assert listen.startswith("tcp://0.0.0.0:") and flag_value(core, "--api-server-count") == "0"
    port = int(listen.rsplit(":", 1)[1])
    assert flag_value(frontend, "--engine-core") == f"dns:///engine-core:{port}", "re-resolved: a new IP is followed"
    assert port in container_ports(services["engine-core"])
    secret = flag_value(command_of(services["executor"]), SECRET_FLAG)
    assert flag_value(core, "--engine-core-secret-file") == flag_value(frontend, "--engine-core-secret-file") == secret
    assert {50051, 8080} <= {container_port(p) for p in services["frontend"]["ports"]}
    assert services["frontend"]["depends_on"]["engine-core"]["condition"] == "service_healthy"


@pytest.mark.parametrize("name", ["engine-core", "frontend"])
def test_tier_defaults_match_the_command_line_defaults(name: str) -> None:
    cmd = command_of(load(COMPOSE_TIERS)["services"][name])
    parser = scheduler_parser()
    got, want = vars(parser.parse_args(cmd[3:])), vars(parser.parse_args([]))
    skip = NETWORK_FLAGS | CONTAINER_FLAGS | TIER_FLAGS
    drift = {k: (got[k], want[k]) for k in want if k not in skip and got[k] != want[k]}
    assert not drift, f"compose.tiers.yaml {name} defaults (compose, flag) differ: {drift}"


def test_gpu_override() -> None:
    gpu = load(COMPOSE_GPU)["services"]
    assert set(gpu) == {"executor"}, "the GPU variant only changes the executor"
    ex = gpu["executor"]
    assert "ports" not in ex
    devices = ex["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), devices
    assert ex["build"]["args"]["BASE_IMAGE"].startswith("${"), "the CUDA base is a build argument"
    mounts = [str(v).rsplit(":", 2) for v in ex["volumes"]]
    cmd = command_of(ex)
    model = flag_value(cmd, "--model")
    assert model is not None and any(m[1] == model for m in mounts if len(m) == 3), (model, mounts)
    args = executor_parser().parse_args(cmd[3:])
    assert args.device == "cuda" and args.listen == "0.0.0.0:50061"


# ------------------------------------------------------------------------------------- the stack, locally


@dataclass
class LocalStack:
    services: dict[str, Any]
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    volumes: Path | None = None  # named volumes become directories here
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def local_port(self, service: str, port: int) -> int:
        return self.ports[(service, port)]

    def rewrite(self, service: str, args: list[str]) -> list[str]:
        """Resolve compose names and container ports of `service`'s arguments to 127.0.0.1 and free ports."""
        out: list[str] = []
        for i, token in enumerate(args):
            scheme = "dns:///" if token.startswith("dns:///") else ""
            token = token.removeprefix(scheme)
            m = re.fullmatch(r"([\w.\-:]*):(\d+)", token)
            if m and (m.group(1) in LOCAL_HOSTS or m.group(1) in self.services):
                target = service if m.group(1) in LOCAL_HOSTS else m.group(1)
                key = (target, int(m.group(2)))
                assert key in self.ports, f"{service} uses {token}, but {target} exposes no port {m.group(2)}"
                token = f"127.0.0.1:{self.ports[key]}"
            elif token.isdigit() and i > 0 and args[i - 1].endswith("-port") and (service, int(token)) in self.ports:
                token = str(self.ports[(service, int(token))])
            elif token == "0.0.0.0":
                token = "127.0.0.1"
            else:
                token = self.local_path(service, token)
            out.append(scheme + token)
        return out

    def local_path(self, service: str, token: str) -> str:
        """A path on one of the service's named volumes, moved to that volume's local directory."""
        for volume, (path, _) in named_mounts(self.services[service]).items():
            if self.volumes is not None and token.startswith(path + "/"):
                local = self.volumes / volume
                local.mkdir(parents=True, exist_ok=True)
                return str(local / token[len(path) + 1:])
        return token

    def python(self, service: str, argv: list[str]) -> list[str]:
        assert argv[:2] == ["python", "-m"], f"{service}: expected `python -m ...`, got {argv[:2]}"
        return [sys.executable, *self.rewrite(service, argv[1:])]

    def log_tail(self, service: str, chars: int = 3000) -> str:
        path = self.logs.get(service)
        return path.read_text(errors="replace")[-chars:] if path and path.exists() else ""

    def start(self, service: str, log_dir: Path) -> None:
        svc = self.services[service]
        env = {**os.environ, **environment_of(svc), "PYTHONUNBUFFERED": "1"}
        self.logs[service] = log_dir / f"{service}.log"
        with self.logs[service].open("wb") as log:
            self.procs[service] = subprocess.Popen(self.python(service, command_of(svc)), cwd=ROOT, env=env,
                                                   stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, service: str, timeout: float = START_TIMEOUT_S) -> None:
        """Run the service's compose healthcheck until it passes, as Docker would (but more often)."""
        check = self.services[service]["healthcheck"]
        test = list(check["test"])
        kind, argv = test[0], test[1:]
        assert kind == "CMD", f"{service}: healthcheck must be exec form ['CMD', ...], got {kind}"
        probe = self.python(service, [interpolate(str(a)) for a in argv])
        probe_timeout = duration_s(str(check.get("timeout", "30s")))
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            proc = self.procs[service]
            if proc.poll() is not None:
                raise AssertionError(f"{service} exited with {proc.returncode}:\n{self.log_tail(service)}")
            try:
                r = subprocess.run(probe, cwd=ROOT, capture_output=True, text=True, timeout=probe_timeout)
            except subprocess.TimeoutExpired:
                last = "probe timed out"
                continue
            if r.returncode == 0:
                return
            last = (r.stdout + r.stderr).strip()
            time.sleep(0.25)
        raise AssertionError(f"{service}: healthcheck {shlex.join(probe)} not passing after {timeout:.0f}s "
                             f"({last}):\n{self.log_tail(service)}")


def duration_s(text: str) -> float:
    total = 0.0
    for value, unit in re.findall(r"([\d.]+)(ms|us|h|m|s)", text):
        total += float(value) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    return total or 30.0


def allocate_ports(services: dict[str, Any]) -> dict[tuple[str, int], int]:
    ports: dict[tuple[str, int], int] = {}
    for name, svc in services.items():
        for port in sorted(container_ports(svc)):
            p = free_port()
            while p in ports.values():
                p = free_port()
            ports[(name, port)] = p
    return ports


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    services = load(COMPOSE)["services"]
    log_dir = tmp_path_factory.mktemp("compose")
    local = LocalStack(services, allocate_ports(services), volumes=log_dir / "volumes")
    try:
        for name in start_order(services):
            local.start(name, log_dir)
            local.wait_healthy(name)
        yield local
    finally:
        for name in reversed(list(local.procs)):
            stop(local.procs[name])


def published(stack: LocalStack, container: int) -> int:
    """The local stand-in for the scheduler's published port that maps to `container`."""
    assert container in {container_port(p) for p in stack.services["scheduler"]["ports"]}
    return stack.local_port("scheduler", container)


async def test_generation_streams_through_the_published_port(stack: LocalStack) -> None:
    address = f"127.0.0.1:{published(stack, 50051)}"
    chunks: list[generation_pb2.GenerateResponse] = []
    async with PagedServeClient(address) as client:
        async for r in client.generate("The scheduler decides", max_tokens=8, temperature=0.0, ignore_eos=True):
            chunks.append(r)
    assert chunks, "no response streamed"
    assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH, chunks[-1]
    assert sum(len(c.token_ids) for c in chunks) == 8
    assert chunks[-1].usage.completion_tokens == 8
    for name, proc in stack.procs.items():
        assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{stack.log_tail(name)}"


def test_metrics_on_the_published_port(stack: LocalStack) -> None:
    url = f"http://127.0.0.1:{published(stack, 8000)}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert "vllm:num_requests_running" in text


def test_http_api_on_the_published_port(stack: LocalStack) -> None:
    base = f"http://127.0.0.1:{published(stack, 8080)}/v1"
    models = json.loads(urllib.request.urlopen(f"{base}/models", timeout=10).read())
    assert models["object"] == "list" and models["data"], models
    body = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{base}/completions", data=body, headers={"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 4


def test_cli_generate_through_the_published_port(stack: LocalStack) -> None:
    address = f"127.0.0.1:{published(stack, 50051)}"
    r = subprocess.run([sys.executable, "-m", "client", "generate", "--server", address, "--max-tokens", "4",
                        "--temperature", "0", "--ignore-eos", "--json", "Hello"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert lines and '"finish_reason": "length"' in lines[-1], r.stdout

