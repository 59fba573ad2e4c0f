"""Who belongs to an ft run (issue 49; docs/security.md, "torchft"): a per-run secret, and the proofs made with it.

torchft authenticates nothing: its Lighthouse admits any replica that asks for a quorum, its ManagerServers take any
`quorum` call, and its default heal transport unpickles whatever a peer serves. A stranger who reaches those ports
could join the quorum (its tensors summed into our gradients), be healed from (its pickle run in every group) or
heal (a copy of the model). So every group of a run holds one secret, and:

  * a group's replica id carries a MAC of its group number and the uuid torchft gives it at start
    (`llmcluster_group_<g>:<uuid>~<mac>`): a quorum holding any other member, or one group twice, is refused by
    every group before torchft configures the cross-group process group (ft/group.py);
  * a heal is a request and a payload both MACed with the secret over a fresh nonce (ft/transport.py): a
    stranger can neither fetch the state nor serve one that is loaded.

The secret is 32 random bytes in `logs/<run>/ft/secret`, mode 0600, created with O_EXCL under a temporary name and
renamed into place (never a file someone planted), read without following links and only when the caller owns it
(on Kubernetes: a Secret mounted into the pods, read the same way as the pods' run_as_user). No torch here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.storage.owned import replace_atomically

SECRET_ENV = "LLMCLUSTER_FT_SECRET_FILE"   # the path of the secret file, given to every group by its launcher
SECRET_FILE = "secret"
VALUE_ENV = "LLMCLUSTER_FT_SECRET"         # Kubernetes: the secret's value, from the run's Secret (secretKeyRef)
_ID = re.compile(r"llmcluster_group_(\d{1,6}):([0-9a-f-]{1,64})~([0-9a-f]{32})", re.ASCII)


def create_secret(ft_dir: Path) -> Path:
    """A fresh secret for this launch of the run in `ft_dir/secret` (0600)."""
    ft_dir.mkdir(parents=True, exist_ok=True)
    path = ft_dir / SECRET_FILE
    try:
        replace_atomically(path, secrets.token_hex(32) + "\n", 0o600)
    except OSError as e:
        raise UserError(f"cannot create the ft run secret {path}: {e.strerror or e}") from None
    return path


def read_secret(path: str | os.PathLike) -> bytes:
    """The secret from `path`: a regular file (not a link), owned by this process's user, readable by it alone."""
    what = f"the ft run secret {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise UserError(f"{what}: cannot open it ({e.strerror or e}; a symbolic link is refused)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{what}: not a regular file")
        if st.st_uid != os.geteuid():
            raise UserError(f"{what}: owned by uid {st.st_uid}, not by this user ({os.geteuid()}): refused")
        if st.st_mode & 0o077:
            raise UserError(f"{what}: mode {stat.S_IMODE(st.st_mode):04o} lets others read it; it must be 0600")
        value = f.read(4096).strip()
    return _long_enough(value, what)


def _long_enough(value: bytes, what: str) -> bytes:
    if len(value) < 32:
        raise UserError(f"{what}: too short to be a secret (at least 32 characters)")
    return value


def secret_from_env(environ=os.environ) -> bytes:
    """The file named by SECRET_ENV; on Kubernetes the value itself, which the kubelet puts in VALUE_ENV from the
    run's Secret (launch/k8s/ft.py: the rendered objects name the Secret, never hold it)."""
    path = environ.get(SECRET_ENV)
    if not path and len(environ.get(VALUE_ENV, "")) >= 32:
        return environ[VALUE_ENV].strip().encode()
    if not path:
        raise UserError(f"ft.enabled: this group was started without the run's secret ({SECRET_ENV} unset): start "
                        "the run with `llmcluster train --procs-per-node P` or `llmcluster launch`")
    return read_secret(path)


class RunKey:
    """HMAC-SHA256 with the run's secret, over parts joined by a separator no part may hold."""

    def __init__(self, secret: bytes):
        self._key = hashlib.sha256(b"llmcluster-ft\0" + secret).digest()

    def _digest(self, *parts: object) -> bytes:
        return hmac.new(self._key, "\0".join(str(p) for p in parts).encode(), hashlib.sha256).digest()

    def mac(self, *parts: object) -> str:
        return self._digest(*parts).hex()[:32]

    def derive(self, *parts: object) -> bytes:
        """32 bytes of key material for `parts` (ft/seal.py's HKDF input), never sent: its first part "key" is one
        no MAC that travels starts with."""
        return self._digest("key", *parts)

    def verify(self, mac: str, *parts: object) -> bool:
        return isinstance(mac, str) and hmac.compare_digest(mac.encode(), self.mac(*parts).encode())

    # -- replica ids -------------------------------------------------------------------------------
    def replica_id(self, torchft_id: str) -> str:
        """torchft's `llmcluster_group_<g>:<uuid>` with the MAC of both appended (what the Lighthouse sees)."""
        base, _, uid = torchft_id.partition(":")
        return f"{torchft_id}~{self.mac('replica', base, uid)}"

    def member(self, replica_id: str, groups: int) -> int | None:
        """The group of a replica id this run's secret made, else None."""
        m = _ID.fullmatch(replica_id)
        if not m or not self.verify(m[3], "replica", f"llmcluster_group_{m[1]}", m[2]):
            return None
        g = int(m[1])
        return g if g < groups else None

    def strangers(self, replica_ids: list[str], groups: int) -> list[str]:
        """The members of a quorum that are not this run's groups: ids without a valid MAC, and every id of a group
        that appears twice (a replayed id beside the group it copied; which one is ours cannot be told)."""
        seen: dict[int, list[str]] = {}
        out = []
        for r in replica_ids:
            g = self.member(r, groups)
            if g is None:
                out.append(r)
            else:
                seen.setdefault(g, []).append(r)
        return out + [r for ids in seen.values() if len(ids) > 1 for r in ids]


def shown(replica_id: str) -> str:
    """A replica id as a log line may show it: printable ASCII, cut (it is a stranger's text)."""
    text = "".join(c if 32 <= ord(c) < 127 else "?" for c in str(replica_id))
    return text if len(text) <= 80 else text[:77] + "..."
