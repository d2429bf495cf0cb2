"""Every fenced code block of README.md, docs/*.md and benchmarks/README.md, run verbatim.

A block runs by its language: ``python`` as a script in a fresh interpreter; ``bash``, ``sh``,
``shell`` with ``bash -euo pipefail``; ``console`` the same, its ``$ `` lines only. ``json`` is
parsed. ``text``, ``proto`` and unlabelled fences are not code; any other language is an error, so a
``py`` or ``zsh`` block cannot slip through unrun.

An HTML comment on the line right before the opening fence says how a block runs:

    <!-- not run: REASON -->                   not executed (REASON required); only parsed
    <!-- example: NAME, process K of N -->     part K of the example NAME (one file): parts
                                               1..N run in that order, each in its own process,
                                               each started after the one before has exited
    <!-- example: NAME, pytest -->             a python block that is a pytest test module
    <!-- example: NAME, needs MODULE -->       skipped unless MODULE is importable here
    <!-- example: NAME, engine -->             runs against the suite's one vLLM engine session
                                               (``vllm_session``, tests/vllm_engine.py; under
                                               the C backend only, as tests/test_engine_vllm.py)

Clauses after NAME combine (``process 2 of 2, needs nixl_cu12``). Any process of a block runs with:
a real daemon of this test (``shm_daemon``) in ``$SHMTRANSPORT_SOCKET``, this venv's ``python`` and
``shmtransport`` first on PATH, a fresh working directory shared by the processes of one example
(the files a doc names are the only way its processes pass data), ResourceWarnings shown, and a
timeout. It passes when every process exits 0 without a ResourceWarning (an unreleased view or
lease) and the daemon then holds no object and no lease.

An ``engine`` example gets the engine session's daemon in ``$SHMTRANSPORT_SOCKET`` instead, the
address of its ``shmtransport vllm-worker`` in ``$SHMTRANSPORT_GENERATOR_ADDRESS`` and the tiny
Qwen2-VL's directory in ``$SHMTRANSPORT_MODEL_DIR``: no doc example starts an engine of its own.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from shmtransport import testing
from shmtransport.daemon import Daemon

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted({ROOT / "README.md", ROOT / "benchmarks" / "README.md", *ROOT.glob("docs/*.md")})
PROCESS_TIMEOUT_S = 120  # a cold interpreter that imports torch on 2 shared cores takes ~10 s
SETTLE_S = 5.0
ENGINE_SESSION_TIMEOUT_S = 900  # an engine example's: it may start the shared vLLM session

PYTHON = {"python"}
SHELL = {"bash", "sh", "shell", "console"}
NOT_CODE = {"", "text", "proto", "json"}

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^`\s]*)")
_COMMENT = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")
_PROCESS = re.compile(r"process (\d+) of (\d+)")


@dataclasses.dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # the HTML comment right before the fence, without <!-- -->

    @property
    def where(self) -> str:
        return f"{self.path}:L{self.line}"


@dataclasses.dataclass
class Example:
    """What runs in one test: one block, or the K-of-N parts of a named example in order."""
    name: str
    blocks: list[Block]
    pytest: bool = False
    needs: list[str] = dataclasses.field(default_factory=list)
    engine: bool = False  # runs against the shared vLLM engine session

    @property
    def id(self) -> str:
        return self.blocks[0].where + "".join(f"+L{b.line}" for b in self.blocks[1:])


def _blocks(path: pathlib.Path, problems: list[str]) -> list[Block]:
    rel = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    blocks, i, in_fence_at = [], 0, set()
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        end = next((j for j in range(i + 1, len(lines))
                    if re.fullmatch(rf" {{0,3}}{fence[0]}{{{len(fence)},}}\s*", lines[j])), None)
        if end is None:
            problems.append(f"{rel}:L{i + 1}: fence never closed")
            break
        prev = _COMMENT.match(lines[i - 1]) if i else None
        code = "\n".join(re.sub(rf"^ {{0,{indent}}}", "", line) for line in lines[i + 1:end])  # the fence's indent
        blocks.append(Block(rel, i + 1, lang, code + "\n", prev.group(1) if prev else None))
        in_fence_at.update(range(i, end + 1))
        i = end + 1
    for n, line in enumerate(lines):
        if n in in_fence_at:
            continue
        c = _COMMENT.match(line)
        attached = n + 1 < len(lines) and _FENCE.match(lines[n + 1])
        if c and re.match(r"(not run|example)\b", c.group(1)) and not attached:
            problems.append(f"{rel}:L{n + 1}: {line.strip()} is not on the line right before a fence")
        # CommonMark's indented code block (after a blank line, outside a list): unfenced, so unrun
        if (line.startswith("    ") and line.strip() and n and not lines[n - 1].strip()
                and not _in_list(lines, n)):
            problems.append(f"{rel}:L{n + 1}: indented code block; fence it so that it is run or marked")
    return blocks


def _in_list(lines: list[str], n: int) -> bool:
    """Whether line ``n`` continues a list item (the last unindented line above it is one)."""
    for line in reversed(lines[:n]):
        if line.strip() and not line.startswith(" "):
            return bool(re.match(r"([-*+]|\d+[.)]) ", line))
    return False


def _example(block: Block, marker: str, problems: list[str]) -> tuple[Example, tuple[int, int] | None] | None:
    """The example an ``example:`` marker puts ``block`` in, and its (K, N) when it is part K of N."""
    name, *clauses = [c.strip() for c in marker.removeprefix("example:").split(",")]
    if not marker.startswith("example:") or not re.fullmatch(r"[\w.-]+", name):
        problems.append(f"{block.where}: write <!-- example: NAME, ... --> (got <!-- {marker} -->)")
        return None
    example, process = Example(name, [block]), None
    for clause in clauses:
        if m := _PROCESS.fullmatch(clause):
            process = (int(m.group(1)), int(m.group(2)))
        elif clause == "pytest" and block.lang in PYTHON:
            example.pytest = True
        elif clause == "engine":
            example.engine = True
        elif clause.startswith("needs ") and clause[6:].strip():
            example.needs.append(clause[6:].strip())
        else:
            problems.append(f"{block.where}: unknown clause {clause!r} in <!-- {marker} -->")
            return None
    if example.pytest and process is not None:
        problems.append(f"{block.where}: a pytest module cannot be one process of several")
        return None
    return example, process


def _discover() -> tuple[list[Example], list[tuple[Block, str]], list[Block], list[str]]:
    """(examples to run, (block, reason) not run, json blocks, problems with the docs)."""
    problems: list[str] = []
    examples: list[Example] = []
    parts: dict[tuple[str, str], list[tuple[tuple[int, int], Example]]] = {}
    not_run: list[tuple[Block, str]] = []
    json_blocks: list[Block] = []
    for path in DOCS:
        for block in _blocks(path, problems):
            runnable = block.lang in PYTHON | SHELL
            marker = block.marker if block.marker and re.match(r"(not run|example)\b", block.marker) else ""
            if not runnable and block.lang not in NOT_CODE:
                problems.append(f"{block.where}: unknown language {block.lang!r}: make it one of "
                                f"{sorted(PYTHON | SHELL | NOT_CODE - {''})}")
            elif marker and not runnable:
                problems.append(f"{block.where}: <!-- {marker} --> on a block that is not code")
            elif block.lang == "json":
                json_blocks.append(block)
            elif not runnable:
                pass
            elif marker.startswith("not run"):
                reason = marker.partition(":")[2].strip()
                if not marker.startswith("not run:") or not reason:
                    problems.append(f"{block.where}: write <!-- not run: REASON -->, with a reason")
                not_run.append((block, reason))
            elif not marker:
                examples.append(Example(block.where, [block]))
            elif found := _example(block, marker, problems):
                example, process = found
                if process is None:
                    examples.append(example)
                else:
                    parts.setdefault((block.path, example.name), []).append((process, example))
    for (path, name), found in parts.items():
        found.sort(key=lambda part: part[0])
        ks, ns = [k for (k, _), _ in found], sorted({n for (_, n), _ in found})
        if len(ns) != 1 or ks != list(range(1, ns[0] + 1)):
            problems.append(f"{path}: example {name!r} has parts {ks} of {ns}; it needs each of 1..N once")
            continue
        examples.append(Example(name, [e.blocks[0] for _, e in found], needs=[m for _, e in found for m in e.needs],
                                engine=any(e.engine for _, e in found)))
    examples.sort(key=lambda e: (e.blocks[0].path, e.blocks[0].line))
    return examples, not_run, json_blocks, problems


EXAMPLES, NOT_RUN, JSON_BLOCKS, PROBLEMS = _discover()


def test_every_block_is_run_or_marked():
    """A block the docs add is run, or says why not; a malformed or stray marker is a failure."""
    assert not PROBLEMS, "\n".join(PROBLEMS)
    ran = {b for e in EXAMPLES for b in e.blocks}
    marked = {b for b, _ in NOT_RUN}
    runnable = [b for path in DOCS for b in _blocks(path, []) if b.lang in PYTHON | SHELL]
    assert [b.where for b in runnable if b not in ran | marked] == []
    assert any(b.lang in SHELL for b in ran) and any(b.lang in PYTHON for b in ran)


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=lambda b: b.where)
def test_json_block_parses(block):
    json.loads(block.code)


@pytest.mark.parametrize("block,reason", NOT_RUN, ids=[b.where for b, _ in NOT_RUN])
def test_block_marked_not_run_still_parses(block, reason):
    """Not run, but still valid code: a typo in a command we cannot run is caught anyway."""
    if block.lang in PYTHON:
        compile(block.code, block.where, "exec")
    else:
        done = subprocess.run(["bash", "-n"], input=_shell_script(block), text=True, capture_output=True,
                              timeout=PROCESS_TIMEOUT_S, check=False)
        assert done.returncode == 0, f"{block.where}: {done.stderr}"
    pytest.skip(f"{block.where} not run: {reason}")


def _timeout(e: Example) -> pytest.MarkDecorator:
    """The suite's per-test timeout, stretched to the example's processes."""
    return pytest.mark.timeout(PROCESS_TIMEOUT_S * len(e.blocks) + 60)


@pytest.mark.parametrize("example", [pytest.param(e, id=e.id, marks=_timeout(e)) for e in EXAMPLES if not e.engine])
def test_doc_example_runs(example, shm_daemon, tmp_path):
    _run_example(example, shm_daemon, tmp_path, {})


# vllm_session is a parameter, not looked up in the body: a session fixture is then set up before
# this test's leak check starts counting (its engines are the run's, not this test's)
@pytest.mark.parametrize("example", [
    # the first may pay for starting the session's engines (as the first test of test_engine_vllm.py)
    pytest.param(e, id=e.id, marks=[pytest.mark.timeout(ENGINE_SESSION_TIMEOUT_S), pytest.mark.skipif(
        os.environ.get("SHMTRANSPORT_BACKEND", "auto").strip().lower() == "python",
        reason="runs against vLLM's engine, once, under the C backend (as tests/test_engine_vllm.py)")])
    for e in EXAMPLES if e.engine])
def test_doc_example_runs_on_the_engine(example, vllm_session, tmp_path):
    _run_example(example, vllm_session["daemon"], tmp_path, {
        "SHMTRANSPORT_GENERATOR_ADDRESS": vllm_session["servers"]["ours"].address,
        "SHMTRANSPORT_MODEL_DIR": vllm_session["model"]})


def _run_example(example: Example, daemon: Daemon, tmp_path: pathlib.Path, extra_env: dict[str, str]) -> None:
    for module in example.needs:
        if importlib.util.find_spec(module) is None:  # finds it without importing it
            pytest.skip(f"{example.id} needs {module}, which is not installed")
    env = dict(os.environ, SHMTRANSPORT_SOCKET=daemon.socket_path, PYTHONUNBUFFERED="1",
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]), **extra_env)
    for k, block in enumerate(example.blocks, 1):
        where = block.where + (f" (process {k} of {len(example.blocks)})" if len(example.blocks) > 1 else "")
        output = _run(block, example.pytest, tmp_path, env, where)
        assert "ResourceWarning" not in output, f"{where} left a view or lease unreleased:\n{output}"
    s = testing.settle_daemon(daemon, max_leases=0, max_objects=0, timeout_s=SETTLE_S)
    assert (s.live_objects, s.live_leases) == (0, 0), (
        f"{example.id} left objects or leases behind:\n{testing.describe_daemon_state(daemon, s)}")


def _shell_script(block: Block) -> str:
    if block.lang != "console":
        return block.code
    return "".join(line[2:] + "\n" for line in block.code.splitlines() if line.startswith("$ "))


def _run(block: Block, as_pytest: bool, cwd: pathlib.Path, env: dict, where: str) -> str:
    """Run one block in its own process (and process group, killed whole on timeout); its output."""
    stem = re.sub(r"\W", "_", f"{block.path}_L{block.line}")
    if block.lang in PYTHON:
        script = cwd / f"test_{stem}.py"  # the block's line numbers in tracebacks: add block.line
        script.write_text(block.code)
        if as_pytest:  # only this plugin, no ini file: how a downstream suite would load it
            env = {k: v for k, v in env.items() if k != "PYTEST_ADDOPTS"} | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
            argv = [sys.executable, "-W", "always::ResourceWarning", "-m", "pytest", "-q", "-c", os.devnull,
                    "--rootdir", ".", "-p", "no:cacheprovider", "-p", "shmtransport.pytest_plugin", script.name]
        else:
            argv = [sys.executable, "-W", "always::ResourceWarning", script.name]
    else:
        script = cwd / f"{stem}.sh"
        script.write_text(_shell_script(block))
        argv = ["bash", "-euo", "pipefail", script.name]
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its children too (a daemon or pytest it started)
        output, _ = proc.communicate()
        pytest.fail(f"{where} ran past {PROCESS_TIMEOUT_S} s:\n{output}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"{where} exited {proc.returncode} (line N of its script is line {block.line} + N of "
                    f"{block.path}):\n{output}", pytrace=False)
    return output
