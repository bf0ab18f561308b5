"""error_law (arXiv 2601.14175): the accuracy law against its closed form and Monte Carlo walks, the count fitter on
planted truths, the differentiable gammainc, the task generators against independent solutions, the endpoint
backend against a loopback server, and the tiny run end to end."""
from __future__ import annotations

import bisect
import json
import math
import random
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import special

from lightning_modules.error_law.data import FORMATS, TASKS, ErrorLawDataModule, canonical, instance, problem, render
from lightning_modules.error_law.law import ErrorGammaLaw, binomial_stats, error_report, gammainc
from sweeps.fit import fit_law
from sweeps.laws import get_law
from tests.helpers import run_experiment

N_GRID = np.array([2, 4, 6, 8, 12, 16, 24, 32, 48, 64], dtype=np.float64)


def acc(r, q, n, shape="q_half"):
    return special.gammainc(q / 2 if shape == "q_half" else q, 1.0 / (r * np.asarray(n, dtype=np.float64)))


def counts(p, m=500, seed=0):
    k = np.random.default_rng(seed).binomial(m, p)
    return pd.DataFrame({"n": N_GRID, "k": k, "m": float(m), "acc": k / m})


# --- the law --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("law", ["error_gamma", "error_gamma_q"])
def test_accuracy_goes_to_one_as_n_goes_to_zero(law):
    theta = [math.log(0.05), math.log(3.0)]
    a = get_law(law).predict(theta, {"n": np.array([1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0])})
    assert a[0] > 1 - 1e-12 and np.all(np.diff(a) <= 0) and a[-1] < a[-2] < a[-3]


@pytest.mark.parametrize("q", [1.0, 3.0, 6.0])
def test_power_law_tail(q):
    """At r n = 1e4: Acc = (1/(r n))^(q/2) / Γ(q/2 + 1) within 1%, a power law in n, not an exponential."""
    r = 0.01
    n = 1e4 / r
    got = ErrorGammaLaw().predict([math.log(r), math.log(q)], {"n": np.array([n])})[0]
    tail = (1 / (r * n)) ** (q / 2) / math.gamma(q / 2 + 1)
    assert got == pytest.approx(tail, rel=0.01)


def test_monte_carlo_walks_match_the_formula():
    """q-dimensional walks of n isotropic steps (σ per direction), right while ‖e‖ < τ: Acc(n) = P(q/2, τ²/(2σ² n))."""
    q, sigma, tau, m = 3, 0.3, 2.0, 4000
    gen = torch.Generator().manual_seed(0)
    law = ErrorGammaLaw()
    r = 2 * sigma ** 2 / tau ** 2
    for n in (1, 3, 6, 10, 16, 25, 40, 64):
        e = (sigma * torch.randn(m, n, q, generator=gen, dtype=torch.float64)).sum(1)
        emp = float((e.norm(dim=-1) < tau).double().mean())
        p = law.predict([math.log(r), math.log(q)], {"n": np.array([float(n)])})[0]
        se = math.sqrt(max(p * (1 - p), 1e-4) / m)
        assert abs(emp - p) < 3 * se, (n, emp, p)


def test_gammainc_matches_scipy_and_passes_gradcheck():
    a = torch.tensor([0.3, 1.5, 4.0, 12.0], dtype=torch.float64, requires_grad=True)
    x = torch.tensor([0.05, 2.0, 3.0, 20.0], dtype=torch.float64, requires_grad=True)
    for upper, ref in ((False, special.gammainc), (True, special.gammaincc)):
        np.testing.assert_allclose(gammainc(a, x, upper).detach().numpy(), ref(a.detach(), x.detach()), rtol=1e-10)
        assert torch.autograd.gradcheck(lambda a, x: gammainc(a, x, upper), (a, x))
        g = torch.autograd.grad(gammainc(a, x, upper).sum(), a)[0].numpy()
        h = 1e-6
        fd = (ref(a.detach() + h, x.detach()) - ref(a.detach() - h, x.detach())).numpy() / (2 * h)
        np.testing.assert_allclose(g, fd, rtol=1e-4)


def test_fitter_recovers_planted_r_q_and_prefers_the_gamma_law():
    r, q = 0.02, 3.0
    df = counts(acc(r, q, N_GRID))
    gamma = fit_law("error_gamma", df, holdout=None)
    assert gamma.constants["r"] == pytest.approx(r, rel=0.1)
    assert gamma.constants["q"] == pytest.approx(q, rel=0.1)
    both = fit_law("error_gamma_q", df, holdout=None)  # the other convention: the same curve with q halved
    assert both.constants["q"] == pytest.approx(gamma.constants["q"] / 2, rel=1e-3)
    expo = fit_law("exponential", df, holdout=None)
    assert binomial_stats("error_gamma", gamma.theta, df)["deviance"] < binomial_stats("exponential", expo.theta, df)["deviance"]


def test_exponential_data_is_fitted_better_by_the_exponential():
    """The comparison is fair: data drawn from (1 − p)^n loses nothing to the exponential (AIC and held-out n)."""
    df = counts((1 - 0.03) ** N_GRID, seed=1)
    rep = error_report(df.assign(task="x", format="plain"), ("error_gamma", "exponential"))["groups"]["x/plain"]
    laws = rep["laws"]
    assert laws["exponential"]["constants"]["p"] == pytest.approx(0.03, rel=0.1)
    assert rep["best_aic"] == "exponential"
    assert laws["exponential"]["heldout_deviance"] < laws["error_gamma"]["heldout_deviance"]
    gamma_rep = error_report(counts(acc(0.02, 3.0, N_GRID)).assign(task="x", format="plain"),
                             ("error_gamma", "exponential"))["groups"]["x/plain"]
    assert gamma_rep["best_aic"] == gamma_rep["best_heldout"] == "error_gamma"


def test_count_rows_with_nothing_right_stay_in_the_fit():
    df = counts(acc(5.0, 2.0, N_GRID), m=100)
    assert (df["k"] == 0).sum() >= 2
    fit = fit_law("error_gamma", df, holdout=None)
    assert fit.n_fit == len(df) and not fit.dropped
    # a relative error has no meaning at k = 0: the fit's mean and max are over the rows with something right
    p = get_law("error_gamma").predict(fit.theta, {"n": df["n"].to_numpy(dtype=float)})
    some = df["k"].to_numpy() > 0
    rel = np.abs(p - df["acc"].to_numpy())[some] / df["acc"].to_numpy()[some]
    assert fit.fit_rel_err == pytest.approx(rel.mean(), rel=1e-12)
    assert fit.fit_max_rel_err == pytest.approx(rel.max(), rel=1e-12)


# --- tasks ----------------------------------------------------------------------------------------------------
def _lis(xs):
    tails = []  # patience sorting: an independent O(n log n) LIS
    for v in xs:
        i = bisect.bisect_left(tails, v)
        tails[i:i + 1] = [v]
    return len(tails)


def _linear(x0, maps, p):
    A, B = 1, 0  # compose the affine maps first, then apply once
    for a, b in maps:
        A, B = a * A % p, (a * B + b) % p
    return (A * x0 + B) % p


def independent(task, prob, modulus=10, prime=7, **_):
    f = ["".join(x) for x in prob.fields]
    return {"copy": lambda: f[0], "reversal": lambda: f[0][::-1], "sorting": lambda: "".join(sorted(f[0])),
            "addition": lambda: str(int(f[0]) + int(f[1])), "multiplication": lambda: str(int(f[0]) * int(f[1])),
            "running_sum": lambda: str(sum(map(int, f[0])) % modulus),
            "lis": lambda: str(_lis([int(v) for v in prob.fields[0]])),
            "linear_maps": lambda: str(_linear(int(f[0]), [(int(m[0]), int(m[1])) for m in prob.fields[1]], prime)),
            }[task]()


@pytest.mark.parametrize("task", list(TASKS))
def test_generators_agree_with_an_independent_solution(task):
    for seed in range(1000):
        rng = random.Random(seed)
        n = rng.randint(1, 30)
        prob = problem(task, n, rng)
        assert prob.answer == independent(task, prob), (task, seed, prob)
        assert max(len(f) for f in prob.fields) == n or task == "multiplication" and len(prob.fields[0]) == n


@pytest.mark.parametrize("fmt", FORMATS)
def test_formats_score_their_own_gold(fmt):
    for task in TASKS:
        inst = instance(task, 9, 0, fmt)
        assert canonical(inst["gold"], fmt) == inst["answer"]
        assert canonical("Let me think.\nAnswer: " + inst["gold"], fmt) == inst["answer"]
        assert instance(task, 9, 0, "plain")["answer"] == inst["answer"]  # same problem in both formats
    prompt, gold = render("reversal", problem("reversal", 5, random.Random(3)), "delimited", chunk=4)
    assert prompt.startswith("rev:a") and "|b" in prompt and gold[0] == "a" and gold.count("|") == 1


def test_char_tokenizer_is_one_token_per_symbol():
    from datamodules.common.tokenizer import char_tokenizer

    tok = char_tokenizer(vocab_size=64)
    text = instance("linear_maps", 7, 0, "delimited")["prompt"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    for task in TASKS:  # every symbol of every task's prompts and answers is in the alphabet (never <|unk|> = 2)
        for fmt in FORMATS:
            inst = instance(task, 12, 1, fmt)
            assert min(tok(inst["prompt"] + inst["gold"], add_special_tokens=False)["input_ids"]) >= 3, (task, fmt)
    assert tok.eos_token_id == 0 and tok.pad_token_id == 1
    with pytest.raises(ValueError, match="vocab_size"):
        char_tokenizer(vocab_size=10)


def test_training_batches_supervise_the_answer_only():
    from datamodules.common.tokenizer import char_tokenizer

    dm = ErrorLawDataModule(char_tokenizer(), batch_size=4, train_n_max=6)
    batch = next(iter(dm.train_dataloader()))
    for ids, lab in zip(batch["input_ids"], batch["labels"]):
        text = dm.tokenizer.decode(ids[lab != -100], skip_special_tokens=True)
        full = dm.tokenizer.decode(ids, skip_special_tokens=True)
        assert full.endswith(text) and full[: len(full) - len(text)].endswith("=")


@pytest.mark.parametrize("kw, match", [({"n_grid": [0, 2]}, "positive"), ({"tasks": ["copy", "division"]}, "unknown"),
                                       ({"formats": ["bold"]}, "format")])
def test_bad_data_input(kw, match):
    with pytest.raises(ValueError, match=match):
        ErrorLawDataModule(None, **kw)


def test_bad_model_input(monkeypatch):
    from lightning_modules.error_law.module import ErrorLawModule

    with pytest.raises(ValueError, match="q_half"):
        ErrorLawModule({"family": "llama"}, shape="q3")
    with pytest.raises(ValueError, match="url"):
        ErrorLawModule(backend="endpoint", endpoint={"url": None, "model": "m"})


# --- the endpoint client ----------------------------------------------------------------------------------------
class Stub(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint: fails the first ``fail`` requests with HTTP 500, then answers copy
    problems of up to 4 digits right (the 'Input:' line) and everything else with 'Answer: 0'."""

    log: list = []
    fail = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.log.append({"auth": self.headers.get("Authorization"), "body": body})
        if Stub.fail > 0:
            Stub.fail -= 1
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"overloaded")
            return
        text = body["messages"][-1]["content"]
        line = next((ln for ln in text.splitlines() if ln.startswith("Input: ")), "Input: ")
        right = text.startswith("Copy") and len(line) <= 7 + 8  # inputs of <= 8 characters: n <= 4 here
        reply = "Answer: " + (line[7:] if right else "0")
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    Stub.log, Stub.fail = [], 0
    server = HTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_endpoint_retries_caches_and_sends_the_key(stub, tmp_path, monkeypatch):
    from lightning_modules.common.endpoint import EndpointClient, EndpointError

    monkeypatch.setenv("PAPERLAB_TEST_KEY", "sk-test")
    client = EndpointClient(stub, "stub-model", "PAPERLAB_TEST_KEY", cache_dir=tmp_path, backoff=0.01,
                            params={"temperature": 0})
    Stub.fail = 1
    assert client.chat("Copy the digit sequence exactly.\nInput: 1234") == "Answer: 1234"
    assert client.stats == {"requests": 2, "retries": 1, "cache_hits": 0} and len(Stub.log) == 2
    assert Stub.log[-1]["auth"] == "Bearer sk-test"
    assert Stub.log[-1]["body"]["model"] == "stub-model" and Stub.log[-1]["body"]["temperature"] == 0
    assert client.chat("Copy the digit sequence exactly.\nInput: 1234") == "Answer: 1234"  # the cache answers
    assert client.stats["cache_hits"] == 1 and len(Stub.log) == 2
    assert "sk-test" not in "".join(p.read_text() for p in tmp_path.rglob("*.json"))
    Stub.fail = 10
    with pytest.raises(EndpointError, match="500"):
        EndpointClient(stub, "m", None, max_retries=2, backoff=0.01).chat("x")
    monkeypatch.delenv("PAPERLAB_TEST_KEY")
    with pytest.raises(ValueError, match="PAPERLAB_TEST_KEY"):
        EndpointClient(stub, "m", "PAPERLAB_TEST_KEY").check()


def test_endpoint_backend_runs_the_grid(stub, tmp_path, monkeypatch):
    monkeypatch.setenv("PAPERLAB_TEST_KEY", "sk-test")
    ep = f"{{url:'{stub}',model:stub,api_key_env:PAPERLAB_TEST_KEY,cache_dir:'{tmp_path / 'cache'}',backoff:0.01}}"
    _, metrics = run_experiment("error_law_tiny", tmp_path / "run", overrides=[
        "task=test", "model.backend=endpoint", f"model.endpoint={ep}",
        "data.tasks=[copy,addition]", "data.formats=[delimited]", "data.n_grid=[2,4,8]", "data.samples_per_n=3"])
    res = metrics["results"]["error_law"]
    got = {(r["task"], r["n"]): (r["k"], r["m"]) for r in res["rows"]}
    assert [got[("copy", n)] for n in (2, 4, 8)] == [(3, 3), (3, 3), (0, 3)]  # the stub copies up to 4 digits
    assert all(got[("addition", n)] == (0, 3) for n in (2, 4, 8))  # and answers 0 to sums
    assert set(res["fits"]["groups"]) == {"copy/delimited"}  # fitted; all-wrong addition is skipped as degenerate
    assert "degenerate" in res["fits"]["skipped"]["addition/delimited"]
    assert len(Stub.log) == 1 + 18 and res["model"] == "stub"  # the probe, then one request per instance


def test_endpoint_backend_refuses_an_unset_key(stub, tmp_path, monkeypatch):
    monkeypatch.delenv("PAPERLAB_TEST_KEY", raising=False)
    ep = f"{{url:'{stub}',model:stub,api_key_env:PAPERLAB_TEST_KEY}}"
    with pytest.raises(ValueError, match="PAPERLAB_TEST_KEY"):
        run_experiment("error_law_tiny", tmp_path, overrides=["task=test", "model.backend=endpoint",
                                                              f"model.endpoint={ep}",])
    assert Stub.log == []


# --- the tiny run -----------------------------------------------------------------------------------------------
def test_error_law_tiny_smoke(tmp_path):
    """debug=smoke shortens training; the grid and the instances per n are shrunk by overrides."""
    _, metrics = run_experiment("error_law_tiny", tmp_path, overrides=[
        "debug=smoke", "data.n_grid=[2,6,10]", "data.samples_per_n=4"])
    res = metrics["results"]["error_law"]
    assert [(r["task"], r["format"], r["n"], r["m"]) for r in res["rows"]] == [
        (t, f, n, 4) for t in ("copy", "reversal") for f in ("delimited", "plain") for n in (2, 6, 10)]
    fits = res["fits"]  # after 20 steps a group is often all wrong: skipped as degenerate, else every law fitted
    assert set(fits["groups"]) | set(fits["skipped"]) == {"copy/delimited", "copy/plain", "reversal/delimited",
                                                          "reversal/plain"}
    for label, g in fits["groups"].items():
        assert set(g["laws"]) == {"error_gamma", "error_gamma_q", "exponential", "logistic_log_n"}
        assert f"test/r/{label}" in metrics["final"]
    assert "test/accuracy" in metrics["final"]


def test_error_table_and_fit_cli(tmp_path):
    from lightning_modules.error_law.law import error_table
    from sweeps.collect import collect
    from sweeps.fit import main

    rows = [{"task": "copy", "format": "plain", "n": float(n), "k": int(k), "m": 500, "acc": k / 500}
            for n, k in zip(N_GRID, counts(acc(0.02, 3.0, N_GRID))["k"])]
    job = tmp_path / "multirun" / "0"
    job.mkdir(parents=True)
    (job / "metrics.json").write_text(json.dumps({"status": "ok", "final": {},
                                                  "results": {"error_law": {"rows": rows, "model": "m"}}}))
    table = error_table(collect(tmp_path / "multirun")[0])
    assert len(table) == len(N_GRID) and list(table["k"]) == [r["k"] for r in rows]
    out = tmp_path / "fit"
    assert main([str(tmp_path / "multirun"), "--law", "error_gamma", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "fit_fit.json").read_text())
    assert report["groups"]["copy/plain"]["laws"]["error_gamma"]["constants"]["r"] == pytest.approx(0.02, rel=0.1)
    assert (tmp_path / "fit.png").exists()
