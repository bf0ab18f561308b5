"""SVEB's problems as the release draws them: a field's file stratified by the policy's own difficulty.

The spec (3.4) names the fields (number, math, science, general, program) and "up to 3000 per field", nothing more.
The release's scripts (``scripts/process/select_3B.sh``, ``scripts/construction/sveb_3B.sh``) sample every problem 20
times with Qwen2.5-3B-Instruct, keep three tiers of pass rate, (0.07, 0.17], (0.17, 0.37] and (0.37, 0.77], and draw
1,000 of each (seeded) into the field's SVEB file; the number field further keeps problems whose correct responses
hold >= 4 intermediate numbers (Numca needs them). :class:`SVEBDataModule` does the tier draw on a local file whose
records carry a pass rate (``pass_rate_field``, or the release's ``correct_responses`` / ``wrong_responses`` lists);
the sampling itself and the number-count filter are the file's (they need the 3B model). Gold answers are kept as
stored (the release's ``solution`` holds the bare final answer), for the math-verify reward.
"""
from __future__ import annotations

import random

from datamodules.common.miniature import register_layout
from datamodules.verifiable import VerifiableDataModule

RELEASE_TIERS = ((0.07, 0.17), (0.17, 0.37), (0.37, 0.77))


def pass_rate(record: dict, field: str) -> float | None:
    """The record's pass rate: ``field`` if present, else correct / (correct + wrong) of the release's lists."""
    if record.get(field) is not None:
        return float(record[field])
    correct, wrong = record.get("correct_responses"), record.get("wrong_responses")
    if correct is None or wrong is None or not (len(correct) + len(wrong)):
        return None
    return len(correct) / (len(correct) + len(wrong))


def stratify(records: list[dict], rates: list[float | None], tiers, per_tier: int, seed: int) -> list[dict]:
    """``per_tier`` records drawn (seeded, without replacement) from each tier (lower, upper] of pass rate, then
    shuffled; a tier with fewer records gives them all."""
    rng = random.Random(seed)
    out = []
    for lower, upper in tiers:
        pool = [r for r, p in zip(records, rates) if p is not None and lower < p <= upper]
        out += rng.sample(pool, min(per_tier, len(pool)))
    rng.shuffle(out)
    return out


class SVEBDataModule(VerifiableDataModule):
    """``test_files``: the field's problems with pass rates, drawn by :func:`stratify` (``tiers``, ``per_tier``);
    ``files`` stay the training problems (ppo-1's critic is fitted outside SVEB)."""

    def __init__(self, *args, tiers=RELEASE_TIERS, per_tier: int = 1000, pass_rate_field: str = "pass_rate", **kwargs):
        super().__init__(*args, **kwargs)
        tiers = [tuple(float(x) for x in t) for t in tiers]
        if not tiers or any(len(t) != 2 or not 0 <= t[0] < t[1] <= 1 for t in tiers) or per_tier < 1:
            raise ValueError(f"data.tiers={tiers}, data.per_tier={per_tier}: tiers are (lower, upper] pass-rate "
                             "intervals in [0, 1] with lower < upper, per_tier >= 1")
        if not self.test_files:
            raise ValueError("SVEB needs data.test_files: the field's problems with their pass rates")
        self.tiers, self.per_tier, self.pass_rate_field = tiers, per_tier, pass_rate_field

    def all_problems(self) -> dict[str, list[dict]]:
        out = super().all_problems()
        out["test"] = self.stratified()
        return out

    def stratified(self) -> list[dict]:
        from datamodules.common.loaders import load_local

        qf = self.question_field or ("question" if self.task == "gsm8k" else "problem")
        af = self.answer_field or ("answer" if self.task == "gsm8k" else "solution")
        records = load_local(self.test_files, field=qf).to_list()
        rates = [pass_rate(r, self.pass_rate_field) for r in records]
        if all(p is None for p in rates):
            raise ValueError(f"{self.test_files}: no record has a pass rate ({self.pass_rate_field!r} or correct_responses"
                             " / wrong_responses): sample the problems first, or set data.pass_rate_field")
        picked = stratify(records, rates, self.tiers, self.per_tier, self.seed)
        problems = [{"question": r[qf], "solution": str(r[af]), "answer": str(r[af]).strip()} for r in picked]
        return problems if self.n["test"] is None else problems[: self.n["test"]]


@register_layout("sveb/*.jsonl")
def write_sveb_field(target, cfg) -> None:
    """A field's SVEB file as the release writes it: MATH-style ``problem`` with the bare final answer as
    ``solution``, and each problem's pass rate (cycling over the three release tiers)."""
    from datamodules.common.miniature import _math_records, write_jsonl

    rates = (0.1, 0.25, 0.5)
    rows = [{"problem": r["problem"], "solution": r["answer"], "pass_rate": rates[i % 3]}
            for i, r in enumerate(_math_records(48, 9))]
    target.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(target, rows)
