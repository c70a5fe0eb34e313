"""Peak memory per phase of a step: the host process's resident set and the local devices' bytes in use.

Host: Linux keeps a process's resident-set high-water mark (VmHWM in /proc/self/status) and resets it when
"5" is written to /proc/self/clear_refs, so each phase's own peak is exact, at no cost while it runs (reward
and tool worker processes are their own processes, not counted). Devices: the largest `peak_bytes_in_use`
of `memory_stats()` over the local devices (GPU and TPU backends keep it; the CPU backend does not), a
running peak since start: a phase whose value is the run's highest set that peak. Phases run one after
another, not nested.
"""

from __future__ import annotations

import contextlib
import ctypes

import jax

_STATUS, _CLEAR = "/proc/self/status", "/proc/self/clear_refs"
GB = 1e9


def host_peak_gb() -> float | None:
  """The process's resident-set high-water mark since the last reset, GB (None off Linux)."""
  try:
    with open(_STATUS, encoding="ascii") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024 / GB
  except OSError:
    return None
  return None


def reset_host_peak() -> bool:
  """Starts a new high-water mark at the current resident set; False where the kernel does not allow it."""
  try:
    with open(_CLEAR, "w", encoding="ascii") as f:
      f.write("5")
    return True
  except OSError:
    return False


def release_host() -> bool:
  """Hands the C heap's free pages back to the system (glibc's malloc_trim): between phases the buffers a phase
  freed would otherwise stay resident, and the next phase's peak would stand on them. False without glibc."""
  try:
    return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
  except (OSError, AttributeError):
    return False


def device_peak_gb() -> float | None:
  """The largest peak bytes in use over the local devices since start, GB (None: the backend keeps none)."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) / GB if peaks else None


class Peaks:
  """Each phase's peak over a step (a phase entered twice keeps its larger peak); `record` returns them as
  `memory/<phase>_gb` (host) and `memory/device/<phase>_gb`, and starts the next step's."""

  def __init__(self):
    self._phases: dict[str, tuple[float | None, float | None]] = {}

  @contextlib.contextmanager
  def phase(self, name: str):
    exact = reset_host_peak()
    try:
      yield
    finally:
      host, device = host_peak_gb() if exact else None, device_peak_gb()
      old_host, old_device = self._phases.get(name, (None, None))
      self._phases[name] = (_max(host, old_host), _max(device, old_device))

  def record(self) -> dict[str, float]:
    out = {}
    for name, (host, device) in self._phases.items():
      if host is not None:
        out[f"memory/{name}_gb"] = round(host, 4)
      if device is not None:
        out[f"memory/device/{name}_gb"] = round(device, 4)
    self._phases = {}
    return out


def _max(a, b):
  return b if a is None else a if b is None else max(a, b)


def peak_phase(records: list[dict], prefix: str = "memory/") -> tuple[str, float] | None:
  """(phase, GB) of the highest `<prefix><phase>_gb` over the records (`memory/device/` for devices)."""
  best = None
  for r in records:
    for key, value in r.items():
      rest = key[len(prefix):] if key.startswith(prefix) else ""
      if rest.endswith("_gb") and "/" not in rest and (best is None or value > best[1]):
        best = (rest[:-3], value)
  return best
