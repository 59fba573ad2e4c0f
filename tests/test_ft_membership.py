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
from llmcluster.launch.ft_auth import RunKey  # noqa: E402

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
