"""Print what the image installs, one requirement a line, without torch: pyproject.toml's runtime dependencies and
those of the extras a job enables (the Dockerfile's EXTRAS: ft, float8, tensorboard, wandb, mlflow, hf), so the
image and the package have one dependency list. torch is left out because the image's comes from its base (the
CUDA build); pip is also pinned to it by a constraint there, so no extra can pull another build over it.

Standard library only (it runs before anything is installed): tomllib, or on 3.10 the tomli pip vendors.

    python scripts/image_deps.py [pyproject.toml [EXTRA,EXTRA,...]]

An extra pyproject.toml does not define: one line on stderr, exit 2.
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


def image_requirements(pyproject: str, extras: str = "") -> list[str]:
    """The dependencies, then each extra's (in the order named), once each, torch left out."""
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    wanted = [e.strip() for e in extras.split(",") if e.strip()]
    if unknown := [e for e in wanted if e not in optional]:
        raise ValueError(f"extra(s) {', '.join(unknown)} not in {pyproject} (it defines {', '.join(optional)})")
    out: list[str] = []
    for d in [*project["dependencies"], *(d for e in wanted for d in optional[e])]:
        if name(d) not in FROM_BASE and d not in out:
            out.append(d)
    return out


if __name__ == "__main__":
    try:
        print("\n".join(image_requirements(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml",
                                           sys.argv[2] if len(sys.argv) > 2 else "")))
    except (OSError, ValueError, KeyError) as e:
        print(f"image_deps: {e}", file=sys.stderr)
        sys.exit(2)
