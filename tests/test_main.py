"""`python -m tlt_jax.main`: bad config keys and values are rejected with their names; a TLT run
of a bfloat16 policy (float32 masters, the GPU configs' precision) interrupted by SIGKILL (also
inside a checkpoint write) and SIGTERM resumes exactly, its policy and its online drafter, and
exports the policy in the bfloat16 it started from."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from tests.conftest import run_clis, tiny_rl_config
from tlt_jax import lock, metrics
from tlt_jax.drafter import checkpoint as drafter_checkpoint
from tlt_jax.drafter.model import Drafter
from tlt_jax.models import hf
from tlt_jax.rl import bootstrap
from tlt_jax.rl.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD_CONFIGS = [
    (["--config.rl.bogus=1"], "unknown config key 'bogus' in --config.rl.bogus"),
    (["--config=configs/tiny.py", "--config.rollout.nope=2"], "unknown config key 'nope' in --config.rollout.nope"),
    (["--config.rl.optimizer.learning_rate=fast"], "--config.rl.optimizer.learning_rate=fast"),
    (["--config.rl.loss.aggregation=mean"], "config.rl.loss.aggregation='mean'"),
    (["--config.policy.weight_dtype=bfloat16"], "config.policy.weight_dtype='bfloat16': bfloat16 master weights "
     "need policy.dtype=bfloat16 (weights narrower than the compute)"),
    (["--config.rl.tis_cap=2"], "config.rl.tis_cap is now config.rl.rollout_correction.is_level and"),
    (["--config.rl.rollout_correction.rs=seq_mean_k9"], "config.rl.rollout_correction.rs='seq_mean_k9': must name"),
    (["--config.policy.lora.rank=-1"], "config.policy.lora.rank=-1: must be >= 0"),
    (["--config.policy.lora.path=nowhere"], "config.policy.lora.path='nowhere': holds no adapter_config.json"),
    (["--config.policy.lora.target_modules=7"], "config.policy.lora.target_modules=7: must be 'all-linear', a regex"),
    (["--config.policy.lora.target_modules=(q"], "config.policy.lora.target_modules='(q': not a regular expression"),
    (["--config.rollout.tools=('search',)"], "config.rollout.tools=('search',): unknown tool 'search': one of "
     "['calculator']"),
    (["--config.rl.old_logp=rollout", "--config.rollout.sampling.top_k=5"],
     "config.rl.old_logp='rollout': the rollout's log-probs under top-k / top-p are of a truncated distribution"),
    (["--config.data.reward=my_reward.py:compute_score"], "config.data.reward='my_reward.py:compute_score': reward "
     "'my_reward.py:compute_score': cannot import my_reward.py: FileNotFoundError: no such file: my_reward.py"),
    (["--config.data.answer_regex=(#### "], "config.data.answer_regex='(#### ': answer_regex '(#### ': missing )"),
    (["--config.rl.normalize_std=False"], "config.rl.normalize_std is now config.rl.advantage_std"),
    (["--config.rollout.strategies=('4_x_5',)"], "config.rollout.strategies=('4_x_5',)"),
    (["--config.rollout.strategies=4_1_5,5_2_8"],  # unquoted, 4_1_5 is the number 415
     "config.rollout.strategies=(415, 528): must be a tuple of strategy names in quotes, e.g. "
     "--config.rollout.strategies=\"('3_1_4','4_2_6')\""),
    (["--config.drafter.warmup_steps=3"], "config.drafter.warmup_steps is now config.drafter.distill.steps"),
    (["--config.kernels.attention=xla"], "config.kernels.attention is now config.rollout.engine.attention"),
    (["--config.distributed.enabled=True", "--config.distributed.coordinator_address=localhost:1",
      "--config.distributed.num_processes=1", "--config.distributed.process_id=3"],
     "error: config.distributed: process_id and num_processes must be nonnegative"),
]


# Where main checks its outputs (after its start-up), the forked run prints the compilation cache
# directory JAX was given and exits 3.
_REPORT_START_UP = """
import sys
import jax
from tlt_jax import files
def report(path):
  print("compilation cache:", jax.config.jax_compilation_cache_dir, file=sys.stderr)
  sys.exit(3)
files.check_writable = report
"""


@pytest.fixture(scope="module")
def main_runs(tmp_path_factory):
  """(exit code, stdout, stderr) of `python -m tlt_jax.main` on each of BAD_CONFIGS, then with a
  compilation cache directory (returned too), in the repository, forked from one process
  (tests/conftest.py `run_clis`)."""
  tmp = tmp_path_factory.mktemp("main")
  cache = str(tmp / "cache")
  start_up = [f"--config.workdir={tmp / 'run'}", f"--config.rollout.compilation_cache_dir={cache}"]
  keys = ["--config=configs/r1_7b.py", "--config.rollout.num_samples=4", "--keys"]
  runs = run_clis([("tlt_jax.main", args, REPO) for args, _ in BAD_CONFIGS]
                  + [("tlt_jax.main", keys, REPO), ("tlt_jax.main", start_up, REPO)], tmp, prelude=_REPORT_START_UP)
  return runs, cache


@pytest.mark.parametrize("index", range(len(BAD_CONFIGS)), ids=[" ".join(args) for args, _ in BAD_CONFIGS])
def test_bad_config_is_rejected_by_name(index, main_runs):
  code, _, stderr = main_runs[0][index]
  assert code != 0
  assert BAD_CONFIGS[index][1] in stderr
  assert "Traceback" not in stderr


def test_keys_lists_every_key_with_its_value_default_and_comment(main_runs):
  from tlt_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  code, stdout, _ = main_runs[0][len(BAD_CONFIGS)]
  lines = stdout.splitlines()
  assert code == 0 and [line.split(" = ")[0] for line in lines] == [k for k, _ in config_lib.leaves(tiny.get_config())]
  assert ("rollout.num_samples = 4  (default 8)  # responses per prompt (the GRPO group; TRL num_generations, verl "
          "rollout.n)") in lines  # a TRL or verl user finds their key's name
  assert "mesh.fsdp = 8  (default 1)" in stdout and sum("  # " in line for line in lines) > 0.8 * len(lines)


def test_the_workdir_keeps_the_config_and_a_resume_names_what_changed(tmp_path, caplog):
  from tlt_jax import main  # pylint: disable=import-outside-toplevel
  c = tiny.get_config()
  c.workdir = str(tmp_path)
  main._write_config(c)  # pylint: disable=protected-access
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["rollout.strategies"] == list(c.rollout.strategies) and written["steps"] == 20 and not caplog.text
  c.steps, c.rl.optimizer.learning_rate = 40, 1e-3
  main._write_config(c)  # pylint: disable=protected-access
  assert ("config changed since the workdir's last run: rl.optimizer.learning_rate: 0.0001 -> 0.001; steps: 20 -> 40"
          in caplog.text)
  assert json.loads((tmp_path / "config.json").read_text())["steps"] == 40


def test_start_up_sets_the_compilation_cache(main_runs):
  """`rollout.compilation_cache_dir` is set process-wide once, at start-up (the engine leaves it alone)."""
  (code, _, stderr), cache = main_runs[0][-1], main_runs[1]
  assert code == 3 and f"compilation cache: {cache}" in stderr, stderr


# ---- rewards that fail, return no score, or cannot score the rows: one error line, no traceback ----

BAD_REWARDS = """
def boom(solution_str, **kwargs):
  raise RuntimeError("the grader is down")

def nan(solution_str, **kwargs):
  return float("nan")

def text(completions, **kwargs):
  return ["1.0" for _ in completions]
"""


@pytest.fixture(scope="module")
def reward_fault_runs(tmp_path_factory, tiny_policy_dir, xla_cache):
  """`python -m tlt_jax.main` (configs/tiny.py:smoke, plain rollouts) on a verl-shaped file with each bad
  reward (forked from one process, tests/conftest.py `run_clis`): {case: (exit code, stdout, stderr)}."""
  tmp = tmp_path_factory.mktemp("reward_faults")
  data = tmp / "data.jsonl"
  data.write_text("".join(json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{a}+1?"}],
                                      "reward_model": {"ground_truth": str(a + 1)}}) + "\n" for a in range(4)))
  (tmp / "bad.py").write_text(BAD_REWARDS)
  base = ["--config=configs/tiny.py:smoke", f"--config.policy.path={tiny_policy_dir}", f"--config.data.path={data}",
          "--config.rollout.speculative=False", "--config.data.reward_workers=0"]  # the scorer tests run the workers
  cases = {name: [*base, f"--config.workdir={tmp / name}", f"--config.data.reward={spec}"]
           for name, spec in [("boom", f"{tmp}/bad.py:boom"), ("nan", f"{tmp}/bad.py:nan"),
                              ("text", f"{tmp}/bad.py:text"), ("unscorable", "reasoning_gym"), ("locked", "auto"),
                              ("row_len", "auto")]}
  # The drafter's warm-up on the policy's responses, with rows too short for any prompt.
  cases["row_len"] += ["--config.rollout.speculative=True", "--config.drafter.distill.row_len=4"]
  held = lock.WorkdirLock(str(tmp / "locked"))  # another run's, for the runs' time: the last case is refused
  try:
    runs = run_clis([("tlt_jax.main", args, REPO) for args in cases.values()], tmp, compilation_cache=xla_cache)
  finally:
    held.release()
  return dict(zip(cases, runs)), str(data)


@pytest.mark.parametrize("case, message", [
    ("boom", r"error: reward '\S+bad.py:boom' failed on 2 of 2 samples in step 1 \(all\), so no update could learn "
             r"from them; the first, sample 0 \(\S+data.jsonl:\d\): RuntimeError: the grader is down"),
    ("nan", r"error: reward '\S+bad.py:nan' returned nan for sample 0 \(\S+data.jsonl:\d\): a reward must return a "
            r"finite number"),
    ("text", r"error: reward '\S+bad.py:text' returned '1.0' for sample 0 .*\(or None where it does not apply\)"),
    ("unscorable", r"error: config.data.reward='reasoning_gym' cannot score the rows of config.data.path='\S+': "
                   r"\S+data.jsonl:1: reward 'reasoning_gym' scores it with reasoning-gym's scorer, .* set "
                   r"config.data.reward to a reward that can"),
    ("locked", rf"error: config.workdir='\S+locked': \S+locked is in use by another run \(pid {os.getpid()} on .*, "
               r"started .* UTC: .*\); wait for it to end, or give this run another workdir"),
    ("row_len", r"error: config.drafter.distill.row_len=4: holds none of the warm-up's 4 prompts and a response token "
                r"\(the shortest prompt has \d+ tokens\); set it to data.max_prompt_len \+ "
                r"rollout.sampling.max_new_tokens \(64 \+ 24\), as rl.row_len")])
def test_bad_rewards_and_a_busy_workdir_stop_the_run_with_one_error_line(reward_fault_runs, case, message):
  """A run whose rewards all fail, or that returns what is no score, or whose reward cannot score its rows,
  stops with one `error:` line naming the reward (and the row), never a traceback or a run of zero rewards;
  so does a run on a workdir that another run holds (naming that run), or whose drafter warm-up's rows hold
  no prompt (naming the key and how many prompts it samples: the file's 4, not drafter.distill.prompts=256)."""
  code, _, stderr = reward_fault_runs[0][case]
  errors = [line for line in stderr.splitlines() if line.startswith("error:")]
  assert code == 1 and len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
  assert re.match(message, errors[0]), errors[0]


# ---- faults: SIGKILL at random points, SIGTERM, Ctrl-C ----

STEPS = 8  # a run killed soon after its first new step never reaches the end, on any machine


def _overrides(config) -> list[str]:
  """`--config.key=value` for every key where `config` differs from configs/tiny.py."""
  base = tiny.get_config()
  def walk(c, b, prefix):
    for key, value in c.items():
      if isinstance(value, ml_collections.ConfigDict):
        yield from walk(value, b[key], f"{prefix}{key}.")
      elif value != b[key]:
        yield f"--config.{prefix}{key}={value}"
  return list(walk(config, base, ""))


def _fault_config(workdir, steps, policy_dir, drafter_dir, cache_dir):
  """TLT on one rollout group: the drafter trains a fixed number of steps after each rollout
  (with several groups the count depends on how long the tail takes, so no two runs agree). A
  bfloat16 policy (`policy_dir` holds one) with float32 masters, as the GPU configs run, and the
  mismatch's optional correction on."""
  c = tiny_rl_config(workdir, steps, cache_dir)
  c.policy.path = policy_dir
  c.policy.dtype = "bfloat16"
  c.rl.rollout_correction.preset = "decoupled_token_is"  # truncated importance sampling, resumed exactly too
  c.data.reward_workers = 2  # the rewards in worker processes, as a run has them
  c.checkpoint.every = 1
  c.mesh.cpu_devices = 0  # the 8 devices XLA_FLAGS gives this process and its subprocesses: one compilation cache
  c.rollout.speculative = True
  c.rollout.strategies = ("2_1_3",)
  c.rollout.engine.sd_max_batch = 4
  c.drafter.path = drafter_dir
  c.drafter.distill.row_len = c.drafter.trainer.row_len = 64
  c.drafter.trainer.rows_per_device = 1
  c.drafter.trainer.warmup_steps = 1
  c.rollout.tlt.solo_steps = 2
  return c


def _launch(config, log):
  """`python -m tlt_jax.main` on `config`, with this process's environment (its 8 CPU devices), in a process
  group of its own (its reward workers join it): a signal to the group is a terminal's Ctrl-C or a scheduler's
  SIGTERM."""
  env = {**os.environ, "PYTHONPATH": REPO}
  with open(log, "w", encoding="utf-8") as out:
    return subprocess.Popen([sys.executable, "-m", "tlt_jax.main", "--config=configs/tiny.py", *_overrides(config)],
                            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _holder(workdir) -> int | None:
  """The pid the workdir's lock file names (tlt_jax.lock), if it names one yet."""
  try:
    with open(os.path.join(workdir, lock.NAME), encoding="utf-8") as f:
      return json.load(f)["pid"]
  except (OSError, ValueError, KeyError):
    return None


def _alive_in_group(pgid: int) -> list[int]:
  """The live (not zombie) processes of process group `pgid` (Linux's /proc)."""
  alive = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
        state, _, group = f.read().rpartition(")")[2].split()[:3]
    except OSError:  # gone meanwhile
      continue
    if int(group) == pgid and state != "Z":
      alive.append(int(pid))
  return alive


def _last_step(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  return max([r["step"] for r in metrics.read(path)], default=0) if os.path.exists(path) else 0


def _wait(condition, every: float, timeout=300.0):
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(every)


@pytest.fixture(scope="module")
def bf16_policy_dir(tmp_path_factory, tiny_policy_dir):
  """The tiny policy saved in bfloat16, as R1-Distill's checkpoints are."""
  path = str(tmp_path_factory.mktemp("bf16_policy"))
  hf.save_pretrained(hf.from_pretrained(tiny_policy_dir), path, tokenizer=hf.load_tokenizer(tiny_policy_dir),
                     dtype="bfloat16")
  return path


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny_policy_dir):
  """A random drafter for the tiny policy (online training is what the fault test follows)."""
  path = str(tmp_path_factory.mktemp("drafter") / "drafter")
  drafter_checkpoint.save_drafter(Drafter(hf.read_config(tiny_policy_dir)[0], rngs=nnx.Rngs(0)), path)
  return path


@pytest.fixture(scope="module")
def straight(tmp_path_factory, bf16_policy_dir, drafter_dir, xla_cache):
  """An uninterrupted in-process run (it also fills the compilation cache the subprocesses read)."""
  workdir = tmp_path_factory.mktemp("straight")
  config = _fault_config(workdir, STEPS, bf16_policy_dir, drafter_dir, xla_cache)
  trainer = Trainer(config, *bootstrap.load(config))
  try:
    trainer.run()
    return workdir, jax.tree.map(np.asarray, trainer.actor.params), metrics.read(trainer.metrics.path)
  finally:
    trainer.close()


def _timing(key: str) -> bool:
  """Figures that follow the wall clock or the process: times, the acceptance length and the idle slot
  share (the bandit picks SD on or off by measured speed, so which tail steps were speculative, and
  how many slot-steps a play took, varies; the samples do not), how many drafter rounds started
  before the last group finished (the drafter's steps and their results do not vary), what
  compiled (a resumed process compiles its engines in its first step), and peak memory (the process's)."""
  return key.endswith(("_s", "_share")) or key.startswith(("time/", "memory/")) or key in (
      "rollout/accept_len", "rollout/idle_slot_fraction", "spot/train_rounds", "rollout/compilations")


def test_sigkill_and_sigterm_at_random_points_resume_exactly(tmp_path, straight, bf16_policy_dir, drafter_dir,
                                                            xla_cache):
  """One TLT run, interrupted three times in a row once it has trained a step, each signal sent to its
  whole process group (its reward workers too): SIGKILL inside a checkpoint write (orbax's temporary
  directory exists), SIGKILL at a seeded random moment, then SIGTERM at one (the step in flight
  finishes, a checkpoint is written, exit 0 with a resume message, no process left). Each restart
  resumes from the newest complete checkpoint, redoing at most the step in flight; the last run
  completes and equals the uninterrupted one record for record (the drafter's loss, held-out loss
  and top-1 included: its data buffer is in the checkpoint), in its final policy and in the
  exported drafter's bytes. (Subprocess starts dominate the cost:
  the SIGTERM shares this chain.)"""
  workdir = tmp_path / "run"
  config = _fault_config(workdir, STEPS, bf16_policy_dir, drafter_dir, xla_cache)
  checkpoints = workdir / "checkpoints"
  writing = lambda: any(n.endswith(".orbax-checkpoint-tmp") for n in os.listdir(checkpoints))
  rng = np.random.default_rng(7)
  interruptions = []
  for k, sig in enumerate((signal.SIGKILL, signal.SIGKILL, signal.SIGTERM)):
    before = _last_step(workdir)
    proc = _launch(config, tmp_path / f"run{k}.log")
    # Each check parses metrics.jsonl: every 10 ms leaves the CPU to the run; a checkpoint write lasts
    # milliseconds, so it is watched every millisecond (a directory listing).
    _wait(lambda: _last_step(workdir) > before or proc.poll() is not None, every=0.01)
    if k == 0:
      _wait(lambda: proc.poll() is not None or writing(), every=0.001)
    else:
      time.sleep(rng.uniform(0.0, 0.3))
    during_save = writing()
    os.killpg(proc.pid, sig)  # the whole group, reward workers included, as a scheduler signals a job
    code = proc.wait(timeout=120)
    assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL), f"run {k} ended before the signal: {code}"
    _wait(lambda: not _alive_in_group(proc.pid), every=0.05, timeout=10)  # no orphaned reward worker
    interruptions.append({"signal": sig.name, "recorded": _last_step(workdir), "during_save": during_save})
  assert interruptions[0]["during_save"]
  # The restart after the kill inside a write says it removes the unfinished checkpoint.
  assert "a checkpoint whose write did not finish" in (tmp_path / "run1.log").read_text()
  stopped = interruptions[-1]["recorded"]
  assert (f"stopped by SIGTERM after step {stopped} of {STEPS}; checkpoint {checkpoints / str(stopped)}; "
          "resume with: python -m tlt_jax.main --config=configs/tiny.py") in (tmp_path / "run2.log").read_text()
  assert not (workdir / "export").exists()
  proc = _launch(config, tmp_path / "run3.log")
  assert proc.wait(timeout=300) == 0, (tmp_path / "run3.log").read_text()[-3000:]
  for k, stop in enumerate(interruptions):
    found = re.search(r"resumed from \S+ at step (\d+)", (tmp_path / f"run{k + 1}.log").read_text())
    resumed = int(found.group(1)) if found else 0  # killed while writing its first checkpoint
    # A kill loses at most the step whose checkpoint was being written; SIGTERM loses nothing.
    assert stop["recorded"] - (stop["signal"] == "SIGKILL") <= resumed <= stop["recorded"], (stop, resumed)
  print(f"interruptions survived: {interruptions}")

  records = metrics.read(str(workdir / "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(STEPS + 1))  # 0: the held-out evaluation before step 1
  # The closing summary covers the whole run, the parts before the restarts included.
  summary = json.loads((workdir / "summary.json").read_text())
  window = max(1, min(5, STEPS // 2))
  assert summary["steps"] == STEPS and summary["training_reward"]["window"] == window
  assert summary["training_reward"]["first_steps"] == pytest.approx(
      np.mean([r["reward/mean"] for r in records[1:1 + window]]))
  assert summary["training_reward"]["last_steps"] == pytest.approx(
      np.mean([r["reward/mean"] for r in records[-window:]]))
  evals = [r for r in records if "eval/reward" in r]
  held_out = summary["held_out"]
  assert held_out["first"]["reward"] == evals[0]["eval/reward"] and held_out["first"]["step"] == 0
  assert held_out["last"]["reward"] == evals[-1]["eval/reward"] and held_out["last"]["step"] == STEPS
  assert held_out["change_interval"] == f"paired over {len(evals[0]['eval/prompt_rewards'])} prompts"
  # The terminal's summary leads with the held-out reward and names the outputs, the run's figure among them.
  log = (tmp_path / "run3.log").read_text()
  assert f"RL: {STEPS} steps" in log and "  held-out reward (95% interval): " in log
  assert f"  figure:      {workdir / 'run.png'}" in log and (workdir / "run.png").is_file()
  strip = lambda r: {k: v for k, v in r.items() if not _timing(k)}
  straight_dir, params, expected = straight
  assert all("drafter/loss" in r and r["drafter/steps"] == 2 for r in expected[1:])
  differing = [(r["step"], {k: (r.get(k), e.get(k)) for k in strip(r) | strip(e) if r.get(k) != e.get(k)})
               for r, e in zip(records, expected) if strip(r) != strip(e)]
  assert len(records) == len(expected) and not differing, differing  # (step, {key: (resumed, straight)})
  # The float32 masters (checkpointed, resumed exactly) exported in the checkpoint's bfloat16.
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))
  assert hf.checkpoint_dtype(str(workdir / "export" / "policy")) == "bfloat16"
  exported = nnx.state(hf.from_pretrained(str(workdir / "export" / "policy")))
  as_bf16 = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), params)
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), exported, as_bf16)))
  # The training-inference mismatch of bfloat16 rollouts, logged every step.
  gaps = [r["mismatch/logp_abs_diff"] for r in records[1:]]
  print(f"bfloat16 mismatch, mean |rollout - trainer log p| per step: {gaps}")
  assert all(0 < g < 0.1 for g in gaps) and all(r["mismatch/k3_kl"] >= 0 for r in records[1:])
  drafter = lambda d: (d / "export" / "drafter" / "model.safetensors").read_bytes()
  assert drafter(workdir) == drafter(straight_dir)


def test_ctrl_c_to_the_process_group_exits_within_seconds(tmp_path, tiny_policy_dir, xla_cache):
  """A terminal's Ctrl-C signals the whole foreground group, reward workers included. Once: the step in flight
  finishes, a checkpoint is written, the run exits 0 within seconds saying how to resume, and no process of
  its group is left. Twice: it exits at once (130), and so does a Ctrl-C before the first step."""
  c = tiny_rl_config(tmp_path / "run", 500, xla_cache)
  c.policy.path, c.eval.every, c.checkpoint.every, c.data.reward_workers = tiny_policy_dir, 0, 5, 1
  for k, (presses, when) in enumerate([(1, "after a step"), (2, "after a step"), (1, "at start-up")]):
    before = _last_step(c.workdir)
    proc = _launch(c, tmp_path / f"run{k}.log")
    if when == "after a step":
      _wait(lambda: _last_step(c.workdir) > before or proc.poll() is not None, every=0.05)
    else:  # once it holds the workdir: its inputs are being read, no step has started
      _wait(lambda: proc.poll() is not None or _holder(c.workdir) == proc.pid, every=0.02)
    start = time.monotonic()
    for _ in range(presses):
      os.killpg(proc.pid, signal.SIGINT)
      time.sleep(0.05)
    code = proc.wait(timeout=60)
    took = time.monotonic() - start
    log = (tmp_path / f"run{k}.log").read_text()
    _wait(lambda: not _alive_in_group(proc.pid), every=0.05, timeout=10)
    if presses == 1 and when == "after a step":
      stopped = _last_step(c.workdir)
      assert code == 0 and f"stopped by SIGINT after step {stopped} of 500; checkpoint " in log, log[-3000:]
      assert str(stopped) in os.listdir(tmp_path / "run" / "checkpoints")
    else:
      what = "the step in flight" if presses == 2 else "the run before its first step"
      assert code == 128 + signal.SIGINT and f"abandoned {what}; resume with: python -m tlt_jax.main" in log, \
          log[-3000:]
    assert "Traceback" not in log and took < 30, (took, log[-3000:])
    print(f"Ctrl-C x{presses} {when}: exit {code} after {took:.1f} s")


# Run between the runs (as `python remount.py SIZE_KB`, a run_clis case): the disk's size, or what it holds plus 128 KB.
_REMOUNT = """
import shutil, subprocess, sys
disk = sys.argv[1]
size = int(sys.argv[2]) if len(sys.argv) > 2 else shutil.disk_usage(disk).used // 1024 + 128
subprocess.run(["mount", "-o", f"remount,size={size}k", disk], check=True)
"""


def test_a_full_disk_is_one_error_line_and_the_run_resumes(tmp_path, tiny_policy_dir, xla_cache):
  """The workdir on a small filesystem (tmpfs, mounted as root; else skipped): a run that fills it stops
  before its next checkpoint with one `error:` line naming the directory and the space needed, no
  traceback, its checkpoints intact; with room again, the same command resumes from the newest one."""
  disk = tmp_path / "disk"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True).returncode:
    pytest.skip("mounting a small filesystem needs root")
  try:
    (tmp_path / "remount.py").write_text(_REMOUNT)
    c = tiny_rl_config(disk / "run", 2, xla_cache)
    c.policy.path, c.eval.every, c.checkpoint.every = tiny_policy_dir, 0, 1
    args = lambda steps: ["--config=configs/tiny.py", *_overrides(c), f"--config.steps={steps}"]
    remount = lambda *size: (str(tmp_path / "remount.py"), [str(disk), *size], REPO)
    runs = run_clis([("tlt_jax.main", args(2), REPO), remount(), ("tlt_jax.main", args(4), REPO),
                     remount(str(64 << 10)), ("tlt_jax.main", args(4), REPO)], tmp_path, compilation_cache=xla_cache)
  finally:
    subprocess.run(["umount", str(disk)], check=True)
  (first, *_), _, (code, _, log), _, (last, _, resumed) = runs
  errors = [line for line in log.splitlines() if line.startswith("error:")]
  assert first == 0 and code == 1 and len(errors) == 1 and "Traceback" not in log, log[-3000:]
  assert re.match(rf"error: \[Errno 28\] no space left on device for checkpoint 3 in {disk}/run/checkpoints: it "
                  r"needs about \d+\.\d MB, 0\.\d MB free there .*; resume with: python -m tlt_jax.main", errors[0])
  assert last == 0 and f"resumed from {disk}/run/checkpoints/2 at step 2" in resumed, resumed[-3000:]
