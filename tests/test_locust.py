"""The Locust file, headless against a real gateway and replicas: one statistics row per
request, timed to its last byte, and the TTFTs reported apart."""

from __future__ import annotations

import asyncio
import csv
import re
import sys
from pathlib import Path

import pytest

from tests.test_gateway_support import script_server, stack

pytestmark = pytest.mark.timeout(120)

LOCUSTFILE = Path(__file__).resolve().parent.parent / "loadtest" / "locustfile.py"


async def _locust(
    host: str, *args: str, env: dict[str, str] | None = None
) -> tuple[int | None, str]:
    """A headless run of the locustfile against ``host``, summary only; ``args``: users,
    rate, time, CSV prefix, then the user classes. Its exit code and output."""
    bin_dir = str(Path(sys.executable).parent)
    proc = await asyncio.create_subprocess_exec(
        str(Path(bin_dir) / "locust"), "-f", str(LOCUSTFILE), "--headless", "--host", host,
        "--only-summary", *args,
        env={"PATH": bin_dir, **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode, out.decode()


async def test_headless_run_counts_each_request_once_and_reports_ttft(tmp_path: Path) -> None:
    prefix = tmp_path / "run"
    async with stack(count=2) as st:
        code, text = await _locust(
            st.url, "-u", "3", "-r", "3", "-t", "6s", "--csv", str(prefix),
            "SharedSystemPromptChat", "ShortUnique", env={"KVGATE_LOCUST_MODEL": st.model},
        )  # fmt: skip
    assert code == 0, text[-2000:]
    check_outputs(text, prefix)


def check_outputs(text: str, prefix: Path) -> None:
    # Locust's printed summary is final (its CSV is rewritten each second and can miss
    # the last requests): per class "POST <class> <requests> <failures>(...)"
    printed = dict(re.findall(r"^POST\s+(\w+)\s+(\d+)\s+0\(", text, re.M))
    ttft_csv = Path(f"{prefix}_ttft.csv").read_text().splitlines()
    ttft = {r["user class"]: r for r in csv.DictReader(ttft_csv)}
    assert set(printed) == set(ttft) == {"SharedSystemPromptChat", "ShortUnique"}
    total = int(re.findall(r"^\s+Aggregated\s+(\d+)\s", text, re.M)[0])
    assert total == sum(map(int, printed.values())) > 0  # one row per request, no TTFT rows
    stats_csv = Path(f"{prefix}_stats.csv").read_text().splitlines()
    stats = {(r["Type"], r["Name"]): r for r in csv.DictReader(stats_csv)}
    assert {kind for kind, _ in stats} == {"POST", ""}  # "" is the Aggregated row
    for name, count in printed.items():
        # every streamed request had a first token, and its row covers the whole stream
        assert int(count) == int(ttft[name]["requests"])
        avg = float(stats[("POST", name)]["Average Response Time"])
        assert avg > float(ttft[name]["TTFT p50 ms"])
    assert float(ttft["SharedSystemPromptChat"]["mean cached tokens"]) > 0
    assert float(ttft["ShortUnique"]["mean cached tokens"]) == 0
    assert "streamed requests: TTFT" in text


_BROKEN_STREAMS = """
import itertools, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

MODES = itertools.cycle(sys.argv[2].split(","))

async def body(mode):
    yield b'data: {"choices":[{"text":"hi"}]}\\n\\n'
    if mode == "not_json":
        yield b"data: {not json\\n\\n"
    if mode == "cut":  # the server drops the connection mid-stream
        raise RuntimeError("cut")

async def endpoint(request):
    return StreamingResponse(body(next(MODES)), media_type="text/event-stream")

app = Starlette(routes=[Route("/v1/completions", endpoint, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="critical")
"""


async def test_a_broken_stream_is_a_failed_request(tmp_path: Path) -> None:
    """A stream that ended without `data: [DONE]` (cut short) counted as a success; one cut
    mid-way (ChunkedEncodingError) or carrying a chunk that is no JSON raised out of the
    task: Locust logged a traceback apart and the request was in neither count."""
    async with script_server(tmp_path, _BROKEN_STREAMS, "no_done,not_json,cut") as url:
        code, text = await _locust(url, "-u", "3", "-r", "3", "-t", "3s", "ShortUnique")
    assert code == 1, text[-2000:]
    assert "Traceback" not in text, text[-3000:]
    requests, failures = re.findall(r"^POST\s+ShortUnique\s+(\d+)\s+(\d+)\(", text, re.M)[0]
    assert int(requests) >= 3 and failures == requests, text[-2000:]
    for says in ("without data: [DONE]", "JSONDecodeError", "ChunkedEncodingError"):
        assert says in text, text[-2000:]


async def test_stream_false_sends_plain_json_and_a_bad_value_is_refused(tmp_path: Path) -> None:
    """KVGATE_LOCUST_STREAM=false streamed (anything but "0" did), so a user turning
    streaming off measured streams; a value that is no flag is refused before any user
    starts. The server's streams all end without [DONE]: a run that streamed would fail."""
    outputs: dict[str, tuple[int | None, str]] = {}
    async with script_server(tmp_path, _BROKEN_STREAMS, "no_done") as url:
        for value in ("false", "maybe"):
            outputs[value] = await _locust(
                url, "-u", "2", "-r", "2", "-t", "2s", "ShortUnique",
                env={"KVGATE_LOCUST_STREAM": value},
            )  # fmt: skip
    code, text = outputs["false"]
    assert code == 0, text[-2000:]
    requests, failures = re.findall(r"^POST\s+ShortUnique\s+(\d+)\s+(\d+)\(", text, re.M)[0]
    assert int(requests) >= 2 and failures == "0", text[-2000:]
    assert "streamed requests: TTFT" not in text
    code, text = outputs["maybe"]
    assert code == 1 and "KVGATE_LOCUST_STREAM must be 1 or 0" in text, text[-2000:]


async def test_embeddings_user_class_through_the_gateway(tmp_path: Path) -> None:
    """EmbedSharedDocs against a real gateway and simulated replicas: every request a
    checked embeddings list (a failure counts in Locust's row), none failed."""
    prefix = tmp_path / "emb"
    async with stack(count=2) as st:
        code, text = await _locust(
            st.url, "-u", "2", "-r", "2", "-t", "4s", "--csv", str(prefix), "EmbedSharedDocs",
            env={"KVGATE_LOCUST_MODEL": st.model},
        )  # fmt: skip
    assert code == 0, text[-2000:]
    found = re.findall(r"^POST\s+(\w+)\s+(\d+)\s+(\d+)\(", text, re.M)
    rows = {name: (int(n), int(f)) for name, n, f in found}
    assert set(rows) == {"EmbedSharedDocs"}, text[-2000:]
    requests, failures = rows["EmbedSharedDocs"]
    assert requests > 0 and failures == 0, text[-2000:]


def _rows(text: str) -> dict[str, tuple[int, int]]:
    """Locust's printed summary, final (its CSV is rewritten each second): per request
    name "POST <name> <requests> <failures>(...)"."""
    found = re.findall(r"^POST\s+(\S+(?: \S+)*?)\s+(\d+)\s+(\d+)\(", text, re.M)
    return {name: (int(n), int(f)) for name, n, f in found}


async def test_responses_agent_chains_through_the_gateway(tmp_path: Path) -> None:
    """ResponsesAgentChain against a real gateway and simulated replicas: first turns and
    follow-ups (previous_response_id with a client-run tool call's output) in rows of their
    own, in the printed summary and the CSV, and none failed (a follow-up that reached a
    replica without its previous response would be a 404: the gateway pins it)."""
    prefix = tmp_path / "resp"
    async with stack(count=2) as st:
        code, text = await _locust(
            st.url, "-u", "3", "-r", "3", "-t", "6s", "--csv", str(prefix),
            "ResponsesAgentChain", env={"KVGATE_LOCUST_MODEL": st.model},
        )  # fmt: skip
    assert code == 0, text[-2000:]
    rows = _rows(text)
    first, follow = "ResponsesAgentChain turn 1", "ResponsesAgentChain follow-up"
    assert set(rows) == {first, follow}, text[-2000:]
    assert rows[first][0] > 0 and rows[follow][0] > 0, text[-2000:]
    assert rows[first][1] == rows[follow][1] == 0, text[-2000:]
    assert _csv_names(prefix) == {first, follow, "Aggregated"}


def _csv_names(prefix: Path) -> set[str]:
    stats_csv = Path(f"{prefix}_stats.csv").read_text().splitlines()
    return {r["Name"] for r in csv.DictReader(stats_csv)}


_NO_AFFINITY = """
import itertools, sys, uuid
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

FIRST = itertools.cycle(["ok", "no_message"])

async def endpoint(request):
    body = await request.json()
    if body.get("previous_response_id"):  # a router without affinity: another replica
        err = {"message": "Response not found", "type": "invalid_request_error",
               "param": "response_id", "code": "response_not_found"}
        return JSONResponse({"error": err}, status_code=404)
    item = {"type": "message", "role": "assistant", "content": []}
    output = [item] if next(FIRST) == "ok" else []
    return JSONResponse({"id": "resp_" + uuid.uuid4().hex, "output": output})

app = Starlette(routes=[Route("/v1/responses", endpoint, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="critical")
"""


async def test_a_responses_follow_up_404_is_a_failure_named_so(tmp_path: Path) -> None:
    """A server whose follow-ups all answer 404 (what a router without affinity gives) and
    every other first turn a 200 without an output message: each such request a failure
    of its own row, saying why, and the chain starts over."""
    async with script_server(tmp_path, _NO_AFFINITY) as url:
        code, text = await _locust(url, "-u", "3", "-r", "3", "-t", "4s", "ResponsesAgentChain")
    assert code == 1, text[-2000:]
    assert "Traceback" not in text, text[-3000:]
    rows = _rows(text)
    turns, bad_turns = rows["ResponsesAgentChain turn 1"]
    follows, bad_follows = rows["ResponsesAgentChain follow-up"]
    assert follows > 0 and bad_follows == follows, text[-2000:]
    assert turns >= 2 and 0 < bad_turns < turns, text[-2000:]
    assert "follow-up 404: previous response not on the replica reached" in text, text[-2000:]
    assert "no id or no output message" in text, text[-2000:]
