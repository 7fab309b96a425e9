"""deploy/docker-compose.yml, deploy/Dockerfile and scripts/scale.sh, checked with no Docker engine.

The compose file is validated by `docker compose config` / `docker-compose config` where one is
installed, and always by a structural check of what --scale and the workers rely on: every stage,
the router included, scales (no host port but the `api` entry point's), workers name the router
service (which resolves to every replica), the entry point's nginx config reaches every replica.
The decode entrypoint script and the router healthcheck are run for real against stand-ins.
"""

from __future__ import annotations

import http.server
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
NGINX_CONF = ROOT / "deploy" / "nginx" / "api.conf"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
SCALE = ROOT / "scripts" / "scale.sh"
STAGES = ("router", "prefill", "decode")
WORKERS = ("prefill", "decode")
ROUTER_CONTROL = "tcp://router:8001"


_INTERPOLATION = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}|\$[\w{]")


def _substitute(m: re.Match) -> str:
    if m[0] == "$$":
        return "$"
    if m[1] is None:  # $NAME or a malformed ${...}: compose would substitute or reject it
        raise AssertionError(f"{m.string!r}: unescaped {m[0]!r}; write $$ for a shell's $")
    return m[2] or ""


def interpolate(value):
    """Compose's variable substitution with every variable unset: `${VAR:-default}` becomes the
    default, `$$` a literal `$`; so the result is what a container gets with no overrides."""
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, str):
        return _INTERPOLATION.sub(_substitute, value)
    return value


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()))


def service(compose: dict, name: str) -> dict:
    return compose["services"][name]


def env(svc: dict) -> dict[str, str]:
    """A service's environment as a dict, from either the mapping or the KEY=VALUE list form."""
    raw = svc.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    return {k: None if v is None else str(v) for k, v in raw.items()}


def argv(value: str | list | None) -> list[str]:
    if value is None:
        return []
    return value.split() if isinstance(value, str) else [str(v) for v in value]


# --- validation by compose itself ------------------------------------------------------------


def _compose_v2_available() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    return probe.returncode == 0


def _config_q(cmd: list[str]) -> None:
    result = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose not installed (Debian: apt-get install --no-install-recommends "
    "docker-compose); the structural checks below still run",
)
def test_compose_file_valid_docker_compose_v1() -> None:
    _config_q(["docker-compose"])


@pytest.mark.skipif(
    not _compose_v2_available(),
    reason="the docker compose v2 plugin is not installed; the structural checks below still run",
)
def test_compose_file_valid_docker_compose_v2() -> None:
    _config_q(["docker", "compose"])


# --- structure: services, volume, addresses, scalability -------------------------------------


def test_services_present(compose: dict) -> None:
    assert set(compose["services"]) >= {"pull", "api", *STAGES}


def test_stage_commands(compose: dict) -> None:
    assert argv(service(compose, "pull").get("command"))[:2] == ["models", "pull"]
    for name in STAGES:
        assert argv(service(compose, name).get("command"))[:1] == [name]
    # Workers run through a shell (for their address); the script execs `pdserve <its $0>`, the
    # command (test_workers_advertise_their_own_container_address runs it).
    for name in WORKERS:
        script = " ".join(argv(service(compose, name).get("entrypoint")))
        assert 'exec pdserve "$0"' in script, name


def _mounts(svc: dict) -> list[tuple[str, str]]:
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v.get("source"), v.get("target")
        out.append((source, target))
    return out


def test_model_cache_volume_everywhere(compose: dict) -> None:
    assert "model-cache" in (compose.get("volumes") or {})
    for name in ("pull", *STAGES):
        svc = service(compose, name)
        assert ("model-cache", "/cache") in _mounts(svc), name
        assert env(svc).get("PDSERVE_CACHE") == "/cache", name


def test_stages_wait_for_pull(compose: dict) -> None:
    for name in STAGES:
        deps = service(compose, name).get("depends_on")
        assert isinstance(deps, dict), f"{name}: depends_on needs the long form for conditions"
        assert deps["pull"]["condition"] == "service_completed_successfully", name
    assert service(compose, "pull").get("restart") in (None, "no")


def test_workers_point_at_router_control_socket(compose: dict) -> None:
    router_env = env(service(compose, "router"))
    host, port = ROUTER_CONTROL.removeprefix("tcp://").split(":")
    assert host == "router"  # the compose service name, resolvable on the project network
    assert router_env["PDSERVE_CONTROL_PORT"] == port
    assert router_env["PDSERVE_CONTROL_HOST"] == "0.0.0.0"
    for name in WORKERS:
        assert env(service(compose, name))["PDSERVE_ROUTER"] == ROUTER_CONTROL, name
        assert "router" in service(compose, name)["depends_on"], name


def test_workers_openmp_threads_spin_briefly(compose: dict) -> None:
    # workers sharing one host's cores: libgomp's default spin held the cores another needed
    for name in ("prefill", "decode"):
        assert env(service(compose, name))["PDSERVE_OMP_SPIN_US"] == "100"
        assert "GOMP_SPINCOUNT" not in env(service(compose, name))  # it would win over the time


def test_kv_transport_is_tcp_between_containers(compose: dict) -> None:
    for name in WORKERS:
        assert env(service(compose, name)).get("PDSERVE_KV_TRANSPORT") == "tcp", name
    # Every worker's KV receiver is reachable from the others: decode workers take prompts' KV
    # there, and any worker serves and fetches cached prefixes there (peer fetch)
    for name in WORKERS:
        worker_env = env(service(compose, name))
        assert worker_env["PDSERVE_KV_HOST"] == "0.0.0.0", name
        assert worker_env["PDSERVE_KV_PORT"] == "8100", name
        assert "8100" in {str(p) for p in service(compose, name).get("expose") or []}, name


def _published(svc: dict) -> list[tuple[str | None, str]]:
    """(host IP, container port) of each published port."""
    out = []
    for p in svc.get("ports") or []:
        if isinstance(p, dict):
            out.append((p.get("host_ip"), str(p.get("target"))))
        else:
            parts = str(p).split(":")
            assert len(parts) == 3, f"{p!r}: give the host IP, or Docker binds every interface"
            out.append((parts[0], parts[2].split("/")[0]))
    return out


def test_only_the_entry_point_publishes_a_port_on_loopback(compose: dict) -> None:
    api = service(compose, "api")
    assert _published(api) == [("127.0.0.1", "8000")]
    for name, svc in compose["services"].items():
        if name != "api" and "profiles" not in svc:  # monitoring: test_monitoring.py
            assert not svc.get("ports"), f"{name}: a published port stops --scale {name}=N"
    router = service(compose, "router")
    assert env(router)["PDSERVE_PORT"] == "8000"
    assert env(router)["PDSERVE_HOST"] == "0.0.0.0"  # inside the container; the network limits it
    assert {"8000", "8001"} <= {str(p) for p in router.get("expose") or []}
    assert "router" in api["depends_on"]


def test_every_stage_is_scalable(compose: dict) -> None:
    # Any of these pins one container per service, and `--scale N` then fails or collides.
    for name in STAGES:
        svc = service(compose, name)
        for key in ("ports", "container_name", "hostname"):
            assert key not in svc, f"{name}: {key} prevents --scale"
    for name in WORKERS:
        assert "PDSERVE_KV_ADVERTISE_HOST" not in env(service(compose, name)), name


def _nginx_directives(text: str) -> list[tuple[str, list[str]]]:
    """(name, arguments) of every simple directive in an nginx config, blocks flattened."""
    text = re.sub(r"#.*", "", text)
    out = []
    for statement in re.split(r"[;{}]", text):
        words = statement.split()
        if words:
            out.append((words[0], words[1:]))
    return out


def test_entry_point_spreads_requests_over_every_router(compose: dict) -> None:
    api = service(compose, "api")
    (mount,) = [m for m in api["volumes"] if m.split(":")[1].startswith("/etc/nginx/")]
    source, target = mount.split(":")[:2]
    assert (COMPOSE.parent / source).resolve() == NGINX_CONF
    assert target == "/etc/nginx/conf.d/default.conf"  # replaces the image's default server
    directives = dict(_nginx_directives(NGINX_CONF.read_text()))
    assert directives["listen"] == ["8000"]
    # Docker's DNS, looked up at request time (a variable): replicas that come and go are followed.
    assert directives["resolver"][0] == "127.0.0.11"
    valid = next(a for a in directives["resolver"] if a.startswith("valid="))
    assert int(valid.removeprefix("valid=").rstrip("s")) <= 10
    variable, upstream = directives["set"]
    assert upstream == f"router:{env(service(compose, 'router'))['PDSERVE_PORT']}"
    assert directives["proxy_pass"] == [f"http://{variable}"]
    # Streams pass through as they come, and live as long as a request may (600 s by default).
    assert directives["proxy_buffering"] == ["off"]
    assert int(directives["proxy_read_timeout"][0].rstrip("s")) > 600
    assert directives["proxy_http_version"] == ["1.1"]
    # A stopped replica, or one without workers yet (503), costs a retry, not an error.
    assert {"error", "http_503", "non_idempotent"} <= set(directives["proxy_next_upstream"])


def test_same_cluster_secret_for_every_router_replica(compose: dict) -> None:
    # Replicas share the service's definition: the one secret file in the one model-cache volume.
    router = service(compose, "router")
    assert ("model-cache", "/cache") in _mounts(router)
    assert env(router)["PDSERVE_CLUSTER_SECRET_FILE"].startswith("/cache/")


def test_router_healthcheck_hits_health(compose: dict) -> None:
    hc = service(compose, "router").get("healthcheck")
    assert hc and not hc.get("disable")
    assert "/health" in " ".join(argv(hc["test"]))


def test_all_services_share_one_image(compose: dict) -> None:
    images = {service(compose, n)["image"] for n in ("pull", *STAGES)}
    assert len(images) == 1
    for name in ("pull", *STAGES):
        build = service(compose, name)["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE


# --- the decode entrypoint and the healthcheck, run --------------------------------------------


def _write_exe(path: Path, body: str) -> None:
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _run_worker_entrypoint(compose: dict, tmp_path: Path, addresses: str, stage: str):
    entrypoint = argv(service(compose, stage)["entrypoint"])
    assert entrypoint[:2] in (["/bin/sh", "-c"], ["sh", "-c"])
    script = entrypoint[2]
    command = argv(service(compose, stage).get("command"))
    shims = tmp_path / "bin"
    shims.mkdir()
    _write_exe(shims / "hostname", f'#!/bin/sh\n[ "$1" = -i ] || exit 9\necho "{addresses}"\n')
    _write_exe(shims / "pdserve", '#!/bin/sh\nprintf "%s\\n" "$@"\n')
    return subprocess.run(
        ["/bin/sh", "-c", script, *command],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}"},
    )


def test_pull_writes_one_cluster_secret_every_stage_reads(compose: dict, tmp_path: Path) -> None:
    pull = service(compose, "pull")
    secret_file = env(pull)["PDSERVE_CLUSTER_SECRET_FILE"]
    for name in STAGES:  # router and workers bind beyond loopback only with the secret
        assert env(service(compose, name)).get("PDSERVE_CLUSTER_SECRET_FILE") == secret_file, name
    entrypoint = argv(pull["entrypoint"])
    assert entrypoint[:2] in (["/bin/sh", "-c"], ["sh", "-c"])
    shims = tmp_path / "bin"
    shims.mkdir()
    _write_exe(shims / "pdserve", '#!/bin/sh\nprintf "%s\\n" "$@"\n')
    secret = tmp_path / "cluster-secret"
    run_env = {
        **os.environ,
        "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
        "PDSERVE_CLUSTER_SECRET_FILE": str(secret),
    }
    cmd = ["/bin/sh", "-c", entrypoint[2], *entrypoint[3:], *argv(pull.get("command"))]
    first = subprocess.run(cmd, capture_output=True, text=True, env=run_env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["models", "pull", "--quiet"]  # then pdserve runs as before
    written = secret.read_text()
    assert len(written) == 64 and (secret.stat().st_mode & 0o077) == 0  # 32 bytes, owner only
    again = subprocess.run(cmd, capture_output=True, text=True, env=run_env)
    assert again.returncode == 0 and secret.read_text() == written  # kept across restarts


@pytest.mark.parametrize("stage", WORKERS)
def test_workers_advertise_their_own_container_address(
    compose: dict, tmp_path: Path, stage: str
) -> None:
    # `hostname -i` may list several addresses (IPv6 too): the first one is advertised.
    result = _run_worker_entrypoint(compose, tmp_path, "172.18.0.5 fd00::5", stage)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [stage, "--kv-advertise-host", "172.18.0.5"]


@pytest.mark.parametrize("stage", WORKERS)
def test_workers_refuse_a_loopback_address(compose: dict, tmp_path: Path, stage: str) -> None:
    result = _run_worker_entrypoint(compose, tmp_path, "127.0.1.1", stage)
    assert result.returncode != 0
    assert f"{stage}: no container address" in result.stderr
    assert result.stdout == ""  # pdserve never started


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (the http.server API)
        code = self.status if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False)])
def test_router_healthcheck_command(compose: dict, status: int, healthy: bool) -> None:
    test = argv(service(compose, "router")["healthcheck"]["test"])
    assert test[0] == "CMD" and test[1] == "python", "the slim image has python, not curl"
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        # Same command, aimed at the stand-in's port instead of the router's 8000.
        code = re.sub(r"127\.0\.0\.1:8000\b", f"127.0.0.1:{server.server_port}", test[3])
        assert code != test[3], "healthcheck must target 127.0.0.1:8000"
        result = subprocess.run([sys.executable, *test[2:3], code], capture_output=True)
    finally:
        server.shutdown()
        server.server_close()
    assert (result.returncode == 0) is healthy


def test_router_healthcheck_fails_with_nothing_listening(compose: dict) -> None:
    test = argv(service(compose, "router")["healthcheck"]["test"])
    with socket.socket() as s:  # a port that was free a moment ago, so nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = re.sub(r"127\.0\.0\.1:8000\b", f"127.0.0.1:{port}", test[3])
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode != 0


# --- Dockerfile ---------------------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_essentials() -> None:
    ins = _instructions()
    assert ins[0] == ("FROM", "python:3.11-slim")
    args = {a.split("=")[0] for op, a in ins if op == "ARG"}
    assert {"TORCH_SPEC", "TORCH_INDEX", "PULL_MODEL"} <= args
    assert ("ENTRYPOINT", '["pdserve"]') in ins
    assert any(op == "ENV" and "PDSERVE_CACHE=/cache" in a for op, a in ins)
    assert any(op == "RUN" and re.search(r"\bgcc\b", a) for op, a in ins)
    users = [a for op, a in ins if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "must not run as root"
    # The model is pulled only when asked, and then as the runtime user, into /cache.
    pulls = [i for i, (op, a) in enumerate(ins) if op == "RUN" and "models pull" in a]
    assert pulls and all("PULL_MODEL" in ins[i][1] for i in pulls)
    assert all(i > ins.index(("USER", users[-1])) for i in pulls)


def test_dockerfile_copies_every_package_pyproject_installs() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set()
    for op, a in _instructions():
        if op == "COPY":
            sources = a.split()[:-1]
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"
                copied.add(src.rstrip("/"))
    assert packages <= copied
    assert {"pyproject.toml", "README.md"} <= copied  # pyproject's readme is read at build time


# --- scripts/scale.sh ---------------------------------------------------------------------------


def _shim_dir(tmp_path: Path, *, v2: bool, v1: bool) -> Path:
    """A PATH directory with recording stand-ins for `docker` / `docker-compose`, plus dirname."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    record = f'printf "%s\\n" "$(basename "$0") $*" >> "{log}"\n'
    if v2:
        _write_exe(bin_dir / "docker", f"#!/bin/sh\n{record}exit 0\n")
    else:  # a docker CLI without the compose plugin
        _write_exe(bin_dir / "docker", f'#!/bin/sh\n{record}[ "$1" = compose ] && exit 1\nexit 0\n')
    if v1:
        _write_exe(bin_dir / "docker-compose", f"#!/bin/sh\n{record}exit 0\n")
    for tool in ("dirname", "basename"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return bin_dir


def _repo_copy(tmp_path: Path, *, override: bool = False) -> Path:
    """scale.sh in a stand-in repository, so whether an override file exists is up to the test."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "deploy").mkdir()
    shutil.copy2(SCALE, repo / "scripts" / "scale.sh")
    shutil.copy2(COMPOSE, repo / "deploy" / "docker-compose.yml")
    if override:
        (repo / "deploy" / "docker-compose.override.yml").write_text("services: {}\n")
    return repo


def _scale(args: list[str], path: str | None = None, repo: Path = ROOT, cwd: Path = ROOT):
    environ = dict(os.environ)
    if path is not None:
        environ["PATH"] = path
    return subprocess.run(
        [shutil.which("bash"), str(repo / "scripts" / "scale.sh"), *args],
        capture_output=True,
        text=True,
        env=environ,
        cwd=cwd,
    )


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["decode"],
        ["router", "0"],
        ["api", "2"],
        ["pull", "1"],
        ["decode", "x"],
        ["decode", "-1"],
        ["decode", "1.5"],
        ["decode", ""],
        ["decode", "0"],
        ["decode", "2", "extra"],
        ["decode", "12345"],
    ],
)
def test_scale_rejects_bad_arguments(args: list[str], tmp_path: Path) -> None:
    shims = _shim_dir(tmp_path, v2=True, v1=True)
    result = _scale(args, path=str(shims))
    assert result.returncode == 2, result.stderr
    assert "usage:" in result.stderr
    assert _calls(tmp_path) == []  # docker was never run


def test_scale_help() -> None:
    result = _scale(["--help"])
    assert result.returncode == 0
    assert result.stdout.startswith("usage:")


@pytest.mark.parametrize(
    "stage, n", [("decode", "3"), ("prefill", "0"), ("prefill", "08"), ("router", "2")]
)
def test_scale_runs_docker_compose_plugin(stage: str, n: str, tmp_path: Path) -> None:
    shims = _shim_dir(tmp_path, v2=True, v1=True)
    # From another directory: the script finds the compose file relative to itself.
    result = _scale([stage, n], path=str(shims), repo=_repo_copy(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    up = (
        f"docker compose -f deploy/docker-compose.yml up -d --no-recreate "
        f"--scale {stage}={int(n)} {stage}"
    )
    assert _calls(tmp_path)[-1] == up
    assert set(_calls(tmp_path)[:-1]) <= {"docker compose version"}


def test_scale_falls_back_to_docker_compose_v1(tmp_path: Path) -> None:
    shims = _shim_dir(tmp_path, v2=False, v1=True)
    result = _scale(["decode", "3"], path=str(shims), repo=_repo_copy(tmp_path))
    assert result.returncode == 0, result.stderr
    up = "docker-compose -f deploy/docker-compose.yml up -d --no-recreate --scale decode=3 decode"
    assert _calls(tmp_path)[-1] == up


def test_scale_includes_the_override_file(tmp_path: Path) -> None:
    # New replicas must be configured like the running ones, which were started with the override.
    shims = _shim_dir(tmp_path, v2=True, v1=False)
    result = _scale(["decode", "2"], path=str(shims), repo=_repo_copy(tmp_path, override=True))
    assert result.returncode == 0, result.stderr
    assert _calls(tmp_path)[-1] == (
        "docker compose -f deploy/docker-compose.yml -f deploy/docker-compose.override.yml "
        "up -d --no-recreate --scale decode=2 decode"
    )


def test_scale_without_any_compose(tmp_path: Path) -> None:
    shims = _shim_dir(tmp_path, v2=False, v1=False)
    result = _scale(["decode", "3"], path=str(shims), repo=_repo_copy(tmp_path))
    assert result.returncode == 1
    assert "docker-compose" in result.stderr
