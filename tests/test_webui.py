"""The chat page ``kvslim serve`` answers at ``/``: served by the real server, and its own
stream parsing (the page's pure functions, run under node) read a real streamed reply into the
text the OpenAI client gets for the same greedy request."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from kvslim.server import start
from tests.test_server import free_port, options, wait_ready

openai = pytest.importorskip("openai")
PAGE = Path(__file__).resolve().parents[1] / "kvslim" / "server" / "webui.html"
needs_node = pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")


@pytest.fixture(scope="module")
def server():
    port = free_port()
    srv = start(options(None, api_key="sekrit"), "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base)
    yield base
    srv.shutdown()


def page_script() -> str:
    return re.search(r"<script>(.*)</script>", PAGE.read_text(), re.S).group(1)


def run_node(code: str, tmp_path) -> str:
    path = tmp_path / "check.js"
    path.write_text(page_script() + "\n" + code)
    done = subprocess.run(["node", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_page_is_served_without_a_key_and_its_api_calls_need_one(server):
    r = httpx.get(server + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text and "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert httpx.get(server + "/v1/models").status_code == 401                       # the page asks for the key
    assert httpx.get(server + "/", headers={"Host": "evil.example"}).status_code == 200  # a keyed server: any Host


@needs_node
def test_the_pages_parser_splits_events_across_reads(tmp_path):
    out = run_node(r'''
const assert = require("assert");
let [events, rest] = sseSplit('data: {"a":1}\n\ndata: [DO');
assert.deepStrictEqual(events, ['{"a":1}']); assert.strictEqual(rest, 'data: [DO');
[events, rest] = sseSplit(rest + 'NE]\r\n\r\n: a comment\n\n');
assert.deepStrictEqual(events, ['[DONE]']); assert.strictEqual(rest, '');
console.log("ok");''', tmp_path)
    assert out.strip() == "ok"


@needs_node
def test_the_page_reads_a_real_stream_into_the_clients_reply(server, tmp_path):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Name a module."}], "temperature": 0,
            "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}}
    out = run_node(f'''
(async () => {{
  const r = await fetch("{server}/v1/chat/completions", {{method: "POST", body: JSON.stringify({json.dumps(body)}),
    headers: {{"Content-Type": "application/json", "Authorization": "Bearer sekrit"}}}});
  const reader = r.body.getReader(), decoder = new TextDecoder();
  const reply = {{content: "", reasoning: "", usage: null, timings: null, finish: null, error: null}};
  let buffer = "", events;
  for (;;) {{
    const {{value, done}} = await reader.read();
    if (done) break;
    [events, buffer] = sseSplit(buffer + decoder.decode(value, {{stream: true}}));
    events.forEach(e => foldChunk(reply, e));
  }}
  console.log(JSON.stringify({{reply, stats: statsLine(reply)}}));
}})();''', tmp_path)
    got = json.loads(out)
    client = openai.OpenAI(base_url=server + "/v1", api_key="sekrit", max_retries=0)
    want = client.chat.completions.create(**{k: v for k, v in body.items() if not k.startswith("stream")})
    message = want.choices[0].message
    assert got["reply"]["content"] == (message.content or "")
    assert got["reply"]["reasoning"] == (getattr(message, "reasoning_content", None) or "")
    assert got["reply"]["finish"] == want.choices[0].finish_reason and got["reply"]["usage"]["completion_tokens"] == 24
    assert re.match(r"\d+ prompt tokens read \(\d+ reused\) at [\d.]+ t/s, 24 generated at [\d.]+ t/s, length$",
                    got["stats"])
