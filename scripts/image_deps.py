"""Print pyproject.toml's runtime dependencies, one requirement a line, without torch: what the Dockerfile
installs (`pip install -r`), so the image and the package have one dependency list. torch is left out
because the image's comes from its base (the CUDA build); pip is also pinned to it by a constraint there.

Standard library only (it runs before anything is installed): tomllib, or on 3.10 the tomli pip vendors.

    python scripts/image_deps.py [pyproject.toml]
"""

from __future__ import annotations

import re
import sys

try:
    import tomllib
except ImportError:   # Python 3.10
    from pip._vendor import tomli as tomllib

FROM_BASE = {"torch"}


def name(requirement: str) -> str:
    """The normalized project name of a PEP 508 requirement ("PyYAML>=6.0" -> "pyyaml")."""
    return re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def image_requirements(pyproject: str) -> list[str]:
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [d for d in deps if name(d) not in FROM_BASE]


if __name__ == "__main__":
    print("\n".join(image_requirements(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")))
