"""``python -m benchmarks.kernels`` runs end to end on CPU at tiny sizes and writes its tables."""
import re


def _row(table: str, start: str) -> dict[str, str]:
    """The cells of the first row starting with ``start``, by column name."""
    lines = table.splitlines()
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    return dict(zip(split(next(r for r in lines if r.startswith("| model") or r.startswith("| dtype"))),
                    split(next(r for r in lines if r.startswith(start)))))


def test_kernels_benchmark_quick_on_cpu(tmp_path, tiny_lm_dir):
    from benchmarks.kernels import main

    out = tmp_path / "kernels.md"
    assert main(["--cpu", "--quick", "--reps", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "the Triton kernels need CUDA" in text
    tables = {m.group(1): m.group(2) for m in re.finditer(r"### (\w+):.*?\n\n(.*?)(?=\n###|\Z)", text, re.S)}
    assert set(tables) == {"fake_quant", "w4a16", "bytes", "attention"}
    # the interpreter (tests/conftest.py sets it) runs the Triton columns too at --quick: their code path, with the
    # equality checks the GPU run reports
    fq = [r for r in tables["fake_quant"].splitlines() if r.startswith("| float32")]
    assert len(fq) == 2 and all(r.rstrip(" |").endswith("True") for r in fq)  # bitwise equal, symmetric and not
    mm = _row(tables["w4a16"], "| tiny | square | 256×256 | 4 |")
    assert float(mm["max rel err"]) < 1e-5 and float(mm["fwd triton ms"]) > 0 and float(mm["fwd reference ms"]) > 0
    # tiny-lm exported for real: packed memory and disk below half the fp32 model's (embeddings stay fp32)
    tiny = _row(tables["bytes"], "| tiny-lm")
    assert int(tiny["quantized linears"]) == 28 and 2 < float(tiny["fp / packed"]) < 2.2
    assert float(tiny["packed MiB disk"]) < 0.5 * float(tiny["fp MiB disk"])
    # block-sparse attention against causal SDPA (benchmarks.attention.kernel_rows): every quick cell measured
    att = [r for r in tables["attention"].splitlines() if r.startswith(("| hici_shift_g", "| rlkv_token"))]
    assert len(att) == 2 and all("error" not in r for r in att)
    auto = _row(tables["attention"].replace("| case", "| model", 1), "| rlkv_token | auto")
    assert float(auto["peak_MiB"]) > 0 and float(auto["mem_x"]) > 0


def test_markdown_drops_empty_columns():
    from benchmarks.kernels import markdown

    text = markdown("t", [{"a": 1.0, "b": None}, {"a": 2.5, "b": None, "c": "x"}])
    assert "| a | c |" in text and "| 2.5 | x |" in text and "b" not in text.split("### t")[1]
