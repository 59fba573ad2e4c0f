"""No stranger heals, joins, poisons or kills an ft run (issue 49; docs/security.md, "torchft").

The attacks run as real processes against a real 2-group run (gloo, the Lighthouse, the supervisor): a stranger
with torchft's own defaults (tests/ft_stranger.py) that reaches every port of the run but holds no secret. The
checks of the heal payload and of the secret run in-process."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import REPO, cli_env
from faultkit import slowed
from test_ft import _digests, _events, _group_1_killed_at_step_4, _job, _step, _supervised, _wait

pytest.importorskip("torchft")
import torch  # noqa: E402

from llmcluster.errors import UserError  # noqa: E402
from llmcluster.launch.ft_auth import RunKey, create_secret, read_secret  # noqa: E402
from llmcluster.ft.payload import HealRefused, payload_chunks, receive  # noqa: E402
from llmcluster.ft.transport import SignedTransport  # noqa: E402

LISTENS = re.compile(r"ft: group (\d) listens on \S+: (?:ManagerServer (\S+), )?heal server (\S+) ")


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3,
            "train": {"sampler": {"epoch": 0, "order": [1, 2]}, "scheduler": {"last_epoch": 3, "lr": 0.1},
                      "scaler": None, "loss_window": [2.5, 2.4]}, "slow_steps": [0, 0]}


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _params(opt) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


def _unpacked(chunks, template, params):
    """`receive` over plaintext chunks (what the seal carries), as the transport reads them."""
    it = iter(chunks)
    return receive(lambda n: bytes(next(it, b"")), template, params, 1 << 30)


def _wrapped(state) -> dict:
    return {"user": {"default": state}, "torchft": {"step": 3, "batches_committed": 6}}


def test_a_payload_round_trips_as_data_and_equals_the_senders_state():
    model, opt = _model()
    sent = _wrapped(_state(model, opt))
    got = _unpacked(payload_chunks(sent), _state(*_model()), _params(opt))["user"]["default"]
    assert all(torch.equal(got["model"][k], v) for k, v in sent["user"]["default"]["model"].items())
    assert got["optimizer"]["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert got["train"] == sent["user"]["default"]["train"] and got["step"] == 3


@pytest.mark.parametrize("bad, said", [
    (lambda s: s["model"].__setitem__("extra.weight", torch.zeros(2)), "keys differ (extra ['extra.weight']"),
    (lambda s: s["model"].__setitem__("0.weight", torch.zeros(8, 5)), "0.weight: shape (8, 5)"),
    (lambda s: s["model"].__setitem__("0.bias", torch.zeros(8, dtype=torch.float64)), "float64, this group's"),
    (lambda s: s["model"].__setitem__("0.bias", "os.system"), "a str where a tensor belongs"),
    (lambda s: s["optimizer"]["state"][0].__setitem__("exp_avg", torch.zeros(3)), "state[0].exp_avg: shape (3,)"),
    (lambda s: s["train"].__setitem__("sampler", [1]), "a list where a dict belongs"),
    (lambda s: s.__setitem__("step", "3; rm -rf"), "a str where a number belongs"),
], ids=["extra-key", "wrong-shape", "wrong-dtype", "non-tensor", "optimizer-shape", "train-type", "step-type"])
def test_a_payload_that_is_not_this_groups_state_is_refused_in_one_line(bad, said):
    model, opt = _model()
    state = _state(model, opt)
    bad(state)
    with pytest.raises(HealRefused) as e:
        _unpacked(payload_chunks(_wrapped(state)), _state(*_model()), _params(opt))
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_pickle_or_a_class_in_the_payload_is_never_loaded(tmp_path):
    """torchft's own format (a pickle) and a JSON node naming a class are both refused as 'not a heal payload'."""
    import pickle

    model, opt = _model()
    for body in (pickle.dumps({"user": {}}), b'{"tree": {"c": 1}, "tensors": []}',
                 b'{"tree": {"cls": "os.system"}, "tensors": []}', b'{"tree": {"T": 0}, "tensors": [["object", [1]]]}'):
        with pytest.raises(HealRefused):
            _unpacked([len(body).to_bytes(8, "big"), body], _state(model, opt), _params(opt))


def _transports(*keys, **kw):
    """A sender (serving `_state` at step 3) per key, and a receiver with the first key (a fresh model)."""
    model, opt = _model()
    senders = [SignedTransport(k, "127.0.0.1", timedelta(seconds=5), lambda: _state(model, opt),
                               lambda: _params(opt), **kw) for k in keys]
    for t in senders:
        t.step = lambda: 3
        t.send_checkpoint([1], 3, _wrapped(_state(model, opt)), timedelta(seconds=5))
    receiver = SignedTransport(keys[0], "127.0.0.1", timedelta(seconds=5), lambda: _state(*_model()),
                               lambda: _params(opt))
    return model, senders, receiver


def _signed(key, dest: str, step: int = 3) -> str:
    """A heal address as `key` signs it (SignedTransport.metadata) for a server at `dest`."""
    base = f"http://{dest}/heal/"
    return f"{base}?src=&step={step}&mac={key.mac('src', base, '', step)}"


def test_a_heal_needs_the_runs_secret_both_ways():
    """Over a real socket: a peer with the secret gets the state; a request without the proof, a replayed nonce and
    one proved for another destination get nothing; the address a stranger signs is refused, and a payload from one
    that serves anyone does not open."""
    ours, theirs = RunKey(b"a" * 64), RunKey(b"b" * 64)
    model, (sender, stranger), receiver = _transports(ours, theirs)
    try:
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=5))
        assert torch.equal(got["user"]["default"]["model"]["0.weight"], model.state_dict()["0.weight"])
        with pytest.raises(HealRefused, match="is not signed with this run's secret"):   # the stranger's address
            receiver.recv_checkpoint(0, stranger.metadata(), 3, timedelta(seconds=5))
        stranger.key.verify = lambda *a: True                      # one that serves whoever asks
        with pytest.raises(HealRefused, match="does not carry this run's proof"):
            receiver.recv_checkpoint(0, _signed(ours, stranger.dest), 3, timedelta(seconds=5))
        assert receiver.refused
        with pytest.raises(ConnectionError, match="signed at step 2"):   # the source moved on: retried, not refused
            receiver.recv_checkpoint(0, _signed(ours, sender.dest, 2), 3, timedelta(seconds=5))
        nonce = "0" * 32
        url = f"http://{sender.dest}/heal/3?nonce={nonce}"
        with pytest.raises(urllib.error.HTTPError) as e:   # no proof: no state
            urllib.request.urlopen(url, timeout=5)
        assert e.value.code == 403
        for dest in ("127.0.0.1:1", sender.dest.replace("127.0.0.1", "localhost")):   # proved for another server
            req = urllib.request.Request(url, headers={"X-Llmcluster-Mac": ours.mac("req", dest, 3, nonce)})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=5)
            assert e.value.code == 403
        mac = ours.mac("req", sender.dest, 3, "1" * 32)
        url = url.replace(nonce, "1" * 32)
        urllib.request.urlopen(urllib.request.Request(url, headers={"X-Llmcluster-Mac": mac}), timeout=5).read()
        with pytest.raises(urllib.error.HTTPError) as e:   # the same nonce again: a replay
            urllib.request.urlopen(urllib.request.Request(url, headers={"X-Llmcluster-Mac": mac}), timeout=5)
        assert e.value.code == 403
        with pytest.raises(HealRefused, match="not a heal server's"):   # a planted torchft address
            receiver.recv_checkpoint(0, "http://127.0.0.1:1/checkpoint/", 3, timedelta(seconds=5))
    finally:
        for t in (sender, stranger, receiver):
            t.shutdown()


def test_only_replica_ids_made_with_the_secret_are_members():
    key = RunKey(b"s" * 64)
    g0, g1 = key.replica_id("llmcluster_group_0:1111-aa"), key.replica_id("llmcluster_group_1:2222-bb")
    assert key.strangers([g0, g1], 2) == []
    forged = "llmcluster_group_1:2222-bb~" + "0" * 32
    assert key.strangers([g0, forged], 2) == [forged]
    assert key.strangers([g0, "llmcluster_group_1:9999"], 2) == ["llmcluster_group_1:9999"]
    assert set(key.strangers([g0, g1, g1.replace("~", "~")], 2)) == {g1}           # one group twice: both out
    assert key.strangers([g0, RunKey(b"t" * 64).replica_id("llmcluster_group_1:2222-bb")], 2) != []
    assert key.strangers([key.replica_id("llmcluster_group_2:3333")], 2) != []    # not a group of this run


def test_the_secret_is_read_only_from_the_callers_own_0600_file(tmp_path):
    path = create_secret(tmp_path / "ft")
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(read_secret(path)) == 64
    link = tmp_path / "link"
    link.symlink_to(path)
    for p, said in ((link, "symbolic link"), (tmp_path / "none", "cannot open")):
        with pytest.raises(UserError, match=said):
            read_secret(p)
    path.chmod(0o644)
    with pytest.raises(UserError, match="must be 0600"):
        read_secret(path)
    path.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        with pytest.raises(UserError, match="owned by uid 65534"):
            read_secret(path)


@pytest.mark.slow   # real processes: a 2-group run, the same run without strangers beside it, four strangers
def test_strangers_neither_heal_nor_are_healed_nor_add_gradients(tiny_root, tmp_path):
    """Four strangers with torchft's defaults, at once, while the run's steps are slowed (1 s): one joins the
    Lighthouse as `llmcluster_group_1` at a far higher step serving a pickle (the run would heal from it), one at
    step 0 (the run would heal it), one with a forged MAC that all-reduces gradients of 1e6, and one that plants a
    huge step and its pickle server's address in group 1's ManagerServer. No pickle is loaded, the stranger at step
    0 receives nothing, a heal server answers 403 without the proof, and the run ends bitwise where the same run
    without strangers ends (every refused quorum is asked again before the step starts)."""
    items = ("ft.min_replicas=2", "train.steps=40", "checkpoint.interval_steps=20")
    env, go = slowed(tmp_path, "0:1.0")
    markers = {m: tmp_path / f"ran-{m}" for m in ("high", "zero", "grads", "poison")}
    with contextlib.ExitStack() as stack:
        ref = stack.enter_context(_supervised(tiny_root, "ft-sec-ref", items, cli_env()))
        proc = stack.enter_context(_supervised(tiny_root, "ft-sec", items, env))
        log1 = tiny_root / "logs" / "ft-sec" / "ft" / "group1.log"
        _wait(lambda: log1.is_file() and LISTENS.search(log1.read_text()) and _step(tiny_root, "ft-sec") >= 1,
              proc, "group 1's addresses and a first step")
        _g, manager, heal = LISTENS.search(log1.read_text()).groups()
        lighthouse = _events(tiny_root, "ft-sec") and _job_lighthouse(tiny_root)
        strangers = [subprocess.Popen([sys.executable, str(REPO / "tests" / "ft_stranger.py"), mode, lighthouse,
                                       str(markers[mode]), "10", manager], cwd=tmp_path, env=cli_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                     for mode in markers]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{heal.split('?')[0]}1?nonce={'0' * 32}", timeout=10)   # the signed address's base
        assert e.value.code == 403
        outs = [s.communicate(timeout=120)[0] for s in strangers]
        go.touch()
        out, err = proc.communicate(timeout=300)
        ref_out, ref_err = ref.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:] + "\n".join(o[-500:] for o in outs)
    assert ref.returncode == 0, ref_err[-3000:]
    assert not [m for m, p in markers.items() if p.exists()], outs
    said = out + log1.read_text()
    assert "refused a quorum holding" in said and "not a group of this run" in said, outs
    assert any(e["event"] == "ft_stranger" for e in _events(tiny_root, "ft-sec"))
    got, want = _digests(tiny_root, "ft-sec", out), _digests(tiny_root, "ft-sec-ref", ref_out)
    assert got[0] == got[1] == want[0] == want[1] and want[0][0] == 40, (got, want)


@pytest.mark.slow   # real processes: a 2-group run, one kill, two restarts
def test_a_heal_payload_that_is_not_the_groups_state_restarts_the_group_in_one_line(tiny_root, tmp_path):
    """Group 1 killed at step 4; group 0's first heal payload carries a key the model lacks (a test hook on the
    sender, so the payload is signed and only the check can refuse it). Group 1 refuses it in one line naming the
    key, exits, is started again by the supervisor, heals from the next payload, and both end bitwise equal."""
    run, steps = "ft-badheal", 30
    # min_replicas 2: group 0 waits for group 1's restarts (with 1 it could finish first on a loaded machine, and
    # group 1, back alone after the end, would rightly end without training: test_ft_end.py)
    items = ("ft.min_replicas=2", f"train.steps={steps}", "checkpoint.interval_steps=10", "ft.quorum_timeout_s=5")
    env, go = slowed(tmp_path, "0:0.5", LLMCLUSTER_TEST_FT_BAD_HEAL="extra-key")
    out = _group_1_killed_at_step_4(tiny_root, run, items, env, go, then=lambda proc: _wait(
        lambda: any(e["event"] == "ft_heal" and e["group"] == 1 and e["step"] >= 4 for e in _events(tiny_root, run)),
        proc, "group 1's heal", 180))
    log1 = (tiny_root / "logs" / run / "ft" / "group1.log").read_text()
    refused = [ln for ln in log1.splitlines() if "refused the heal from replica llmcluster_group_0" in ln]
    assert len(refused) == 1 and "keys differ (extra ['planted.weight']" in refused[0], log1[-3000:]
    assert "Traceback" not in log1.split(refused[0])[0].rsplit("started again", 1)[-1]
    assert _job(tiny_root, run)["ft"]["groups"][1]["restarts"] == 2   # the kill, then the refusal
    digests = _digests(tiny_root, run, out)
    assert digests[0] == digests[1] and digests[0][0] == steps, digests


def _job_lighthouse(root: Path) -> str:
    import json

    return "http://" + json.loads((root / "logs" / "ft-sec" / "job.json").read_text())["ft"]["lighthouse"]
