"""The docs, read as an operator reads them: every ``KVGATE_*`` name they set is a setting
(or a variable the code reads), every ``kvgate <cmd> --flag`` is accepted by that command's
parser, every command in a shell block parses as typed, and every ``kvgate_*`` metric they
name is on a real ``/metrics`` page with the labels they give it. README's "Running the
pieces" and the runbook's ACL commands are run as typed; the gateway's page is held to the
gateway (its settings, flags, admin routes, metrics, error codes, span attributes, rewritten
body fields) and index.md to the index (its API, defaults and Redis keys).

Each check parses the docs and asks the live parser, settings classes, app or scrape: a doc
that names something that does not exist, or leaves out what a user meets, fails here."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import random
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from cachecore.agent.metrics import AgentMetrics
from cachecore.agent.settings import AgentSettings
from cachecore.replica.settings import ReplicaSettings
from cachecore.testing import PATIENT_TIMEOUT_S
from gateway.cli import SUBCOMMANDS
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from loadtest.bench import BENCHMARKS
from tests.test_gateway_support import stack, words

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEPLOY = [ROOT / "docker-compose.yml", ROOT / "Dockerfile", ROOT / "Makefile"]
SOURCES = [
    p for d in ("gateway", "cachecore", "loadtest", "policies") for p in (ROOT / d).rglob("*.py")
]
SETTINGS = (GatewaySettings, AgentSettings, ReplicaSettings)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------ environment variables


def _setting_names() -> tuple[set[str], set[str]]:
    """Every ``KVGATE_*`` variable a settings class reads, and the classes' prefixes."""
    names: set[str] = set()
    prefixes: set[str] = set()
    for cls in SETTINGS:
        prefix = str(cls.model_config.get("env_prefix", ""))
        prefixes.add(prefix)
        names.update((prefix + field).upper() for field in cls.model_fields)
    return names, prefixes


def _read_by_code() -> set[str]:
    """Variables the code reads itself (``os.environ`` / ``getenv``), outside the settings."""
    pattern = re.compile(r"""(?:environ(?:\.get)?|getenv)\s*[\(\[]\s*["'](KVGATE_[A-Z0-9_]+)["']""")
    return {m for path in SOURCES for m in pattern.findall(path.read_text())}


def test_every_kvgate_variable_in_the_docs_is_read_by_kvgate() -> None:
    names, prefixes = _setting_names()
    names |= _read_by_code()
    unknown = []
    for path in DOCS + DEPLOY:
        for name in sorted(set(re.findall(r"KVGATE_[A-Z0-9_]*", path.read_text()))):
            ok = name in prefixes if name.endswith("_") else name in names
            if not ok:
                unknown.append(f"{_rel(path)}: {name}")
    assert not unknown, "documented variables that nothing reads:\n" + "\n".join(unknown)


# ------------------------------------------------------------------------- command lines


def _parser(command: str, bench: str | None = None) -> argparse.ArgumentParser:
    """The parser ``kvgate <command>`` (or ``kvgate bench <bench>``) builds."""
    if bench is None:
        module = importlib.import_module(SUBCOMMANDS[command][0])
        parser = argparse.ArgumentParser(prog=f"kvgate {command}")
        module.configure(parser)
        return parser
    module = importlib.import_module(BENCHMARKS[bench][0])
    parser = argparse.ArgumentParser(prog=f"kvgate bench {bench}")
    configure = getattr(module, f"configure_{bench}", None) or module.configure
    configure(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Option strings of a parser and of its subcommands' parsers (``trace analyze``)."""
    out: set[str] = set()
    for action in parser._actions:  # argparse has no public accessor for its actions
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _options(sub)
    return out


def _joined(text: str) -> str:
    """Shell line continuations joined, as a shell reads them."""
    return re.sub(r"\\\n\s*", " ", text)


def _doc_commands() -> Iterator[tuple[str, str, str | None, str]]:
    """(doc, subcommand, benchmark, the rest of the command) for every ``kvgate <cmd>`` in
    the docs, in prose (up to its closing backtick) or in a code block (up to its line end)."""
    for path in DOCS:
        text = _joined(path.read_text())
        for m in re.finditer(r"(?<![\w/-])kvgate (\w+)([^`\n|;&()]*)", text):
            command, rest = m.group(1), m.group(2)
            if command not in SUBCOMMANDS:
                continue
            bench = None
            if command == "bench":
                first = rest.split()[:1]
                if not first or first[0].startswith("-"):
                    continue  # "`kvgate bench`" on its own names the command, not a run
                bench = first[0]
            yield _rel(path), command, bench, rest


def test_every_documented_flag_is_accepted_by_its_command() -> None:
    bad = []
    seen = 0
    for doc, command, bench, rest in _doc_commands():
        if bench is not None and bench not in BENCHMARKS:
            bad.append(f"{doc}: kvgate bench {bench}: no such benchmark")
            continue
        options = _options(_parser(command, bench))
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest):
            seen += 1
            if flag not in options and flag != "--help":
                bad.append(f"{doc}: kvgate {command} {bench or ''} has no {flag}")
    assert seen > 50  # the scan finds the docs' commands at all
    assert not bad, "\n".join(bad)


def _shell_blocks(text: str) -> Iterator[str]:
    """The fenced blocks marked ``sh`` (what the docs give to paste into a shell)."""
    block: list[str] | None = None
    for line in text.splitlines():
        fence = line.strip()  # a block in a list item is indented
        if fence.startswith("```"):
            if block is None and fence[3:] in ("sh", "bash", "shell"):
                block = []
            elif block is not None:
                yield "\n".join(block) + "\n"
                block = None
        elif block is not None:
            block.append(line)


# the operator's path through the docs (docs/benchmarks.md's blocks are recipes with
# placeholders to fill in: N, R, $SYSTEMS)
WALKED = [ROOT / n for n in ("README.md", "docs/runbook.md", "docs/gateway.md", "docs/index.md",
                             "docs/lifecycle.md", "docs/peers.md")]  # fmt: skip


def test_every_kvgate_command_in_a_shell_block_parses_as_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an operator pastes: the whole command line, values included (a port, a list, a
    choice), through the command's own parser."""
    monkeypatch.chdir(tmp_path)  # output-path checks look at paths, never under the checkout
    parsed = 0
    failures = []
    for path in WALKED:
        for block in _shell_blocks(path.read_text()):
            for line in _joined(block).splitlines():
                if "kvgate " not in line or "[" in line:  # "[--flag]" lines are synopses
                    continue
                words_ = shlex.split(line, comments=True)
                at = next((i for i, w in enumerate(words_) if w.split("/")[-1] == "kvgate"), None)
                if at is None or at + 1 >= len(words_):
                    continue
                argv = words_[at + 1 :]
                for stop in ("&", "&&", "|", ";"):
                    if stop in argv:
                        argv = argv[: argv.index(stop)]
                command, bench = argv[0], None
                args = argv[1:]
                if command == "bench":
                    bench, args = args[0], args[1:]
                try:
                    _parser(command, bench).parse_args(args)
                except SystemExit:
                    failures.append(f"{_rel(path)}: {line.strip()}")
                parsed += 1
    assert parsed >= 6  # README's replica, agents and gateways; peers' replica and tokenizer
    assert not failures, "\n".join(failures)


def test_readme_names_every_subcommand_and_benchmark() -> None:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"`kvgate`, with subcommands: (.*?)\.\n", text, re.S)
    assert m, "README no longer lists the subcommands"
    assert re.findall(r"`(\w+)`", m.group(1)) == list(SUBCOMMANDS)
    documented = set(re.findall(r"`kvgate bench (\w+)", text))
    assert documented == set(BENCHMARKS)


# ------------------------------------------------------------------------------- metrics

METRIC = re.compile(r"(?<![\w./])(kvgate_[a-z0-9_]*[a-z0-9])(?![\w*])(\{[^}]*\})?")


def _family(name: str, families: dict[str, set[str]]) -> str | None:
    for suffix in ("", "_total", "_bucket", "_count", "_sum"):
        if name.endswith(suffix) and name.removesuffix(suffix) in families:
            return name.removesuffix(suffix) if suffix else name
    return None


def _registered_labels(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Label names of each metric a registry holds, whether it has a child yet or not."""
    out: dict[str, set[str]] = {}
    for collector, names in registry._collector_to_names.items():  # no public accessor
        labels = set(getattr(collector, "_labelnames", ()))
        for name in names:
            out.setdefault(name, set()).update(labels)
    return out


def _scrape(text: str, families: dict[str, set[str]], samples: dict[str, int]) -> None:
    for fam in text_string_to_metric_families(text):
        labels = families.setdefault(fam.name, set())
        samples[fam.name] = samples.get(fam.name, 0) + len(fam.samples)
        for s in fam.samples:
            labels.update(k for k in s.labels if k not in ("le", "quantile"))


async def _live_metrics(requests: int) -> tuple[dict[str, set[str]], dict[str, int]]:
    """Family -> label names and family -> sample count, from a real gateway with embedded
    agents after ``requests`` chats (plus one replica's own page)."""
    families: dict[str, set[str]] = {}
    samples: dict[str, int] = {}
    async with stack(count=2, agents=True) as st:
        async with st.client() as client:
            for i in range(requests):
                await client.chat.completions.create(
                    model=st.model,
                    max_tokens=2,
                    messages=[{"role": "user", "content": words(64, i % 2)}],
                )
        async with st.http() as http:
            page = await http.get("/metrics")
            assert page.status_code == 200, page.text
            _scrape(page.text, families, samples)
        async with httpx.AsyncClient(timeout=10) as http:
            page = await http.get(st.fleet.endpoints[0].url + "/metrics")
            _scrape(page.text, families, samples)
    return families, samples


async def test_every_metric_the_docs_name_is_exported_with_its_labels() -> None:
    families, _ = await _live_metrics(requests=3)
    # a family without a child yet has no sample to show its labels: take them from the
    # registries the gateway and its agents build
    agent_labels = {
        k: v | {"replica"} for k, v in _registered_labels(AgentMetrics().registry).items()
    }
    for reg in (_registered_labels(GatewayMetrics().registry), agent_labels):
        for name, labels in reg.items():
            fam = _family(name, families)
            if fam is not None:
                families[fam] |= labels
    bad = []
    named = 0
    for path in DOCS:
        for m in METRIC.finditer(path.read_text()):
            named += 1
            name, given = m.group(1), m.group(2) or "{}"
            fam = _family(name, families)
            if fam is None:
                bad.append(f"{_rel(path)}: {name} is not exported")
                continue
            want = {p.split("=")[0].strip() for p in given[1:-1].split(",") if p.strip()}
            if not want <= families[fam]:
                bad.append(f"{_rel(path)}: {name}{given}: labels are {sorted(families[fam])}")
    assert named > 60
    assert not bad, "\n".join(bad)


async def test_the_runbooks_no_series_until_first_event_list_is_true() -> None:
    """The runbook tells operators which labelled metrics have no series before their first
    event (alert with absent()); it named kvgate_index_fallbacks_total, which is exported at
    0 per reason from the start, and a dashboard built on the runbook's word misread it."""
    text = (ROOT / "docs" / "runbook.md").read_text()
    m = re.search(r"([^\n]*) have no series until their first event", text)
    assert m, "the runbook no longer says which metrics start without series"
    named = [n for n, _ in METRIC.findall(m.group(1))]
    assert named
    families, samples = await _live_metrics(requests=1)
    for name in named:
        fam = _family(name, families)
        assert fam is not None, name
        assert samples[fam] == 0, f"{name} has series on a fresh gateway"
    # and what it says is exported from the start is
    m = re.search(r"([^\n]*) are exported at 0 from the start", text)
    assert m, "the runbook no longer says which labelled metrics start at 0"
    for name, _ in METRIC.findall(m.group(1)):
        fam = _family(name, families)
        assert fam is not None and samples[fam] > 0, name


# ------------------------------------------------------------------------- the index API


def _params(func: object) -> list[str]:
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    sig = inspect.signature(func)  # type: ignore[arg-type]
    return [p.name for p in sig.parameters.values() if p.name != "self" and p.kind not in kinds]


def test_index_md_lists_the_index_api_as_it_is() -> None:
    """docs/index.md's "API" block is what an agent or gateway author codes against: every
    method of the PrefixIndex protocol, each with its parameters (a method added to the
    protocol, remove_pending, was missing from it)."""
    from cachecore.index.base import PrefixIndex
    from cachecore.index.redis import RedisIndex

    text = (ROOT / "docs" / "index.md").read_text()
    m = re.search(r"^## API.*?```python\n(.*?)^```", text, re.M | re.S)
    assert m, "docs/index.md has no API block"
    import ast

    documented: dict[tuple[str, str], list[str]] = {}
    defaults: dict[tuple[str, str], dict[str, str]] = {}
    for call in re.finditer(r"\b(index|redis_index|RedisIndex)\.(\w+)\(([^)]*)\)", m.group(1)):
        parts = [p.strip() for p in call.group(3).split(",")]
        names = [p.split(":")[0].split("=")[0].strip() for p in parts]
        key = (call.group(1), call.group(2))
        documented[key] = [n for n in names if n and n != "*"]
        defaults[key] = {
            n: p.split("=", 1)[1].strip() for n, p in zip(names, parts, strict=True) if "=" in p
        }
    protocol = {n for n, _ in inspect.getmembers(PrefixIndex, inspect.isfunction)}
    protocol = {n for n in protocol if not n.startswith("_")}
    assert protocol <= {name for owner, name in documented if owner == "index"}
    for (owner, name), params in documented.items():
        cls = PrefixIndex if owner == "index" and name in protocol else RedisIndex
        assert hasattr(cls, name), f"{owner}.{name}"
        assert params == _params(getattr(cls, name)), f"{owner}.{name}({', '.join(params)})"
        real = inspect.signature(getattr(cls, name)).parameters
        for param, text in defaults[(owner, name)].items():  # a documented default is real
            assert ast.literal_eval(text) == real[param].default, f"{owner}.{name}: {param}"


def test_lifecycle_md_names_every_gateway_write() -> None:
    """The lifecycle names its writers; every index method the gateway writes with (the
    protocol marks them gateway-owned) is among them."""
    from cachecore.index.base import PrefixIndex

    writes = [
        name
        for name, func in inspect.getmembers(PrefixIndex, inspect.isfunction)
        if "gateway-owned" in (func.__doc__ or "").lower()
    ]
    assert "add_pending" in writes
    text = (ROOT / "docs" / "lifecycle.md").read_text()
    missing = [name for name in writes if f"{name}(" not in text]
    assert not missing, f"docs/lifecycle.md does not say how the gateway uses {missing}"


# ------------------------------------------------------- the gateway reference is complete


def _section(text: str, heading: str) -> str:
    m = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no section {heading!r}"
    return m.group(1)


GATEWAY_MD = ROOT / "docs" / "gateway.md"


def test_gateway_md_lists_every_setting() -> None:
    """Every variable GatewaySettings reads is in docs/gateway.md (its settings table or the
    text): an operator reads that page to configure the process."""
    text = GATEWAY_MD.read_text()
    prefix = str(GatewaySettings.model_config.get("env_prefix", ""))
    missing = [
        (prefix + f).upper()
        for f in GatewaySettings.model_fields
        if (prefix + f).upper() not in text
    ]
    assert not missing, f"settings docs/gateway.md does not name: {missing}"


def test_gateway_md_lists_every_admin_route() -> None:
    from starlette.routing import Route

    from gateway.app import create_app
    from gateway.serve import build_gateway

    rows = [
        line
        for line in _section(GATEWAY_MD.read_text(), "Operations and admin API").splitlines()
        if line.startswith("|")
    ]
    app = create_app(build_gateway(GatewaySettings(open_access=True, replicas=["http://h:1"])))
    missing = []
    for route in app.routes:
        if not isinstance(route, Route) or not route.path.startswith("/admin"):
            continue
        pattern = re.compile(re.sub(r"\{\w+\}", r"[^ `/?]+", route.path) + r"(?![\w/])")
        for method in sorted((route.methods or set()) - {"HEAD"}):
            if not any(pattern.search(row) and method in row for row in rows):
                missing.append(f"{method} {route.path}")
    assert not missing, f"admin routes docs/gateway.md's table does not list: {missing}"


def test_gateway_md_lists_every_gateway_metric() -> None:
    text = _section(GATEWAY_MD.read_text(), "Metrics")
    named = {m.group(1) for m in METRIC.finditer(text)}
    missing = []
    for family in GatewayMetrics().registry.collect():
        forms = {family.name, family.name + "_total"}
        if not forms & named:
            missing.append(family.name)
    assert not missing, (
        f"gateway metrics docs/gateway.md's Metrics section does not name: {missing}"
    )


def test_peers_md_installs_the_versions_it_was_verified_with() -> None:
    """docs/peers.md's findings (flags, topics, source lines) are those of the versions it
    names; its install commands pin them, so a later release cannot change what an
    operator following the page gets."""
    text = (ROOT / "docs" / "peers.md").read_text()
    m = re.search(r"Verified on this machine with vllm-router (\S+) and sglang-router (\S+),", text)
    assert m, "docs/peers.md no longer names the versions it was verified with"
    for package, version in (("vllm-router", m.group(1)), ("sglang-router", m.group(2))):
        assert re.search(rf"bin/pip install {package}=={re.escape(version)}\b", text), package


# ---------------------------------------------------------------- the runbook's ACL users


def _runbook_acl_commands() -> list[list[str]]:
    """The runbook's commands that create Redis ACL users, as a shell splits them."""
    text = (ROOT / "docs" / "runbook.md").read_text()
    out = []
    for block in _shell_blocks(text):
        for line in _joined(block).splitlines():
            if "acl_setuser_args" in line:
                out.append(shlex.split(line, comments=True))
    return out


@pytest.mark.redis
async def test_the_runbooks_acl_commands_make_working_agent_and_gateway_users() -> None:
    """Typed as shown (the administrator's URL pointed at a real password-protected Redis):
    one command makes the agent's user, one the gateway's, and each user can do its work and
    no more. The runbook said to make the gateway's user by putting gateway_acl_rules() in
    place of agent_acl_rules(...): done to the call, the command died with a NameError (the
    import names only agent_acl_rules); done to both names, gateway_acl_rules(sys.argv[4])
    took the replica id for a key layout (AttributeError)."""
    import sys

    from cachecore.index.base import IndexError_, ReplicaState
    from cachecore.index.redis import RedisIndex
    from cachecore.lifecycle import IndexWrite
    from cachecore.testing import RedisServer

    commands = _runbook_acl_commands()
    assert len(commands) == 2, commands
    with RedisServer(extra_args=["--requirepass", "admin-secret-1"]) as srv:
        admin_url = f"redis://default:admin-secret-1@127.0.0.1:{srv.port}/0"
        users: dict[str, tuple[str, list[str]]] = {}
        for argv in commands:
            assert argv[0] == ".venv/bin/python" and argv[1] == "-c", argv
            assert argv[3] == "redis://ADMIN:PASSWORD@redis:6379/0", argv
            run = [sys.executable, "-c", argv[2], admin_url, *argv[4:]]
            out = await asyncio.to_thread(
                subprocess.run, run, cwd=ROOT, capture_output=True, text=True, timeout=60
            )
            assert out.returncode == 0 and out.stdout.strip() == "b'OK'", out.stderr[-2000:]
            users[argv[4]] = (argv[5], argv[6:])

        def url(user: str) -> str:
            return f"redis://{user}:{users[user][0]}@127.0.0.1:{srv.port}/0"

        agent_user = next(u for u, (_, rest) in users.items() if rest)  # it names its replica
        replica = users[agent_user][1][0]
        gateway_user = next(u for u in users if u != agent_user)
        agent = RedisIndex.from_url(
            url(agent_user), socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
        )
        gateway = RedisIndex.from_url(
            url(gateway_user),
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
        key = b"k" * 16
        try:
            epoch = await agent.clear_replica(replica, ReplicaState.LIVE, 1)
            await agent.apply(replica, epoch, IndexWrite({key: 1}), 2)
            with pytest.raises(IndexError_):
                await agent.apply("another", 0, IndexWrite({key: 1}), 2)
            await gateway.add_pending(replica, [key + b"x"], 1000, 3)
            found = await gateway.lookup([key], [replica], 4)
            assert found[replica].stored_blocks == 1
            with pytest.raises(IndexError_):
                await gateway.apply(replica, epoch, IndexWrite({key: 0}), 5)
        finally:
            await agent.close()
            await gateway.close()


# ------------------------------------------------------- README's "Running the pieces"


def _port_base(span: int, count: int) -> int:
    """A port P with P+i, P+span+i and P+2*span+i (i < count) all free: the replica's
    HTTP, event and replay ports as `kvgate replica --base-port P` lays them out."""
    import socket

    for _ in range(200):
        base = random.randrange(20_000, 60_000 - 2 * span - count)
        wanted = [base + k * span + i for k in range(3) for i in range(count)]
        socks = []
        try:
            for port in wanted:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


PORT = re.compile(r"(?<![\w.])(\d{4,5})(?![\w.])")  # a port number in a command line


def _readme_pieces() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = _section(text, "Running the pieces")
    (commands,) = list(_shell_blocks(block))
    out = []
    for line in _joined(commands).splitlines():
        words_ = shlex.split(line, comments=True)
        if words_ and words_[0] == ".venv/bin/kvgate":
            out.append(line)
    return out


@pytest.mark.slow
@pytest.mark.redis
def test_readmes_running_the_pieces_works_as_typed(redis_url: str, tmp_path: Path) -> None:
    """Every command of README's "Running the pieces", typed in order, each left running
    (only its ports moved to free ones, and Redis to the test's): the replicas, the embedded
    gateway, the agents and the Redis gateway all serve, and both gateways route a repeated
    prefix to the replica that cached it. Both gateways used to be written without --port:
    typed in order, the second could not listen (8000 was the first's)."""
    from cachecore.testing import free_ports, wait_for_port

    lines = _readme_pieces()
    assert [shlex.split(c, comments=True)[1] for c in lines] == [
        "replica",
        "serve",
        "agent",
        "agent",
        "serve",
    ]
    base = _port_base(1000, 4)
    redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    # distinct ports, drawn at once: a port drawn alone for the second gateway at the start
    # is bound only at the end, and an agent's --http-port drawn alone in between came back
    # equal to it once in CI (the agent answered the gateway's requests: 404 Not Found)
    replica_ports = {base + k * 1000 + i for k in range(3) for i in range(4)}
    spare = iter([p for p in free_ports(24) if p not in replica_ports and p != redis_port])
    moved: dict[int, int] = {}
    for line in lines:
        for number in map(int, PORT.findall(line)):
            if number == 6379:
                moved[number] = redis_port
            elif 9100 <= number < 9104 or 10100 <= number < 10104 or 11100 <= number < 11104:
                moved[number] = base + (number - 9100)
            else:
                moved.setdefault(number, next(spare))
    defaults = {"agent": ("--http-port", 9400), "serve": ("--port", 8000)}
    procs: list[subprocess.Popen[bytes]] = []
    gateways: list[int] = []
    try:
        for i, line in enumerate(lines):
            argv = shlex.split(line, comments=True)
            argv = [PORT.sub(lambda m: str(moved[int(m.group(1))]), a) for a in argv]
            command = argv[1]
            flag, default = defaults.get(command, ("", 0))
            if flag and flag not in argv:  # the command's default port, moved like the rest
                argv += [flag, str(moved.setdefault(default, next(spare)))]
            if command == "serve":
                gateways.append(int(argv[argv.index("--port") + 1]))
            log = (tmp_path / f"{i}-{command}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [str(ROOT / ".venv" / "bin" / "kvgate"), *argv[1:]],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            if command == "replica":
                for port in (base, base + 3):
                    wait_for_port(port, timeout_s=30)
            if command == "serve":
                wait_for_port(gateways[-1], timeout_s=30)
            assert procs[-1].poll() is None, (tmp_path / f"{i}-{command}.log").read_text()
        assert len(set(gateways)) == 2, "both gateways on one port"
        prompt = [{"role": "system", "content": words(600, 11)}, {"role": "user", "content": "hi"}]
        for port in gateways:
            served = []
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                for _ in range(40):  # bounded: the agents' first writes take a moment
                    r = http.post(
                        "/v1/chat/completions",
                        json={"model": "kvgate-sim-8b", "max_tokens": 2, "messages": prompt},
                    )
                    assert r.status_code == 200, r.text
                    predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
                    served.append((r.headers["x-kvgate-replica"], predicted))
                    if (
                        predicted > 0
                        and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                    ):
                        break
                    time.sleep(0.25)
            assert served[-1][1] > 0, served  # routed by what the index knew was cached
        for i, p in enumerate(procs):
            assert p.poll() is None, sorted(tmp_path.iterdir())[i].read_text()[-2000:]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def test_gateway_md_dispatch_names_every_body_field_the_gateway_rewrites() -> None:
    """The request path's Dispatch step tells a client which of its body fields never reach
    the engine as sent: every field the gateway replaces or removes, and the tenant's
    ``priority`` rule (a21c403), which it did not mention."""
    from gateway import core

    text = GATEWAY_MD.read_text()
    m = re.search(r"^11\. \*\*Dispatch\*\*(.*?)^12\. ", text, re.M | re.S)
    assert m, "docs/gateway.md's request path has no Dispatch step"
    named = set(re.findall(r"`([a-z_]+\*?)`", m.group(1)))
    fields = set(core._REWRITTEN_FIELDS) | {"priority"}  # the module's own list of them
    missing = sorted(
        f
        for f in fields
        if f not in named and not any(f.startswith(n[:-1]) for n in named if n.endswith("*"))
    )
    assert not missing, f"gateway.md's Dispatch step does not name {missing}"


# where each error-building function of the gateway takes its ``code``
_CODE_ARG = {
    "GatewayError": 2,
    "error_body": 2,
    "sse_error_event": 2,
    "bad_request": 2,
    "_send_error": 3,
    "_upstream_failed": 4,
}


def _error_codes() -> set[str]:
    """Every error ``code`` the gateway's source can answer with, read from its calls."""
    import ast

    codes: set[str] = set()
    for path in (ROOT / "gateway").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name not in _CODE_ARG:
                    continue
                values = [k.value for k in node.keywords if k.arg == "code"]
                if len(node.args) > _CODE_ARG[name]:
                    values.append(node.args[_CODE_ARG[name]])
                codes |= {
                    v.value
                    for v in values
                    if isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value
                }
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
                for target in node.targets:  # status, code = 503, "upstream_busy"
                    if isinstance(target, ast.Tuple):
                        for t, v in zip(target.elts, node.value.elts, strict=False):
                            named = isinstance(t, ast.Name) and t.id == "code"
                            if named and isinstance(v, ast.Constant) and isinstance(v.value, str):
                                codes.add(v.value)
    return codes


def test_gateway_md_names_every_error_code() -> None:
    """A client's error handling is written from the page: every ``code`` the gateway can
    answer with is in it (ten were not: body_too_large, invalid_json, no_replica,
    upstream_unreachable, ...)."""
    codes = _error_codes()
    assert {"upstream_busy", "no_replica", "invalid_api_key", "timeout"} <= codes  # the scan works
    text = GATEWAY_MD.read_text()
    missing = sorted(c for c in codes if f"`{c}`" not in text)
    assert not missing, f"error codes docs/gateway.md does not name: {missing}"


# ------------------------------------------------------------------- links, paths, tests


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_and_anchor_in_the_docs_resolves() -> None:
    bad = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file) if file else path
            if not dest.exists():
                bad.append(f"{_rel(path)}: {target}")
            elif anchor and dest.suffix == ".md":
                heads = {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                if anchor not in heads:
                    bad.append(f"{_rel(path)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_every_repository_path_and_test_the_walked_docs_name_exists() -> None:
    """`cachecore/lifecycle.py`, `tests/test_x.py::test_y`: what an operator opens."""
    pattern = re.compile(r"`([\w.-]+/[\w./-]*\.(?:py|md|yaml|yml|json|jinja|toml))(?:::(\w+))?")
    bad = []
    for path in WALKED:
        for file, test in pattern.findall(path.read_text()):
            if file.startswith(".peers/"):
                continue  # made by the page's own install step
            dest = ROOT / file
            if not dest.exists():
                bad.append(f"{_rel(path)}: {file}")
            elif test and not re.search(rf"def {test}\b", dest.read_text()):
                bad.append(f"{_rel(path)}: {file}::{test}")
    assert not bad, "\n".join(bad)


def test_gateway_md_replica_ids_are_as_described() -> None:
    """`--replica [ID=]URL`: the id defaults to host-port; an IPv6 host has no such id (its
    colons), and the page says to give one, as the refusal does."""
    from gateway.replicas import ReplicaSpecError, parse_replica_spec

    text = GATEWAY_MD.read_text()
    assert "the replica id defaults to `host-port`" in text
    assert parse_replica_spec("http://10.0.0.1:8000").id == "10.0.0.1-8000"
    assert parse_replica_spec("https://eng.example.com").id == "eng.example.com-443"
    m = re.search(r"an IPv6 replica needs its `ID=`: `--replica (\S+)`", text)
    assert m, "gateway.md does not say how to name an IPv6 replica"
    assert parse_replica_spec(m.group(1)).id == m.group(1).split("=")[0]
    with pytest.raises(ReplicaSpecError, match="give the replica an id"):
        parse_replica_spec(m.group(1).split("=", 1)[1])


async def test_gateway_md_names_the_request_spans_attributes() -> None:
    """The Tracing paragraph lists a routed request's span attributes: exactly those a real
    gateway exports (kvgate.request_id, the one that ties a span to a client's x-request-id,
    was missing)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    m = re.search(r"^Tracing: (.*?)\. A request refused", GATEWAY_MD.read_text(), re.M | re.S)
    assert m, "docs/gateway.md has no Tracing paragraph"
    documented = set(re.findall(r"`((?:kvgate|http)\.[a-z_.]+)`", m.group(1))) - {"kvgate.request"}
    exporter = InMemorySpanExporter()
    async with stack(count=1, build={"span_exporter": exporter}) as st:
        async with st.client() as client:
            await client.completions.create(model=st.model, prompt=words(40, 1), max_tokens=1)
        provider = st.gw._tracer_provider
        assert provider is not None
        provider.force_flush()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "kvgate.request"]
    assert documented == set(span.attributes or {})


def test_gateway_md_names_every_serve_flag() -> None:
    """Each `kvgate serve` option is on the gateway's page (five were not: --host, --port,
    --admin-key, --seed, --otel-endpoint, so the table did not say which flag sets them)."""
    text = GATEWAY_MD.read_text()
    flags = [o for o in _options(_parser("serve")) if o.startswith("--") and o != "--help"]
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text)]
    assert not missing, f"kvgate serve flags docs/gateway.md does not name: {missing}"


def test_index_md_key_layout_table_is_the_layouts() -> None:
    """The Redis key table of docs/index.md (what an operator greps Redis for, and writes
    ACLs against) equals the keys cachecore.index.layout.KeyLayout makes for a replica."""
    from cachecore.index.layout import KeyLayout

    text = _section((ROOT / "docs" / "index.md").read_text(), "Redis backend (`RedisIndex`)")
    table = set(re.findall(r"^\| `(kvg:\{r:<id>\}:[^`]+)` \|", text, re.M))
    lay = KeyLayout()
    rid, epoch = "ID", 987654
    made = {
        lay.meta(rid), lay.blocks(rid, epoch), lay.mirror(rid, epoch), lay.removals(rid, epoch),
        lay.registration(rid), lay.load(rid), lay.pending(rid, epoch), lay.inflight(rid),
    }  # fmt: skip
    made = {k.replace(rid, "<id>").replace(str(epoch), "<epoch>") for k in made}
    assert table == made
