"""validate's logic without processes: nccl-tests arithmetic, the result checker, outliers, drain, NVML
mapping, driver/CUDA rule, spec loading. Only NVML is faked (there is no GPU here), and said so below."""

from __future__ import annotations

import subprocess

import pytest
import torch

from llmcluster.errors import UserError
from llmcluster.validate import nodes, thermal
from llmcluster.validate import collectives
from llmcluster.validate.collectives import Buffers, periodic, time_collective, timed_row
from llmcluster.validate.nccl_semantics import (
    OPS, bandwidths, bus_factor, element_count, parse_size, size_sweep)
from llmcluster.validate.result import FAIL, PASS, SKIP, WARN, CheckResult
from llmcluster.validate.spec import ValidateSpec, load_spec
from llmcluster.validate.stack import driver_cuda_status, ib_ports
from llmcluster.validate.storage import parse_fio


# -- nccl-tests arithmetic --------------------------------------------------------------------------

def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == 1.0
    # 1 GB in 10 ms on 8 ranks: algbw 100 GB/s, busbw 175 GB/s
    assert bandwidths("all_reduce", 10**9, 0.01, 8) == pytest.approx((100.0, 175.0))


class RecordedClock:
    """A monotonic fake clock that a fake collective advances by recorded per-call durations: validate and a
    hand-written loop fed the same recording must measure exactly the same window, whatever the machine's load."""

    def __init__(self, durations):
        self.now, self.durations = 1000.0, list(durations)

    def __call__(self) -> float:
        return self.now

    def collective(self, real):
        def run(*args, **kwargs):
            real(*args, **kwargs)
            self.now += self.durations.pop(0)
        return run


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# the per-call durations of 3 warm-up + 4 timed calls; a window that took in a warm-up call, the barrier
# or the rank-mean all-reduce would give another number than 0.25 s
RECORDED = [9.0, 7.0, 5.0, 0.1, 0.2, 0.3, 0.4]


def test_validate_times_exactly_the_window_a_hand_loop_times(one_rank_group, monkeypatch):
    import torch.distributed as dist

    count = 1 << 16
    validate_clock = RecordedClock(RECORDED)
    monkeypatch.setattr(collectives, "clock", validate_clock)
    bufs = Buffers("all_reduce", count, True, 0, 1, torch.device("cpu"))
    bufs.fill()
    bufs.run = validate_clock.collective(bufs.run)
    row = timed_row(bufs, warmup=3, iters=4)
    assert not validate_clock.durations                       # every recorded call was made, no more
    assert row["bytes"] == count * 4 and row["time_us"] == pytest.approx(0.25e6, rel=1e-12)
    assert row["algbw_GBps"] == pytest.approx(count * 4 / 0.25 / 1e9, rel=1e-12)
    assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * bus_factor("all_reduce", 1))

    # the plainest hand loop (warm-up; barrier; t0; iters calls; t1) over the same recording
    hand_clock = RecordedClock(RECORDED)
    buf = torch.ones(count)
    all_reduce = hand_clock.collective(dist.all_reduce)
    for _ in range(3):
        all_reduce(buf)
    dist.barrier()
    t0 = hand_clock()
    for _ in range(4):
        all_reduce(buf)
    assert (hand_clock() - t0) / 4 * 1e6 == pytest.approx(row["time_us"], rel=1e-12)


def test_time_collective_window_starts_after_warmup_and_barrier(one_rank_group, monkeypatch):
    clock = RecordedClock([1.0] * 2 + [0.5] * 3)
    monkeypatch.setattr(collectives, "clock", clock)
    bufs = Buffers("broadcast", 1024, True, 0, 1, torch.device("cpu"))
    bufs.run = clock.collective(bufs.run)
    assert time_collective(bufs, warmup=2, iters=3) == pytest.approx(0.5)


def test_sizes_and_sweep():
    assert parse_size("8") == 8 and parse_size("64K") == 64 << 10 and parse_size("1G") == 1 << 30
    assert parse_size("256MiB") == 256 << 20
    assert size_sweep(8, 128, 2) == [8, 16, 32, 64, 128]
    assert size_sweep(1 << 20, 8 << 20, 4) == [1 << 20, 4 << 20]
    assert element_count(1000, 8) == 248       # 250 floats, rounded down to a multiple of 8 ranks
    for bad in ("64Q", "-1", "x"):
        with pytest.raises(UserError):
            parse_size(bad)
    with pytest.raises(UserError):
        size_sweep(64, 8, 2)
    with pytest.raises(UserError):
        size_sweep(8, 64, 1)


def test_periodic_pattern():
    assert periodic(95, 4, "cpu").tolist() == [95, 96, 0, 1]
    assert periodic(0, 200, "cpu").tolist() == [i % 97 for i in range(200)]


def _simulate(op: str, n: int, count: int) -> list[torch.Tensor]:
    """What each rank's output must be, by brute force from every rank's filled input (no process group)."""
    bufs = [Buffers(op, count, False, r, n, torch.device("cpu")) for r in range(n)]
    for b in bufs:
        b.fill()
    ins = [b.send.clone() for b in bufs]
    c = count // n
    if op == "all_reduce":
        return [sum(ins)] * n
    if op == "broadcast":
        return [ins[0]] * n
    if op == "all_gather":
        return [torch.cat(ins)] * n
    if op == "reduce_scatter":
        return [sum(ins)[r * c:(r + 1) * c] for r in range(n)]
    return [torch.cat([ins[s][r * c:(r + 1) * c] for s in range(n)]) for r in range(n)]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [2, 3])
def test_checker_accepts_the_right_answer_and_counts_each_wrong_element(op, n):
    count = element_count(4 * 1000, n)
    for r, truth in enumerate(_simulate(op, n, count)):
        b = Buffers(op, count, False, r, n, torch.device("cpu"))
        b.recv.copy_(truth)
        assert b.count_wrong() == 0
        b.recv[[0, 5, -1]] += 1
        assert b.count_wrong() == 3


def test_inplace_buffers_alias_the_nccl_tests_way():
    ag = Buffers("all_gather", 12, True, 1, 3, torch.device("cpu"))
    assert ag.send.data_ptr() == ag.recv[4:8].data_ptr()     # my chunk of the output is my input
    rs = Buffers("reduce_scatter", 12, True, 2, 3, torch.device("cpu"))
    assert rs.recv.data_ptr() == rs.send[8:12].data_ptr()    # my output is my chunk of the input


# -- outliers and drain ------------------------------------------------------------------------------

def _compute(node: str, tflops: float) -> CheckResult:
    r = CheckResult("compute", node=node)
    r.add("bf16", PASS, f"{tflops}")
    r.data = {"shapes": [{"dtype": "bf16", "shape": [8192] * 3, "tflops": tflops}]}
    return r


def test_outlier_logic_flags_an_injected_slow_node():
    results = [_compute(f"gpu{i:02d}:0", 780.0 + i) for i in range(7)] + [_compute("gpu07:0", 600.0)]
    cmp = nodes.compare_nodes(results, tolerance=0.10)
    assert cmp.status == FAIL
    assert [o["node"] for o in cmp.data["outliers"]] == ["gpu07:0"]
    # 10% is a threshold, not a ranking: 5% below the median is fine
    fine = nodes.compare_nodes([_compute("a:0", 100), _compute("b:0", 100), _compute("c:0", 95)], 0.10)
    assert fine.status == PASS and fine.data["outliers"] == []
    assert nodes.find_outliers({"only": 1.0}, 0.1) == []


def test_inject_slowness_hook_slows_only_that_rank(monkeypatch):
    monkeypatch.setenv("LLMCLUSTER_TESTING", "1")   # test hooks act only with the testing switch on
    monkeypatch.setenv(nodes.SLOW_RANK_ENV, "1")
    mine, other = [_compute("h:1", 800.0)], [_compute("h:0", 800.0)]
    nodes.inject_slowness(mine, rank=1)
    nodes.inject_slowness(other, rank=0)
    assert mine[0].data["shapes"][0]["tflops"] == pytest.approx(800.0 * nodes.SLOW_FACTOR) and other[0].data["shapes"][0]["tflops"] == 800.0


def test_drain_command_construction():
    cmd = nodes.drain_command("gpu07", "llmcluster validate: compute bf16 TFLOP/s 600 < median 783\n(x)")
    assert cmd == ["scontrol", "update", "nodename=gpu07", "state=drain",
                   "reason=llmcluster validate: compute bf16 TFLOP/s 600 < median 783 (x)"]


def test_drain_names_failing_and_outlier_hosts_and_runs_scontrol_per_host():
    results = [_compute("gpu01:0", 790), _compute("gpu01:1", 785), _compute("gpu02:0", 400),
               _compute("gpu03:0", 788)]
    bad_storage = CheckResult("storage", node="gpu03")
    bad_storage.add("checkpoints write", FAIL, "0.1 GB/s", "2% of expected 5 GB/s")
    results.append(bad_storage)
    to_drain = nodes.nodes_to_drain(results, nodes.compare_nodes(results, 0.10))
    assert set(to_drain) == {"gpu02", "gpu03"}
    assert "compute bf16" in to_drain["gpu02"] and "storage" in to_drain["gpu03"]
    seen = []

    def fake_run(cmd, **kw):   # a stand-in for subprocess.run: there is no slurmctld to drain in
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0 if "nodename=gpu02" in cmd else 1, "", "Invalid node name")

    r = nodes.drain(to_drain, run=fake_run)
    assert [c[2] for c in seen] == ["nodename=gpu02", "nodename=gpu03"]
    assert {i.name: i.status for i in r.items} == {"drain gpu02": WARN, "drain gpu03": FAIL}


# -- thermal: NVML readings mapped and judged (NVML is faked: no GPU on this machine) ----------------

class FakeNVML:
    """Just the pynvml calls `thermal.sample` makes, with pynvml's constant names."""
    NVML_TEMPERATURE_GPU, NVML_CLOCK_SM = 0, 1

    def __init__(self, temps, clocks, powers_mw, reasons):
        self.readings = list(zip(temps, clocks, powers_mw, reasons))
        self.i = -1

    def nvmlDeviceGetTemperature(self, handle, kind):
        assert kind == self.NVML_TEMPERATURE_GPU
        self.i += 1
        return self.readings[self.i][0]

    def nvmlDeviceGetClockInfo(self, handle, kind):
        assert kind == self.NVML_CLOCK_SM
        return self.readings[self.i][1]

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.readings[self.i][2]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self.readings[self.i][3]


def _samples(nvml, k):
    return [thermal.sample(nvml, "handle") for _ in range(k)]


def test_nvml_readings_are_mapped():
    s = thermal.sample(FakeNVML([71], [1980], [650_000], [0x4 | 0x40]), "h")
    assert (s["temp_c"], s["sm_mhz"], s["power_w"]) == (71, 1980, 650.0)
    assert s["reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert thermal.decode_reasons(0) == []


def test_thermal_healthy_gpu_at_power_cap_warns_only():
    k = 8
    fake = FakeNVML([65 + i for i in range(k)], [1980] * k, [690_000] * k, [0x4] * k)
    r = thermal.judge(_samples(fake, k), ValidateSpec(), power_limit_w=700)
    assert r.status == WARN, r.items
    assert {i.name: i.status for i in r.items}["max temperature"] == PASS


def test_thermal_fails_on_heat_throttle_and_sagging_clocks():
    k = 8
    hot = FakeNVML([80, 82, 84, 86, 87, 87, 88, 88], [1980] * k, [700_000] * k, [0] * k)
    assert {i.name: i.status for i in thermal.judge(_samples(hot, k), ValidateSpec()).items}["max temperature"] == FAIL
    sag = FakeNVML([70] * k, [1980, 1980, 1900, 1700, 1500, 1500, 1450, 1450], [700_000] * k, [0x20] * 4 + [0] * 4)
    items = {i.name: i.status for i in thermal.judge(_samples(sag, k), ValidateSpec()).items}
    assert items["SM clock sag"] == FAIL and items["throttle reasons"] == FAIL


def test_thermal_skips_without_a_gpu():
    assert thermal.check_thermal(torch.device("cpu"), ValidateSpec(), 1).status == SKIP


# -- stack rules and parsers -------------------------------------------------------------------------

def test_driver_cuda_compatibility_rule():
    assert driver_cuda_status("550.54.15", "12.4")[0] == PASS
    assert driver_cuda_status("535.104.05", "12.4")[0] == WARN     # minor-version compatibility only
    assert driver_cuda_status("470.82.01", "12.4")[0] == FAIL
    assert driver_cuda_status("580.65.06", "13.0")[0] == PASS


def test_ib_ports_read_from_sysfs(tmp_path):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    assert ib_ports(tmp_path) == [{"device": "mlx5_0", "port": "1", "state": "ACTIVE",
                                   "rate": "400 Gb/sec (4X NDR)", "link_layer": "InfiniBand"}]


def test_parse_fio_json():
    out = 'fio-3.33 note\n{"jobs": [{"write": {"bw_bytes": 2500000000}, "read": {"bw_bytes": 0}}]}'
    assert parse_fio(out, "write") == 2.5


def test_spec_loading(tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_text("nodes: {count: 4}\nhardware: {gpu: H200, gpus_per_node: 8}\nvalidate:\n  min_busbw_GBps: 360\n"
                 "storage:\n  areas:\n    checkpoints: {write_GBps: 5}\n")
    spec = load_spec(str(f))
    assert spec.gpu_model(None).name == "H200" and spec.storage["checkpoints"].write_GBps == 5
    assert spec.gpus_per_node == 8 and spec.min_busbw_GBps == 360
    assert ValidateSpec().gpu_model("NVIDIA H100 80GB HBM3").name == "H100"
    h200 = spec.gpu_model(None)                     # the PCIe expectation: the table's link, or the spec's
    assert spec.pcie_expect_GBps(h200) == h200.pcie_h2d_GBps
    f.write_text("hardware: {gpu: RTX4090, gpus_per_node: 2, pcie_lanes: 8}\n")   # a consumer board's x8/x8
    box = load_spec(str(f))
    assert box.pcie_expect_GBps(box.gpu_model(None)) == pytest.approx(box.gpu_model(None).pcie_h2d_GBps / 2)
    f.write_text("hardware: {gpu: RTX4090, gpus_per_node: 2, pcie_lanes: 8}\nvalidate: {pcie_GBps: 20}\n")
    assert load_spec(str(f)).pcie_expect_GBps(box.gpu_model(None)) == 20   # a site's own figure wins
    seed = load_spec("seed-a100")                     # a shipped cluster by name
    assert seed.gpu == "A100-80GB" and seed.gpus_per_node == 4 and seed.storage["datasets"].read_GBps == 10
    f.write_text("validate:\n  tolerence: 0.2\n")
    with pytest.raises(UserError, match="did you mean 'validate.tolerance'"):
        load_spec(str(f))
    f.write_text("hardware: {gpu: B300, gpus_per_node: 8}\n")
    with pytest.raises(UserError, match="unknown GPU"):
        load_spec(str(f))
    f.write_text("validate:\n  gpu: H200\n")        # the old format: the GPU is hardware's now
    with pytest.raises(UserError, match="validate.gpu.*hardware.gpu"):
        load_spec(str(f))


def test_result_status_is_the_worst_item_and_all_skip_is_skip():
    r = CheckResult("x")
    r.add("a", SKIP)
    assert r.status == SKIP
    r.add("b", PASS)
    r.add("c", WARN, detail="meh")
    assert (r.status, r.reason) == (WARN, "c: meh")
    assert CheckResult.from_dict(r.to_dict()).to_dict() == r.to_dict()


# -- where a rank sits: torchrun and srun environments ----------------------------------------------

def test_place_from_torchrun_and_srun_env():
    from llmcluster.validate.distributed import Place, current_place

    srun = {"SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURMD_NODENAME": "gpu02"}
    assert current_place(srun) == Place(11, 16, 3, "gpu02") and current_place(srun).label == "gpu02:3"
    # torchrun inside an allocation: torchrun's variables win
    assert current_place({**srun, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).rank == 1
    # a one-task step is not a distributed run
    assert not current_place({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).distributed


def test_slurm_rendezvous_fills_in_master_addr_and_port():
    from llmcluster.validate.distributed import first_host, slurm_rendezvous

    assert first_host("node[03-05,07],gpu1") == "node03"
    assert first_host("gpu7") == "gpu7"
    env = slurm_rendezvous({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[03-04]",
                            "SLURM_JOB_ID": "4242"})
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "node03",
                   "MASTER_PORT": str(15000 + 4242 % 20000)}
    # exported by the batch script: left alone
    assert "MASTER_ADDR" not in slurm_rendezvous({"SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                                                  "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})


# -- stack: what the spec expects decides whether a missing GPU piece is a SKIP or a FAIL ------------

class NoNVML:
    """NVML as a node without a driver answers it (faked: pynvml is not installed here)."""
    def nvmlDeviceGetCount(self):
        raise RuntimeError("NVML Shared Library Not Found")


def _no_gpu_stack(monkeypatch, tmp_path, spec):
    from llmcluster.validate import stack
    monkeypatch.setattr(stack, "nvidia_driver", lambda: None)
    monkeypatch.setattr(stack, "torch_build", lambda: ("2.13.0", None))
    monkeypatch.setattr(stack, "_dist_version", lambda *names: None)
    r = stack.check_stack(spec, tmp_path, nvml=NoNVML())
    return r, {i.name: i for i in r.items}


def test_stack_fails_a_node_missing_the_gpus_its_spec_expects(monkeypatch, tmp_path, no_scheduler_probe):
    r, items = _no_gpu_stack(monkeypatch, tmp_path, ValidateSpec(gpu="A100-80GB", gpus_per_node=4,
                                                                 cluster="seed (x.yaml)"))
    assert r.status == FAIL
    for name in ("nvidia driver", "cudnn", "nccl", "pytorch build", "gpus"):
        assert items[name].status == FAIL, items[name]
        assert items[name].detail.endswith("cluster seed expects 4 x A100-80GB per node"), items[name]


@pytest.mark.parametrize("gpus_per_node", [None, 0])      # no spec, or a CPU-only one: as before, SKIP
def test_stack_skips_gpu_items_when_no_gpu_is_expected(monkeypatch, tmp_path, gpus_per_node, no_scheduler_probe):
    r, items = _no_gpu_stack(monkeypatch, tmp_path, ValidateSpec(gpus_per_node=gpus_per_node))
    assert all(items[n].status == SKIP for n in ("nvidia driver", "cudnn", "nccl", "gpus"))
    assert "pytorch build" not in items and FAIL not in {i.status for i in r.items}


def test_expected_gpus_are_this_hosts(monkeypatch, tmp_path):
    # the head node runs `validate stack` as the provisioning gate without GPUs; an override is that node's count
    f = tmp_path / "cluster.yaml"
    f.write_text("nodes: {hosts: 'gpu[01-04]', overrides: {gpu04: {gpus_per_node: 0}}}\n"
                 "hardware: {gpu: A100-80GB, gpus_per_node: 4}\nscheduler: {slurm: {head_node: head01}}\n")
    expect = {}
    for host in ("gpu01", "gpu04", "head01"):
        monkeypatch.setenv("SLURMD_NODENAME", host)
        expect[host] = load_spec(str(f)).gpus_per_node
    assert expect == {"gpu01": 4, "gpu04": 0, "head01": None}


def test_thermal_power_capped_hopper_settling_below_boost_warns_not_fails():
    # NVML faked (no GPU here): boost 1980 MHz, then held at the power cap ~12% lower, no thermal slowdown
    k = 8
    capped = FakeNVML([70] * k, [1980, 1980, 1900, 1800] + [1740] * 4, [700_000] * k, [0x4] * k)
    r = thermal.judge(_samples(capped, k), ValidateSpec(), power_limit_w=700)
    items = {i.name: i.status for i in r.items}
    assert items["SM clock sag"] == WARN and r.status == WARN, r.items
    # the same sag with no limiter to explain it, or with a thermal slowdown, still FAILs
    for reasons in ([0] * k, [0x4] * 4 + [0x4 | 0x20] * 4):
        sag = FakeNVML([70] * k, [1980, 1980, 1900, 1800] + [1740] * 4, [700_000] * k, reasons)
        assert {i.name: i.status for i in thermal.judge(_samples(sag, k), ValidateSpec()).items}["SM clock sag"] == FAIL


# -- the GPU table: PCIe/NVL parts and MIG slices get their own peaks (names as NVML reports them) ---------

@pytest.mark.parametrize("device, table, bf16, hbm", [
    ("NVIDIA H100 PCIe", "H100-PCIe", 756, 2000),          # H100 datasheet, PCIe column (1,513 sparse)
    ("NVIDIA H100 NVL", "H100-NVL", 835, 3900),             # H100 datasheet, NVL column (1,671 sparse)
    ("NVIDIA H200 NVL", "H200-NVL", 835, 4800),             # H200 NVL datasheet
    ("NVIDIA H100 80GB HBM3", "H100", 989, 3350),           # SXM unchanged
    ("NVIDIA A100-SXM4-80GB", "A100-80GB", 312, 2039),
])
def test_pcie_and_nvl_parts_get_their_own_peaks(device, table, bf16, hbm):
    from llmcluster.config.gpus import match_device_name
    g = match_device_name(device)
    assert (g.name, g.bf16_tflops, g.memory_bw_gbps) == (table, bf16, hbm)
    assert ValidateSpec().gpu_model(device).name == table


def test_mig_slices_get_their_share_or_no_peak():
    from llmcluster.config.gpus import match_device_name
    s = match_device_name("NVIDIA A100-SXM4-80GB MIG 3g.40gb")      # the 80GB part, not the '40gb' in the profile
    assert s.bf16_tflops == pytest.approx(312 * 3 / 7) and s.memory_bw_gbps == pytest.approx(2039 / 2)
    assert s.memory_gb == 40 and s.peak_tflops("fp16") == pytest.approx(312 * 3 / 7)
    # the spec names the GPU, the node hands out slices: the slice's share, not the whole GPU's peak
    sliced = ValidateSpec(gpu="H100").gpu_model("NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    assert sliced.bf16_tflops == pytest.approx(989 / 7) and sliced.memory_bw_gbps == pytest.approx(3350 / 8)
    assert match_device_name("NVIDIA H100 80GB HBM3 MIG") is None     # a profile we cannot read: peak unknown
    assert ValidateSpec(gpu="H100").gpu_model("NVIDIA H100 80GB HBM3 MIG") is None


# -- Xids from the kernel log (a made-up log: there is no NVIDIA driver here) ------------------------------

def test_xids_are_classified_as_dcgm_does():
    from llmcluster.validate.stack import judge_xids
    app = ("[ 12.0] NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python, Graphics SM Warp Exception\n"
           "[ 13.0] NVRM: Xid (PCI:0000:18:00): 31, pid=4242, Ch 00000010, intr 10000000. MMU Fault\n"
           "[ 14.0] NVRM: Xid (PCI:0000:18:00): 43, pid=4242, Ch 00000008\n"
           "[ 15.0] NVRM: Xid (PCI:0000:18:00): 45, pid=4242, Ch 00000008\n")
    item = judge_xids(app)
    assert item.status == WARN and "the job that caused them" in item.detail, item
    for code, why in ((48, "double-bit ECC"), (79, "fell off the bus"), (95, "uncontained ECC"), (63, "row remap"),
                      (74, "NVLink"), (119, "GSP"), (150, "look it up")):
        item = judge_xids(app + f"[ 20.0] NVRM: Xid (PCI:0000:3b:00): {code}, pid=1, something\n")
        assert item.status == FAIL and why in item.detail and item.value == f"Xid {code} on PCI:0000:3b:00", item
    assert judge_xids("nothing from the driver").status == PASS


def test_a_gpu_of_another_form_than_the_spec_fails_by_name():
    from llmcluster.validate.stack import check_gpus

    class OneGpuNVML:   # NVML faked (no GPU here): one healthy GPU of the given name, no ECC/page/persistence calls
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED = NVML_VOLATILE_ECC = 0
        NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 0

        def __init__(self, name): self.name = name
        def nvmlDeviceGetCount(self): return 1
        def nvmlDeviceGetHandleByIndex(self, i): return i
        def nvmlDeviceGetName(self, h): return self.name
        def nvmlDeviceGetEccMode(self, h): return (1, 1)
        def nvmlDeviceGetTotalEccErrors(self, h, a, b): return 0
        def nvmlDeviceGetRetiredPages(self, h, c): return []
        def nvmlDeviceGetPersistenceMode(self, h): return 1

    spec = ValidateSpec(gpu="H100", gpus_per_node=1)
    item = {i.name: i for i in check_gpus(spec, OneGpuNVML("NVIDIA H100 PCIe")).items}["gpu 0"]
    assert item.status == FAIL and "H100-PCIe where the spec expects H100" in item.detail
    assert {i.name: i for i in check_gpus(spec, OneGpuNVML("NVIDIA H100 80GB HBM3")).items}["gpu 0"].status == PASS
