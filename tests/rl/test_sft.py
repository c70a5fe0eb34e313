"""SFT: packing keeps samples apart and the sloppy teacher drops answer lines (the CLI: tests/test_sft.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import packing
from tlt_jax.rl import datasets, scorer, sft, tokenizer as tokenizer_lib, tools

import configs.tiny


def tiny_config():
  config = configs.tiny.get_config()
  config.model.update(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
  return config


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.build_tokenizer()


def test_packing_keeps_samples_apart(tok):
  config = tiny_config()
  examples = datasets.from_tasks("basic_arithmetic", tok, size=6, seed=0).examples
  packed = packing.pack(sft.sequences(examples, tok), 512)
  tokens, positions, segments, loss_mask = packed
  assert packed.shape[1] == 1 and segments.max() == 6
  expected = {tuple(ex.prompt_ids) + tuple(tok(ex.solution, add_special_tokens=False)["input_ids"]) +
              (tok.eos_token_id,): len(ex.prompt_ids) for ex in examples}
  for seg in range(1, 7):
    at = np.flatnonzero(segments[0] == seg)
    assert positions[0, at].tolist() == list(range(len(at)))  # positions restart per sample
    prompt_len = expected.pop(tuple(tokens[0, at].tolist()))  # each sample is one example's prompt + solution
    assert loss_mask[0, at].tolist() == [0] * prompt_len + [1] * (len(at) - prompt_len)
  assert not expected
  # The packed row's loss is the token-weighted mean of the samples' losses computed alone.
  model = sft.build_policy(config, tok)
  packed_loss = sft.lm_loss(model, *map(jnp.asarray, packed))
  alone = [packing.pack(sft.sequences([ex], tok), 512) for ex in examples]
  losses = [float(sft.lm_loss(model, *map(jnp.asarray, p))) for p in alone]
  weights = [p[3, 0, 1:].sum() for p in alone]
  np.testing.assert_allclose(float(packed_loss), np.average(losses, weights=weights), rtol=1e-5)


def test_policy_takes_the_configured_architecture_and_vocabulary(tok):
  """A Qwen2 policy (q/k/v bias) with its LM head padded past the tokenizer; a vocabulary smaller than
  the tokenizer's is refused, naming the key."""
  config = tiny_config()
  assert sft.build_policy(config, tok).config.qk_norm  # the tiny world's: Qwen3
  config.model.update(architecture="Qwen2ForCausalLM", vocab_size=256)
  cfg = sft.build_policy(config, tok).config
  assert cfg.qkv_bias and not cfg.qk_norm and cfg.vocab_size == 256 and cfg.eos_token_id == tok.eos_token_id
  config.model.vocab_size = 50
  with pytest.raises(ValueError, match=r"config.model.vocab_size=50: smaller than the tokenizer's 103 tokens"):
    sft.build_policy(config, tok)


def test_unanswered_solutions_lose_their_answer_line_and_with_it_the_reward(tok):
  # configs/tiny.py's sloppy teacher: what SFT copies and RL has to unlearn.
  examples = datasets.from_tasks("basic_arithmetic", tok, size=400, seed=0).examples
  full, cut = sft.sequences(examples, tok), sft.sequences(examples, tok, unanswered=0.3, seed=5)
  assert cut == sft.sequences(examples, tok, unanswered=0.3, seed=5) != sft.sequences(examples, tok, 0.3, seed=6)
  assert sft.sequences(examples, tok, unanswered=0.0, seed=5) == full
  dropped = 0
  for ex, (prompt, answered, _), (same_prompt, response, trained) in zip(examples, full, cut):
    assert all(trained)
    assert same_prompt == prompt and response[-1] == answered[-1] == tok.eos_token_id
    text, answered_text = (tok.decode(r, skip_special_tokens=True) for r in (response, answered))
    assert answered_text == ex.solution
    if text != answered_text:
      dropped += 1
      assert answered_text == f"{text}\nAnswer: {ex.ground_truth}"  # only the answer line is gone
      scores, _ = scorer.Scorer(workers=0).score(ex.reward, [ex.item(text), ex.item(answered_text)])
      assert scores.tolist() == [0.0, 1.0]
  assert 0.25 < dropped / len(examples) < 0.35


def test_tool_solutions_are_the_conversation_transformers_renders_with_the_tool_turn_masked(tok):
  """With tools, `tool_share` of the solutions call the calculator on the problem's expression and answer with
  its result: prompt + solution is the whole conversation as transformers renders it, token for token, and
  only the tool turn (its message and the next turn's opening) is out of the loss."""
  turns = tools.ToolTurns(["calculator"], tok, max_turns=2, timeout_s=5, workers=0)
  examples = datasets.from_tasks("basic_arithmetic", tok, size=200, seed=0, tools=turns.schemas,
                                 difficulty=sft.difficulty(tiny_config())).examples
  called = 0
  for ex, (prompt, response, trained) in zip(examples, sft.sequences(examples, tok, turns=turns, tool_share=0.5)):
    if all(trained):
      continue
    called += 1
    expression = ex.extra_info["entry"]["metadata"]["expression"]
    messages = ex.messages + [
        {"role": "assistant", "content": tools.call_text("calculator", {"expression": expression})},
        {"role": "tool", "name": "calculator", "content": ex.ground_truth},
        {"role": "assistant", "content": f"Answer: {ex.ground_truth}"}]
    whole = tok.apply_chat_template(messages, tools=turns.schemas, tokenize=False)
    assert prompt + response == tok(whole, add_special_tokens=False).input_ids
    masked = [t for t, keep in zip(response, trained) if not keep]
    assert tok.decode(masked) == f"<|tool|>{ex.ground_truth}<|assistant|>"
  assert 0.4 < called / len(examples) < 0.6
