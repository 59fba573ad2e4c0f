"""Tokenizers: a byte-level BPE trained with Hugging Face `tokenizers`, raw bytes, or an HF model's own.

All three are plain `tokenizers.Tokenizer` objects saved as tokenizer.json, so export to Hugging Face and
generation load them the same way; a `DocTokenizer` adds the BOS/EOS that delimit documents. Byte-level means every input round-trips exactly: decode(encode(x)) == x.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmcluster.errors import UserError

EOT = "<|endoftext|>"  # appended after every document by our own tokenizers; also their HF eos/bos token
# A bare tokenizer.json names no EOS: the first of these it holds is taken as one.
EOS_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")
HF_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _byte_level(model: models.Model) -> Tokenizer:
    tok = Tokenizer(model)
    # use_regex=True splits like GPT-2 (words, numbers, punctuation, whitespace runs) before merging.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_tokenizer(specials: tuple[str, ...] = ()) -> Tokenizer:
    """256 byte tokens + EOT (+ `specials` after it): no training, vocab 257 (+ len(specials))."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for t in (EOT, *specials):
        vocab[t] = len(vocab)
    tok = _byte_level(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([EOT, *specials])
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None,
              specials: tuple[str, ...] = ()) -> Tokenizer:
    if vocab_size < 257 + len(specials):
        raise UserError(f"--tokenizer bpe:{vocab_size}: a byte-level BPE needs at least {257 + len(specials)} tokens")
    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT, *specials], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def _token_text(v) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


@dataclass
class DocTokenizer:
    """A tokenizer plus how documents are delimited: [bos] + ids + [eos], as the tokenizer defines them."""
    tok: Tokenizer
    eos_id: int
    bos_id: int | None = None
    hf_files: dict[str, str] = field(default_factory=dict)  # tokenizer_config.json etc., copied verbatim

    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()


def _special_id(tok: Tokenizer, text: str | None, what: str, where: Path) -> int | None:
    if text is None:
        return None
    i = tok.token_to_id(text)
    if i is None:
        raise UserError(f"tokenizer {where}: its {what} token {text!r} is not in the vocabulary")
    return i


def load_tokenizer(path: str | Path) -> DocTokenizer:
    """An HF model/tokenizer directory (tokenizer.json + tokenizer_config.json) or a bare tokenizer.json.

    BOS/EOS come from tokenizer_config.json when there is one (BOS if add_bos_token says so or, unsaid, if the
    post-processor prepends it);
    a bare tokenizer.json has no such file, so its post-processor decides BOS (what it prepends to an empty
    text) and EOS is the first of the usual end-of-text tokens it holds, else <|endoftext|> is added."""
    p = Path(path)
    d = p if p.is_dir() else p.parent
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise UserError(f"tokenizer not found: {p}")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises plain Exception subclasses with multi-line text
        raise UserError(f"cannot load tokenizer {p}: {str(e).splitlines()[0]}") from None
    conf_path = d / "tokenizer_config.json"
    if conf_path.is_file() and p.parent == d:
        try:
            conf = json.loads(conf_path.read_text())
        except ValueError as e:
            raise UserError(f"{conf_path}: not JSON ({e})") from None
        eos = _special_id(tok, _token_text(conf.get("eos_token")), "eos", conf_path)
        bos = _special_id(tok, _token_text(conf.get("bos_token")), "bos", conf_path)
        add_bos = conf.get("add_bos_token")
        if add_bos is None:  # unsaid: whatever the tokenizer's post-processor does (Llama 3 adds, GPT-2 not)
            add_bos = bos is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos]
        bos = bos if add_bos else None
        files = {n: (d / n).read_text() for n in HF_TOKENIZER_FILES if (d / n).is_file()}
    else:
        eos = next((i for i in map(tok.token_to_id, EOS_NAMES) if i is not None), None)
        prefix = tok.encode("", add_special_tokens=True).ids
        bos, files = (prefix[0] if len(prefix) == 1 else None), {}
    if eos is None:
        tok.add_special_tokens([EOT])
        eos = tok.token_to_id(EOT)
    return DocTokenizer(tok, eos, bos, files)


def make_tokenizer(spec: str, texts: Callable[[], Iterator[str]] | None = None,
                   specials: tuple[str, ...] = ()) -> DocTokenizer:
    """'bpe:N' (train on `texts()`), 'byte', or an HF tokenizer directory / tokenizer.json.

    `specials` (chat data: the default template's turn markers) become special tokens of a tokenizer made here,
    so each encodes to one id; an HF tokenizer is kept as it is (its ids are its model's)."""
    if spec == "byte":
        tok = byte_tokenizer(specials)
    elif spec.startswith("bpe:"):
        try:
            n = int(spec[4:])
        except ValueError:
            raise UserError(f"--tokenizer {spec!r}: expected bpe:N with N an integer") from None
        if texts is None:
            raise UserError("a BPE tokenizer needs training text")
        tok = train_bpe(texts(), n, specials=specials)
    else:
        return load_tokenizer(spec)
    return DocTokenizer(tok, eot_id(tok))


def is_trained(spec: str) -> bool:
    return spec.startswith("bpe:")


def eot_id(tok: Tokenizer) -> int:
    i = tok.token_to_id(EOT)
    assert i is not None
    return i


def encode_docs(tok: Tokenizer, docs: list[str]) -> Iterator[list[int]]:
    """Encode a batch of documents (parallel across cores inside `tokenizers`)."""
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        yield enc.ids
