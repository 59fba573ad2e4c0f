"""Torch versions, in a module that imports nothing (so `validate stack` and `benchmarks/gpu_check.sh`, which
must not need torch or pydantic, can read it): the oldest torch llmcluster supports (pyproject's `torch>=`
bound says the same; tests/test_compat.py ties them), the driver each CUDA toolkit needs, and the CUDA build
the registry's default Linux wheel of a torch release carries."""

TORCH_FLOOR = (2, 6)
TORCH_FLOOR_TEXT = ".".join(map(str, TORCH_FLOOR))


def torch_too_old(version: str) -> str | None:
    """None if torch `version` (e.g. '2.5.1+cu124') is at least the floor, else the one-line reason."""
    if version_tuple(version)[:2] >= TORCH_FLOOR:
        return None
    return f"torch {version} is older than llmcluster's floor torch>={TORCH_FLOOR_TEXT}: upgrade torch"


def require_torch() -> None:
    """Before the trainer is imported (an older torch may fail inside that import with a traceback): one
    UserError line naming the floor. Reads the installed version from package metadata, not by importing."""
    import importlib.metadata as md

    from llmcluster.errors import UserError

    try:
        version = md.version("torch")
    except md.PackageNotFoundError:
        raise UserError(f"torch is not installed (llmcluster needs torch>={TORCH_FLOOR_TEXT})") from None
    problem = torch_too_old(version)
    if problem:
        raise UserError(problem)


# Minimum Linux driver per CUDA toolkit (NVIDIA CUDA Toolkit release notes, "CUDA Toolkit and
# Corresponding Driver Versions"), and the floor under which not even minor-version compatibility holds.
CUDA_MIN_DRIVER = {"11.8": "520.61.05", "12.0": "525.60.13", "12.1": "530.30.02", "12.2": "535.54.03",
                   "12.3": "545.23.06", "12.4": "550.54.14", "12.5": "555.42.02", "12.6": "560.28.03",
                   "12.8": "570.26", "12.9": "575.51.03", "13.0": "580.65.06"}
MINOR_COMPAT_FLOOR = {"11": "450.80.02", "12": "525.60.13", "13": "580.65.06"}

# The CUDA build of the registry's default Linux x86-64 wheel (`pip install torch==X`), newest first, from
# the floor up (shared/reference/torch-api-versions.md; PyTorch's release notes).
PYPI_TORCH_CUDA = {"2.11.0": "13.0", "2.10.0": "12.8", "2.9.1": "12.8", "2.7.1": "12.6", "2.6.0": "12.4"}


def version_tuple(v: str) -> tuple[int, ...]:
    import re

    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def torch_for_driver(driver: str) -> str | None:
    """The newest torch release whose default registry wheel this NVIDIA driver runs without relying on
    minor-version compatibility; None if even the floor's wheel needs a newer driver."""
    for version, cuda in PYPI_TORCH_CUDA.items():
        if version_tuple(driver) >= version_tuple(CUDA_MIN_DRIVER[cuda]):
            return version
    return None
