"""Tokenizers: a byte-level BPE trained on a corpus and cached by (corpus, vocab size), or a model's own."""
from __future__ import annotations

from pathlib import Path

from datamodules.common.cache import cache_root
from datamodules.common.errors import ConfigError

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_bpe(documents: list[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE with the `tokenizers` library and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD, unk_token=None)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def corpus_tokenizer(vocab_size: int = 2048, corpus: str = "embedded"):
    """The BPE tokenizer of a corpus at a vocabulary size, trained once and then loaded from the cache."""
    from transformers import PreTrainedTokenizerFast

    from datamodules.common.corpus import corpus_key, embedded_documents

    if corpus != "embedded":
        raise ConfigError(f"data.tokenizer.corpus={corpus!r}: only the 'embedded' corpus has a built-in tokenizer — "
                          "for your own data set data.tokenizer.pretrained=<dir with a tokenizer>")
    out_dir = cache_root() / "tokenizers" / f"{corpus}-{corpus_key()}-v{vocab_size}"
    if (out_dir / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    return train_bpe(embedded_documents(), vocab_size, out_dir)


def load_tokenizer(pretrained: str | None = None, vocab_size: int = 2048, corpus: str = "embedded"):
    """The tokenizer of a run: the pretrained model's own when there is one, else the corpus BPE.

    ``pretrained`` takes the same values as ``backbone.pretrained``: a hub id, a local dir, or ``tiny-lm``.
    """
    if pretrained is None:
        return corpus_tokenizer(vocab_size, corpus)
    from transformers import AutoTokenizer

    from datamodules.common.errors import hub_loading
    from datamodules.common.tiny_models import resolve_pretrained

    key = "data.tokenizer.pretrained"
    with hub_loading(pretrained, key, "tokenizer", note=" (it follows backbone.pretrained unless set apart)"):
        tok = AutoTokenizer.from_pretrained(resolve_pretrained(pretrained, key))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def declare_mask_token(tok, mask_token_id: int, where: str = "backbone.diffusion.mask_token_id"):
    """``tok`` with the token at ``mask_token_id`` declared as its mask token: the id is set in one place (a masked
    diffusion backbone's ``diffusion.mask_token_id``) and resolved here against the tokenizer. LLaDA's hub tokenizer
    holds ``<|mdm_mask|>`` (126336) as an added token without naming it its mask token; a tokenizer whose declared
    mask token is another id is refused."""
    mask_token_id = int(mask_token_id)
    if tok.mask_token_id == mask_token_id:
        return tok
    if tok.mask_token_id is not None:
        raise ValueError(f"{where}={mask_token_id} but the tokenizer's mask token {tok.mask_token!r} is id "
                         f"{tok.mask_token_id}: use the backbone's own tokenizer, or set {where}={tok.mask_token_id}")
    token = tok.convert_ids_to_tokens(mask_token_id) if 0 <= mask_token_id < len(tok) else None
    if token is None:
        raise ValueError(f"{where}={mask_token_id} is not a token of this tokenizer ({len(tok)} tokens): use the "
                         "backbone's own tokenizer")
    tok.mask_token = token
    return tok


# --- a closed character-level tokenizer (error_law: one processed symbol = one token) -------------------------
CHAR_UNK = "<|unk|>"
CHAR_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*=:,|[]<>#\n"


def char_tokenizer(alphabet: str = CHAR_ALPHABET, vocab_size: int | None = None):
    """A transformers fast tokenizer with one token per character of ``alphabet`` (ids 3...), after
    ``<|endoftext|>`` = 0 (bos/eos, as tiny_llama expects), ``<|pad|>`` = 1 and ``<|unk|>`` = 2 for any other
    character. ``vocab_size`` is the model's embedding size: it must hold the alphabet (the rows past it stay unused)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate([EOS, PAD, CHAR_UNK, *chars])}
    if vocab_size is not None and vocab_size < len(vocab):
        raise ValueError(f"char_tokenizer: vocab_size={vocab_size} < {len(vocab)} symbols (3 special + the alphabet); "
                         f"set data.tokenizer.vocab_size >= {len(vocab)}")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=CHAR_UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character its own piece
    tok.decoder = decoders.Fuse()  # and back without separators
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD, unk_token=CHAR_UNK)


MASK = "[MASK]"
WORD_UNK = "[UNK]"
# Words, numbers, "(A)"-style option labels, "Answer:"-style labels, newlines and single punctuation marks.
WORD_PATTERN = r"\n|\([A-Z]\)|[A-Za-z]+:?|\d+|[^\sA-Za-z\d]"


def word_tokenizer(words, out_dir: Path | None = None):
    """A closed word-level tokenizer with a ``[MASK]`` token: ids 0 EOS, 1 PAD, 2 [MASK], 3 [UNK], then ``words``
    in order (duplicates dropped). Text splits on spaces into words, numbers, option labels like ``(A)``,
    ``Answer:``-style labels, newlines and punctuation (``WORD_PATTERN``); a piece outside the vocabulary is [UNK]."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate((EOS, PAD, MASK, WORD_UNK))}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=WORD_UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"[ \t]+"), "removed"),
                                                 pre_tokenizers.Split(Regex(WORD_PATTERN), "isolated")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   mask_token=MASK, unk_token=WORD_UNK)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(str(out_dir))
    return fast
