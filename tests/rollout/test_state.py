"""The engine's state and record types: config checks and lookups, rollout metrics."""

import numpy as np
import pytest

from tests.rollout.conftest import CONFIG, configured, with_sd
from tlt_jax.rollout.state import EngineConfig, RolloutMetrics, SegmentRecord


@pytest.mark.parametrize("changes,message", [
    (dict(batch_buckets=(1, 3)), "batch_buckets must be 1, 2, 4, ..."),
    (dict(batch_buckets=(2, 4)), "batch_buckets must be 1, 2, 4, ..."),
    (dict(attention="flash"), "attention must be one of"),
    (dict(refill_rows=9), r"refill_rows must be in \[0, 8\]"),
    (dict(suffix_ngram=0), "suffix_ngram must be >= 1"),
])
def test_config_rejects_bad_values_by_name(changes, message):
  with pytest.raises(ValueError, match=message):
    configured(CONFIG, **changes)


def test_config_lookups():
  assert CONFIG.prompt_buckets == (16, 24) and CONFIG.prompt_bucket(16) == 16 and CONFIG.prompt_bucket(17) == 24
  assert [CONFIG.bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
  assert CONFIG.refill_chunk == 2 and configured(CONFIG, refill_rows=3).refill_chunk == 3
  assert CONFIG.capacity == 96  # 24 + 64 (+ a plain step's window 1, - 1) rounded up to kv_block 16
  assert with_sd(CONFIG, "3_2_6").capacity == 96 and not with_sd(CONFIG, "3_2_6").banking
  banking = with_sd(CONFIG, "s2_2_4")
  assert banking.banking and banking.bank_rows == 9 and CONFIG.bank_rows == 0
  with pytest.raises(ValueError, match="suffix_bank_len must be >= max_prompt_len \\+ suffix_history_len \\+ 2 = 26"):
    configured(banking, suffix_bank_len=25)
  assert EngineConfig().bucket(33) == 64


def test_occupancy_idle_slots_and_tail_share():
  m = RolloutMetrics(decode_s=10.0)
  # bucket, active rows at the start, tokens, seconds, strategy, row-steps, steps, tail, waiting
  m.segments = [SegmentRecord(8, 8, 60, 4.0, None, 60, 8, False, 5), SegmentRecord(8, 6, 30, 2.0, None, 30, 8),
                SegmentRecord(4, 4, 8, 3.0, "2_1_3", 8, 4, True), SegmentRecord(2, 1, 3, 1.0, None, 3, 3)]
  np.testing.assert_allclose(m.occupancy(), [7.5, 3.75, 2.0, 1.0])
  summary = m.summary()
  assert summary["rollout/idle_slot_fraction"] == pytest.approx(1 - 101 / (64 + 64 + 16 + 6))
  assert summary["rollout/tail_share"] == pytest.approx((3.0 + 1.0) / 10.0)  # plays begun with <= 4 of 8 rows
  assert summary["rollout/refills"] == 0
