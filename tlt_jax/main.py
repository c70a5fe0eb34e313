"""RL training of a reasoning model with TLT rollouts.

  python -m tlt_jax.main                                        # the tiny default on a CPU
  python -m tlt_jax.main --config=configs/r1_7b.py [--config.key=value ...]
  python -m tlt_jax.main --config=configs/r1_7b.py --config.dry_run=True   # size it, read no weights
  python -m tlt_jax.main --config=configs/r1_7b.py --keys       # every key: value, default, what it does

A run writes the config it runs with to <workdir>/config.json (a resume logs the keys changed since). An
unknown, ill-typed or non-finite key, a config file that does not load, a prompt file that does not parse
or a workdir that cannot be written is one line `error: ...` naming it, before any work. Resumes from
<workdir>/checkpoints when there are any.

SIGTERM or Ctrl-C (to the process or its whole group, as a terminal or a scheduler sends them): the
step in flight finishes, a checkpoint is written, and the run exits 0 saying where it stopped and how
to resume; a second signal abandons the step (the run resumes from the last checkpoint), and so does
the first before the training loop starts (SFT, drafter warm-up: nothing to keep). A killed run
resumes from its newest complete checkpoint. One run per workdir: a second one on it is refused,
naming the first (tlt_jax.lock).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time

from absl import flags, logging

from tlt_jax import cli
from tlt_jax import config as config_lib
from tlt_jax import files

# The rest of the package (and jax) is imported inside main(): a spawned reward worker (rl/rewards.py) imports
# this module again, as multiprocessing prepares every worker of a `python -m` program, and needs none of it.
_CONFIG = cli.define_config(config_lib.__file__)  # its get_config(): the tiny world, found in an installed copy too
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Same as --config.dry_run=True.")
_KEYS = flags.DEFINE_bool("keys", False, "Print every config key with its value (and the default where the config "
                          "changes it) and what it does, then exit.")


class _StopSignal:
  """SIGTERM / SIGINT handler: once `armed` (the training loop runs), the first asks the trainer to stop
  after the step in flight; a second, or the first before then, exits at once, as if killed (an exception
  raised from a handler can land in a finalizer and be swallowed): a restart redoes the step from the last
  complete checkpoint (every output is written atomically)."""

  def __init__(self):
    self.reason: str | None = None
    self.armed = False
    self.resume = shlex.join(["python", "-m", "tlt_jax.main", *sys.argv[1:]])
    self.checkpoints = "the workdir's checkpoints"  # their directory, once the config is read

  def __call__(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.reason is None and self.armed:
      self.reason = name
      logging.warning("%s: stopping after the step in flight, then writing a checkpoint (send it again to abandon "
                      "the step)", name)
      return
    what = "the step in flight" if self.armed else "the run before its first step"
    print(f"{name}{' again' if self.reason else ''}: abandoned {what}; resume with: {self.resume} (it continues "
          f"from the newest complete checkpoint in {self.checkpoints}, if any)", file=sys.stderr, flush=True)
    os._exit(128 + signum)  # pylint: disable=protected-access


# The handler of SIGTERM and SIGINT, installed before the flags are parsed and the package is imported: a
# Ctrl-C at any point ends the run with one line.
_STOP = _StopSignal()


def check_outputs(config) -> None:
  """The workdir and the compilation cache can be written, and the export replaces no input (before
  any work)."""
  export = os.path.join(config.workdir, "export")
  for key in ("policy.path", "drafter.path", "data.path", "eval.path"):
    path = config_lib.config_value(config, key)
    if path and files.contains(export, path):
      cli.fail(f"config.{key}={path!r} lies in {export}, which the run's export replaces; copy it elsewhere first")
  for key in ("workdir", "rollout.compilation_cache_dir"):
    path = config_lib.config_value(config, key)
    if not path:
      continue
    if os.path.lexists(path) and not os.path.isdir(path):
      cli.fail(f"config.{key}={path!r}: not a directory")
    try:
      files.check_writable(os.path.join(path, "probe"))
    except files.OutputError as e:
      cli.fail(f"config.{key}={path!r}: {e}")


def _lock_workdir(config):
  """The workdir's lock (tlt_jax.lock), which process 0 takes (the others get None); when another run holds
  it, every process stops with one line naming that run."""
  from tlt_jax import distributed, lock  # pylint: disable=import-outside-toplevel
  held, busy = None, None
  if distributed.primary():
    try:
      held = lock.WorkdirLock(config.workdir)
    except lock.InUse as e:
      busy = str(e)
  busy = distributed.allgather(busy)[0]
  if busy:
    cli.fail(f"config.workdir={config.workdir!r}: {busy}")
  return held


def main(argv):
  del argv
  from tlt_jax import distributed  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl import checks  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  config = cli.config_value(_CONFIG)
  if _DRY_RUN.value:
    config.dry_run = True
  if _KEYS.value:
    print(config_lib.describe(config))
    return
  try:
    checks.check(config)
  except ValueError as e:
    cli.fail(str(e))
  try:
    distributed.setup_devices(config)
  except (RuntimeError, ValueError) as e:  # jax.distributed could not start (config.distributed.*)
    cli.fail(f"config.distributed: {e}")
  if config.dry_run:
    _dry_run(config)
    return
  check_outputs(config)
  held = _lock_workdir(config)
  try:
    _train(config, start)
  finally:  # a run that wrote nothing (bad input) leaves nothing
    if held is not None:
      held.release()


def _dry_run(config) -> None:
  """The dry run's report (tlt_jax.dry_run) on stdout and in <workdir>/dry_run[_<target>].json, written whether
  or not every executable compiles and fits (else one error line, exit 1)."""
  from tlt_jax import dry_run  # pylint: disable=import-outside-toplevel
  path = os.path.join(config.workdir, f"dry_run{'_' + config.mesh.target if config.mesh.target else ''}.json")
  try:
    report, error = dry_run.run(config), None
  except dry_run.DryRunError as e:  # an executable that does not compile or fit: the report says which
    report, error = e.report, f"dry run: {e} (report: {path})"
  except (OSError, ValueError) as e:  # a missing vocabulary size, an unknown target, ...
    cli.fail(f"dry run: {e}")
  try:
    with files.atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=2)
  except (OSError, files.OutputError) as e:
    cli.fail(f"config.workdir={config.workdir!r}: the dry run's report: {e}")
  if error:
    cli.fail(error)
  print(json.dumps(report, indent=2))


def _write_config(config) -> None:
  """<workdir>/config.json: every key's value this run has; a resume logs those that differ from the last run's."""
  path = os.path.join(config.workdir, "config.json")
  values = json.loads(json.dumps(dict(config_lib.leaves(config)), default=str))  # tuples as lists
  try:
    with open(path, encoding="utf-8") as f:
      before = json.load(f)
  except (OSError, ValueError):
    before = None
  if before is not None:
    changed = [f"{k}: {before.get(k, '(absent)')!r} -> {v!r}" for k, v in values.items() if before.get(k) != v]
    if changed:
      logging.warning("config changed since the workdir's last run: %s", "; ".join(changed))
  try:
    with files.atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
      json.dump(values, f, indent=1)
  except (OSError, files.OutputError) as e:
    cli.fail(f"config.workdir={config.workdir!r}: {e}")


def _train(config, start: float) -> None:
  """The run, on a workdir this process holds: its inputs read, RL steps, the summary."""
  from tlt_jax import distributed, metrics, report  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl import bootstrap  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl.rewards import RewardError  # pylint: disable=import-outside-toplevel
  from tlt_jax.rl.trainer import NonFiniteUpdates, Trainer  # pylint: disable=import-outside-toplevel
  resume = _STOP.resume
  _STOP.checkpoints = os.path.join(os.path.abspath(config.workdir), "checkpoints")
  try:  # prompt files, the policy and the drafter are read (and checked) before SFT or a rollout starts
    trainer = Trainer(config, *bootstrap.load(config))
  except (OSError, ValueError) as e:
    cli.fail(str(e))
  if distributed.primary():  # once the inputs are read: bad input writes nothing
    _write_config(config)
  _STOP.armed = True
  expected = (NonFiniteUpdates, RewardError, OSError)  # diverged; rewards failed; a write failed (a full disk)
  try:
    records = trainer.run(stop=lambda: _STOP.reason)
  except BaseException as e:
    trainer.close(quiet=True)
    if isinstance(e, expected):
      cli.fail(f"{e}" + (f"; resume with: {resume}" if isinstance(e, OSError) else ""))
    raise
  try:
    trainer.close()  # waits for the last checkpoint, whose write may fail too
  except OSError as e:
    cli.fail(f"{e}; resume with: {resume}")
  if trainer.stopped:
    print(f"stopped by {trainer.stopped} after step {trainer.step} of {config.steps}; checkpoint "
          f"{trainer.checkpoint_path}; resume with: {resume}")
    return
  if records and trainer.metrics is not None:  # process 0 of several
    history = metrics.read(trainer.metrics.path)  # the whole run, resumed parts included
    plot = report.figure({"TLT" if config.rollout.speculative else "plain": history},
                         os.path.join(config.workdir, report.FIGURE))
    summary = report.summary(history, config.workdir, figure=plot, wall_s=time.perf_counter() - start)
    path = os.path.join(config.workdir, "summary.json")
    with files.atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
      json.dump(summary, f, indent=2)
    print(report.text(summary) + f"\n  {'summary:':13s}{path}")


if __name__ == "__main__":
  for _signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(_signum, _STOP)
  cli.run(main)
