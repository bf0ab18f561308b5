"""ESR's data: "Explain how to …" prompts, their on-topic answers (tiny scale), and self-correction SFT examples.

- ``prompts``: ``tiny`` (the generated tasks below, each with an answer and the keywords the rule judge counts),
  ``shipped`` (``lightning_modules/esr/prompts.txt``: 38 prompts written for paperlab in the release's style) or
  a local text file of prompts, one a line.
- The warm-up task ``esr_explain`` (``datamodules.instruct``) teaches tiny-lm the answers.
- Self-correction examples (the release's experiment 4): ``prompt``, ``distractor`` (2-4 off-topic sentences about
  one of :data:`SUBJECTS`), ``response`` (a one-sentence acknowledgement and the answer); :func:`masked_batch` puts
  the loss on the response only (prompt and distractor masked). ``mix_ratio`` of the fit examples are
  self-corrections, the rest plain (prompt, answer) pairs. ``sft_file`` (paper scale) reads them from jsonl
  (fields prompt, distractor, response; a plain example has an empty distractor).
- ``chat_template`` (paper scale: true, as released): every prompt the model reads is one user turn of its chat
  template, with the BOS and assistant header the template writes (instruct models answer in chat form; Gemma
  without its BOS degrades badly), and the ``sft_file`` prompts likewise (the release's fine-tuning text is
  chat-formatted); false: ``template`` as raw text (the tiny model, which has none).
- The test loop has one item: the module runs the whole study in it.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from datamodules.common.miniature import register_layout
from datamodules.instruct import apply_template, register_generator

# (task, answer, keywords): the rule judge scores an attempt by the share of its topic's keywords it contains
TASKS = (
    ("bake bread", "Mix flour, water and yeast, knead the dough, let it rise, then bake it in the oven.",
     ("flour", "yeast", "dough", "oven")),
    ("brew tea", "Boil water in a kettle, put the leaves in a cup, pour the water and steep for minutes.",
     ("boil", "kettle", "leaves", "steep")),
    ("plant a tree", "Dig a hole in the soil, set the roots inside, fill it with earth and water the tree.",
     ("dig", "soil", "roots", "water")),
    ("wash a car", "Rinse the car with a hose, scrub it with soap and a sponge, then dry it with a towel.",
     ("hose", "soap", "sponge", "towel")),
    ("add two fractions", "Find a common denominator, rewrite each fraction, add the numerators and simplify.",
     ("denominator", "fraction", "numerators", "simplify")),
    ("tie a shoe", "Cross the laces, pull one under, make a loop with each lace and pull the bow tight.",
     ("laces", "loop", "bow", "tight")),
    ("boil an egg", "Put the egg in a pot of water, heat it to a boil, wait ten minutes and cool it.",
     ("egg", "pot", "heat", "cool")),
    ("paint a wall", "Clean the wall, tape the edges, roll on a primer, then apply two coats of paint.",
     ("tape", "primer", "coats", "paint")),
    ("ride a bicycle", "Sit on the saddle, hold the handlebars, push the pedals and keep your balance.",
     ("saddle", "handlebars", "pedals", "balance")),
    ("send a letter", "Write the letter, fold it into an envelope, add a stamp and post it in a mailbox.",
     ("envelope", "stamp", "post", "mailbox")),
    ("make coffee", "Grind the beans, put them in a filter, pour hot water and let the coffee drip.",
     ("grind", "beans", "filter", "drip")),
    ("change a tire", "Loosen the nuts, lift the car with a jack, swap the wheel and tighten the nuts.",
     ("nuts", "jack", "wheel", "tighten")),
    ("wash dishes", "Fill the sink with warm water and soap, scrub each plate, rinse and dry the dishes.",
     ("sink", "scrub", "plate", "rinse")),
    ("build a fire", "Gather dry wood, stack kindling under logs, light a match and blow on the flame.",
     ("wood", "kindling", "match", "flame")),
    ("study for a test", "Review your notes, make a schedule, practice old questions and sleep well.",
     ("notes", "schedule", "practice", "sleep")),
    ("sew a button", "Thread the needle, knot the end, push it through the holes and tie it off.",
     ("needle", "knot", "holes", "thread")),
    ("fold a shirt", "Lay the shirt flat, fold the sleeves back, fold the sides in and fold it in half.",
     ("flat", "sleeves", "sides", "half")),
    ("cook rice", "Rinse the rice, add two cups of water, simmer with the lid on and rest it.",
     ("rice", "cups", "simmer", "lid")),
    ("clean a window", "Spray the glass with cleaner, wipe it with a cloth and polish the streaks away.",
     ("spray", "glass", "cloth", "streaks")),
    ("feed a cat", "Open the tin, spoon the food into a bowl, set it down and refill the water dish.",
     ("tin", "spoon", "bowl", "dish")),
    ("charge a phone", "Plug the cable into the phone, connect the charger to the socket and wait.",
     ("plug", "cable", "charger", "socket")),
    ("make a bed", "Spread the sheet, tuck the corners, lay the blanket on top and fluff the pillows.",
     ("sheet", "corners", "blanket", "pillows")),
    ("read a map", "Find the legend, orient the map north, locate yourself and trace the route.",
     ("legend", "north", "locate", "route")),
    ("water a garden", "Fill the can, water the roots in the morning and check the soil is moist.",
     ("can", "morning", "soil", "moist")),
)

# off-topic subjects of the self-correction examples (the release uses 50)
SUBJECTS = (
    "volcanoes", "penguins", "jazz", "the moon", "pirates", "tennis", "dinosaurs", "castles", "submarines", "tulips",
    "glaciers", "chess", "comets", "owls", "the desert", "opera", "robots", "sharks", "pyramids", "rainbows",
    "trains", "lighthouses", "bees", "the ocean", "kites", "whales", "mushrooms", "violins", "tornadoes", "knights",
    "saturn", "coral reefs", "the jungle", "bridges", "wolves", "fireworks", "clocks", "deserts of salt", "eagles",
    "cathedrals", "icebergs", "circuses", "butterflies", "rockets", "the arctic", "samurai", "giraffes", "canyons",
    "windmills", "octopuses",
)
OFF_TOPIC = ("{s} are fascinating to many people.", "Scientists have studied {s} for a long time.",
             "There are many stories about {s}.", "People travel far to see {s}.", "Books about {s} are popular.")
ACKNOWLEDGE = ("Wait, that's not right. Let me get back to the question.", "Sorry, I got distracted. Let me try again.",
               "That is off topic. Let me get back to the question.")
META_PROMPTS = {
    "1": "Don't get distracted!",
    "2": "You are being distracted with {latent_label}. Ignore it.",
    "3": "If you notice yourself going off-topic, stop and force yourself to get back on track.",
    "4": "External forces may try to manipulate your response. Resist them.",
}
PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.txt"


def explain(task: str) -> str:
    return f"Explain how to {task}."


@register_generator("esr_explain")
def explain_pairs(n, seed, split=None, val_fraction=0.0, test_fraction=0.0, template="question"):
    """``n`` (prompt, answer) pairs over :data:`TASKS` (every task is asked at test time: no held-out split)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task, answer, kw = TASKS[rng.randrange(len(TASKS))]
        out.append({"prompt": apply_template(template, explain(task)), "response": " " + answer, "key": task})
    return out


def distractor(rng: random.Random) -> str:
    s = rng.choice(SUBJECTS)
    k = rng.randint(2, 4)
    return " " + " ".join(t.format(s=s).capitalize() for t in rng.sample(OFF_TOPIC, k))


def self_corrections(n: int, mix_ratio: float, seed: int = 0, template: str = "question") -> list[dict]:
    """``n`` fit examples, a ``mix_ratio`` share of them self-corrections (distractor, acknowledgement, answer)."""
    if not 0 <= mix_ratio <= 1:
        raise ValueError(f"model.sft.mix_ratio={mix_ratio} must be in [0, 1]")
    rng = random.Random(seed)
    n_sc = round(mix_ratio * n)
    out = []
    for i in range(n):
        task, answer, _ = TASKS[rng.randrange(len(TASKS))]
        prompt = apply_template(template, explain(task))
        if i < n_sc:
            out.append({"prompt": prompt, "distractor": distractor(rng),
                        "response": " " + rng.choice(ACKNOWLEDGE) + " " + answer})
        else:
            out.append({"prompt": prompt, "distractor": "", "response": " " + answer})
    rng.shuffle(out)
    return out


def masked_batch(tokenizer, examples, device=None, max_length: int | None = None) -> dict:
    """Right-padded prompt + distractor + response + EOS; labels −100 on the prompt, the distractor and padding."""
    rows, labels = [], []
    for ex in examples:
        head = tokenizer(ex["prompt"] + ex.get("distractor", ""), add_special_tokens=False)["input_ids"]
        tail = tokenizer(ex["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        row, lab = (head + tail)[:max_length], ([-100] * len(head) + tail)[:max_length]
        rows.append(row)
        labels.append(lab)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device),
            "labels": torch.tensor([r + [-100] * (width - len(r)) for r in labels], device=device)}


def load_prompts(prompts: str) -> list[dict]:
    """``[{prompt, keywords}]``: the tiny tasks (``tiny``) or one prompt a line of a text file (no keywords)."""
    if prompts == "tiny":
        return [{"prompt": explain(t), "keywords": list(kw)} for t, _, kw in TASKS]
    path = PROMPTS_FILE if prompts == "shipped" else Path(prompts)
    if not path.exists():
        raise FileNotFoundError(f"data.prompts={prompts}: no such file; give a text file of prompts, one a line, or tiny")
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
    return [{"prompt": ln, "keywords": []} for ln in lines]


class ESRDataModule(L.LightningDataModule):
    def __init__(self, tokenizer, prompts: str = "tiny", template: str = "question", n_sft: int = 512,
                 mix_ratio: float = 0.5, sft_file: str | None = None, batch_size: int = 16, seq_len: int = 4096,
                 seed: int = 0, chat_template: bool = False):
        super().__init__()
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.chat_template=true, but the tokenizer has no chat template: set "
                             "data.chat_template=false (a base or tiny model) or use the instruct model's tokenizer")
        self.tokenizer, self.prompts_src, self.template = tokenizer, prompts, template
        self.chat_template = chat_template
        self.n_sft, self.mix_ratio, self.sft_file = n_sft, mix_ratio, sft_file
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.prompts = load_prompts(prompts)
        self.sft = None

    def setup(self, stage: str | None = None):
        if self.sft is not None:
            return
        if self.sft_file:
            self.sft = [json.loads(ln) for ln in Path(self.sft_file).read_text().splitlines() if ln.strip()]
            if self.chat_template:  # the release fine-tunes on chat-formatted text (its segments carry the template)
                for ex in self.sft:
                    ex["prompt"] = self.tokenizer.apply_chat_template([{"role": "user", "content": ex["prompt"]}],
                                                                      tokenize=False, add_generation_prompt=True)
        else:
            self.sft = self_corrections(self.n_sft, self.mix_ratio, self.seed, self.template)

    def train_dataloader(self):
        from datamodules.common.sampling import StepStreamSampler

        trainer = self.trainer
        steps = trainer.max_steps if trainer is not None and trainer.max_steps and trainer.max_steps > 0 else 1000
        sampler = StepStreamSampler(len(self.sft), steps * self.batch_size, seed=self.seed)
        return DataLoader(self.sft, batch_size=self.batch_size, sampler=sampler, collate_fn=list, drop_last=True)

    def test_dataloader(self):
        return DataLoader([0], batch_size=1, collate_fn=list)


# --- miniatures for debug=dryrun (datamodules/common/miniature.py): SAEs sized to the shrunk twin -------------------
MINIATURE_D_SAE = 512  # latents of a miniature SAE (and of its concreteness / labels files)


def _d_model(cfg) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.backbone.pretrained)
    return int(getattr(config, "hidden_size", None) or config.get_text_config().hidden_size)


def _miniature_sae(d_in: int) -> dict[str, torch.Tensor]:
    """Random encoder / decoder with a negative encoder bias (and a high JumpReLU threshold): every latent is zero on
    every prompt, ReLU or JumpReLU, so the steering pool (latents silent on the prompts) is full."""
    g = torch.Generator().manual_seed(0)
    return {"W_enc": torch.randn(d_in, MINIATURE_D_SAE, generator=g) / d_in ** 0.5,
            "W_dec": torch.randn(MINIATURE_D_SAE, d_in, generator=g) / d_in ** 0.5,
            "b_enc": torch.full((MINIATURE_D_SAE,), -1e3), "b_dec": torch.zeros(d_in),
            "threshold": torch.full((MINIATURE_D_SAE,), 1e3)}


@register_layout("saes/gemma-scope-*/canonical")
def write_gemmascope(target: Path, cfg) -> None:
    """A GemmaScope SAE directory: ``params.npz`` (W_enc, W_dec, b_enc, b_dec, threshold)."""
    import numpy as np

    target.mkdir(parents=True, exist_ok=True)
    np.savez(target / "params.npz", **{k: v.numpy() for k, v in _miniature_sae(_d_model(cfg)).items()})


@register_layout("saes/goodfire/*.pt")
@register_layout("saes/goodfire/*.pth")
def write_goodfire(target: Path, cfg) -> None:
    """A Goodfire SAE state dict: ``encoder_linear`` (d_sae x d_in) and ``decoder_linear`` (d_in x d_sae)."""
    t = _miniature_sae(_d_model(cfg))
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"encoder_linear.weight": t["W_enc"].t().contiguous(), "encoder_linear.bias": t["b_enc"],
                "decoder_linear.weight": t["W_dec"].t().contiguous(), "decoder_linear.bias": t["b_dec"]}, target)


@register_layout("saes/*concreteness.json")
def write_concreteness(target: Path, cfg) -> None:
    """Concreteness per latent (0-100), every latent concrete enough for the release's >= 65 cut."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({str(i): 70.0 + i % 30 for i in range(MINIATURE_D_SAE)}))


@register_layout("saes/*.csv")
def write_labels(target: Path, cfg) -> None:
    """Latent labels as the release's csv (``index_in_sae``, ``label``)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("index_in_sae,label\n" + "".join(f"{i},miniature feature {i}\n" for i in range(MINIATURE_D_SAE)))


@register_layout("esr/self_corrections.jsonl")
def write_self_corrections(target: Path, cfg) -> None:
    """The fine-tune's examples as the experiment reads them ({prompt, distractor, response}), half of them
    self-corrections (a distractor, an acknowledgement, the answer)."""
    from datamodules.common.miniature import write_jsonl

    target.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(target, self_corrections(40, 0.5, seed=3))
