"""Tests for tlt_jax/rl/tasks.py."""

import numpy as np
import pytest
import reasoning_gym

from tlt_jax.rl import tasks
from tlt_jax.rl import tokenizer as tokenizer_lib


@pytest.mark.parametrize("family", sorted(tasks.FAMILIES))
def test_same_seed_same_problems(family):
  problems = tasks.generate(family, 64, seed=3)
  assert problems == tasks.generate(family, 64, seed=3)
  assert problems != tasks.generate(family, 64, seed=4)
  # Problem i depends on (seed, i) only: a smaller batch is a prefix.
  assert tasks.generate(family, 16, seed=3) == problems[:16]


@pytest.mark.parametrize("family", sorted(tasks.FAMILIES))
def test_worked_solutions_score_one_with_reasoning_gym(family):
  score = reasoning_gym.get_score_answer_fn(family)
  for problem in tasks.generate(family, 512, seed=0):
    assert problem.entry["metadata"]["source_dataset"] == family
    assert problem.prompt == problem.entry["question"]
    assert problem.answer == problem.entry["answer"]
    assert problem.entry["metadata"]["num_terms"] == problem.num_terms
    assert len(problem.solution.splitlines()) == problem.num_terms  # n - 1 steps + answer
    assert score(tasks.extract_answer(problem.solution), problem.entry) == 1.0


def test_solution_lengths_are_long_tailed():
  tokenizer = tokenizer_lib.build_tokenizer()
  problems = tasks.generate("chain_sum", 512, seed=0)
  lengths = np.array([len(tokenizer(p.solution).input_ids) + 1 for p in problems])  # + EOS
  assert np.percentile(lengths, 99) / np.median(lengths) >= 4
  # Harder problems (more terms) have longer solutions.
  terms = np.array([p.num_terms for p in problems])
  assert np.corrcoef(terms, lengths)[0, 1] > 0.95


def test_sample_num_terms_range_and_tail():
  difficulty = tasks.Difficulty(min_terms=3, max_terms=20, tail_alpha=1.0)
  terms = tasks.sample_num_terms(20_000, seed=0, difficulty=difficulty)
  assert terms.min() == 3 and terms.max() == 20
  # P(X >= k) = 1 / k: half the problems have the minimum, about 1/18 reach the cap.
  assert np.mean(terms == 3) == pytest.approx(0.5, abs=0.02)
  assert np.mean(terms == 20) == pytest.approx(1 / 18, abs=0.01)
  np.testing.assert_array_equal(tasks.sample_num_terms(100, 0, difficulty), terms[:100])


def test_worked_solution():
  assert tasks.worked_solution("12 + 7 - 30") == ("12+7=19\n19-30=-11\nAnswer: -11", -11)
  assert tasks.worked_solution("5") == ("Answer: 5", 5)
  with pytest.raises(ValueError, match="not a chain"):
    tasks.worked_solution("3 * 4")


@pytest.mark.parametrize(
    "response, answer",
    [
        ("1+2=3\nAnswer: 3", "3"),
        ("Answer:  -7 \n\n", "-7"),
        ("Answer: 3\nmore text", None),  # the answer line must be the last one
        ("Answer:", None),
        ("3", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer(response, answer):
  assert tasks.extract_answer(response) == answer


def test_bad_arguments():
  with pytest.raises(ValueError, match="known: .*chain_sum"):
    tasks.generate("chain_summ", 4, seed=0)
  with pytest.raises(ValueError, match="min_terms"):
    tasks.Difficulty(min_terms=0)
  with pytest.raises(ValueError, match="tail_alpha"):
    tasks.Difficulty(tail_alpha=0.0)
