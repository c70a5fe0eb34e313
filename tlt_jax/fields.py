"""Range checks of config dataclasses (in their `__post_init__`) with one error type that names the
field, so that `tlt_jax.rl.checks.check` can name the config key that set it."""

from __future__ import annotations


class FieldError(ValueError):
  """`field` holds a bad `value`; `why` says what it must be (e.g. "must be >= 1")."""

  def __init__(self, field: str, value, why: str):
    super().__init__(f"{field} {why}, got {value!r}")
    self.field, self.value, self.why = field, value, why


def require(ok: bool, field: str, value, why: str) -> None:
  if not ok:
    raise FieldError(field, value, why)


def at_least(obj, low, *names: str) -> None:
  """Each of `obj`'s fields `names` is >= `low` (a NaN is not)."""
  for name in names:
    value = getattr(obj, name)
    require(value >= low, name, value, f"must be >= {low}")
