"""Membership proved per quorum (issue 63; ft/membership.py): the proof's checks in-process, the proof's two rounds
over torchft's own gloo process group, and a stranger under a dead group's copied replica id against a real run."""

from __future__ import annotations

import secrets
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest

pytest.importorskip("torchft")

from llmcluster.ft.membership import NONCE_BYTES, Prover, QuorumUnproved, check, claim, record  # noqa: E402
from llmcluster.launch.ft_auth import RunKey, shown  # noqa: E402

KEY, OTHER = RunKey(b"s" * 64), RunKey(b"t" * 64)
IDS = [KEY.replica_id(f"llmcluster_group_{g}:{g}{g}{g}{g}-aa") for g in range(3)]
ADDR = [(f"10.0.0.{g}:2900{g}", f"10.0.0.{g}:3900{g}") for g in range(3)]


def _round(qid=7, keys=(KEY, KEY, KEY), ids=IDS, addr=ADDR, nonces=None):
    nonces = nonces or [secrets.token_bytes(NONCE_BYTES) for _ in ids]
    return nonces, [record(k, qid, claim(i, *a), nonces) for k, i, a in zip(keys, ids, addr)]


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_quorum_whose_members_all_hold_the_secret_is_proved_by_each(rank):
    nonces, records = _round()
    assert check(KEY, 7, IDS, rank, nonces, records) is None


def test_a_member_without_the_secret_is_named_by_every_member():
    nonces, records = _round(keys=(KEY, OTHER, KEY))
    for rank in (0, 2):
        why = check(KEY, 7, IDS, rank, nonces, records)
        assert why.startswith(f"replica {IDS[1]} (rank 1)") and "did not prove the run's secret over quorum 7" in why


def test_a_proof_replayed_from_another_quorum_or_with_other_nonces_is_refused():
    nonces, records = _round(qid=6)
    assert "rank 0" in check(KEY, 7, IDS, 1, nonces, records)          # quorum 6's proofs shown in quorum 7
    old_nonces, old = _round()
    nonces, records = _round()
    records[2] = old[2]                                                # rank 2's proof of an earlier round
    assert "(rank 2)" in check(KEY, 7, IDS, 0, nonces, records)


def test_a_swapped_address_or_id_is_refused():
    nonces, records = _round()
    forged = record(OTHER, 7, claim(IDS[1], "10.9.9.9:1", ADDR[1][1]), nonces)   # its own MAC, another address
    mac_of_1 = records[1][:32]
    assert "rank 1" in check(KEY, 7, IDS, 0, nonces, records[:1] + [mac_of_1 + forged[32:]] + records[2:])
    swapped = list(records)
    swapped[1], swapped[2] = records[2], records[1]                    # proofs in each other's slots
    assert "claims to be replica" in check(KEY, 7, IDS, 0, nonces, swapped)


def test_a_nonce_used_twice_or_seen_before_is_refused():
    n = [secrets.token_bytes(NONCE_BYTES) for _ in range(2)]
    nonces, records = _round(nonces=[n[0], n[1], n[0]])
    assert "(rank 2) sent a nonce used before" in check(KEY, 7, IDS, 0, nonces, records)
    nonces, records = _round()
    assert "(rank 1) sent a nonce used before" in check(KEY, 7, IDS, 0, nonces, records, seen={nonces[1]})


def test_this_groups_own_id_claimed_at_another_address_is_named():
    ids = [IDS[0], IDS[1], IDS[0]]
    nonces, records = _round(ids=ids, addr=[ADDR[0], ADDR[1], ("10.6.6.6:1", "10.6.6.6:2")])
    why = check(KEY, 7, ids, 0, nonces, records)
    assert why == (f"this group's own id {IDS[0]} is claimed by rank 2 at ManagerServer 10.6.6.6:1, heal server "
                   "10.6.6.6:2, not this group's address")


def test_a_record_that_is_not_one_is_refused_without_being_interpreted():
    nonces, records = _round()
    for junk in (b"\xff" * 512, b"x" * 32 + b"\x7f\xff" + b"\0" * 478, b"short"):
        assert "sent no proof" in check(KEY, 7, IDS, 0, nonces, [records[0], junk, records[2]])


def _gloo_pair(keys):
    """Two members proving over torchft's own ProcessGroupGloo in two threads: what each raised, or None."""
    import torch  # noqa: F401
    from torch.distributed import TCPStore
    from torchft import ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    q = [SimpleNamespace(quorum_id=3, replica_rank=r, replica_world_size=2, replica_ids=IDS[:2]) for r in range(2)]
    got: list = [None, None]

    def member(r):
        pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
        pg.configure(f"127.0.0.1:{store.port}/torchft/3/0", IDS[r], r, 2)
        prover = Prover(keys[r], ADDR[r])
        try:
            prover.prove(pg, q[r], IDS[r])
            got[r] = prover.proved
        except QuorumUnproved as e:
            got[r] = e

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_the_proof_runs_over_torchfts_gloo_process_group():
    assert _gloo_pair((KEY, KEY)) == [3, 3]
    got = _gloo_pair((KEY, OTHER))
    assert isinstance(got[0], QuorumUnproved) and str(got[0]).startswith(f"replica {IDS[1]} (rank 1)"), got
    assert isinstance(got[1], QuorumUnproved) and str(got[1]).startswith(f"replica {IDS[0]} (rank 0)"), got  # its
    # own secret proves nothing to it either: each side names the other


def _gradient_values(root) -> int:
    """How many values a step's gradient all-reduce carries in the test's run (the parameters of its model, as the
    trainer shapes it: the tiny shape, the byte tokenizer's vocabulary; the loss; one writer entry per group; no
    straggler slots): what a stranger must send to be summed."""
    import torch

    from conftest import TINY
    from llmcluster.config.load import load_job_config
    from llmcluster.model.llama import build_model
    from llmcluster.train.hf_import import resolve_model_config

    cfg = load_job_config("llm_tiny", list(TINY))
    resolve_model_config(cfg, root)
    with torch.device("meta"):
        model = build_model(cfg.model, "meta")
    return sum(p.numel() for p in model.parameters()) + 1 + 2


@pytest.mark.slow   # real processes: a 2-group run, one kill and restart, one stranger (60-150 s)
def test_a_copied_replica_id_after_a_kill_is_refused_and_sums_nothing(tiny_root, tmp_path):
    """Issue 63's reproduction: group 1's full replica id read from the Lighthouse's `/status` (its MAC is valid),
    group 1 killed, and a stranger without the secret joins under that id at the run's step (no heal needed),
    all-reducing 1000s of the gradient's size while group 1's restart is held back. Group 0 refuses the quorum
    in one line naming the copied id, before any gradient: no committed step holds the stranger's values (every
    loss stays a byte model's), and after the stranger leaves group 1 heals and both end equal."""
    import contextlib
    import json
    import re
    import subprocess
    import sys
    import urllib.request

    from conftest import REPO, cli_env
    from faultkit import slowed
    from test_ft import _digests, _events, _kill_group, _losses, _step, _supervised, _wait

    run, steps = "ft-copy", 24
    items = ("ft.min_replicas=2", f"train.steps={steps}", "checkpoint.interval_steps=12", "ft.timeout_s=8",
             "ft.quorum_timeout_s=60")
    env, go = slowed(tmp_path, "0:1.0", LLMCLUSTER_TEST_FT_SLOW_START_S="35")
    with contextlib.ExitStack() as stack:
        proc = stack.enter_context(_supervised(tiny_root, run, items, env))
        _wait(lambda: _step(tiny_root, run) >= 2, proc, "a second step")
        job = json.loads((tiny_root / "logs" / run / "job.json").read_text())
        lighthouse = "http://" + job["ft"]["lighthouse"]
        status = urllib.request.urlopen(f"{lighthouse}/status", timeout=10).read().decode()
        copied = re.search(r"llmcluster_group_1:[0-9a-f-]+~[0-9a-f]{32}", status)
        assert copied, status[:2000]
        copied = copied[0]
        _kill_group(tiny_root, run, 1)
        stranger = subprocess.Popen([sys.executable, str(REPO / "tests" / "ft_stranger.py"), "copy", lighthouse,
                                     str(tmp_path / "unused"), "25", copied, str(_gradient_values(tiny_root))],
                                    cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
        said = stranger.communicate(timeout=120)[0]
        (tmp_path / "stranger.out").write_text(said)
        go.touch()
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:] + said[-2000:]
    losses = _losses(tiny_root, run)
    assert losses and max(losses.values()) < 20, (losses, said[-2000:])   # (own + 1000) / 2 had it been summed
    refused = [ln for ln in out.splitlines() if "before any gradient" in ln]   # group 0 writes to the run's stdout
    assert len(refused) == 1 and f"replica {shown(copied)} (rank 1)" in refused[0], (refused, said[-2000:])
    assert [e["replica_ids"] for e in _events(tiny_root, run) if e["event"] == "ft_stranger"] == [
        f"replica {shown(copied)} (rank 1)"]
    digests = _digests(tiny_root, run, out)
    assert digests[0] == digests[1] and digests[0][0] == steps, digests
