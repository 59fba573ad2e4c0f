"""A heal bound to both ends, sealed and bounded (issue 63), over real sockets: a relay keeps ciphertext and serves
nothing it can use, an address the source did not sign is never connected to, half-open connections pin at most C
threads for at most T s, and a state larger than one chunk round-trips exactly."""

from __future__ import annotations

import select
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest

pytest.importorskip("torchft")
import torch  # noqa: E402

from test_ft_security import _model, _params, _signed, _state, _transports  # noqa: E402

from llmcluster.ft import seal  # noqa: E402
from llmcluster.ft.transport import HealRefused, SignedTransport  # noqa: E402
from llmcluster.launch.ft_auth import RunKey  # noqa: E402

KEY = RunKey(b"k" * 64)


class Relay:
    """A TCP relay on 127.0.0.1 to `target` (host:port) that keeps every byte the server sends back."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target, self.kept = (host, int(port)), bytearray()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.dest = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.kept), daemon=True).start()

    @staticmethod
    def _pipe(src, dst, keep):
        try:
            while data := src.recv(65536):
                if keep is not None:
                    keep += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def test_a_relay_between_healer_and_server_keeps_ciphertext_and_heals_nothing():
    """A healer sent to a relay (as if the relay's address were signed) names the relay in its proof: the server
    refuses it. A relay on the path to the real address (a port forward the healer cannot see) passes a heal that
    loads, and keeps only ciphertext: neither a tensor's bytes nor the head's names."""
    model, (sender,), receiver = _transports(KEY)
    relay = Relay(sender.dest)
    try:
        with pytest.raises(ConnectionError, match="Forbidden"):
            receiver.recv_checkpoint(0, _signed(KEY, relay.dest), 3, timedelta(seconds=5))
        assert len(relay.kept) < 400 and b"0.weight" not in relay.kept   # the 403 answer only

        nonce = "2" * 32   # the healer's request for the real server, carried by the relay
        req = urllib.request.Request(f"http://{relay.dest}/heal/3?nonce={nonce}",
                                     headers={"X-Llmcluster-Mac": KEY.mac("req", sender.dest, 3, nonce)})
        with urllib.request.urlopen(req, timeout=10) as r:
            stream = r.read()
        time.sleep(0.2)
        kept = bytes(relay.kept)
        weight = model.state_dict()["0.weight"].numpy().tobytes()
        assert len(kept) > len(weight) and weight[:16] not in kept and b"0.weight" not in kept
        assert b"exp_avg" not in kept and b"sampler" not in kept
        # what the relay kept opens only with the key of that request: the real healer's
        opener = seal.Opener(seal.heal_key(KEY, nonce, 3, sender.dest), iter_reader(stream))
        opener.open()   # the head's length, then the head
        assert b"0.weight" in opener.open()[0]
        with pytest.raises(seal.SealBroken):
            seal.Opener(seal.heal_key(RunKey(b"x" * 64), nonce, 3, sender.dest), iter_reader(stream)).open()
    finally:
        relay.close()
        sender.shutdown()
        receiver.shutdown()


def iter_reader(data: bytes):
    pos = 0

    def read(n):
        nonlocal pos
        pos += n
        return data[pos - n:pos]
    return read


def test_a_heal_address_the_source_did_not_sign_is_refused_in_one_line_and_never_reached():
    """Planted in torchft's checkpoint_metadata: an address with a MAC of another secret, one re-pointed at another
    port under the source's MAC, and one without a MAC. The healer refuses each in one line before connecting."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    there = f"127.0.0.1:{listener.getsockname()[1]}"
    receiver = SignedTransport(KEY, "127.0.0.1", timedelta(seconds=5), lambda: _state(*_model()),
                               lambda: _params(_model()[1]))
    genuine = _signed(KEY, "127.0.0.1:9")
    try:
        for planted in (_signed(RunKey(b"s" * 64), there), genuine.replace("127.0.0.1:9", there),
                        f"http://{there}/heal/?src=&step=3"):
            with pytest.raises(HealRefused) as e:
                receiver.recv_checkpoint(0, planted, 3, timedelta(seconds=5))
            assert "is not signed with this run's secret" in str(e.value) and "\n" not in str(e.value)
            assert receiver.refused == str(e.value)
        with pytest.raises(TimeoutError):   # nothing connected to the planted address
            listener.accept()
    finally:
        listener.close()
        receiver.shutdown()


def test_half_open_connections_pin_at_most_c_threads_each_closed_after_t_seconds():
    """C=3, T=1 s: 8 clients that connect and send nothing. 3 handler threads exist; the others are closed at once;
    the 3 are closed after T; one that drips its request a byte at a time is closed after T too; then a heal is
    served again."""
    model, (sender,), receiver = _transports(KEY, connections=3, idle_s=1.0)
    host, port = sender.dest.rsplit(":", 1)
    threads_before = threading.active_count()
    socks = [socket.create_connection((host, int(port))) for _ in range(8)]
    try:
        t0 = time.monotonic()
        while sender.open_connections < 3 and time.monotonic() < t0 + 0.8:
            time.sleep(0.02)
        time.sleep(0.1)
        assert sender.open_connections == 3 and threading.active_count() - threads_before == 3
        waiting = []
        for s in socks:   # over C: closed at once, without a thread
            s.settimeout(0.05)
            try:
                assert s.recv(1) == b""
            except TimeoutError:
                waiting.append(s)
        assert len(waiting) == 3
        for s in waiting:   # the C held: closed by the server after T
            s.settimeout(5)
            assert s.recv(1) == b""
        assert 0.9 <= time.monotonic() - t0 < 1.0 + 1.5   # T, plus a loaded machine's slack
        drip, t1, closed = socket.create_connection((host, int(port))), time.monotonic(), False
        socks.append(drip)
        while not closed and time.monotonic() - t1 < 5:   # a request head a byte every 0.3 s: T bounds it whole
            try:
                drip.send(b"G")
            except OSError:
                break
            closed = bool(select.select([drip], [], [], 0.3)[0])
        assert 0.9 <= time.monotonic() - t1 < 1.0 + 1.5
        time.sleep(0.2)
        assert sender.open_connections == 0
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=5))
        assert torch.equal(got["user"]["default"]["model"]["1.weight"], model.state_dict()["1.weight"])
    finally:
        for s in socks:
            s.close()
        sender.shutdown()
        receiver.shutdown()


def test_a_state_larger_than_one_chunk_round_trips_exactly(monkeypatch):
    """Chunks of 64 bytes (CHUNK_BYTES is 64 MiB): each tensor over 64 bytes (the 8x4 weight, 128 bytes, and its
    AdamW moments) spans several, and the state arrives bitwise equal over the socket."""
    monkeypatch.setattr(seal, "CHUNK_BYTES", 64)
    model, (sender,), receiver = _transports(KEY)
    sealed = []
    real_frame = seal.Sealer.frame
    monkeypatch.setattr(seal.Sealer, "frame",
                        lambda self, p, last=False: sealed.append(len(p)) or real_frame(self, p, last))
    try:
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=5))["user"]["default"]
        _model_again, opt = _model()
        want = _state(model, opt)
        assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
        for i, st in want["optimizer"]["state"].items():
            assert all(torch.equal(got["optimizer"]["state"][i][k], v) for k, v in st.items())
        assert len(sealed) > 10 and max(sealed) <= 64 and sum(n == 64 for n in sealed) > 5
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_sealed_stream_cut_short_reordered_or_altered_does_not_open():
    aead = seal.heal_key(KEY, "3" * 32, 3, "127.0.0.1:1")
    sealer = seal.Sealer(aead)
    frames = [sealer.seal(b"a" * 10), sealer.seal(b"b" * 10), sealer.seal(b"", last=True)]

    def opened(data: bytes):
        o = seal.Opener(seal.heal_key(KEY, "3" * 32, 3, "127.0.0.1:1"), iter_reader(data))
        got = [o.open()[0], o.open()[0]]
        o.close()
        return got

    assert opened(b"".join(frames)) == [b"a" * 10, b"b" * 10]
    altered = bytearray(frames[1])
    altered[-1] ^= 1
    for bad, said in ((frames[0] + frames[1], "cut short"), (frames[1] + frames[0] + frames[2], "does not open"),
                      (frames[0] + bytes(altered) + frames[2], "does not open"),
                      (frames[0] + frames[2], "does not open"), (b"".join(frames) + b"x", "after the last")):
        with pytest.raises(seal.SealBroken, match=said):
            opened(bad)
