"""SVEB, the State Value Estimation Benchmark (spec 3.4), run as the test loop of a policy (task=test).

Per test problem: ``group_size`` (32) samples → their mean binarised reward is V_grpo; the first sample is cut at a
random space (a token boundary where the next token starts with a space); ``mcs_num`` (20) continuations of that
prefix → V_mc, the unbiased target. Estimators of V at the cut:

- ``hista``: the 32 samples' last-layer states as the library (sample 0 is the online rollout; its own longer nodes
  are masked), ``hista.cut_value``;
- ``numca``: the 32 samples' table, ``numca.cut_value`` (characters, merge gap 50, λ = 0);

``sveb_protocol`` (both estimators): ``release`` (default: the release's ``sveb/{hista,numca}`` scripts, so the MAEs
compare with the paper's) — Hista takes the state node just before the cut with k scheduled over all of the
response's nodes; Numca sums the λ = 0 advantages where they change, so numbers merged past the cut and a δ equal to
the next one are skipped — or ``exact`` (ours before: Hista on the exact cut prefix, Numca V of the state the cut
reached). On synthetic cases 98% (Hista) and 26% (Numca) of the estimates differ between the two.
- ``ppo-1`` / ``ppo-n``: a value head on the frozen policy's states fitted by regression to each response's
  reward on ``critic_tokens`` random tokens per response (``rl/critic.py``; ridge chosen on held-out problems,
  clamped to [0, 1]), on ``critic_problems`` training
  problems (outside SVEB) / on 80% of the SVEB problems (by hash), scored on the other 20%.

Metrics (:func:`sveb_metrics`, also over stored JSON): MAE(V_est, V_mc) per estimator, MAE(V_grpo, V_mc), and
the noise floor: MAE of the mean of the first n continuations against V_mc, n = 1 … mcs_num. Every case (texts,
rewards, cut, estimates) is kept in ``results["sveb"]["cases"]`` (metrics.json). Fields: ``number`` and ``math``
only (exact-match rewards); science / general / program need an LLM judge or a sandbox.
"""
from __future__ import annotations

import random

import torch

from datamodules.common.cache import stable_hash
from lightning_modules.hista.critic import ValueHead
from lightning_modules.common.rl.rollouts import batched_logprobs, generate_rollouts
from lightning_modules.hista import hista as hista_values, numca as numca_values
from lightning_modules.hista.hista import representations, state_positions
from lightning_modules.hista.module import HistaModule
from lightning_modules.hista.numca import SVEB_PROTOCOLS, NumcaTable, parse_numbers

FIELDS = ("number", "math")
JUDGED = ("science", "general", "program")


def check_field(field: str) -> None:
    if field in JUDGED:
        raise ValueError(f"model.sveb_field={field}: that field needs an external LLM judge or code sandbox, which "
                         f"this benchmark does not run; use one of {', '.join(FIELDS)}")
    if field not in FIELDS:
        raise ValueError(f"model.sveb_field={field!r}: choose one of {', '.join(FIELDS)}")


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def sveb_metrics(cases: list[dict]) -> dict:
    """MAE of every estimator and of V_grpo against V_mc, and the noise MAE for 1 … n continuations (the first n)."""
    if not cases:
        raise ValueError("SVEB has no case: every problem's first response lacked a space to cut at")
    v_mc = [_mean(c["mc_rewards"]) for c in cases]
    out = {"cases": len(cases), "mae/grpo": _mean([abs(_mean(c["grpo_rewards"]) - v) for c, v in zip(cases, v_mc)])}
    for name in sorted({n for c in cases for n, x in c["estimates"].items() if x is not None}):
        errs = [abs(c["estimates"][name] - v) for c, v in zip(cases, v_mc) if c["estimates"].get(name) is not None]
        out[f"mae/{name}"] = _mean(errs)
        out[f"n/{name}"] = len(errs)
    n_mc = min(len(c["mc_rewards"]) for c in cases)
    out["noise_mae"] = [_mean([abs(_mean(c["mc_rewards"][:n]) - v) for c, v in zip(cases, v_mc)])
                        for n in range(1, n_mc + 1)]
    return out


def cut_points(pieces: list[str]) -> list[int]:
    """Token counts t at which a prefix may end: the next token begins with a space."""
    return [t for t in range(1, len(pieces)) if pieces[t].startswith(" ")]


class SVEBModule(HistaModule):
    def __init__(self, *args, mcs_num: int = 20, sveb_field: str = "number", critic_problems: int = 64,
                 critic_tokens: int = 8, critic_split: float = 0.8, sveb_seed: int = 42, sveb_protocol: str = "release",
                 **kwargs):
        super().__init__(*args, **kwargs)
        check_field(sveb_field)
        if sveb_protocol not in SVEB_PROTOCOLS:
            raise ValueError(f"model.sveb_protocol={sveb_protocol!r}: choose release or exact")
        self.sveb_protocol = sveb_protocol
        if mcs_num < 1 or critic_tokens < 1 or not 0 < critic_split < 1:
            raise ValueError("model.mcs_num and model.critic_tokens must be >= 1, model.critic_split in (0, 1)")
        self.mcs_num, self.sveb_field, self.critic_problems = mcs_num, sveb_field, critic_problems
        self.critic_tokens, self.critic_split, self.sveb_seed = critic_tokens, critic_split, sveb_seed
        self.results: dict = {}

    # --- sampling ---------------------------------------------------------------------------------------
    def sample(self, prompt_ids, prompt: str, answer: str, n: int, max_new: int, prefix_text: str = ""):
        tok = self.get_tokenizer()
        ro = generate_rollouts(self.model, [prompt_ids], n, max_new, tok.eos_token_id, tok.pad_token_id,
                               self.temperature, self.top_p, tokenizer=tok, top_k=self.top_k)
        r = self.reward([prompt] * n, [prefix_text + c for c in ro.completions], [answer] * n, device=self.device)
        ro.rewards = (r.float() > 0.5).float().to(ro.input_ids.device)  # binarised
        return ro

    def token_features(self, ro, states, gen: torch.Generator):
        """``critic_tokens`` random response-token states per response, labelled with its reward."""
        feats, targets = [], []
        for i, s in enumerate(states):
            p, n = int(ro.prompt_lengths[i]), int(ro.lengths[i])
            pick = torch.randperm(n, generator=gen)[:self.critic_tokens]
            feats.append(s[p + pick].float().cpu())
            targets.append(ro.rewards[i].cpu().expand(len(pick)))
        return torch.cat(feats), torch.cat(targets)

    def states(self, ro):
        hidden = batched_logprobs(self.model, ro, ro.lengths, self.micro_batch_size, self.temperature, True)[1]
        return [hidden[i][ro.attention_mask[i].bool()] for i in range(len(ro))]

    # --- the test loop ------------------------------------------------------------------------------------
    def on_test_epoch_start(self):
        self._cases, self._feats = [], []
        self._gen = torch.Generator().manual_seed(self.sveb_seed)
        feats, targets, groups = [], [], []
        dm = self.trainer.datamodule
        for g, item in enumerate([dm.train_set[i] for i in range(min(self.critic_problems, len(dm.train_set)))]):
            ro = self.sample(item["prompt_ids"], item["prompt"], item["answer"], self.group_size, self.max_new_tokens)
            f, t = self.token_features(ro, self.states(ro), self._gen)  # ppo-1's data: problems outside SVEB
            feats.append(f)
            targets.append(t)
            groups.append(torch.full((len(t),), g))
        self._critic1 = (torch.cat(feats), torch.cat(targets), torch.cat(groups)) if feats else None

    @torch.no_grad()
    def test_step(self, batch, batch_idx):
        for prompt_ids, prompt, answer, pid in zip(batch["prompt_ids"], batch["prompt"], batch["answer"], batch["id"]):
            self.sveb_case(prompt_ids, prompt, answer, pid)

    def sveb_case(self, prompt_ids, prompt, answer, pid) -> None:
        tok, cfg = self.get_tokenizer(), self.hista
        ro = self.sample(prompt_ids, prompt, answer, self.group_size, self.max_new_tokens)
        n0 = int(ro.lengths[0])
        pieces = tok.batch_decode([[t] for t in ro.response_ids[0, :n0].tolist()], skip_special_tokens=True)
        cuts = cut_points(pieces)
        if not cuts:
            return
        t = random.Random(f"{self.sveb_seed}:{pid}").choice(cuts)
        prefix = "".join(pieces[:t])
        cont = self.sample(list(prompt_ids) + ro.response_ids[0, :t].tolist(), prompt, answer, self.mcs_num,
                           self.max_new_tokens - t, prefix_text=prefix)
        # Numca: the 32 samples' table, the value at the cut (characters, merge gap 50, λ = 0)
        table = NumcaTable()
        for c, r in zip(ro.completions, ro.rewards.tolist()):
            table.update(pid, [x for x, _ in parse_numbers(c)], r)
        text = "".join(pieces)
        numca = numca_values.cut_value(table, pid, parse_numbers(text), float(ro.rewards[0]), len(text), len(prefix),
                                       protocol=self.sveb_protocol)
        # Hista: sample 0 at the cut against every (sample, state) node
        states = self.states(ro)
        plens, lengths = ro.prompt_lengths.tolist(), ro.lengths.tolist()
        reps = representations(states, cfg)
        pos = [state_positions(plens[i], lengths[i], cfg.min_interval, cfg.state_grid) for i in range(len(ro))]
        cut_at = plens[0] + t - 1  # the prefix's last token
        hista = hista_values.cut_value(reps, pos, ro.rewards, cut_at, cfg, self.sveb_protocol)
        self._cases.append({"id": pid, "field": self.sveb_field, "prompt": prompt, "answer": answer,
                            "responses": ro.completions, "grpo_rewards": ro.rewards.tolist(), "cut_tokens": t,
                            "prefix": prefix, "continuations": cont.completions, "mc_rewards": cont.rewards.tolist(),
                            "estimates": {"hista": hista, "numca": numca}})
        f, y = self.token_features(ro, states, self._gen)
        self._feats.append((states[0][cut_at].float().cpu(), f, y))

    def on_test_epoch_end(self):
        cases = self._cases
        if cases:
            cut = torch.stack([c for c, _, _ in self._feats])
            if self._critic1 is not None:
                v1 = ValueHead(cut.shape[-1]).fit_cv(*self._critic1)(cut).clamp(0, 1)
                for c, v in zip(cases, v1.tolist()):
                    c["estimates"]["ppo-1"] = v
            train = [int(stable_hash(c["id"]), 16) % 1000 < 1000 * self.critic_split for c in cases]
            if any(train) and not all(train):
                rows = [(f, y, torch.full((len(y),), i)) for i, ((_, f, y), tr) in enumerate(zip(self._feats, train)) if tr]
                head = ValueHead(cut.shape[-1]).fit_cv(*(torch.cat(x) for x in zip(*rows)))
                vn = head(cut).clamp(0, 1)  # a value of 0/1 rewards
                for c, v, tr in zip(cases, vn.tolist(), train):
                    c["estimates"]["ppo-n"] = None if tr else v
        metrics = sveb_metrics(cases)
        for k, v in metrics.items():
            if k.startswith("mae/"):
                self.log(f"test/mae_{k[4:].replace('-', '_')}", float(v), sync_dist=False)
        self.log("test/noise_mae_1", float(metrics["noise_mae"][0]), sync_dist=False)  # one continuation vs all
        self.results["sveb"] = {"metrics": metrics, "cases": cases}
