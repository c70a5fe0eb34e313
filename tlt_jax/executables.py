"""Executables compiled ahead of a rollout, keyed by what they were compiled for.

The JAX counterpart of TLT's CUDA-graph pool: the engine fills it before a rollout starts
(`jit(...).lower(...).compile()` on bucketed shapes) and only looks executables up inside one.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable


class ExecutablePool:

  def __init__(self):
    self._executables: dict[Hashable, Any] = {}
    self.compile_seconds: dict[Hashable, float] = {}

  def get_or_compile(self, key: Hashable, build: Callable[[], Any]) -> Any:
    if key not in self._executables:
      start = time.perf_counter()
      self._executables[key] = build()
      self.compile_seconds[key] = time.perf_counter() - start
    return self._executables[key]

  def __getitem__(self, key: Hashable) -> Any:
    try:
      return self._executables[key]
    except KeyError:
      raise KeyError(f"no compiled executable for {key}: the pool must be prepared before the rollout") from None

  def keys(self) -> list[Hashable]:
    return list(self._executables)

  def __len__(self) -> int:
    return len(self._executables)

  def stats(self) -> dict[str, float]:
    """Executable count, total compile time, and device memory where the backend reports it."""
    memory = 0
    for exe in self._executables.values():
      analysis = exe.memory_analysis()
      if analysis is not None:
        memory += analysis.temp_size_in_bytes + analysis.generated_code_size_in_bytes
    return {"executables": len(self), "compile_s": sum(self.compile_seconds.values()), "memory_bytes": memory}
