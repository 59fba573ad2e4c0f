"""Membership proved per quorum (issue 63): every member of a new quorum proves the run's secret over that quorum.

Why: a replica id's MAC (launch/ft_auth.py) covers only the group and torchft's uuid. The Lighthouse's `/status`
lists every full id, and torchft keys members by id, so a stranger that copies an id (a group killed through the
Lighthouse's `POST /replica/<id>/kill`, or any id ever seen) passes that check and its tensors would be summed into
our gradients. An id is a name, not a proof; so once per quorum id, after torchft configured the quorum's process
group and before its first gradient all-reduce, every member proves, over that process group itself:

  round 1   all-gather a fresh random nonce from every member (NONCE_BYTES each)
  round 2   all-gather each member's claim (its replica id, its ManagerServer and heal addresses) and
            MAC(secret, quorum id, the claim, every member's nonce in rank order)

and every member checks every MAC. The nonces make a proof good for this quorum only (a MAC copied from another
quorum, or from an earlier quorum of the same members, names other nonces); the quorum id and the claim bind who
proves it and where it listens. A quorum that fails is refused before anything is summed, in one line naming who
failed; a group that finds its own replica id claimed by another member (at an address not its own) names that.

Both rounds are fixed-size uint8 tensors, so they go through torchft's process-group wrapper (gloo on CPU, nccl on
GPU) like any collective and are bounded by its timeout; nothing a peer sends is unpickled or evaluated: a record
is bytes, split on a separator, compared and MAC'd.
"""

from __future__ import annotations

import secrets
from collections import deque

from llmcluster.launch.ft_auth import RunKey, shown

NONCE_BYTES = 32
RECORD_BYTES = 512   # 32-hex MAC, a 2-byte length, the claim; zero padding (a claim longer than this is refused)
_MAC = 32
_SEP = "\0"          # RunKey joins parts with it: no part of a claim may hold it


class QuorumUnproved(Exception):
    """A quorum not every member proved: the one line that says who (raised before any gradient is summed).
    `who`: the members named, without the error's own words (a refusal said again is not logged twice)."""

    def __init__(self, line: str, who: str | None = None):
        super().__init__(line)
        self.who = who or line


def claim(replica_id: str, manager_address: str, heal_address: str) -> str:
    return _SEP.join((replica_id, manager_address, heal_address))


def record(key: RunKey, quorum_id: int, own: str, nonces: list[bytes]) -> bytes:
    """This member's round-2 record: its MAC over the quorum, its claim and every nonce, then the claim."""
    body = own.encode()
    if len(body) > RECORD_BYTES - _MAC - 2:
        raise ValueError(f"a membership claim of {len(body)} bytes: at most {RECORD_BYTES - _MAC - 2}")
    mac = key.mac("member", quorum_id, own, *(n.hex() for n in nonces)).encode()
    return (mac + len(body).to_bytes(2, "big") + body).ljust(RECORD_BYTES, b"\0")


def _parsed(rec: bytes) -> tuple[str, list[str]] | None:
    """(mac, [replica id, manager address, heal address]) of a record, or None when it is not one."""
    n = int.from_bytes(rec[_MAC:_MAC + 2], "big")
    if len(rec) != RECORD_BYTES or n > RECORD_BYTES - _MAC - 2:
        return None
    try:
        mac, parts = rec[:_MAC].decode("ascii"), rec[_MAC + 2:_MAC + 2 + n].decode("utf-8").split(_SEP)
    except UnicodeDecodeError:
        return None
    return (mac, parts) if len(parts) == 3 else None


def check(key: RunKey, quorum_id: int, replica_ids: list[str], rank: int, nonces: list[bytes],
          records: list[bytes], seen: set[bytes] | frozenset = frozenset()) -> str | None:
    """None when every member of the quorum proved it; else who did not, in words (the first failure in rank
    order: every member finds the same one, since all hold the same gathered bytes). `rank`: this member's replica
    rank; `seen`: nonces this process met in earlier quorums (one seen again is a replay)."""
    mine = replica_ids[rank]
    if len(nonces) != len(replica_ids) or len(records) != len(replica_ids):
        return f"{len(records)} proofs for {len(replica_ids)} members"
    for r, nonce in enumerate(nonces):
        first = nonces.index(nonce)
        if first != r or (r != rank and nonce in seen):   # a nonce is fresh: the proof cannot have been made before
            return f"replica {shown(replica_ids[r])} (rank {r}) sent a nonce used before"
    for r, rec in enumerate(records):
        who = f"replica {shown(replica_ids[r])} (rank {r})"
        got = _parsed(rec)
        if got is None:
            return f"{who} sent no proof of the run's secret (not a membership record)"
        mac, (rid, manager, heal) = got
        at = f"at ManagerServer {shown(manager)}, heal server {shown(heal)}"
        if r != rank and (rid == mine or replica_ids[r] == mine):
            return f"this group's own id {shown(mine)} is claimed by rank {r} {at}, not this group's address"
        if rid != replica_ids[r]:
            return f"{who} claims to be replica {shown(rid)}"
        if not key.verify(mac, "member", quorum_id, claim(rid, manager, heal), *(n.hex() for n in nonces)):
            return f"{who} {at} did not prove the run's secret over quorum {quorum_id}"
    return None


class Prover:
    """One group rank's side of the proof. `addresses`: (ManagerServer, heal server) this group listens on."""

    def __init__(self, key: RunKey, addresses: tuple[str, str], device="cpu"):
        self.key, self.addresses, self.device = key, addresses, device
        self.proved: int | None = None        # the quorum id last proved (the proof runs once per quorum id)
        self._seen: deque[bytes] = deque(maxlen=4096)   # nonces of earlier quorums (a replay is refused)

    def _gather(self, pg, data: bytes, world: int) -> list[bytes]:
        import torch
        from torch.distributed.distributed_c10d import AllgatherOptions

        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        out = [torch.zeros(len(data), dtype=torch.uint8, device=self.device) for _ in range(world)]
        pg.allgather([out], [mine], AllgatherOptions()).wait()   # bounded by the process group's timeout
        return [bytes(t.cpu().numpy().tobytes()) for t in out]

    def prove(self, pg, q, replica_id: str) -> None:
        """Over quorum `q` (torchft's QuorumResult, its process group `pg` configured): raises QuorumUnproved."""
        if q.quorum_id == self.proved:
            return
        ids, rank, world = list(q.replica_ids), q.replica_rank, q.replica_world_size
        if len(ids) != world or ids[rank] != replica_id:
            raise QuorumUnproved(f"quorum {q.quorum_id} places this group at rank {rank} of {ids!r:.200}")
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            nonces = self._gather(pg, nonce, world)
            own = claim(replica_id, *self.addresses)
            records = self._gather(pg, record(self.key, q.quorum_id, own, nonces), world)
        except Exception as e:   # noqa: BLE001 - a member that does not speak the proof, or one that left
            # which one cannot be told from an error or a timeout: every other member is named
            others = ", ".join(f"replica {shown(i)} (rank {r})" for r, i in enumerate(ids) if r != rank)
            raise QuorumUnproved(f"{others} did not complete the proof over quorum {q.quorum_id} (not holding the "
                                 f"run's secret, or gone: {type(e).__name__}: {' '.join(str(e).split())[:120]})",
                                 who=others) from None
        why = check(self.key, q.quorum_id, ids, rank, nonces, records, set(self._seen))
        self._seen.extend(nonces)
        if why:
            raise QuorumUnproved(why)
        self.proved = q.quorum_id
