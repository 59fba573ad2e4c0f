"""Reading and running what `llmcluster provision` renders: its YAML (every string var tagged `!unsafe`) and
ansible-playbook on this machine (`-c local`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!unsafe", lambda loader, node: loader.construct_scalar(node))


def read_rendered(path: Path):
    """A rendered inventory or group_vars file, `!unsafe` strings read as plain strings."""
    return yaml.load(Path(path).read_text(), Loader=_Loader)


def playbook(project: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """ansible-playbook in the rendered project, every host on this machine (`-c local`, the system Python that
    has apt's bindings)."""
    return subprocess.run([str(ANSIBLE_PLAYBOOK), "-c", "local", "-e", "ansible_python_interpreter=/usr/bin/python3",
                           *args], cwd=project, capture_output=True, text=True, timeout=timeout)
