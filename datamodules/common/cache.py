"""One cache root for everything the project builds once and reuses (tokenizers, tokenized corpora, tiny models)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_root() -> Path:
    """``$PAPERLAB_CACHE``, else ``~/.cache/paperlab``: in the user cache, never in the repo."""
    root = Path(os.environ.get("PAPERLAB_CACHE", Path.home() / ".cache" / "paperlab"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def stable_hash(*parts) -> str:
    """A short hash of JSON-serialisable parts, stable across processes and Python versions."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:16]
