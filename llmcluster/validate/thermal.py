"""thermal: sustained matmul load on a GPU while NVML is sampled; throttling or sagging clocks FAIL.

A healthy GPU under a long matmul load sits at its power cap (SW power cap is the normal limiter of a
busy H100, so it only WARNs); thermal slowdown, hardware slowdown and the power brake are faults (bad
cooling, a PSU or board problem) and FAIL, as does a temperature at or over the gate (84 °C, the GCM and
Imbue health checks) or an SM clock that sags by more than `max_clock_drop` from its early (boost) peak without
the power cap to explain it; settled at the power cap, the sag WARNs.
"""

from __future__ import annotations

import statistics
import threading
import time

from llmcluster.validate.result import FAIL, PASS, WARN, CheckResult, skipped
from llmcluster.validate.spec import ValidateSpec

# NVML's nvmlClocksEventReason* bits (nvml.h); names as `nvidia-smi -q -d PERFORMANCE` prints them.
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}
FAULT_REASONS = {"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}


def decode_reasons(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


def sample(nvml, handle) -> dict:
    """One reading: temperature (°C), SM clock (MHz), power (W), the active throttle reasons."""
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
        or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return {"t": time.monotonic(),
            "temp_c": nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
            "sm_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            "power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "reasons": decode_reasons(reasons(handle))}


def judge(samples: list[dict], spec: ValidateSpec, power_limit_w: float | None = None) -> CheckResult:
    """Turn the readings of one load run into PASS/WARN/FAIL items (pure: unit-tested with made-up readings)."""
    r = CheckResult("thermal")
    if not samples:
        r.add("samples", FAIL, detail="no NVML readings were taken during the load")
        return r
    t0 = samples[0]["t"]
    r.data["samples"] = [{**s, "t": round(s["t"] - t0, 3)} for s in samples]
    hottest = max(s["temp_c"] for s in samples)
    r.add("max temperature", FAIL if hottest >= spec.max_temp_c else PASS, f"{hottest:g} °C",
          f"gate < {spec.max_temp_c:g} °C")
    # the clock the GPU reached once warm vs what it holds over the second half of the run
    clocks = [s["sm_mhz"] for s in samples]
    peak = max(clocks[: max(1, len(clocks) // 4)] or clocks)
    late = statistics.median(clocks[len(clocks) // 2:])
    drop = 1 - late / peak if peak else 0.0
    # The early peak is the boost clock; a power-capped Hopper settles ~12% below it under a full matmul load.
    # Held there by the power cap alone is the normal limiter (a WARN, as the throttle reasons below): the sag
    # FAILs only with a thermal/hardware slowdown, or with no limiter to explain it.
    settled = {x for s in samples[len(samples) // 2:] for x in s["reasons"]}
    capped = "sw_power_cap" in settled and not settled & FAULT_REASONS
    status = PASS if drop <= spec.max_clock_drop else WARN if capped else FAIL
    r.add("SM clock sag", status, f"{peak:g} -> {late:g} MHz",
          f"{drop:.0%} drop (above {spec.max_clock_drop:.0%}: FAIL, WARN when held at the power cap only)")
    power = statistics.median(s["power_w"] for s in samples[len(samples) // 2:])
    r.add("power under load", PASS, f"{power:.0f} W",
          f"{power / power_limit_w:.0%} of the {power_limit_w:.0f} W limit" if power_limit_w else "")
    seen = sorted({x for s in samples for x in s["reasons"]})
    faults = [x for x in seen if x in FAULT_REASONS]
    if faults:
        r.add("throttle reasons", FAIL, ", ".join(seen), "thermal/hardware/power-brake slowdown under load")
    elif "sw_power_cap" in seen:
        r.add("throttle reasons", WARN, ", ".join(seen), "held at the power cap (normal for a full matmul "
              "load; check the power limit if clocks sag)")
    else:
        r.add("throttle reasons", PASS, ", ".join(seen) or "none")
    return r


def check_thermal(device, spec: ValidateSpec, seconds: float, nvml=None, interval: float = 0.5) -> CheckResult:
    """Load `device` for `seconds` with matmuls while sampling NVML every `interval` seconds."""
    if device.type != "cuda":
        return skipped("thermal", "no CUDA device to load")
    if nvml is None:
        try:
            import pynvml as nvml
            nvml.nvmlInit()
        except Exception as e:  # the library is missing or there is no driver
            return skipped("thermal", f"NVML unavailable: {e}")
    from llmcluster.validate.compute import matmul_load

    try:
        handle = _handle(nvml, device)
        sample(nvml, handle)   # fail here, before the load, if this driver lacks a call we need
    except Exception as e:
        return skipped("thermal", f"NVML cannot read this GPU: {e}")
    try:
        limit = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
    except Exception:
        limit = None
    stop, samples, errors = threading.Event(), [], []

    def sampler():
        while not stop.wait(interval):
            try:
                samples.append(sample(nvml, handle))
            except Exception as e:   # keep loading; report the failed reading below
                errors.append(str(e))

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    try:
        matmuls = matmul_load(device, stop)
    finally:
        stop.set()
        timer.cancel()
        th.join()
    r = judge(samples, spec, limit)
    r.data.update(seconds=seconds, matmuls=matmuls, nvml_errors=errors[:5])
    return r


def _handle(nvml, device):
    """The NVML handle of the GPU torch calls `device`: by UUID, since CUDA_VISIBLE_DEVICES renumbers
    torch's devices but not NVML's; by index when the UUID is not available (old torch)."""
    import torch
    try:
        u = str(torch.cuda.get_device_properties(device).uuid)
        return nvml.nvmlDeviceGetHandleByUUID(u if u.startswith("GPU-") else f"GPU-{u}")
    except Exception:
        return nvml.nvmlDeviceGetHandleByIndex(device.index or 0)
