"""``python -m benchmarks.kernels`` runs end to end on CPU at tiny sizes and writes its tables."""
import re


def test_kernels_benchmark_quick_on_cpu(tmp_path, tiny_lm_dir):
    from benchmarks.kernels import main

    out = tmp_path / "kernels.md"
    assert main(["--cpu", "--quick", "--reps", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "the Triton kernels need CUDA" in text
    tables = {m.group(1): m.group(2) for m in re.finditer(r"### (\w+):.*?\n\n(.*?)(?=\n###|\Z)", text, re.S)}
    assert set(tables) == {"fake_quant", "w4a16", "bytes", "attention"}
    assert len([r for r in tables["fake_quant"].splitlines() if r.startswith("| float32") or r.startswith("| bfloat16")]) == 4
    assert "| tiny | square | 256×256 | 4 |" in tables["w4a16"]
    # tiny-lm exported for real: packed memory and disk below half the fp32 model's (embeddings stay fp32)
    row = next(r for r in tables["bytes"].splitlines() if r.startswith("| tiny-lm"))
    head = next(r for r in tables["bytes"].splitlines() if r.startswith("| model"))
    cells = dict(zip([c.strip() for c in head.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))
    assert int(cells["quantized linears"]) == 28 and 2 < float(cells["fp / packed"]) < 2.2
    assert float(cells["packed MiB disk"]) < 0.5 * float(cells["fp MiB disk"])
    try:
        import benchmarks.attention  # noqa: F401
    except ImportError:
        assert "benchmarks/attention.py is not present: the attention section is skipped." in tables["attention"]


def test_markdown_drops_empty_columns():
    from benchmarks.kernels import markdown

    text = markdown("t", [{"a": 1.0, "b": None}, {"a": 2.5, "b": None, "c": "x"}])
    assert "| a | c |" in text and "| 2.5 | x |" in text and "b" not in text.split("### t")[1]
