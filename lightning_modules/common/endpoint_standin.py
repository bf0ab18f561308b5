"""A local stand-in for OpenAI-compatible chat endpoints (``debug=dryrun``): judges and API models answered on the
loopback address, in the form each of our parsers reads.

``StandInEndpoint().start()`` serves ``POST /v1/chat/completions`` from a daemon thread and returns the base URL
(``http://127.0.0.1:<port>/v1``). The reply depends on the rubric the request carries (``judge.py``): the harm rubric
gets ``score: 1``; the attempts rubric a JSON list with the reply as one attempt scored 50; the pivot rubric the gold
answer as the value when a passage states it (else null); anything else (an API model doing a task) ``Answer: 0``.
Replies are well-formed, never right on purpose: a dry run checks that requests, parsing and bookkeeping work, not
the numbers. ``requests`` counts what was served.
"""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def reply_for(prompt: str) -> str:
    """The stand-in's answer to one prompt (the last user message)."""
    if "#thescore:" in prompt:  # the harm judges' policy rubric: reason, then a 1-5 score
        return "#thereason: the stand-in judges every reply harmless.\n#thescore: 1"
    if '"attempts"' in prompt:
        # the graded reply: after the rubric's last "Response:" (or "Reply:"), up to the label line
        found = re.findall(r"(?:Response|Reply):(.*?)(?:\nUnrelated feature:|Answer with JSON only|\Z)", prompt, re.S)
        reply = (found[-1].strip() if found else "") or "(empty)"
        return "<json>" + json.dumps({"attempts": [{"attempt_text": reply, "score": 50}]}) + "</json>"
    if '"entity"' in prompt and '"relation"' in prompt:
        gold = re.search(r"Gold answer: (.*)", prompt)
        value = gold.group(1).strip() if gold else ""
        found = bool(value) and value in prompt.split("Gold answer:", 1)[0]
        return json.dumps({"entity": "the subject", "relation": "answer", "value": value if found else None})
    return "Answer: 0"


class StandInEndpoint:
    """An OpenAI-compatible ``/v1/chat/completions`` server on 127.0.0.1 in a daemon thread."""

    def __init__(self):
        self.requests = 0
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> str:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server hook name
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self.send_error(404, "the stand-in serves /v1/chat/completions only")
                    return
                messages = body.get("messages") or [{}]
                content = messages[-1].get("content", "")
                if isinstance(content, list):  # content parts
                    content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
                owner.requests += 1
                data = {"id": f"standin-{owner.requests}", "object": "chat.completion", "model": body.get("model"),
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": reply_for(str(content))}}],
                        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
                out = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):  # quiet: one line per request would flood the run's log
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True, name="endpoint-standin").start()
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
