"""Per-phase peak memory: each phase's own host peak (the resident-set high-water mark reset at its start),
the run's peak phase named, and records that a resume may differ in (tests strip memory/*)."""

import numpy as np
import pytest

from tlt_jax import memory


def test_each_phase_gets_its_own_host_peak():
  if not memory.reset_host_peak():
    pytest.skip("this kernel does not reset the resident-set high-water mark")
  assert memory.device_peak_gb() is None  # the CPU backend keeps none (and is up before the phases, as in a run)
  peaks = memory.Peaks()
  with peaks.phase("big"):
    block = np.ones(40_000_000)  # 320 MB touched
    del block
  with peaks.phase("small"):
    block = np.ones(2_000_000)  # 16 MB
    del block
  with peaks.phase("small"):  # entered twice: the larger peak stays
    pass
  record = peaks.record()
  assert record["memory/big_gb"] - record["memory/small_gb"] > 0.25  # the big phase's peak is not the small one's
  assert set(record) == {"memory/big_gb", "memory/small_gb"}  # a CPU backend keeps no device peak
  assert peaks.record() == {}  # the next step starts afresh
  assert memory.peak_phase([{"step": 1, **record}, {"memory/small_gb": 0.01}]) == ("big", record["memory/big_gb"])
  assert memory.peak_phase([{"memory/device/update_gb": 3.0, "memory/rollout_gb": 1.0}], "memory/device/") == (
      "update", 3.0)


def test_the_summary_names_the_phase_that_set_the_peak():
  from tlt_jax import report  # pylint: disable=import-outside-toplevel
  records = [{"step": 1, "reward/mean": 0.1, "memory/rollout_gb": 1.5, "memory/update_gb": 2.25},
             {"step": 2, "reward/mean": 0.2, "memory/rollout_gb": 1.75, "memory/update_gb": 2.0,
              "memory/device/update_gb": 9.0}]
  s = report.summary(records, "nowhere")
  assert s["memory"] == {"host": {"phase": "update", "gb": 2.25}, "device": {"phase": "update", "gb": 9.0}}
  assert "peak memory: host 2.25 GB (in update), device 9.00 GB (in update)" in report.text(s)


def test_releasing_the_host_heap_returns_what_a_phase_freed():
  """200 MB of small blocks freed below a live one stay resident (the heap cannot shrink past it) until
  `release_host` hands their pages back."""
  rss = lambda: int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmRSS"))) / 1e6
  blocks = [bytes(2000) for _ in range(100_000)]
  live = [bytes(2000) for _ in range(10)]
  del blocks
  before = rss()
  if not memory.release_host():
    pytest.skip("no glibc malloc_trim here")
  assert before - rss() > 0.1 and live
