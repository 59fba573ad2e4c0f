"""Tokenizers: a byte-level BPE trained with Hugging Face `tokenizers`, raw bytes, or a tokenizer.json.

All three are plain `tokenizers.Tokenizer` objects saved as tokenizer.json, so export to Hugging Face and
generation load them the same way. Byte-level means every input round-trips exactly: decode(encode(x)) == x.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmcluster.errors import UserError

EOT = "<|endoftext|>"  # appended after every document; also the HF eos/bos token


def _byte_level(model: models.Model) -> Tokenizer:
    tok = Tokenizer(model)
    # use_regex=True splits like GPT-2 (words, numbers, punctuation, whitespace runs) before merging.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens + EOT: no training, vocab 257."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab[EOT] = len(vocab)
    tok = _byte_level(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([EOT])
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None) -> Tokenizer:
    if vocab_size < 257:
        raise UserError(f"--tokenizer bpe:{vocab_size}: a byte-level BPE needs at least 257 tokens")
    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise UserError(f"tokenizer not found: {p}")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises plain Exception subclasses with multi-line text
        raise UserError(f"cannot load tokenizer {p}: {str(e).splitlines()[0]}") from None
    if tok.token_to_id(EOT) is None:
        tok.add_special_tokens([EOT])
    return tok


def make_tokenizer(spec: str, texts: Callable[[], Iterator[str]] | None = None) -> Tokenizer:
    """'bpe:N' (train on `texts()`), 'byte', or a path to tokenizer.json / a dir holding one."""
    if spec == "byte":
        return byte_tokenizer()
    if spec.startswith("bpe:"):
        try:
            n = int(spec[4:])
        except ValueError:
            raise UserError(f"--tokenizer {spec!r}: expected bpe:N with N an integer") from None
        if texts is None:
            raise UserError("a BPE tokenizer needs training text")
        return train_bpe(texts(), n)
    return load_tokenizer(spec)



def eot_id(tok: Tokenizer) -> int:
    i = tok.token_to_id(EOT)
    assert i is not None
    return i


def encode_docs(tok: Tokenizer, docs: list[str]) -> Iterator[list[int]]:
    """Encode a batch of documents (parallel across cores inside `tokenizers`)."""
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        yield enc.ids
