"""``loadtest.replay`` against a server answering badly (a peer router's bug, a cut stream):
every such answer is one failed request with its reason, never an exception out of the
replay (which lost every result of the run) nor a success."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loadtest.replay import replay
from loadtest.workloads import WorkItem, Workload
from tests.test_gateway_support import script_server

pytestmark = pytest.mark.timeout(60)

_SERVER = """
import sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

OK = b'{"choices":[{"text":"hi"}]}'

async def endpoint(request):
    mode = request.path_params["mode"]
    if mode == "no_done":
        async def body():
            yield b"data: " + OK + b"\\n\\n"
        return StreamingResponse(body(), media_type="text/event-stream")
    if mode == "list_chunk":
        async def body():
            yield b"data: [1, 2]\\n\\ndata: [DONE]\\n\\n"
        return StreamingResponse(body(), media_type="text/event-stream")
    if mode == "list_body":
        return Response(b"[1, 2]", media_type="application/json")
    if mode == "bare_error":
        return Response(b'{"error": "no workers"}', status_code=503,
                        media_type="application/json")
    if mode == "bad_usage":
        return Response(b'{"choices": [], "usage": {"prompt_tokens": "many"}}',
                        media_type="application/json")
    if mode == "html_error":
        return PlainTextResponse("<html>bad gateway</html>", status_code=502)
    return Response(status_code=404)

app = Starlette(routes=[Route("/{mode}/v1/completions", endpoint, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="critical")
"""


@pytest.fixture
async def bad_server(tmp_path: Path) -> AsyncIterator[str]:
    async with script_server(tmp_path, _SERVER) as url:
        yield url


@pytest.mark.parametrize(
    ("mode", "stream", "says"),
    [
        ("no_done", True, "stream ended without data: [DONE]"),
        ("list_chunk", True, "bad SSE payload"),
        ("list_body", False, "not a JSON object"),
        ("bare_error", False, "no workers"),
        ("bad_usage", False, "usage count is not a count: 'many'"),
        ("html_error", False, "<html>bad gateway</html>"),
    ],
)
async def test_a_bad_answer_is_one_failed_request(
    bad_server: str, mode: str, stream: bool, says: str
) -> None:
    """Unfixed: a stream cut before [DONE] was a success; a chunk or body that is JSON but no
    object, a bare {"error": "..."} (some routers' form) and a usage count that is no number
    raised AttributeError/ValueError out of replay(), losing the run's results."""
    items = tuple(WorkItem(t=0.0, api="completions", max_tokens=4, prompt="x") for _ in range(2))
    report = await replay(Workload("bad", items), f"{bad_server}/{mode}", "m", stream=stream)
    assert [r.ok for r in report.results] == [False, False]
    for r in report.results:
        assert r.error is not None and says in r.error, r.error
    assert report.summary()["errors"] == 2
