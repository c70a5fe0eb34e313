"""Executables compiled ahead of time, keyed by what they were compiled for.

The JAX counterpart of TLT's CUDA-graph pool: the engine, the actor and the drafter trainer fill
theirs before a rollout or an update (`jit(...).lower(...).compile()` on bucketed shapes) and only
look executables up afterwards. A dry run's pools keep going past an executable the compiler refuses
(`failures`), so that its report names every one.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable

from absl import logging


class ExecutablePool:

  def __init__(self):
    self._executables: dict[Hashable, Any] = {}
    self.compile_seconds: dict[Hashable, float] = {}
    self.keep_going = False  # a dry run's: a compile error is recorded in `failures`, not raised
    self.failures: dict[Hashable, Exception] = {}

  def get_or_compile(self, key: Hashable, build: Callable[[], Any]) -> Any:
    """The executable `build` compiles for `key` (once); None when it failed and `keep_going` is set."""
    if key not in self._executables and key not in self.failures:
      start = time.perf_counter()
      try:
        self._executables[key] = build()
      except Exception as e:  # pylint: disable=broad-exception-caught  # the compiler's, for the report
        if not self.keep_going:
          raise
        self.failures[key] = e
      self.compile_seconds[key] = time.perf_counter() - start
      if self.keep_going:
        logging.info("dry run: %s %s in %.1f s", "failed to compile" if key in self.failures else "compiled", key,
                     self.compile_seconds[key])
    return self._executables.get(key)

  def __getitem__(self, key: Hashable) -> Any:
    try:
      return self._executables[key]
    except KeyError:
      raise KeyError(f"no compiled executable for {key}: the pool must be prepared before the rollout") from None

  def items(self) -> list[tuple[Hashable, Any]]:
    return list(self._executables.items())

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
