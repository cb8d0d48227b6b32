"""Tests of colocate.telemetry: readings, the switch timeline, leak tracking."""

import os
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import asdict

import pytest
import torch

from colocate.telemetry import (
    LeakTracker,
    MemoryReading,
    ResidualGrowthWarning,
    SwitchEvent,
    TelemetryError,
    Timeline,
    leak_tracker,
    process_rss,
    process_runs,
    read,
    read_cpu,
    read_gpu,
    readings,
    timeline,
)

MIB = 1 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def event(op="pause", tag="gen", nbytes=MIB, seconds=0.1, before=2 * MIB, after=MIB, **kw):
    fields = dict(device="cuda:0", start=1000.0, pid=os.getpid()) | kw
    return SwitchEvent(op, tag, nbytes, seconds, before, after, **fields)


# readings


def test_read_cpu_rss_rises_with_a_filled_tensor():
    before = read_cpu()
    tensor = torch.ones(64 * MIB // 4, dtype=torch.float32)
    after = read_cpu()
    assert after.used_bytes - before.used_bytes >= 0.9 * tensor.nbytes
    assert after.device == "cpu" and after.uss_bytes is None
    assert after.timestamp >= before.timestamp


def test_read_cpu_with_uss():
    reading = read_cpu(include_uss=True)
    assert reading.uss_bytes is not None and 0 < reading.uss_bytes <= reading.used_bytes


def test_process_rss_is_psutils_rss_and_a_forked_child_reads_its_own():
    import psutil

    assert abs(process_rss() - psutil.Process().memory_info().rss) < 4 * MIB
    read_r, write_w = os.pipe()
    child = os.fork()  # inherits the parent's open /proc file
    if child == 0:  # no torch here: its threads do not survive a fork
        before = process_rss()
        filled = b"x" * (64 * MIB)
        os.write(write_w, f"{before} {process_rss()} {psutil.Process().memory_info().rss}"
                 .encode())
        os._exit(0 if filled else 1)
    os.waitpid(child, 0)
    before, after, psutils = map(int, os.read(read_r, 96).split())
    os.close(read_r)
    os.close(write_w)
    assert after - before > 48 * MIB and abs(after - psutils) < 4 * MIB


def test_process_rss_and_read_dispatch():
    assert process_rss() > 0
    for device in ("cpu", torch.device("cpu")):
        reading = read(device)
        assert isinstance(reading, MemoryReading) and reading.device == "cpu"
    with pytest.raises(ValueError, match="meta"):
        read("meta")


def test_process_runs_tells_a_live_process_from_a_zombie_and_a_gone_one():
    # a name with ") Z " in it: /proc/<pid>/stat is read after the comm's last ")"
    named = subprocess.Popen([sys.executable, "-c", (
        "import ctypes, time; ctypes.CDLL(None).prctl(15, b'x) Z 1 (', 0, 0, 0); "
        "print(flush=True); time.sleep(60)")], stdout=subprocess.PIPE)
    quick = subprocess.Popen(["true"])
    try:
        named.stdout.readline()  # renamed
        deadline = time.monotonic() + 10
        while readings._runs_by_psutil(quick.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # until it has exited, unreaped: a zombie
        assert process_runs(os.getpid()) and process_runs(named.pid)
        assert not process_runs(quick.pid)  # a zombie holds no memory: it does not run
        for pid in (os.getpid(), named.pid, quick.pid):  # the same answers as psutil's
            assert process_runs(pid) == readings._runs_by_psutil(pid)
    finally:
        named.kill()
        named.wait()
        quick.wait()
    assert not process_runs(quick.pid) and not process_runs(named.pid)  # reaped: gone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and NVML")
def test_read_gpu_sees_an_allocation():
    index = torch.cuda.current_device()
    before = read_gpu(index)
    tensor = torch.ones(256 * MIB // 4, device=f"cuda:{index}")
    torch.cuda.synchronize()
    after = read("cuda")
    assert after.device == f"cuda:{index}"
    assert after.used_bytes - before.used_bytes >= 0.9 * tensor.nbytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_read_gpu_without_cuda_raises_a_clear_error():
    with pytest.raises(TelemetryError, match="nvidia-ml-py|driver|CUDA device"):
        read_gpu(0)
    with pytest.raises(TelemetryError):
        read("cuda:0")


def test_read_gpu_without_nvml_bindings_says_what_to_install(monkeypatch):
    from colocate.telemetry.nvml import nvml

    monkeypatch.setattr(readings, "_handles", {})
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    nvml.cache_clear()
    try:
        with pytest.raises(TelemetryError, match="nvidia-ml-py"):
            readings.read_gpu_uuid("GPU-00000000-0000-0000-0000-000000000000")
    finally:
        nvml.cache_clear()


def test_process_share_is_this_pids_nvml_entries_or_nothing():
    from types import SimpleNamespace as Entry

    from colocate.telemetry import process_share

    entries = [Entry(pid=10, usedGpuMemory=300 * MIB), Entry(pid=11, usedGpuMemory=5 * MIB),
               Entry(pid=10, usedGpuMemory=2 * MIB)]  # one pid, two contexts (e.g. MPS)
    assert process_share(entries, 10) == 302 * MIB
    assert process_share(entries, 12) is None  # hidden by a pid namespace, or no context
    assert process_share([Entry(pid=10, usedGpuMemory=None)], 10) is None  # not available


def test_gpu_readings_say_they_are_device_wide(monkeypatch):
    from types import SimpleNamespace

    uuid = "00000000-0000-0000-0000-000000000000"
    nvml = SimpleNamespace(nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=5, total=9))
    monkeypatch.setattr(readings, "_nvml", lambda: nvml)  # NVML's answer, injected
    monkeypatch.setattr(readings, "_handles", {uuid: "handle"})
    reading = readings.read_gpu_uuid(uuid)
    assert (reading.used_bytes, reading.total_bytes, reading.scope) == (5, 9, "device")
    assert read_cpu().scope == "process"
    # a pid's share where NVML lists it; device-wide where it does not
    nvml.NVMLError = RuntimeError
    nvml.nvmlDeviceGetComputeRunningProcesses = \
        lambda h: [SimpleNamespace(pid=7, usedGpuMemory=3)]
    mine = readings.read_gpu_uuid_process("GPU-" + uuid, pid=7)
    assert (mine.used_bytes, mine.total_bytes, mine.scope) == (3, 9, "process")
    assert readings.read_gpu_uuid_process(uuid, pid=8).scope == "device"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and NVML")
def test_read_gpu_process_counts_this_process_or_says_device_wide():
    from colocate.telemetry import read_gpu_process

    before = read_gpu_process(0)
    tensor = torch.ones(256 * MIB // 4, device="cuda:0")
    torch.cuda.synchronize()
    after = read_gpu_process(0)
    assert before.scope == after.scope in ("process", "device")
    assert after.used_bytes - before.used_bytes >= 0.9 * tensor.nbytes
    assert read_gpu(0).scope == "device"


# timeline


def test_switch_event_properties():
    pause = event(nbytes=2_000_000_000, seconds=0.5, before=5 * MIB, after=2 * MIB)
    assert pause.released_bytes == 3 * MIB
    assert pause.gbps == pytest.approx(4.0)
    assert event(op="resume").released_bytes == 0
    assert event(seconds=0.0).gbps == 0.0
    with pytest.raises(ValueError, match="op"):
        event(op="stop")


def test_timeline_json_round_trip(tmp_path):
    line = Timeline()
    recorded = [
        event(tag="gen", start=10.0),
        event(op="resume", tag="gen", start=11.0, before=MIB, after=2 * MIB),
        event(tag="train", device="cpu", start=12.5, seconds=0.25),
    ]
    for e in recorded:
        line.record(e)
    path = tmp_path / "timeline.json"
    line.to_json(path)
    assert Timeline.from_json(path).events == recorded
    line.clear()
    assert line.events == []


def test_timeline_events_is_a_copy():
    line = Timeline()
    line.record(event())
    line.events.clear()
    assert len(line.events) == 1


def test_timeline_summary():
    line = Timeline()
    line.record(event(tag="gen", nbytes=2_000_000_000, seconds=1.0))
    line.record(event(op="resume", tag="gen", nbytes=2_000_000_000, seconds=0.5))
    line.record(event(tag="train", nbytes=1_000_000_000, seconds=0.0))
    gen, train = line.summary()
    assert gen == {
        "tag": "gen",
        "pauses": 1,
        "resumes": 1,
        "total_bytes": 4_000_000_000,
        "mean_seconds": pytest.approx(0.75),
        "mean_gbps": pytest.approx(3.0),
    }
    assert (train["tag"], train["pauses"], train["resumes"]) == ("train", 1, 0)
    assert train["total_bytes"] == 1_000_000_000 and train["mean_gbps"] == 0.0


def test_timeline_plot_writes_a_png(tmp_path):
    line = Timeline()
    gib = 1 << 30
    t = 1000.0
    for cycle in range(3):
        for tag, device in (("gen", "cuda:0"), ("kv", "cuda:0"), ("train", "cpu")):
            where = dict(tag=tag, device=device)
            line.record(event(start=t, before=20 * gib, after=8 * gib, **where))
            line.record(event(op="resume", start=t + 1, before=8 * gib, after=20 * gib, **where))
            t += 2 + cycle
    path = tmp_path / "timeline.png"
    line.plot(path)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_empty_timeline_summarises_and_plots(tmp_path):
    line = Timeline()
    assert line.summary() == []
    line.plot(tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG_MAGIC)


def test_timeline_is_thread_safe():
    line, ring = Timeline(max_events=None), Timeline(max_events=5000)

    def record_many(worker):
        for i in range(1000):
            line.record(event(tag=f"t{worker}", start=float(i)))
            ring.record(event(tag=f"t{worker}", start=float(i)))

    threads = [threading.Thread(target=record_many, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(line.events) == 8000
    assert all(row["pauses"] == 1000 for row in line.summary())
    assert (len(ring.events), ring.dropped, ring.recorded) == (5000, 3000, 8000)


def test_timeline_is_a_ring_of_the_newest_events_and_counts_the_dropped():
    line = Timeline(max_events=5)
    recorded = [event(start=float(i)) for i in range(12)]
    for e in recorded:
        line.record(e)
    assert line.events == recorded[-5:]  # the bound holds, the newest are kept, in order
    assert (line.max_events, line.dropped, line.recorded) == (5, 7, 12)
    assert line.since(9) == recorded[9:] and line.since(12) == []
    with pytest.raises(LookupError, match="dropped 1 of the events"):
        line.since(6)  # event 6 is gone: a reader who last looked at 6 missed one
    assert Timeline(recorded, max_events=5).events == recorded[-5:]
    line.clear()
    assert (line.events, line.dropped, line.recorded) == ([], 0, 0)
    with pytest.raises(ValueError):
        Timeline(max_events=0)


def test_timeline_says_how_many_events_it_dropped(tmp_path):
    from matplotlib.figure import Figure

    line = Timeline(max_events=3)
    for i in range(10):
        line.record(event(start=float(i)))
    path = tmp_path / "ring.json"
    line.to_json(path)
    again = Timeline.from_json(path)
    assert (again.events, again.dropped, again.max_events) == (line.events, 7, 3)
    old = Timeline.from_dict({"events": [asdict(e) for e in line.events]})  # an older file
    assert (old.dropped, old.max_events) == (0, None)
    titles = []
    real_savefig = Figure.savefig

    def savefig(fig, *args, **kwargs):
        titles.extend(ax.get_title() for ax in fig.axes)
        real_savefig(fig, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", savefig)
        line.plot(tmp_path / "ring.png")
    assert titles == ["memory timeline: the last 3 events (7 older ones dropped)"]


def test_the_process_wide_timeline_bound_comes_from_the_environment():
    from colocate.telemetry.timeline import DEFAULT_MAX_EVENTS, MAX_EVENTS_ENV, max_events_from

    assert timeline().max_events == DEFAULT_MAX_EVENTS == max_events_from({})
    assert max_events_from({MAX_EVENTS_ENV: "100"}) == 100
    assert max_events_from({MAX_EVENTS_ENV: "0"}) is None  # keep every event
    for bad in ("-1", "many"):
        with pytest.raises(ValueError, match=MAX_EVENTS_ENV):
            max_events_from({MAX_EVENTS_ENV: bad})


def test_process_wide_defaults():
    assert timeline() is timeline()
    assert leak_tracker() is leak_tracker()


# leaks


def observe_all(tracker, tag, residuals):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for residual in residuals:
            tracker.observe(tag, residual)
    return [w for w in caught if issubclass(w.category, ResidualGrowthWarning)]


def test_steady_residuals_do_not_warn():
    tracker = LeakTracker()
    assert observe_all(tracker, "gen", [100 * MIB] * 20) == []
    assert tracker.history("gen") == [100 * MIB] * 20


def test_noise_within_tolerance_does_not_warn():
    tracker = LeakTracker()
    noise = [0, 4, -3, 7, 8, 2, -6, 8, 5, 7]  # MiB, never above the 8 MiB tolerance
    assert observe_all(tracker, "gen", [100 * MIB + n * MIB for n in noise]) == []
    big = LeakTracker()  # 1% of 10 GiB is ~102 MiB: 50 MiB more is noise
    assert observe_all(big, "kv", [10 << 30] + [(10 << 30) + 50 * MIB] * 10) == []


def test_growing_residuals_warn_once():
    tracker = LeakTracker()
    caught = observe_all(tracker, "generator", [100 * MIB + i * 10 * MIB for i in range(10)])
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'generator'" in message and "MiB" in message


def test_growth_during_warmup_is_the_baseline_not_a_leak():
    warming = [100 * MIB, 120 * MIB, 140 * MIB] + [150 * MIB] * 10  # grows once, then steady
    assert len(observe_all(LeakTracker(), "gen", warming)) == 1
    assert observe_all(LeakTracker(warmup=3), "gen", warming) == []
    growing = [100 * MIB] * 3 + [150 * MIB + i * 10 * MIB for i in range(5)]
    assert len(observe_all(LeakTracker(warmup=3), "gen", growing)) == 1  # still caught


def test_growth_must_last_a_whole_window():
    tracker = LeakTracker(window=3)
    up, base = 200 * MIB, 100 * MIB
    assert observe_all(tracker, "gen", [base, up, up, base, up, up, base]) == []
    assert len(observe_all(tracker, "gen", [up])) == 0
    assert len(observe_all(tracker, "gen", [up, up])) == 1


def test_reset():
    tracker = LeakTracker()
    growing = [100 * MIB + i * 10 * MIB for i in range(5)]
    assert len(observe_all(tracker, "gen", growing)) == 1
    assert len(observe_all(tracker, "gen", growing)) == 0  # already warned
    tracker.reset("gen")
    assert tracker.history("gen") == []
    assert len(observe_all(tracker, "gen", growing)) == 1  # new baseline, warns again
    observe_all(tracker, "train", [MIB])
    tracker.reset()
    assert tracker.history("gen") == [] and tracker.history("train") == []


def test_leak_tracker_rejects_bad_settings():
    with pytest.raises(ValueError):
        LeakTracker(window=0)
    with pytest.raises(ValueError):
        LeakTracker(tolerance_bytes=-1)
    with pytest.raises(ValueError):
        LeakTracker(warmup=-1)
    with pytest.raises(ValueError):
        LeakTracker(drift_bytes_per_cycle=-1)
    with pytest.raises(ValueError):
        LeakTracker(span=0)


def test_device_wide_readings_get_a_wider_tolerance():
    from colocate.telemetry import DEVICE_WIDE_TOLERANCE_BYTES

    # another process on the GPU grew by 100 MiB: no leak of ours in a device-wide reading
    residuals = [1000 * MIB] + [1100 * MIB] * 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = LeakTracker()
        for residual in residuals:
            tracker.observe("gen", residual, min_tolerance_bytes=DEVICE_WIDE_TOLERANCE_BYTES)
    assert caught == []
    assert len(observe_all(LeakTracker(), "gen", residuals)) == 1  # per-process: a leak


def like_the_default():
    """A fresh tracker with the process-wide one's settings."""
    default = leak_tracker()
    return LeakTracker(tolerance_bytes=default.tolerance_bytes,
                       tolerance_fraction=default.tolerance_fraction, window=default.window,
                       warmup=default.warmup, drift_bytes_per_cycle=default.drift_bytes_per_cycle,
                       span=default.span)


def drifting(cycles, per_cycle, start=600 * MIB):
    """Residuals of a proc at about 600 MiB that grows `per_cycle` bytes a cycle, with the
    warm-up climb the RL loop's procs show (30 MiB over 5 cycles) and +-4 MiB of noise."""
    noise = [0, 3, -4, 1, 4, -2, -3, 2]
    warm = [start - 30 * MIB + 6 * MIB * i for i in range(5)]
    return warm + [start + i * per_cycle + noise[i % len(noise)] * MIB for i in range(cycles)]


def test_a_leak_of_a_mib_a_cycle_still_warns():
    caught = observe_all(like_the_default(), "gen", drifting(60, MIB))
    assert len(caught) == 1
    assert "KiB a pause" in str(caught[0].message)


def test_the_runtimes_steady_drift_does_not_warn():
    # 12 KiB a cycle: what the RL loop's tenant proc grew with its timeline unbounded
    # (bench/RESULTS.md, soak), above Monarch's own ~0.4 KiB a call at a few calls a cycle
    assert observe_all(like_the_default(), "gen", drifting(10_000, 12 * 1024)) == []
    from colocate.telemetry.leaks import DRIFT_BYTES_PER_CYCLE

    below = DRIFT_BYTES_PER_CYCLE - 4 * 1024
    assert observe_all(like_the_default(), "gen", drifting(3_000, below)) == []


def test_growth_just_above_the_drift_is_caught_in_the_end():
    from colocate.telemetry.leaks import DRIFT_BYTES_PER_CYCLE

    tracker = like_the_default()
    above = DRIFT_BYTES_PER_CYCLE + 16 * 1024  # 16 MiB of tolerance is gone after 1024 cycles
    residuals = drifting(3_000, above)
    assert observe_all(tracker, "gen", residuals[:500]) == []
    assert len(observe_all(tracker, "gen", residuals[500:])) == 1


def test_a_leak_that_starts_late_is_caught_as_soon_as_an_early_one():
    tracker = like_the_default()
    steady = drifting(20_000, 12 * 1024)
    assert observe_all(tracker, "gen", steady) == []
    last = steady[-1]
    leaking = [last + (i + 1) * MIB for i in range(60)]
    caught_at = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for cycle, residual in enumerate(leaking, 1):
            tracker.observe("gen", residual)
            if caught:
                caught_at = cycle
                break
    # against the recent reference (16 MiB + 256 x 64 KiB): against the baseline, 20,000
    # cycles of 52 KiB unused allowance would let it grow about 1 GiB first
    assert len(caught) == 1 and caught_at <= 40
    assert len(tracker.history("gen")) == tracker.span + 1  # the history is bounded too


def test_a_one_off_step_late_in_a_long_run_does_not_warn():
    # Monarch's per-call table doubles now and then: RSS steps up once by tens of MiB (25 MiB
    # at 115,000 calls in bench/monarch_growth.py), then grows at its usual pace again
    tracker = like_the_default()
    steady = drifting(20_000, 12 * 1024)
    stepped = steady[:15_000] + [r + 40 * MIB for r in steady[15_000:]]
    assert observe_all(tracker, "gen", stepped) == []


def test_the_largest_recent_rise_is_kept_without_a_pass_over_the_span():
    # the recent reference leaves out the largest rise among the last span + 1 residuals;
    # the tracker keeps it as a sliding-window maximum: it must equal that maximum after
    # every pause, and what it keeps for it stays within the span however long the run
    import random
    from itertools import pairwise

    rng = random.Random(0)
    span = 16
    tracker = LeakTracker(span=span, warmup=2)
    residual = 600 * MIB
    for cycle in range(2_000):
        residual += rng.choice([0, 1, -1, 3, -2]) * 64 * 1024
        if cycle % 97 == 0:
            residual += rng.randrange(1, 40) * MIB  # a one-off step now and then
        observe_all(tracker, "gen", [residual])
        state = tracker._tags["gen"]
        assert len(state.rises) <= span
        history = tracker.history("gen")
        if len(history) > 1:
            assert state.rises[0][1] == max(b - a for a, b in pairwise(history))
