"""stack: the software levels of a training node, bottom up, as the seed's bring-up lists them.

OS/kernel -> NVIDIA driver, CUDA, cuDNN, NCCL (and the driver/CUDA compatibility rule) -> InfiniBand
ports, OFED, UCX -> /storage mounts -> Slurm / Kubernetes -> PyTorch -> monitoring exporters -> the GPUs
themselves (count, ECC, persistence, XID errors). Anything a CPU machine lacks is SKIP with the reason, unless
the cluster spec expects GPUs on this node: then a missing GPU, driver or library is a FAIL that says what was
expected (a node that lost its driver must not pass bring-up because nothing GPU-side could be judged).
No torch import: torch's version and CUDA build are read from its package files, so this runs in a
second on a head node.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import re
import shutil
import socket
import subprocess
from pathlib import Path

from llmcluster.config.gpus import gpu_spec, match_device_name
from llmcluster.floor import CUDA_MIN_DRIVER, MINOR_COMPAT_FLOOR, torch_too_old
from llmcluster.validate.result import FAIL, PASS, SKIP, WARN, CheckResult, Item
from llmcluster.validate.spec import ValidateSpec

MAX_RETIRED_PAGES = 10           # GCM/Imbue gate (planning facts §2)
EXPORTER_PORTS = {"dcgm-exporter": 9400, "node-exporter": 9100}


def _ver(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def _run(cmd: list[str], timeout: float = 10) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, (p.stdout + p.stderr).strip()
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)


def driver_cuda_status(driver: str, cuda: str) -> tuple[str, str]:
    """(status, why) for running a CUDA `cuda` build on driver `driver`."""
    need = CUDA_MIN_DRIVER.get(".".join(cuda.split(".")[:2]))
    if need and _ver(driver) >= _ver(need):
        return PASS, f"CUDA {cuda} needs driver >= {need}"
    floor = MINOR_COMPAT_FLOOR.get(cuda.split(".")[0])
    if floor and _ver(driver) >= _ver(floor):
        return WARN, (f"CUDA {cuda} wants driver >= {need or '?'}; runs under minor-version compatibility "
                      "only (no PTX JIT of newer code): upgrade the driver")
    return FAIL, f"CUDA {cuda} needs driver >= {need or floor or '?'}"


def torch_build() -> tuple[str | None, str | None]:
    """(torch version, CUDA version it was built with) from the installed files, without importing it."""
    try:
        version = md.version("torch")
    except md.PackageNotFoundError:
        return None, None
    spec = importlib.util.find_spec("torch")
    cuda = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        m = re.search(r"^cuda[^=]*=\s*['\"]([\d.]+)['\"]", _read(Path(loc) / "version.py"), re.M)
        cuda = m.group(1) if m else cuda
    return version, cuda


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            pass
    return None


def nvidia_driver() -> str | None:
    m = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", _read(Path("/proc/driver/nvidia/version")))
    return m.group(1) if m else None


def ib_ports(sysfs: Path = Path("/sys/class/infiniband")) -> list[dict]:
    """Every InfiniBand/RoCE port: device, port, state ('ACTIVE'), rate ('400 Gb/sec (4X NDR)'), link layer."""
    ports = []
    for dev in sorted(sysfs.glob("*")) if sysfs.is_dir() else []:
        for port in sorted((dev / "ports").glob("*")):
            state = _read(port / "state").strip()
            ports.append({"device": dev.name, "port": port.name, "state": state.split(":")[-1].strip(),
                          "rate": _read(port / "rate").strip(), "link_layer": _read(port / "link_layer").strip()})
    return ports


def _absent(spec: ValidateSpec) -> tuple[str, str]:
    """(status, note) for a GPU-side item this node lacks: FAIL when the spec expects GPUs here, else SKIP."""
    if spec.gpus_per_node:
        where = f"cluster {spec.cluster.split(' (')[0]}" if spec.cluster else "the cluster spec"
        return FAIL, f"; {where} expects {spec.gpus_per_node} x {spec.gpu or 'GPU'} per node"
    return SKIP, ""


def check_stack(spec: ValidateSpec, storage_root: Path, nvml=None) -> CheckResult:
    r = CheckResult("stack")
    absent, expected = _absent(spec)
    env = r.data
    # 1. OS and kernel
    os_name = re.search(r'PRETTY_NAME="?([^"\n]+)', _read(Path("/etc/os-release")))
    env.update(os=os_name.group(1) if os_name else platform.system(), kernel=platform.release())
    r.add("os / kernel", PASS, f"{env['os']} / {env['kernel']}")
    # 2. driver, CUDA, cuDNN, NCCL
    driver = nvidia_driver()
    torch_version, torch_cuda = torch_build()
    env.update(driver=driver, torch=torch_version, torch_cuda=torch_cuda,
               cudnn=_dist_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cudnn-cu11"),
               nccl=_dist_version("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"))
    if driver is None:
        r.add("nvidia driver", absent, detail="no NVIDIA kernel module (/proc/driver/nvidia/version)" + expected)
    else:
        r.add("nvidia driver", PASS, driver)
        if torch_cuda:
            status, why = driver_cuda_status(driver, torch_cuda)
            r.add("driver / CUDA", status, f"{driver} / {torch_cuda}", why)
    for lib in ("cudnn", "nccl"):
        if env[lib]:
            r.add(lib, PASS, env[lib], "the wheel torch loads")
        else:
            r.add(lib, absent, detail=("not installed (CPU build of torch)" if not torch_cuda else "no pip wheel found")
                  + expected)
    # 3. fabric
    ports = ib_ports()
    env["ib_ports"] = ports
    if not ports:
        r.add("infiniband", SKIP, detail="no devices in /sys/class/infiniband")
    for p in ports:
        ok = p["state"] == "ACTIVE"
        r.add(f"ib {p['device']}/{p['port']}", PASS if ok else WARN, f"{p['state']} {p['rate']}",
              p["link_layer"] if ok else "port not ACTIVE: cable, switch port or subnet manager (ibstat)")
    for tool, args in (("ofed_info", ["-s"]), ("ucx_info", ["-v"])):
        if shutil.which(tool):
            rc, out = _run([tool, *args])
            r.add(tool.split("_")[0].upper(), PASS if rc == 0 else WARN, out.splitlines()[0][:60] if out else "")
        elif ports:
            r.add(tool.split("_")[0].upper(), WARN, detail=f"{tool} not found next to InfiniBand devices")
    # 4. storage mounts
    from llmcluster.storage.layout import AREAS
    from llmcluster.validate.storage import fs_type

    mounts = {}
    for area in AREAS:
        p = storage_root / area
        if p.is_dir():
            mounts[area] = fs_type(p)
            if area == "datasets" and os.access(p, os.W_OK) and os.environ.get("SLURM_JOB_ID"):
                r.add("datasets mount", WARN, mounts[area], f"{p} is writable from a job: mount it read-only on workers")
    env["storage_mounts"] = mounts
    if mounts:
        r.add("storage mounts", PASS, ", ".join(f"{a}={t}" for a, t in mounts.items()), str(storage_root))
    else:
        r.add("storage mounts", SKIP, detail=f"no storage areas under {storage_root}")
    # 5. schedulers
    r.items.extend(_schedulers(env).items)
    # 6. PyTorch
    if torch_version is None:
        r.add("pytorch", FAIL, detail="torch is not installed")
    else:
        too_old = torch_too_old(torch_version)
        build = f"CUDA {torch_cuda}" if torch_cuda else "CPU-only"
        r.add("pytorch", FAIL if too_old else PASS, f"{torch_version} ({build})", too_old or "")
        if (driver or absent == FAIL) and not torch_cuda:
            r.add("pytorch build", FAIL, build, "a GPU node with a CPU-only torch: install the CUDA wheel" + expected)
    # 7. monitoring exporters (loopback only: this node's own exporters)
    for name, port in EXPORTER_PORTS.items():
        up = _port_open(port)
        if up:
            r.add(name, PASS, f"127.0.0.1:{port}")
        else:
            r.add(name, WARN if (driver and name == "dcgm-exporter") else SKIP,
                  detail=f"nothing listening on 127.0.0.1:{port}")
    # 8. the GPUs
    r.items.extend(check_gpus(spec, nvml).items)
    return r


def _schedulers(env: dict) -> CheckResult:
    """Slurm / Kubernetes tools and whether their controller answers. Unreachable is a FAIL inside a job
    of that scheduler (this node must reach it), a WARN elsewhere (client tools on a workstation)."""
    r = CheckResult("schedulers")
    if shutil.which("sinfo"):
        rc, out = _run(["sinfo", "-h", "-o", "%D %T"], timeout=5)
        down = FAIL if os.environ.get("SLURM_JOB_ID") else WARN
        r.add("slurm", PASS if rc == 0 else down, " ".join(out.split()[:6]) if rc == 0 else "",
              "" if rc == 0 else f"sinfo failed: {out.splitlines()[-1][:80] if out else rc} (is slurmctld up?)")
        env["slurm"] = out if rc == 0 else None
    if shutil.which("kubectl"):
        rc, ctx = _run(["kubectl", "config", "current-context"], timeout=5)
        if rc != 0:
            r.add("kubernetes", SKIP, detail="kubectl has no current context")
        else:
            rc, out = _run(["kubectl", "version", "--request-timeout=5s"], timeout=10)
            down = FAIL if os.environ.get("KUBERNETES_SERVICE_HOST") else WARN
            r.add("kubernetes", PASS if rc == 0 else down, ctx,
                  "" if rc == 0 else "API server unreachable from this node")
    if not r.items:
        r.add("scheduler", SKIP, detail="neither sinfo nor kubectl on PATH")
    return r


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


def check_gpus(spec: ValidateSpec, nvml=None) -> CheckResult:
    """GPU count, ECC, retired pages, persistence mode (NVML) and XID errors (kernel log)."""
    r = CheckResult("gpus")
    try:
        if nvml is None:
            import pynvml as nvml
            nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
    except Exception as e:
        absent, expected = _absent(spec)
        r.add("gpus", absent, detail=f"NVML unavailable: {' '.join(str(e).split())[:80]}" + expected)
        return r
    want = spec.gpus_per_node
    want_model = gpu_spec(spec.gpu).name if spec.gpu else None
    r.add("gpu count", FAIL if want is not None and count != want else PASS, str(count),
          f"expected {want}" if want is not None else "")
    for i in range(count):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        name = nvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
        problems, warnings = [], []
        seen = match_device_name(name)
        if want_model and seen and seen.name.split(" MIG ")[0] != want_model:
            # an H100 PCIe where the spec says H100 (SXM): every peak validate and plan use would be wrong
            problems.append(f"{seen.name} where the spec expects {want_model}")
        try:
            if nvml.nvmlDeviceGetEccMode(h)[0] != 1:
                warnings.append("ECC off")
            dbe = nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
            if dbe:
                problems.append(f"{dbe} uncorrectable ECC errors")
        except Exception:
            warnings.append("ECC not readable")
        try:
            retired = sum(len(nvml.nvmlDeviceGetRetiredPages(h, c)) for c in (
                nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
            if retired >= MAX_RETIRED_PAGES:
                problems.append(f"{retired} retired pages (>= {MAX_RETIRED_PAGES})")
        except Exception:
            pass    # Hopper replaced page retirement by row remapping
        try:
            if nvml.nvmlDeviceGetPersistenceMode(h) != 1:
                warnings.append("persistence mode off (nvidia-smi -pm 1 or nvidia-persistenced)")
        except Exception:
            pass
        status = FAIL if problems else WARN if warnings else PASS
        r.add(f"gpu {i}", status, name, "; ".join(problems + warnings) or "ECC on, persistence on")
    rc, log = _run(["dmesg"], timeout=10)
    if rc != 0:
        r.add("xid errors", SKIP, detail="kernel log not readable (dmesg needs privileges)")
    else:
        r.items.append(judge_xids(log))
    return r


# Xids an application causes (a bad kernel, an illegal address, a killed context), which NVIDIA's Xid catalog
# resolves by restarting the application and DCGM does not count against the GPU: a WARN. Every other Xid since
# boot FAILs bring-up: the named ones are the hardware faults, and an unknown one must be looked up first.
APP_XIDS = {13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing (channel "
            "reset)", 45: "preemptive cleanup after earlier errors"}
HW_XIDS = {48: "double-bit ECC error", 63: "ECC page retirement / row remap", 64: "row remap failure",
           74: "NVLink error", 79: "GPU fell off the bus", 92: "high single-bit ECC rate", 94: "contained ECC error",
           95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error"}


def judge_xids(log: str):
    """The `xid errors` item from a kernel log: FAIL on a hardware (or unknown) Xid, WARN on application ones."""
    xids = sorted({(int(x), pci) for pci, x in re.findall(r"NVRM: Xid \(([^)]*)\): (\d+)", log)})
    if not xids:
        return Item("xid errors", PASS, "none")
    bad = [(x, pci) for x, pci in xids if x not in APP_XIDS]
    shown = bad or xids
    value = ", ".join(f"Xid {x} on {pci}" for x, pci in shown[:5]) + (f" (+{len(shown) - 5})" if len(shown) > 5 else "")
    if bad:
        names = sorted({HW_XIDS.get(x, "not an application Xid: look it up in NVIDIA's Xid catalog") for x, _ in bad})
        return Item("xid errors", FAIL, value, "; ".join(names))
    return Item("xid errors", WARN, value, "application Xids (" + "; ".join(sorted({APP_XIDS[x] for x, _ in xids}))
                + "): the job that caused them, not the GPU")
