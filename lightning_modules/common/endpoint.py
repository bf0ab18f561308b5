"""The one client for OpenAI-compatible chat endpoints (API models: error_law's backend, esr's judge).

``EndpointClient(url, model, api_key_env)`` POSTs ``{url}/chat/completions``; the URL and model name come from
config (``conf/local/``: ``local.endpoints.<name>``), the key only from the environment variable named there
(never from a file or the config). Transient failures (HTTP 408/429/5xx, connection errors, timeouts) are retried
with exponential backoff; other HTTP errors raise at once. Responses are cached on disk by a hash of the request
(url + payload, not the key): a rerun, or a crashed run resumed, sends nothing it has already had answered.

    client = EndpointClient(url="https://api.deepseek.com/v1", model="deepseek-reasoner", api_key_env="DEEPSEEK_API_KEY")
    client = EndpointClient.from_spec(cfg.model.endpoint)  # the same from config (local.endpoints.<name>)
    client.check()                          # one probe request: fails fast on a missing url/key or a bad endpoint
    text = client.chat("What is 2 + 2?")    # or a list of {"role", "content"} messages
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

from datamodules.common.errors import ConfigError, UserError, one_line

RETRY_STATUS = (408, 429, 500, 502, 503, 504)
WHERE = "local.endpoints.<name> (conf/local/)"  # where a url, model name and key variable are set


class EndpointError(UserError, RuntimeError):
    """A request the endpoint refused, or that still failed after every retry; the message names what to check."""


class EndpointClient:
    """An OpenAI-compatible chat-completions client with retries and an on-disk response cache.

    Args:
        url: the API base (``.../v1``); ``/chat/completions`` is appended.
        model: the model name as the provider spells it.
        api_key_env: the environment variable holding the key (None: send no key, e.g. a local server).
        cache_dir: where responses are cached (None: no cache).
        max_retries: retries after the first attempt for transient failures.
        backoff: seconds before the first retry, doubled each time.
        timeout: seconds per request.
        params: request fields sent with every call (temperature, max_tokens, ...); a call's own override them.
    """

    def __init__(self, url: str | None, model: str | None, api_key_env: str | None = None,
                 cache_dir: str | Path | None = None, max_retries: int = 5, backoff: float = 1.0,
                 timeout: float = 120.0, params: Mapping[str, Any] | None = None):
        if not url:
            raise ConfigError("endpoint: no url — set local.endpoints.<provider>.url (conf/local/) or "
                              "model.endpoint.url")
        if not model:
            raise ConfigError("endpoint: no model name — set model.endpoint.model (as the provider spells it)")
        self.url = url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.max_retries = max_retries
        self.backoff = backoff
        self.timeout = timeout
        self.params = dict(params or {})
        self.stats = {"requests": 0, "retries": 0, "cache_hits": 0}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> "EndpointClient":
        """A client from a config mapping (``{url, model, api_key_env, cache_dir, ...}``, e.g. ``model.endpoint``
        built from ``local.endpoints.<name>``); a missing url or model fails here, naming the key to set."""
        import inspect

        spec = dict(spec or {})
        known = set(inspect.signature(cls).parameters)
        if set(spec) - known:
            raise ConfigError(f"endpoint: unknown key(s) {sorted(set(spec) - known)} — use {sorted(known)}")
        return cls(**spec)

    def _key(self) -> str | None:
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(f"endpoint: the environment variable {self.api_key_env} is not set — export your API "
                              "key there (or name another variable in local.endpoints.<name>.api_key_env)")
        return key

    def _fix(self, status: int | None) -> str:
        """What to check after a failed request: the key for 401/403, a later rerun for rate limits and server
        errors (answers so far are cached), else the url and model (and the key's variable) in conf/local/."""
        key = f"${self.api_key_env}" if self.api_key_env else "no key (api_key_env: null)"
        if status in (401, 403):
            return f"check the API key in {key} (the variable named in {WHERE})"
        if status in RETRY_STATUS:
            return "the provider is failing or rate-limiting: rerun later (answered requests are cached)"
        return f"check the url and model in {WHERE}, and the key in {key}"

    def payload(self, messages: str | Sequence[Mapping[str, str]], **params) -> dict:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return {"model": self.model, "messages": [dict(m) for m in messages], **self.params, **params}

    def cache_path(self, payload: Mapping[str, Any]) -> Path | None:
        if self.cache_dir is None:
            return None
        digest = hashlib.sha256(json.dumps([self.url, payload], sort_keys=True).encode()).hexdigest()
        return self.cache_dir / digest[:2] / f"{digest}.json"

    def request(self, payload: Mapping[str, Any]) -> dict:
        """The endpoint's JSON response to ``payload``, from the cache when it has been asked before."""
        path = self.cache_path(payload)
        if path is not None and path.exists():
            self.stats["cache_hits"] += 1
            return json.loads(path.read_text())
        headers = {"Content-Type": "application/json"}
        key = self._key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        body = json.dumps(payload).encode()
        for attempt in range(self.max_retries + 1):
            self.stats["requests"] += 1
            try:
                req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    data = json.loads(resp.read().decode())
                break
            except urllib.error.HTTPError as err:
                detail = one_line(err.read().decode(errors="replace"))[:300]
                if err.code not in RETRY_STATUS or attempt == self.max_retries:
                    raise EndpointError(f"{self.url} answered HTTP {err.code}: {detail} — "
                                        f"{self._fix(err.code)}") from err
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                if attempt == self.max_retries:
                    raise EndpointError(f"{self.url} unreachable after {attempt + 1} attempts ({err}) — "
                                        f"{self._fix(None)}") from err
            self.stats["retries"] += 1
            time.sleep(self.backoff * 2 ** attempt)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer thread
            tmp.write_text(json.dumps(data))
            tmp.replace(path)  # atomic: a crash never leaves half a response in the cache
        return data

    def chat(self, messages: str | Sequence[Mapping[str, str]], **params) -> str:
        """The first choice's message text for a prompt (or a list of chat messages)."""
        data = self.request(self.payload(messages, **params))
        try:
            return data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as err:
            raise EndpointError(f"{self.url}: not a chat-completions response: {json.dumps(data)[:300]} — point the "
                                f"url in {WHERE} at an OpenAI-compatible API base (.../v1)") from err

    def check(self) -> str:
        """One uncached probe request, so a wrong url, model or key fails before any real work."""
        self._key()
        cache, self.cache_dir = self.cache_dir, None
        try:
            return self.chat("Reply with OK.")
        finally:
            self.cache_dir = cache
