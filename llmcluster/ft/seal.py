"""A heal payload sealed in chunks (issue 63): what a relay between two groups keeps is ciphertext.

The key is HKDF-SHA256 over the run's secret (RunKey.derive), salted with the request's nonce and bound to the step
and the destination the healer connected to: a key per heal, so each chunk's AEAD nonce can simply be its index.
A chunk travels as `len (4 bytes) | AES-GCM(plaintext)`, its associated data the index and whether it is the last:
a chunk moved, dropped, replayed from another heal or a stream cut short (no last chunk) fails to open. Each chunk
is at most CHUNK_BYTES: AESGCM's one-shot calls take under 2**31 bytes, and neither side holds more than one chunk
of ciphertext at a time (the sender writes each chunk as it is sealed, the receiver copies each into place).
"""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from llmcluster.launch.ft_auth import RunKey

CHUNK_BYTES = 64 << 20   # the most plaintext in one chunk (a tensor larger than this spans several)
_TAG = 16


class SealBroken(Exception):
    """A chunk that does not open with this heal's key, or a stream that ends before its last chunk."""


def heal_key(key: RunKey, nonce: str, step: int, dest: str) -> AESGCM:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=bytes.fromhex(nonce),
                info=f"llmcluster-ft-heal\0{step}\0{dest}".encode())
    return AESGCM(hkdf.derive(key.derive("heal-seal")))


def _nonce_ad(index: int, last: bool) -> tuple[bytes, bytes]:
    return index.to_bytes(12, "big"), index.to_bytes(8, "big") + (b"\1" if last else b"\0")


class Sealer:
    def __init__(self, aead: AESGCM):
        self.aead, self.index = aead, 0

    def frame(self, plain: bytes | memoryview, last: bool = False) -> tuple[bytes, bytes]:
        """The chunk's length and its ciphertext, written one after the other (joined, a 64 MiB chunk is copied)."""
        if len(plain) > CHUNK_BYTES:
            raise ValueError(f"a chunk of {len(plain)} bytes: at most {CHUNK_BYTES}")
        nonce, ad = _nonce_ad(self.index, last)
        self.index += 1
        body = self.aead.encrypt(nonce, plain, ad)
        return len(body).to_bytes(4, "big"), body

    def seal(self, plain: bytes | memoryview, last: bool = False) -> bytes:
        return b"".join(self.frame(plain, last))


class Opener:
    """`read(n)`: up to n bytes of the stream (fewer only at its end)."""

    def __init__(self, aead: AESGCM, read):
        self.aead, self.read, self.index, self.done = aead, read, 0, False

    def _exact(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n and (more := self.read(n - len(data))):   # a socket may answer in pieces
            data += more
        if len(data) != n:
            raise SealBroken(f"the stream ended inside chunk {self.index} (cut short)")
        return data   # not copied into bytes: AESGCM takes any buffer, and a chunk may be 64 MiB

    def open(self, limit: int = CHUNK_BYTES) -> tuple[bytes, bool]:
        """The next chunk's plaintext (at most `limit` bytes) and whether it is the last."""
        if self.done:
            raise SealBroken("a chunk after the last one")
        n = int.from_bytes(self._exact(4), "big")
        if n < _TAG or n - _TAG > min(limit, CHUNK_BYTES):
            raise SealBroken(f"chunk {self.index} claims {n} bytes: more than it may hold")
        body = self._exact(n)
        for last in (False, True):
            nonce, ad = _nonce_ad(self.index, last)
            try:
                plain = self.aead.decrypt(nonce, body, ad)
            except InvalidTag:
                continue
            self.index += 1
            self.done = last
            return plain, last
        raise SealBroken(f"chunk {self.index} does not open with this heal's key (altered, moved or a stranger's)")

    def close(self) -> None:
        """The stream must end with its last chunk, and nothing after it."""
        plain, last = self.open(0)
        if not last or plain:
            raise SealBroken("the stream holds more chunks than its payload")
        if self.read(1):
            raise SealBroken("bytes after the last chunk")
