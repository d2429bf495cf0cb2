"""The deployment files of ``docs/deploy.md`` (``deploy/``), checked without a cluster or a container
engine:

- every ``shmtransport ...`` command line in them (the systemd unit's ``Exec*=``, the manifests'
  ``command``, probes and ``sh -c`` scripts, the Containerfile's ``RUN`` / ``CMD`` / ``ENTRYPOINT``
  / ``HEALTHCHECK``, the compose file's, and the inline ones of ``docs/deploy.md``) parses with the
  real ``build_parser()``, so a renamed flag fails here;
- the systemd unit: ``systemd-analyze verify`` where it is installed, and its keys read with
  configparser everywhere;
- the Kubernetes manifests and the compose file: parsed with PyYAML; the fields a deployment
  depends on (images, commands, probes, the socket and ``/dev/shm`` volumes in every container,
  non-root security contexts, a memory limit that holds the arena), no misspelled key in the parts
  we write, and one socket path for the daemon and all its clients;
- the Containerfile: its ``COPY`` sources exist; its daemon command line runs for real (a 16 MiB
  arena on a private socket), its ``HEALTHCHECK`` command exits 0 against it, metrics answer, and
  SIGTERM ends it with exit 0 and nothing left behind.
"""
from __future__ import annotations

import configparser
import json
import os
import pathlib
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from shmtransport import testing
from shmtransport.cli import build_parser
from shmtransport.daemon.config import DaemonConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
if not DEPLOY.is_dir():  # the sdist carries tests/ and docs/ but not deploy/
    pytest.skip("deploy/ is not in this tree (an unpacked sdist)", allow_module_level=True)

yaml = pytest.importorskip("yaml")

UNIT = DEPLOY / "systemd" / "shmtransportd.service"
CONTAINERFILE = DEPLOY / "container" / "Containerfile"
COMPOSE = DEPLOY / "container" / "compose.yaml"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
DOC = ROOT / "docs" / "deploy.md"
UNIT_EXECUTABLE = "/opt/shmtransport/bin/shmtransport"  # where the unit expects the venv
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0

# -- command lines ---------------------------------------------------------------------------------

_OPERATORS = {";", "&&", "||", "|", "&", "(", ")", "\n"}
_KEYWORDS = {"until", "while", "do", "done", "if", "then", "else", "fi", "!", "exec"}


def _simple_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script, without keywords and redirections."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    commands, current, tokens = [], [], list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in _OPERATORS or set(token) <= set(";&|()") and token:
            commands.append(current)
            current = []
        elif set(token) <= set("<>&"):  # a redirection and its target
            if current and current[-1].isdigit():
                current.pop()
            i += 1
        elif not current and token in _KEYWORDS:
            pass
        else:
            current.append(token)
        i += 1
    commands.append(current)
    return [c for c in commands if c]


def shmtransport_argvs(argv: list[str]) -> list[list[str]]:
    """The arguments of every ``shmtransport`` invocation in ``argv`` (a command, or ``sh -c SCRIPT``)."""
    if not argv:
        return []
    if os.path.basename(argv[0]) == "shmtransport":
        return [argv[1:]]
    if os.path.basename(argv[0]) in ("sh", "bash") and len(argv) >= 3 and argv[1] == "-c":
        return [args for command in _simple_commands(argv[2]) for args in shmtransport_argvs(command)]
    return []


def parse_cli(args: list[str], where: str):
    """``build_parser().parse_args(args)``; a failure names ``where``. None for ``--version``."""
    try:
        parsed = build_parser().parse_args(args)
    except SystemExit as exc:
        if exc.code == 0 and args == ["--version"]:
            return None
        pytest.fail(f"{where}: `shmtransport {shlex.join(args)}` does not parse (exit {exc.code})", pytrace=False)
    if parsed.command == "daemon":
        problem = _socket_path_problem(parsed.socket)
        assert problem is None, f"{where}: {problem}"
    return parsed


def _socket_path_problem(path: str) -> str | None:
    from shmtransport.cli import _check_socket_paths

    return _check_socket_paths(DaemonConfig(socket_path=path, allowed_uids=(os.getuid(),)))


def option(args: list[str], name: str) -> str | None:
    """The last value of ``name`` in ``args`` (argparse: the last one wins)."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    values += [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return values[-1] if values else None


def with_options(args: list[str], **replace: str) -> list[str]:
    """``args`` with each ``--name value`` of ``replace`` (``name_with_underscores``) set instead."""
    out, skip = [], False
    names = {"--" + k.replace("_", "-") for k in replace}
    for a in args:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if a.split("=", 1)[0] in names:
            continue
        out.append(a)
    for key, value in replace.items():
        out += ["--" + key.replace("_", "-"), value]
    return out


def nbytes(quantity: str) -> int:
    """A Kubernetes quantity or a CLI size (``4352Mi``, ``6Gi``, ``4G``, ``6gb``) in bytes."""
    m = re.fullmatch(r"(\d+)\s*([KMGT]?)(i?)[bB]?", str(quantity).strip(), re.IGNORECASE)
    assert m, f"not a size: {quantity!r}"
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(m.group(1)) * (1 << (10 * power))


def arena_and_table_nbytes(daemon_args: list[str]) -> int:
    """What the daemon reserves of its own memory at start (one tenant): the arena and its object table."""
    arena = nbytes(option(daemon_args, "--arena-size"))
    slots = DaemonConfig(allowed_uids=(os.getuid(),)).resolved_object_slots(arena)
    return arena + 64 * slots


# -- the systemd unit ------------------------------------------------------------------------------

def read_unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True, empty_lines_in_values=False)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string(UNIT.read_text())
    return unit


def test_unit_declares_a_hardened_restarting_service():
    unit = read_unit()
    assert unit.sections() == ["Unit", "Service", "Install"]
    service = unit["Service"]
    expected = {"Type": "exec", "Restart": "on-failure", "KillSignal": "SIGTERM", "RuntimeDirectoryMode": "0700",
                "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
                "PrivateDevices": "yes", "CapabilityBoundingSet": ""}
    assert {k: service.get(k) for k in expected} == expected
    assert service.get("User") and service.get("User") != "root"
    # These would take the daemon's /dev/shm away from its clients, or delete their segments at stop.
    assert not {"PrivateIPC", "RemoveIPC", "DynamicUser"} & set(service), "see the unit's hardening comment"
    stop_s = int(re.fullmatch(r"(\d+)s?", service["TimeoutStopSec"]).group(1))
    assert stop_s > DaemonConfig(allowed_uids=(0,)).stop_grace_s, "SIGTERM lets calls in flight finish first"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_unit_command_lines_parse_and_agree_on_the_socket():
    service = read_unit()["Service"]
    start = shlex.split(service["ExecStart"])
    assert start[0] == UNIT_EXECUTABLE
    daemon = parse_cli(start[1:], "ExecStart")
    assert daemon.command == "daemon"
    assert os.path.dirname(daemon.socket) == "/run/" + service["RuntimeDirectory"], "the socket is in RuntimeDirectory"
    post = shmtransport_argvs(shlex.split(service["ExecStartPost"]))
    assert [a[0] for a in post] == ["health"]
    assert parse_cli(post[0], "ExecStartPost").socket == daemon.socket


def test_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here; the unit's keys are checked by the tests above")
    # verify insists that the executables exist: point the unit at this venv's console script.
    executable = pathlib.Path(sys.executable).with_name("shmtransport")
    assert executable.exists(), executable
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(UNIT_EXECUTABLE, str(executable)))
    done = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


# -- Kubernetes --------------------------------------------------------------------------------------

# The keys of the objects we write (a subset of the API's), so that a misspelled one fails.
_KEYS = {
    "container": {"name", "image", "imagePullPolicy", "command", "args", "env", "ports", "volumeMounts", "resources",
                  "securityContext", "livenessProbe", "readinessProbe", "startupProbe", "restartPolicy",
                  "workingDir"},
    "probe": {"exec", "httpGet", "tcpSocket", "grpc", "initialDelaySeconds", "periodSeconds", "timeoutSeconds",
              "failureThreshold", "successThreshold"},
    "volume": {"name", "emptyDir", "hostPath"},
    "emptyDir": {"medium", "sizeLimit"},
    "hostPath": {"path", "type"},
    "volumeMount": {"name", "mountPath", "readOnly", "subPath"},
    "securityContext": {"runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem",
                        "allowPrivilegeEscalation", "capabilities", "seccompProfile", "privileged"},
    "podSecurityContext": {"runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "supplementalGroups",
                           "seccompProfile"},
    "podSpec": {"containers", "initContainers", "volumes", "securityContext", "automountServiceAccountToken",
                "nodeSelector", "tolerations", "shareProcessNamespace", "terminationGracePeriodSeconds",
                "hostIPC", "serviceAccountName"},
    "port": {"name", "containerPort", "protocol"},
    "env": {"name", "value", "valueFrom"},
}
_HOST_PATH_TYPES = {"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice",
                    "BlockDevice"}


def _keys(obj: dict, kind: str, where: str) -> None:
    unknown = set(obj) - _KEYS[kind]
    assert not unknown, f"{where}: unknown {kind} key(s) {sorted(unknown)}"


def manifest_documents():
    return [pytest.param(path, i, doc, id=f"{path.name}#{i}")
            for path in MANIFESTS for i, doc in enumerate(yaml.safe_load_all(path.read_text())) if doc]


def pod_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def argv_of(container: dict) -> list[str]:
    return list(container.get("command", [])) + list(container.get("args", []))


def test_both_kubernetes_layouts_and_one_tenant_everywhere():
    """A sidecar Deployment and a DaemonSet; every non-root container, compose service and the image
    run as one uid: daemon, frontend and worker are one tenant, so handles pass between them."""
    docs = [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert {"DaemonSet", "Deployment"} <= {doc["kind"] for doc in docs}
    uids = set()
    for doc in docs:
        spec = pod_spec(doc)
        for c in containers(spec):
            uid = {**spec.get("securityContext", {}), **c.get("securityContext", {})}.get("runAsUser")
            if uid != 0:  # the DaemonSet's init container that chowns the host directory
                uids.add(uid)
    uids |= {int(service["user"].split(":")[0]) for service in yaml.safe_load(COMPOSE.read_text())["services"].values()}
    uids |= {int(rest.split(":")[0]) for instruction, rest in containerfile_instructions() if instruction == "USER"}
    assert len(uids) == 1, uids


@pytest.mark.parametrize("path,index,doc", manifest_documents())
def test_manifest(path, index, doc):
    where = f"{path.name}#{index}"
    assert doc["apiVersion"] in ("v1", "apps/v1") and doc["kind"] in ("Pod", "Deployment", "DaemonSet")
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    if doc["kind"] != "Pod":
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items(), f"{where}: selector"
    spec = pod_spec(doc)
    _keys(spec, "podSpec", where)
    _keys(spec.get("securityContext", {}), "podSecurityContext", where)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for v in spec["volumes"]:
        _keys(v, "volume", where)
        _keys(v.get("emptyDir") or {}, "emptyDir", where)
        if "hostPath" in v:
            _keys(v["hostPath"], "hostPath", where)
            assert v["hostPath"].get("type", "") in _HOST_PATH_TYPES

    sockets: dict[str, str] = {}  # container -> the daemon socket it names
    daemons = []
    for c in containers(spec):
        name = f"{where} {c['name']}"
        _keys(c, "container", name)
        assert c["image"] and c["command"], f"{name}: image and command"
        for m in c.get("volumeMounts", []):
            _keys(m, "volumeMount", name)
            assert m["name"] in volumes, f"{name}: mounts an undeclared volume {m['name']}"
        for p in c.get("ports", []):
            _keys(p, "port", name)
        for e in c.get("env", []):
            _keys(e, "env", name)
        _check_security_context(spec, c, name)
        invocations = [(args, "command") for args in shmtransport_argvs(argv_of(c))]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in c:
                _keys(c[kind], "probe", name)
                probe = shmtransport_argvs(c[kind]["exec"]["command"])
                assert [a[0] for a in probe] == ["health"], f"{name}: {kind} runs `shmtransport health`"
                invocations += [(args, kind) for args in probe]
        for args, what in invocations:
            parsed = parse_cli(args, f"{name} {what}")
            socket_path = {"daemon": "socket", "health": "socket", "stat": "socket", "ls": "socket",
                           "worker": "daemon_socket"}.get(parsed.command)
            if socket_path:
                sockets[f"{c['name']} {what}"] = getattr(parsed, socket_path)
            if parsed.command == "daemon":
                daemons.append((c, args))
        for e in c.get("env", []):
            if e["name"] == "SHMTRANSPORT_SOCKET":
                sockets[f"{c['name']} env"] = e["value"]
    assert len(set(sockets.values())) == 1, f"{where}: the daemon and its clients name different sockets: {sockets}"
    (socket_path,) = set(sockets.values())

    # The socket's directory is on one volume, mounted in every container.
    socket_volumes = {m["name"] for c in containers(spec) for m in c.get("volumeMounts", [])
                      if socket_path.startswith(m["mountPath"].rstrip("/") + "/")}
    assert len(socket_volumes) == 1, f"{where}: the socket {socket_path} is on {socket_volumes}"
    (socket_volume,) = socket_volumes
    for c in containers(spec):
        assert socket_volume in {m["name"] for m in c.get("volumeMounts", [])}, f"{where} {c['name']}: socket volume"
    if "emptyDir" in volumes[socket_volume]:  # created 0777: the daemon needs a directory of its own in it
        mount = next(m["mountPath"] for c in containers(spec) for m in c["volumeMounts"] if m["name"] == socket_volume)
        assert os.path.dirname(socket_path) != mount.rstrip("/"), f"{where}: the socket directory is the emptyDir"

    for daemon, args in daemons:
        _check_daemon_container(where, doc, volumes, daemon, args)
    if doc["kind"] == "DaemonSet":
        assert daemons, f"{where}: a DaemonSet of the daemon"
    if not daemons:  # a client of a node daemon: waits for it, with the health command
        assert any(shmtransport_argvs(argv_of(c)) for c in spec.get("initContainers", [])), where


def _check_security_context(spec: dict, c: dict, name: str) -> None:
    ctx = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
    _keys(c.get("securityContext", {}), "securityContext", name)
    assert ctx.get("allowPrivilegeEscalation") is False, f"{name}: allowPrivilegeEscalation: false"
    assert "ALL" in ctx.get("capabilities", {}).get("drop", []), f"{name}: drop ALL capabilities"
    assert not ctx.get("privileged"), name
    if ctx.get("runAsUser") == 0:  # only to prepare a host directory, with CHOWN alone
        assert set(ctx["capabilities"].get("add", [])) <= {"CHOWN"} and ctx.get("runAsNonRoot") is False, name
        assert not shmtransport_argvs(argv_of(c)), f"{name}: shmtransport as root"
    else:
        assert ctx.get("runAsNonRoot") is True and ctx.get("runAsUser", 0) > 0, f"{name}: non-root"
        assert not c.get("securityContext", {}).get("capabilities", {}).get("add"), name


def _check_daemon_container(where: str, doc: dict, volumes: dict, c: dict, args: list[str]) -> None:
    name = f"{where} {c['name']}"
    spec = pod_spec(doc)
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c), f"{name}: probes"
    if c in spec.get("initContainers", []):
        assert c.get("restartPolicy") == "Always", f"{name}: a native sidecar (restartPolicy: Always)"
    # Metrics: bound where Prometheus can reach them, on the port the container declares.
    address = option(args, "--metrics-address")
    assert address and address.rpartition(":")[0] == "0.0.0.0", f"{name}: --metrics-address 0.0.0.0:PORT"
    ports = {p["containerPort"] for p in c["ports"]}
    assert int(address.rpartition(":")[2]) in ports, f"{name}: the metrics port is declared"
    metadata = doc["metadata"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]
    scrape_port = metadata.get("annotations", {}).get("prometheus.io/port")
    assert scrape_port in (None, address.rpartition(":")[2]), f"{name}: prometheus.io/port"
    # /dev/shm (dedicated segments): a volume mounted at /dev/shm, shared with every client.
    shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(shm) == 1, f"{name}: /dev/shm is a volume"
    volume = volumes[shm[0]["name"]]
    reserved = arena_and_table_nbytes(args)
    if "emptyDir" in volume:
        assert volume["emptyDir"]["medium"] == "Memory", f"{name}: /dev/shm is a tmpfs"
        for other in containers(spec):  # dedicated segments are opened by name: one /dev/shm for all
            assert shm[0]["name"] in {m["name"] for m in other["volumeMounts"] if m["mountPath"] == "/dev/shm"}, \
                f"{where} {other['name']}: the shared /dev/shm"
    else:
        assert volume["hostPath"]["path"] == "/dev/shm", f"{name}: the host's /dev/shm"
    # The arena and table are the daemon's memory: its container's memory limit must hold them.
    limit = nbytes(c["resources"]["limits"]["memory"])
    assert limit >= reserved + (64 << 20), f"{name}: memory limit {limit} below the arena + table + process"
    assert c["securityContext"].get("readOnlyRootFilesystem") is True, name


# -- the container recipe and compose ------------------------------------------------------------------

def containerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of the Containerfile, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in CONTAINERFILE.read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        lines.append(current)
        current = ""
    assert not current, "a continuation line ends the file"
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"exec form: {rest}"
    return value


def containerfile_commands() -> dict[str, list[str]]:
    """ENTRYPOINT + CMD, and the HEALTHCHECK command, as argv lists."""
    found = {}
    for instruction, rest in containerfile_instructions():
        if instruction in ("ENTRYPOINT", "CMD"):
            found[instruction] = exec_form(rest)
        elif instruction == "HEALTHCHECK":
            m = re.fullmatch(r"((?:--[\w-]+=\S+\s+)*)CMD\s+(\[.*\])", rest)
            assert m, f"HEALTHCHECK {rest}"
            found["HEALTHCHECK"] = exec_form(m.group(2))
    return {"run": found["ENTRYPOINT"] + found.get("CMD", []), "health": found["HEALTHCHECK"]}


def test_containerfile_copies_files_that_exist_and_runs_the_cli():
    instructions = containerfile_instructions()
    for instruction, rest in instructions:
        if instruction == "COPY" and not rest.startswith("--from"):
            *sources, _dest = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
        if instruction == "RUN":
            for args in shmtransport_argvs(["sh", "-c", rest]):
                parse_cli(args, f"RUN {rest[:40]}...")
    users = [rest for instruction, rest in instructions if instruction == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the image runs as a non-root uid"
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(rest for i, rest in instructions if i == "ENV")))
    commands = containerfile_commands()
    assert [a[0] for a in shmtransport_argvs(commands["run"])] == ["daemon"]
    assert [a[0] for a in shmtransport_argvs(commands["health"])] == ["health"]
    daemon = parse_cli(shmtransport_argvs(commands["run"])[0], "ENTRYPOINT + CMD")
    assert parse_cli(shmtransport_argvs(commands["health"])[0], "HEALTHCHECK")
    assert _socket_path_problem(env["SHMTRANSPORT_SOCKET"]) is None
    assert daemon.socket is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_containerfile_daemon_serves_passes_its_healthcheck_and_drains_on_sigterm():
    """The image's command line for real: its daemon on a private socket and a 16 MiB arena, the
    HEALTHCHECK's command against it (through SHMTRANSPORT_SOCKET, as the image's ENV does), the
    metrics endpoint, then SIGTERM."""
    commands = containerfile_commands()
    tmp = testing.short_tmpdir()
    socket_path = os.path.join(tmp, "sock", "daemon.sock")  # the daemon creates sock/, 0700
    prefix = testing.unique_prefix()
    port = _free_port()
    args = with_options(shmtransport_argvs(commands["run"])[0], socket=socket_path, arena_size="16M",
                        name_prefix=prefix, metrics_address=f"127.0.0.1:{port}")
    env = dict(os.environ, SHMTRANSPORT_SOCKET=socket_path)
    proc = subprocess.Popen([sys.executable, "-m", "shmtransport", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline().decode() if ready else ""
        assert line.startswith("shmtransportd ready"), f"not ready: {line!r}"
        assert stat_mode(os.path.dirname(socket_path)) == 0o700

        health = subprocess.run([sys.executable, "-m", "shmtransport", *shmtransport_argvs(commands["health"])[0]],
                                capture_output=True, text=True, env=env, timeout=START_TIMEOUT_S, check=False)
        assert (health.returncode, health.stdout[:3]) == (0, "ok:"), health.stdout + health.stderr

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
        assert re.search(r'^shmtransport_arena_nbytes\{tenant="uid:\d+"\} 1\.6777216e\+07$', metrics, re.M), metrics

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_TIMEOUT_S) == 0, proc.stderr.read().decode()
        assert sorted(os.listdir(os.path.dirname(socket_path))) == [], "sockets and lock file removed"
        assert testing.segments_of(prefix) == [], "segments unlinked"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
        proc.stdout.close()
        proc.stderr.close()
        testing.remove_tree(tmp)


def stat_mode(path: str) -> int:
    return os.stat(path).st_mode & 0o7777


def test_compose_services_share_the_socket_and_dev_shm():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    daemons, sockets = [], {}
    for name, service in services.items():
        assert service.get("image"), name
        assert service.get("user", "0").split(":")[0] not in ("0", "root"), f"{name}: non-root"
        assert service.get("cap_drop") == ["ALL"], name
        if "build" in service:
            assert (COMPOSE.parent / service["build"]["context"] / service["build"]["dockerfile"]).resolve() \
                == CONTAINERFILE
        argv = list(service.get("entrypoint", [])) + list(service.get("command", []))
        for args in shmtransport_argvs(argv):
            parsed = parse_cli(args, f"compose {name}")
            if parsed.command == "daemon":
                daemons.append(name)
                sockets[f"{name} --socket"] = parsed.socket
            if parsed.command == "worker":
                sockets[f"{name} --daemon-socket"] = parsed.daemon_socket
        if "SHMTRANSPORT_SOCKET" in service.get("environment", {}):
            sockets[f"{name} env"] = service["environment"]["SHMTRANSPORT_SOCKET"]
        test = service.get("healthcheck", {}).get("test")
        if test:
            assert test[0] == "CMD"
            (health,) = shmtransport_argvs(test[1:])
            sockets[f"{name} healthcheck"] = parse_cli(health, f"compose {name} healthcheck").socket
    assert len(daemons) == 1 and len(set(sockets.values())) == 1, sockets
    (daemon,) = daemons
    (socket_path,) = set(sockets.values())
    assert services[daemon]["ipc"] == "shareable" and nbytes(services[daemon]["mem_limit"]) >= (64 << 20) + \
        arena_and_table_nbytes(shmtransport_argvs(services[daemon]["entrypoint"] + services[daemon]["command"])[0])
    volume = None
    for name, service in services.items():
        if name != daemon:
            assert service["ipc"] == f"service:{daemon}", f"{name}: the daemon's /dev/shm"
            assert service["depends_on"][daemon]["condition"] == "service_healthy", name
        mounts = dict(v.split(":", 1)[::-1] for v in service["volumes"])
        (found,) = [vol for path, vol in mounts.items() if socket_path.startswith(path + "/")]
        assert volume in (None, found), f"{name}: another socket volume"
        volume = found
    options = compose["volumes"][volume]["driver_opts"]
    assert options["type"] == "tmpfs" and "mode=0700" in options["o"].split(",")


# -- the page ------------------------------------------------------------------------------------------

# Options of other programs that docs/deploy.md names.
_NOT_OURS = {"--shm-size", "--ipc", "--format", "--build-arg", "--system"}  # docker, podman, useradd


def test_docs_name_every_deploy_file_and_only_real_commands_and_flags():
    text = DOC.read_text()
    fences = re.split(r"^```.*$", text, flags=re.M)
    prose = "\n".join(fences[::2])  # outside code blocks
    odd = [line for line in prose.splitlines() if line.count("`") % 2]
    assert odd == [], "an inline code span across a line break (keep each on one line)"
    named = set(re.findall(r"`(deploy/[\w./-]+)`", text))
    files = {str(p.relative_to(ROOT)) for p in DEPLOY.rglob("*") if p.is_file()}
    assert named - files == set(), "docs/deploy.md names files that do not exist"
    assert files - named == set(), "files in deploy/ that docs/deploy.md does not name"
    assert "docs/deploy.md" in (ROOT / "README.md").read_text()
    flags = {option.dest.replace("_", "-") for option in _all_options()}
    spans = re.findall(r"`([^`\n]+)`", prose)
    for span in spans:
        if span.startswith("shmtransport "):
            parse_cli(shlex.split(span)[1:], f"docs/deploy.md `{span}`")
        for flag in re.findall(r"(?<![\w-])--([a-z][\w-]*)", span):
            if not span.startswith("shmtransport ") and f"--{flag}" in _NOT_OURS:
                continue
            assert flag in flags or f"--{flag}" in _NOT_OURS, f"docs/deploy.md: `--{flag}` is no shmtransport option"


def _all_options():
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for p in [parser, *sub.choices.values()]:
        for action in p._actions:
            for string in action.option_strings:
                if string.startswith("--"):
                    yield argparse.Namespace(dest=string[2:].replace("-", "_"))
