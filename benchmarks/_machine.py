"""The machine a benchmark measures on: this process's memory (RSS and its high-water mark), the
CPU other processes use (and waiting until they are quiet), and the description of the machine,
torch and commit every result file records.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import platform
import subprocess
import time

import torch

from _models import fsdp2_tuned
from _ranks import REPO


# --------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------


_libc = None


def malloc_trim() -> None:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except OSError:
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    gc.collect()
    malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM since the last :func:`reset_peak_rss` (getrusage's ru_maxrss when that is unavailable)."""
    hwm = _status_kib("VmHWM")
    if hwm:
        return hwm * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------------------------
# other load on the machine
# --------------------------------------------------------------------------------------------


def machine_busy_s() -> float:
    """CPU seconds all processes spent in user and system mode since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq = vals[:7]
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")  # irq/softirq: not attributable


def process_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def wait_until_quiet(max_wait_s: float, threshold: float = 0.15, window_s: float = 2.0) -> float:
    """Sleep until the CPU used by processes other than this one over ``window_s`` is below
    ``threshold`` of the machine (or ``max_wait_s`` passed). Returns the last foreign fraction.

    Call on one rank while the others wait in a barrier (a gloo barrier blocks without spinning).
    """
    deadline = time.monotonic() + max_wait_s
    ncpu = os.cpu_count() or 1
    while True:
        b0, c0, t0 = machine_busy_s(), process_cpu_s(), time.monotonic()
        time.sleep(window_s)
        foreign = (machine_busy_s() - b0 - (process_cpu_s() - c0)) / (ncpu * (time.monotonic() - t0))
        if foreign < threshold or time.monotonic() > deadline:
            return foreign
        time.sleep(5.0)


# --------------------------------------------------------------------------------------------
# the record of a run
# --------------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "mfsdp2"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except Exception:
        rev, dirty = "?", ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "backend": "gloo",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads_per_rank": 1,
        "mfsdp2_commit": rev + ("+uncommitted changes in mfsdp2/" if dirty else ""),
        "malloc_mmap_max": os.environ.get("MALLOC_MMAP_MAX_"),
        "fsdp2_tuned_cpu": fsdp2_tuned("cpu"),  # what "FSDP2 tuned" meant in this run
        "env": {k: v for k, v in os.environ.items() if k.startswith(("MFSDP2_", "MALLOC_"))},
    }


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
