"""Procedural reasoning problems from reasoning-gym, with worked long-tailed solutions.

reasoning-gym writes each question and its ground truth and scores answers. We add a
step-by-step solution for SFT (one partial result per line, then `Answer: <value>`), and draw
the number of terms from a capped discrete Pareto law so that solution lengths are
long-tailed like real reasoning rollouts: most problems are short, a few run to the cap.
"""

import dataclasses
from typing import Any

import numpy as np
import reasoning_gym

ANSWER_PREFIX = "Answer:"

# Fixed reasoning-gym settings per family; terms and digits are set per problem.
# basic_arithmetic keeps to + and - without parentheses: its ground truth is computed left
# to right, which disagrees with operator precedence once * or / appear.
FAMILIES: dict[str, dict[str, Any]] = {
    "chain_sum": {},
    "basic_arithmetic": {"operators": ("+", "-"), "allow_parentheses": False},
}

# Salts the difficulty stream so it is independent of reasoning-gym's per-item
# `random.Random(seed + index)`.
_DIFFICULTY_SALT = 0x7E57


@dataclasses.dataclass(frozen=True)
class Difficulty:
  """Terms per problem: min_terms - 1 + X with P(X >= k) = k**-tail_alpha, capped at max_terms.

  Operands have min_digits..max_digits digits (reasoning-gym draws the count per problem).
  """

  min_terms: int = 2
  max_terms: int = 24
  tail_alpha: float = 1.0
  min_digits: int = 1
  max_digits: int = 1

  def __post_init__(self):
    if not 1 <= self.min_terms <= self.max_terms:
      raise ValueError(f"need 1 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")
    if self.tail_alpha <= 0:
      raise ValueError(f"tail_alpha must be > 0, got {self.tail_alpha}")
    if not 1 <= self.min_digits <= self.max_digits:
      raise ValueError(
          f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem: reasoning-gym's question and answer plus our worked solution."""

  prompt: str
  answer: str
  solution: str  # partial results, one per line; last line `Answer: <answer>`
  num_terms: int  # the difficulty
  entry: dict[str, Any]  # reasoning-gym's item, what its score_answer reads


def sample_num_terms(size: int, seed: int, difficulty: Difficulty = Difficulty()) -> np.ndarray:
  """Heavy-tailed term counts; element i depends on (seed, i) only, not on size."""
  u = np.random.default_rng([seed, _DIFFICULTY_SALT]).random(size)
  # 1 - u lies in (0, 1], so the power is finite or +inf, and the cap clips +inf.
  x = np.floor((1.0 - u) ** (-1.0 / difficulty.tail_alpha))
  return np.minimum(difficulty.min_terms - 1 + x, difficulty.max_terms).astype(np.int64)


def worked_solution(expression: str) -> tuple[str, int]:
  """Solves `a + b - c ...` left to right: ('a+b=s\\ns-c=t\\nAnswer: t', t)."""
  parts = expression.split()
  operators = parts[1::2]
  if len(parts) % 2 == 0 or any(op not in ("+", "-") for op in operators):
    raise ValueError(f"not a chain of + and - terms: {expression!r}")
  total = int(parts[0])
  lines = []
  for op, term in zip(operators, map(int, parts[2::2])):
    new_total = total + term if op == "+" else total - term
    lines.append(f"{total}{op}{term}={new_total}")
    total = new_total
  lines.append(f"{ANSWER_PREFIX} {total}")
  return "\n".join(lines), total


def extract_answer(response: str | None) -> str | None:
  """The answer on the response's last non-empty line, or None if it is not `Answer: ...`."""
  lines = (response or "").rstrip().splitlines()
  if not lines or not lines[-1].startswith(ANSWER_PREFIX):
    return None
  return lines[-1][len(ANSWER_PREFIX):].strip() or None


def generate(
    family: str, size: int, seed: int, difficulty: Difficulty = Difficulty()
) -> list[Problem]:
  """`size` problems; problem i depends on (family, seed, i, difficulty) only."""
  if family not in FAMILIES:
    raise ValueError(f"unknown task family {family!r}; known: {sorted(FAMILIES)}")
  # One reasoning-gym dataset per term count: its items use random.Random(seed + index),
  # so problem i is the same whichever dataset holds it.
  datasets = {}
  problems = []
  for index, num_terms in enumerate(sample_num_terms(size, seed, difficulty).tolist()):
    if num_terms not in datasets:
      datasets[num_terms] = reasoning_gym.create_dataset(
          family, min_terms=num_terms, max_terms=num_terms, min_digits=difficulty.min_digits,
          max_digits=difficulty.max_digits, seed=seed, size=size, **FAMILIES[family])
    entry = datasets[num_terms][index]
    solution, value = worked_solution(entry["metadata"]["expression"])
    if str(value) != entry["answer"]:
      # Guards against a reasoning-gym change that our solver would silently disagree with.
      raise RuntimeError(f"{family} item {index}: our {value} != reasoning-gym's {entry['answer']}")
    problems.append(Problem(entry["question"], entry["answer"], solution, num_terms, entry))
  return problems
