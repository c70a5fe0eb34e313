"""A reward in verl's custom-reward signature for GSM8K-style answers, to copy for a task of your own.

  --config.data.reward=configs/gsm8k_reward.py:compute_score

The answer is the number after the response's last "####" (else its last number, counted as not
following the format), compared with the ground truth as numbers. The dict's "score" is the reward;
"formatted" is logged beside it (reward/formatted).
"""

import re

_NUMBER = r"-?[\d,]*\.?\d+"


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
  del data_source, extra_info
  marked = re.findall(rf"####\s*({_NUMBER})", solution_str or "")
  numbers = marked or re.findall(_NUMBER, solution_str or "")
  if not numbers:
    return {"score": 0.0, "formatted": 0.0}
  try:
    right = abs(float(numbers[-1].replace(",", "")) - float(str(ground_truth).replace(",", ""))) < 1e-6
  except ValueError:  # a ground truth that is no number
    right = False
  return {"score": float(right), "formatted": float(bool(marked))}
