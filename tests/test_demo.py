"""`kvgate demo` end to end (DEMO_SERVE=0), at a reduced size: real replica and gateway
subprocesses, embedded agents, the same code path as `make demo`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachecore.testing import free_port


@pytest.mark.slow
def test_demo_prints_a_comparison_with_expected_latency_ahead() -> None:
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "demo", "--serve", "0", "--requests", "48",
         "--time-scale", "0.5", "--port", str(port)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\| (round_robin|expected_latency) \| ([\d.]+)% \|", line)
        if m:
            rows[m.group(1)] = float(m.group(2))
    assert set(rows) == {"round_robin", "expected_latency"}, proc.stdout
    assert rows["expected_latency"] > rows["round_robin"]
    assert "requests failed" not in proc.stdout


def _descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_sigterm_stops_the_demo_and_every_process_it_started() -> None:
    """SIGTERM (a CI timeout, systemd, docker stop) cleans up like Ctrl-C: no replica or
    gateway outlives the command."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "demo", "--serve", "1", "--requests", "8",
         "--time-scale", "0.5", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    started: set[int] = set()
    try:
        assert proc.stdout is not None
        seen = []
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # bounded: the demo ends its output or the deadline passes
            seen.append(line)
            if "Ctrl-C to stop." in line or time.monotonic() > deadline:
                break
        assert any("Ctrl-C to stop." in s for s in seen), "".join(seen[-40:])
        started = _descendants(proc.pid)
        assert len(started) >= 2  # the replica fleet and the gateway, at least
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()  # until the demo exits and closes it
        assert proc.wait(timeout=60) == 0, rest[-3000:]
        for _ in range(100):  # children exit as their parent's cleanup stops them
            left = {p for p in started if _alive(p)}
            if not left:
                break
            time.sleep(0.1)
        assert not left, f"processes left running: {sorted(left)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in started:  # never leave a failed run's processes behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _curl_args(command: str) -> list[str]:
    """The arguments bash passes to curl for ``command`` as printed (continuations and
    quoting as a shell reads them), with curl stubbed out."""
    out = subprocess.run(
        ["bash", "-c", "curl() { printf '%s\\0' \"$@\"; }\n" + command],
        capture_output=True, text=True, timeout=10, check=True,
    )  # fmt: skip
    return out.stdout.split("\0")[:-1]


def test_the_printed_curl_examples_work_as_shown() -> None:
    """The explain example names the demo's tenant (else it explains as ``anonymous`` and
    shows no match) and its line continuations are real (not one space-padded line)."""
    from loadtest.demo import DEMO_KEY, DEMO_TENANT, EXAMPLE_PROMPT, examples_text
    from loadtest.harness import MODEL

    text = examples_text(8123, "adm")
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip().startswith("curl -s ")]
    commands = []
    for i in starts:
        j = i  # the command goes on past a trailing backslash or an open quote
        while lines[j].endswith("\\") or "\n".join(lines[i : j + 1]).count("'") % 2:
            j += 1
        commands.append("\n".join(lines[i : j + 1]))
    chat = next(c for c in commands if "/v1/chat/completions" in c)
    explain = next(c for c in commands if "/admin/route/explain" in c)
    assert explain.count("\n") == 3 and chat.count("\n") == 3
    args = _curl_args(explain)
    assert args[:2] == ["-s", f"http://127.0.0.1:8123/admin/route/explain?tenant={DEMO_TENANT}"]
    assert args[2:6] == ["-H", "x-admin-key: adm", "-H", "content-type: application/json"]
    assert args[6] == "-d" and len(args) == 8
    explained = json.loads(args[7])
    args = _curl_args(chat)
    assert args[:2] == ["-s", "http://127.0.0.1:8123/v1/chat/completions"]
    assert args[2:4] == ["-H", f"authorization: Bearer {DEMO_KEY}"] and args[6] == "-d"
    sent = json.loads(args[7])
    # the explain shows the chat example's prefix: the same prompt, longer than a KV block
    assert explained["model"] == sent["model"] == MODEL
    assert explained["messages"] == sent["messages"]
    assert sent["messages"][0]["content"] == EXAMPLE_PROMPT and len(EXAMPLE_PROMPT.split()) > 16


def _printed_commands(text: str) -> dict[str, str]:
    """The demo's printed commands by kind, each as the lines a user pastes."""
    lines = text.splitlines()
    out: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith(("curl -s ", ".venv/bin/python -c")):
            j = i  # a command runs to its closing quote and its last continuation
            while (
                lines[j].endswith("\\")
                or "\n".join(lines[i : j + 1]).count("'" if line.startswith("curl") else '"') % 2
            ):
                j += 1
            command = "\n".join(lines[i : j + 1])
            kind = "sdk" if line.startswith(".venv") else "explain" if "explain" in line else "chat"
            out[kind] = command
            i = j + 1
            continue
        if line.startswith("metrics (the admin key): "):
            out["metrics"] = line.split(": ", 1)[1]
        i += 1
    return out


async def test_every_printed_example_works_against_a_real_gateway(tmp_path: Path) -> None:
    """Pasted into bash as printed (the demo's API key, this gateway's admin key): the curl
    chat and the openai SDK snippet are answered, /metrics is scraped, and the explain shows
    the chat's cached prefix on the replica that served it."""
    import asyncio

    from loadtest.demo import DEMO_KEY, DEMO_TENANT, examples_text
    from loadtest.harness import write_api_keys
    from tests.test_gateway_support import ADMIN, stack

    keys = tmp_path / "keys.yaml"
    write_api_keys(keys, {DEMO_TENANT: DEMO_KEY})
    async with stack(count=2, agents=True, api_keys_file=keys) as st:
        port = int(st.url.rsplit(":", 1)[1])
        commands = _printed_commands(examples_text(port, ADMIN))
        assert set(commands) == {"chat", "sdk", "metrics", "explain"}, commands

        async def bash(kind: str) -> str:
            out = await asyncio.to_thread(
                subprocess.run, ["bash", "-c", commands[kind]], cwd=Path(__file__).parents[1],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert out.returncode == 0, f"{kind}: {out.stderr[-2000:]}"
            return out.stdout

        chat = json.loads(await bash("chat"))
        assert chat["choices"][0]["message"]["content"], chat
        assert "CompletionUsage(" in await bash("sdk")
        assert "kvgate_requests_total" in await bash("metrics")
        for _ in range(40):  # bounded: the agents index the chat's blocks within moments
            explained = json.loads(await bash("explain"))
            if any(s["matched_blocks"] > 0 for s in explained["decision"]["scores"]):
                break
            await asyncio.sleep(0.25)
        assert explained["tenant"] == DEMO_TENANT
        assert any(s["matched_blocks"] > 0 for s in explained["decision"]["scores"]), explained
