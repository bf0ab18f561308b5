"""SubspacePath's data: per-domain text pools (probes, importance, calibration) and multi-turn scenarios.

``source: embedded`` (tiny, no download): domains are standard-library families of the embedded corpus
(``embedded_documents_by_source``), e.g. networking = socket, ssl, http.*, urllib.*, ...; documents are cut into
passages of ``passage_words`` words and split train / val / test by a hash of the passage. Pools: train passages
(probes and importance), val passages (calibration). Scenarios come from test passages, each a conversation of
``turns`` turns whose text is split in half: ``prompt`` (the turn's opening) and ``answer`` (its continuation):
``selected`` (one selected domain), ``out_of_domain`` (one held-out family), ``cross_domain`` (turns cycling over
2..``max_mix`` selected domains).

``source: files`` (paper scale): ``files.pools`` maps each domain to a .txt (one text a line) or .jsonl (field
``text``) file, split train / val by hash; ``files.scenarios`` is a jsonl of ``{"split", "domains", "turns":
[{"prompt", "answer", "choices"?}]}`` (XDomainBench-style splits, CommonsenseQA / NQ / ARC as single-turn
scenarios with ``choices`` for multiple choice).

The test loader yields scenario indices; the module reads ``scenario(i)`` (its domains are chosen by the module's
basis after the loader is made).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from datamodules.common.miniature import register_layout
from datamodules.common.splits import split_of

# stdlib families as text domains (module-name prefixes of embedded_documents_by_source)
FAMILIES = {
    "networking": ("socket", "ssl", "http", "urllib", "ftplib", "smtplib", "poplib", "imaplib", "nntplib",
                   "socketserver", "ipaddress", "wsgiref", "xmlrpc", "telnetlib", "mailbox", "cgi"),
    "numerics": ("decimal", "_pydecimal", "fractions", "statistics", "random", "numbers", "colorsys", "bisect",
                 "heapq", "operator", "datetime", "calendar", "zoneinfo", "_strptime"),
    "text": ("string", "textwrap", "re", "difflib", "codecs", "gettext", "locale", "stringprep", "shlex", "html",
             "_markupbase", "csv", "pprint", "reprlib", "base64", "quopri"),
    "concurrency": ("threading", "_threading_local", "multiprocessing", "asyncio", "concurrent", "queue", "sched",
                    "subprocess", "selectors", "asynchat", "asyncore"),
    "files": ("os", "shutil", "pathlib", "tempfile", "glob", "fnmatch", "zipfile", "tarfile", "filecmp", "fileinput",
              "stat", "_pyio", "gzip", "bz2", "lzma", "posixpath", "ntpath", "genericpath", "shelve", "dbm"),
    "reference": ("reference",),
    # held-out families (out-of-domain scenarios)
    "email": ("email",),
    "xml": ("xml",),
    "testing": ("unittest", "doctest", "bdb", "pdb"),
    "imports": ("importlib", "pkgutil", "modulefinder", "runpy", "zipimport"),
    "gui": ("tkinter", "idlelib", "turtle"),
    "packaging": ("distutils",),
}
SOURCES = ("embedded", "files")
SPLITS = ("selected", "out_of_domain", "cross_domain")


def family_of(source: str) -> str | None:
    top = source.split(".")[0]
    for name, prefixes in FAMILIES.items():
        if top in prefixes:
            return name
    return None


def _read_texts(path: str) -> list[str]:
    lines = Path(path).read_text().splitlines()
    if path.endswith(".jsonl"):
        return [json.loads(x)["text"] for x in lines if x.strip()]
    return [x.strip() for x in lines if x.strip()]


class SubspacePathDataModule(L.LightningDataModule):
    def __init__(self, tokenizer, source: str = "embedded", domains=("networking", "numerics", "text", "concurrency",
                 "files", "reference"), ood_domains=("email", "xml", "testing", "imports"), files=None,
                 passage_words: int = 64, pool_size: int = 32, min_passages: int = 8, turns: int = 3,
                 n_scenarios: int = 6, max_mix: int = 3, val_fraction: float = 0.2, test_fraction: float = 0.3,
                 seed: int = 0):
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"data.source={source!r}: choose one of {', '.join(SOURCES)}")
        self.tokenizer, self.source, self.seed = tokenizer, source, seed
        self.domains, self.ood_domains = list(domains), list(ood_domains)
        self.pool_size, self.turns, self.n_scenarios, self.max_mix = pool_size, turns, n_scenarios, max_mix
        if len(self.domains) < 2:
            raise ValueError(f"data.domains={self.domains}: name at least 2 domains")
        if turns < 2:
            raise ValueError(f"data.turns={turns}: a scenario needs >= 2 turns (the first compiles the mask)")
        if source == "embedded":
            unknown = [d for d in self.domains + self.ood_domains if d not in FAMILIES]
            if unknown:
                raise ValueError(f"data.domains / ood_domains {unknown} unknown: choose from {', '.join(FAMILIES)}")
            passages = self._embedded_passages(passage_words, val_fraction, test_fraction)
            need = {"train": min_passages, "val": 2, "test": turns}
            for d in self.domains + self.ood_domains:
                for split, n in need.items():
                    have = len(passages[d][split])
                    if have < n and not (split != "test" and d in self.ood_domains):
                        raise ValueError(f"domain {d!r} has {have} {split} passages (< {n}): drop it or lower "
                                         "data.passage_words / data.min_passages")
            self.passages = passages
            self._files_scenarios = None
        else:
            if not files or "pools" not in files or "scenarios" not in files:
                raise ValueError("data.source=files needs data.files.pools ({domain: path}) and data.files.scenarios")
            missing = [d for d in self.domains if d not in files["pools"]]
            if missing:
                raise ValueError(f"data.domains {missing} have no pool in data.files.pools: add their files")
            self.passages = {d: {"train": [], "val": [], "test": []} for d in self.domains}
            for d in self.domains:
                for t in _read_texts(files["pools"][d]):
                    self.passages[d][split_of(t, val_fraction, 0.0)].append(t)
            self._files_scenarios = [json.loads(x) for x in Path(files["scenarios"]).read_text().splitlines()
                                     if x.strip()]
        self.selected = list(self.domains)   # the module's basis narrows this (quasi_orthogonal)

    def _embedded_passages(self, words: int, val_fraction: float, test_fraction: float):
        from datamodules.common.corpus import embedded_documents_by_source

        out = {d: {"train": [], "val": [], "test": []} for d in FAMILIES}
        for src, text in embedded_documents_by_source():
            fam = family_of(src)
            if fam is None:
                continue
            toks = text.split()
            for i in range(0, len(toks) - words // 2, words):
                p = " ".join(toks[i:i + words])
                out[fam][split_of(p, val_fraction, test_fraction)].append(p)
        return out

    def pools(self, split: str = "train", domains=None) -> dict[str, list[str]]:
        """Up to ``pool_size`` passages per domain of ``split`` (a fixed seeded draw)."""
        rng = random.Random(f"{self.seed}:{split}")
        out = {}
        for d in domains or self.selected:
            texts = list(self.passages[d][split])
            rng.shuffle(texts)
            out[d] = texts[: self.pool_size]
        return out

    def _turn(self, text: str) -> dict:
        w = text.split()
        return {"prompt": " ".join(w[: len(w) // 2]), "answer": " ".join(w[len(w) // 2:])}

    def scenarios(self) -> list[dict]:
        if self._files_scenarios is not None:
            return self._files_scenarios
        rng = random.Random(f"{self.seed}:scenarios")
        tests = {d: list(v["test"]) for d, v in self.passages.items()}
        for v in tests.values():
            rng.shuffle(v)
        used = {d: 0 for d in tests}

        def take(d):
            t = tests[d][used[d] % len(tests[d])]
            used[d] += 1
            return self._turn(t)

        out = []
        ood = [d for d in self.ood_domains if len(tests[d]) >= self.turns]
        for i in range(self.n_scenarios):
            d = self.selected[i % len(self.selected)]
            out.append({"split": "selected", "domains": [d], "turns": [take(d) for _ in range(self.turns)]})
        for i in range(self.n_scenarios if ood else 0):
            d = ood[i % len(ood)]
            out.append({"split": "out_of_domain", "domains": [d], "turns": [take(d) for _ in range(self.turns)]})
        for i in range(self.n_scenarios):
            mix = rng.sample(self.selected, rng.randint(2, min(self.max_mix, len(self.selected))))
            out.append({"split": "cross_domain", "domains": mix,
                        "turns": [take(mix[t % len(mix)]) for t in range(self.turns)]})
        return out

    def scenario(self, i: int) -> dict:
        if getattr(self, "_cache", None) is None or self._cache[0] != self.selected:
            self._cache = (list(self.selected), self.scenarios())
        return self._cache[1][i]

    def n_total(self) -> int:
        if self._files_scenarios is not None:
            return len(self._files_scenarios)
        ood = [d for d in self.ood_domains if len(self.passages[d]["test"]) >= self.turns]
        return self.n_scenarios * (3 if ood else 2)

    def test_dataloader(self):
        return DataLoader(list(range(self.n_total())), batch_size=None, shuffle=False)


# --- miniatures for debug=dryrun (datamodules/common/miniature.py) ----------------------------------------------------
@register_layout("xdomain/pools/*.jsonl")
def write_pool(target: Path, cfg) -> None:
    """A domain pool: one ``text`` per line, passages of the miniature documents (a different text per domain)."""
    from datamodules.common.miniature import documents, write_jsonl

    seed = sum(map(ord, target.stem))
    passages = [p for d in documents(seed=seed) for p in d.split("\n") if len(p.split()) >= 8]
    target.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(target, [{"text": p} for p in passages])


@register_layout("xdomain/scenarios.jsonl")
def write_scenarios(target: Path, cfg) -> None:
    """Scenarios as the module reads them: XDomainBench-style splits over ``data.domains`` (two-turn conversations;
    cross-domain over two domains) and CommonsenseQA / NQ / ARC-style single turns (``choices`` for the two
    multiple-choice sets, the answer a letter)."""
    from datamodules.common.miniature import documents, write_jsonl

    domains = list(cfg.data.domains)
    words = documents(n=4, seed=11)[0].split()
    turn = lambda i: {"prompt": " ".join(words[i * 24: i * 24 + 12]), "answer": " ".join(words[i * 24 + 12: i * 24 + 24])}  # noqa: E731
    rows = [{"split": "selected", "domains": [domains[0]], "turns": [turn(0), turn(1)]},
            {"split": "out_of_domain", "domains": ["ood"], "turns": [turn(2), turn(3)]},
            {"split": "cross_domain", "domains": domains[:2], "turns": [turn(4), turn(5)]},
            {"split": "nq", "domains": [], "turns": [turn(6)]}]
    for split in ("csqa", "arc"):
        rows.append({"split": split, "domains": [], "turns": [{"prompt": turn(7)["prompt"] + " Answer:", "answer": "B",
                                                                 "choices": ["A", "B", "C", "D"]}]})
    target.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(target, rows)
