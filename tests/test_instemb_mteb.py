"""The mteb adapter of InstEmb (lightning_modules/instemb/mteb_eval.py): it embeds as InstEmbModule.encode does,
whatever the batching, in the shape mteb takes; a run dir round-trips; bad task names and a missing mteb say what
to do. mteb itself is not needed (it is the instemb extra): the batches are built as mteb 2.x builds them."""
import sys
import types

import numpy as np
import pytest
import torch
import yaml

from lightning_modules.instemb import mteb_eval
from lightning_modules.instemb.module import InstEmbModule
from lightning_modules.instemb.mteb_eval import ALIASES, INSTALL, MtebEncoder, load_module, resolve_tasks

CONFIG = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 2}
KW = {"n_lookahead": 3, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "views": ["s1", "teacher_input"],
      "max_length": 64}
TEXTS = ["A small red cube lies in the kitchen.", "In the attic there is a tiny blue ball.", "x",
         "The large star in the office is green and sits beside a lamp.", "A cone."]
QUESTION = "What colour is the object?"


@pytest.fixture(scope="module")
def module(tiny_tokenizer):
    torch.manual_seed(0)
    m = InstEmbModule({"family": "llama", "config": {**CONFIG, "vocab_size": len(tiny_tokenizer)}}, **KW)
    m.tokenizer = tiny_tokenizer
    m.configure_model()
    with torch.no_grad():  # trained-looking weights: LoRA's B starts at 0, the look-ahead at EOS
        for name, p in m.named_parameters():
            if "lora_B" in name or name == "lookahead":
                p.add_(torch.randn_like(p) * 0.3)
    return m.eval()


def test_embeds_as_the_module_does(module):
    enc = MtebEncoder(module)
    meta = types.SimpleNamespace(name="Toy", prompt=QUESTION)
    got = enc.encode(TEXTS, task_metadata=meta, batch_size=2)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (len(TEXTS), CONFIG["hidden_size"])
    assert np.allclose(got, module.encode(TEXTS, QUESTION).numpy(), atol=1e-6)
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)  # DAAP is normalised: cosine = dot
    # the instruction matters (else the adapter could be dropping it)
    assert not np.allclose(got, enc.encode(TEXTS, batch_size=2), atol=1e-3)
    for how in ("last", "mean"):
        assert np.allclose(MtebEncoder(module, pooling=how).encode(TEXTS, task_metadata=meta),
                           module.encode(TEXTS, QUESTION, pooling=how).numpy(), atol=1e-6)


def test_batching_does_not_change_embeddings(module):
    enc = MtebEncoder(module)
    one = enc.encode(TEXTS, batch_size=1)
    for bs in (2, 3, len(TEXTS)):
        assert np.allclose(enc.encode(TEXTS, batch_size=bs), one, atol=1e-5), bs
    # mteb 2.x hands a DataLoader of {"text": [...]} batches
    loader = [{"text": TEXTS[:3]}, {"text": TEXTS[3:]}]
    assert np.allclose(enc.encode(loader, task_metadata=None, hf_split="test", hf_subset="default"), one, atol=1e-5)


def test_followir_queries_keep_their_instruction_apart(module):
    """mteb joins a FollowIR query with its instruction into ``text``; InstEmb gets the two parts in their slots."""
    queries, instructions = TEXTS[:3], ["Relevant: red things.", QUESTION, "Where is it?"]
    batch = {"id": ["q1", "q2", "q3"], "text": [f"{q} {i}" for q, i in zip(queries, instructions)],
             "query": queries, "instruction": instructions}
    enc = MtebEncoder(module)
    got = enc.encode([batch], task_metadata=types.SimpleNamespace(name="Robust04InstructionRetrieval", prompt=None),
                     prompt_type="query")
    assert np.allclose(got, module.encode(queries, instructions).numpy(), atol=1e-6)
    # documents: the task's instruction for their prompt type, overridden per task by ``prompts``
    meta = types.SimpleNamespace(name="T", prompt={"query": "Q?", "document": "D?"})
    docs = [{"id": ["d1", "d2"], "text": TEXTS[3:]}]
    assert np.allclose(enc.encode(docs, task_metadata=meta, prompt_type=types.SimpleNamespace(value="document")),
                       module.encode(TEXTS[3:], "D?").numpy(), atol=1e-6)
    assert np.allclose(MtebEncoder(module, {"T": QUESTION}).encode(docs, task_metadata=meta, prompt_type="document"),
                       module.encode(TEXTS[3:], QUESTION).numpy(), atol=1e-6)


def test_generic_task_instruction_as_mteb_picks(module, monkeypatch):
    """A task without a prompt gets its task type's generic instruction from mteb, none when mteb is absent."""
    meta = types.SimpleNamespace(name="SomeRetrieval", prompt=None)
    monkeypatch.setitem(sys.modules, "mteb", None)
    assert np.allclose(MtebEncoder(module).encode(TEXTS, task_metadata=meta), module.encode(TEXTS, "").numpy(), atol=1e-6)
    asked = []
    fake = types.SimpleNamespace(get_abstask_prompt=lambda name: asked.append(name) or "Retrieve text.")
    for name, mod in [("mteb", types.ModuleType("mteb")), ("mteb.abstasks", types.ModuleType("mteb.abstasks")),
                      ("mteb.abstasks.abstask", fake)]:
        monkeypatch.setitem(sys.modules, name, mod)
    got = MtebEncoder(module).encode(TEXTS, task_metadata=meta)
    assert asked == ["SomeRetrieval"] and np.allclose(got, module.encode(TEXTS, "Retrieve text.").numpy(), atol=1e-6)


def test_run_dir_round_trip(module, tiny_tokenizer, tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "checkpoints").mkdir()
    model = {"_target_": "lightning_modules.instemb.module.InstEmbModule", "backbone": "${backbone}", **KW,
             "warmup": {"task": "instemb_objects", "steps": 10},  # not rebuilt: the checkpoint has every weight
             "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-4}}
    cfg = {"backbone": {"family": "llama", "config": {**CONFIG, "vocab_size": len(tiny_tokenizer)}}, "model": model}
    (tmp_path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    torch.save({"state_dict": module.state_dict(), "global_step": 7}, tmp_path / "checkpoints" / "last.ckpt")
    loaded = load_module(tmp_path)
    assert loaded.warmup is None
    assert np.allclose(loaded.encode(TEXTS, QUESTION).numpy(), module.encode(TEXTS, QUESTION).numpy(), atol=1e-6)
    assert torch.equal(load_module(tmp_path / "checkpoints" / "last.ckpt").lookahead, module.lookahead)
    with pytest.raises(ValueError, match="no checkpoint at"):
        load_module(tmp_path / "checkpoints" / "best.ckpt")
    with pytest.raises(ValueError, match="config.yaml; pass the run dir"):
        load_module(tmp_path / "checkpoints")


def test_task_names():
    available = ["Robust04InstructionRetrieval", "News21InstructionRetrieval", "Core17InstructionRetrieval",
                 "STSBenchmark"]
    assert resolve_tasks(["FollowIR", "STSBenchmark", "FollowIR-Core17"], available) == available
    with pytest.raises(ValueError, match=r"unknown mteb task 'STSBenchmrk': .*closest: \['STSBenchmark'\].*FollowIR"):
        resolve_tasks(["STSBenchmrk"], available)
    assert set(ALIASES["FollowIR"]) <= set(available)


@pytest.fixture
def offline_env(monkeypatch):  # main() sets these; restore them after
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(k, "1")


def test_cli_messages(monkeypatch, tmp_path, offline_env, capsys):
    argv = ["--checkpoint", str(tmp_path), "--tasks", "FollowIR-Robust4", "--output", str(tmp_path / "out")]
    monkeypatch.setitem(sys.modules, "mteb", None)  # not installed
    with pytest.raises(SystemExit) as exc:
        mteb_eval.main(argv)
    assert str(exc.value) == f"mteb_eval: {INSTALL}"
    tasks = [types.SimpleNamespace(metadata=types.SimpleNamespace(name=n)) for n in ALIASES["FollowIR"]]
    monkeypatch.setitem(sys.modules, "mteb", types.SimpleNamespace(get_tasks=lambda **kw: tasks))
    with pytest.raises(SystemExit) as exc:  # the task name is checked before the checkpoint is looked for
        mteb_eval.main(argv)
    assert "unknown mteb task 'FollowIR-Robust4'" in str(exc.value) and "FollowIR-Robust04" in str(exc.value)
    with pytest.raises(SystemExit) as exc:
        mteb_eval.main(argv[:3] + ["FollowIR"] + argv[4:])
    assert "config.yaml; pass the run dir" in str(exc.value) and "\n" not in str(exc.value)
