"""What the command-line tools share: one-line errors, checked flags, checked outputs.

A CLI runs `run(main)` instead of `app.run(main)`: a bad flag (unknown, ill-typed, out of bounds, a
non-finite float, a config file that does not load or an unknown `--config.*` key) and every
`InputError` / `files.OutputError` that `main` raises print one line `error: ...` naming the flag,
file or key, and exit 1 with no traceback; so does an optional dependency that is not installed
(naming the extra that installs it, `EXTRAS`). Checks run before the expensive work: `named` turns a
failure to load what a flag names into such an error, `check_output` refuses an output that is an
input or would replace something its tool did not make. `provenance` is what a record of measurements
carries: the command, the machine, the commit and the date.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import traceback
from typing import Callable, Iterator, NoReturn

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from tlt_jax import files

# jax (and what imports it) is imported inside the functions that need it: tlt_jax.main imports this module,
# and so does every reward worker it spawns (rl/rewards.py), which never needs jax.


class InputError(ValueError):
  """Bad input; the message names the flag, file (and line) or key."""


# The optional dependencies a tool may need, and the extra of setup.py that installs each.
EXTRAS = {"gguf": "gguf", "accelerate": "gguf", "torch": "gguf", "datasets": "data", "wandb": "wandb",
          "jax_triton": "gpu", "triton": "gpu"}


def provenance() -> dict[str, str | None]:
  """Where a record of measurements comes from: the command as typed (`python -m tool ...`), the
  machine (CPU cores, JAX's devices and version), the commit of this checkout (`+changes` when its
  tracked files differ from it; None outside a git checkout or without git) and the date (UTC)."""
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  program = f"python -m {spec.name}" if spec else f"python {os.path.relpath(sys.argv[0])}"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  git = lambda *args: subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=False)
  try:
    head, changed = git("rev-parse", "--short=10", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    commit = head.stdout.strip() + ("+changes" if changed.stdout.strip() else "") if head.returncode == 0 else None
  except OSError:  # no git on this machine
    commit = None
  import jax  # pylint: disable=import-outside-toplevel
  devices = jax.devices()
  return {"command": " ".join([program, *map(shlex.quote, sys.argv[1:])]),
          "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {len(devices)} x {devices[0].device_kind}, "
                     f"JAX {jax.__version__}",
          "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _not_installed(module: str) -> str:
  return f"{module} is not installed: it comes with the {EXTRAS[module]} extra, pip install -e \".[{EXTRAS[module]}]\""


def require(*modules: str) -> None:
  """Fails on one line, naming the extra to install, when one of `modules` (keys of EXTRAS) is missing."""
  for module in modules:
    if importlib.util.find_spec(module) is None:
      fail(_not_installed(module))


def fail(message: str) -> NoReturn:
  """Exits 1 printing `error: message` on one line."""
  sys.exit("error: " + re.sub(r"\s*\n\s*", " ", message.strip()))


class _QuietLibraries(logging.logging.Filter):
  """orbax logs every save and restore at INFO: its warnings only. A full disk fails every background write of
  orbax and tensorstore, each logged with its traceback: left out, since the run stops on it with one line."""

  def filter(self, record):
    raised = record.exc_info[1] if record.exc_info else None
    if "No space left on device" in f"{record.getMessage()} {raised}":
      return False
    return record.levelno >= logging.logging.WARNING or "orbax" not in record.pathname


def _unraisable(unraisable) -> None:
  """sys.unraisablehook that drops what tensorstore's callbacks raise when they fire after orbax closed their
  event loop (its failed writes on a full disk end so): harmless, and each a traceback."""
  if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
    sys.__unraisablehook__(unraisable)


def run(main: Callable[[list[str]], None]) -> None:
  """`app.run(main)` with the flags parsed by `parse_flags`, input errors printed on one line, and
  orbax's INFO chatter left out of the log."""
  def checked(argv):
    logging.get_absl_handler().addFilter(_QuietLibraries())
    sys.unraisablehook = _unraisable
    if len(argv) > 1:
      fail(f"unexpected arguments: {argv[1:]}")
    try:
      main(argv)
    except (InputError, files.OutputError) as e:
      fail(str(e))
    except ModuleNotFoundError as e:
      if (e.name or "").split(".")[0] not in EXTRAS:
        raise
      fail(_not_installed(e.name.split(".")[0]))
  app.run(checked, flags_parser=parse_flags)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with one-line errors, and every float flag checked to be finite. `--config=configs/
  <name>.py` (or `<name>.py`) that is not there is the package's own copy of the shipped config."""
  argv = [_shipped_config(arg) for arg in argv]
  try:
    rest = flags.FLAGS(argv)
  except (KeyError, AttributeError) as e:  # an unknown key in an override of a --config=FILE
    fail(_unknown_key(e, argv))
  except OSError as e:  # an override of a --config=FILE that did not load
    _config_not_loaded(e)
  except flags.Error as e:
    # A config file that raises comes with its traceback in the message: its last line says why,
    # unless the file sets an old key (the traceback quotes the line).
    head, _, tail = str(e).partition("Traceback (most recent call last):")
    if tail:
      fail(head.split("\n")[0].rstrip(":") + ": " + (_renamed(_dotted(tail))
                                                     or tail.strip().split("\n")[-1]))
    fail(str(e))
  for name in flags.FLAGS:
    value = flags.FLAGS[name].value
    if isinstance(value, float) and not math.isfinite(value):
      fail(f"--{name}={value}: must be a finite number")
  return rest


def _shipped_config(arg: str) -> str:
  """`arg`, a `--config=configs/<name>.py[:variant]` that is not here replaced by the installed package's copy."""
  if not arg.startswith("--config="):
    return arg
  path, colon, variant = arg.removeprefix("--config=").partition(":")
  if os.path.exists(path) or os.path.dirname(path) not in ("", "configs"):
    return arg
  import tlt_jax.configs  # pylint: disable=import-outside-toplevel
  shipped = os.path.join(os.path.dirname(tlt_jax.configs.__file__), os.path.basename(path))
  return f"--config={shipped}{colon}{variant}" if os.path.isfile(shipped) else arg


def define_config(default: str) -> flags.FlagHolder:
  """`--config=FILE[:variant]` (a `get_config()` file, ml_collections) defaulting to `default`; read it
  with `config_value`. Overrides of the default config are applied right here, as it is defined."""
  try:
    return config_flags.DEFINE_config_file("config", default, "Experiment config file (get_config()).")
  except (KeyError, AttributeError) as e:
    fail(_unknown_key(e, sys.argv))
  except (flags.Error, ValueError) as e:  # an ill-typed override of the default config, or an unparsable key
    fail(str(e))


def define_scan_layers() -> flags.FlagHolder:
  """`--scan_layers` of the tools that load a Hugging Face model (`ModelConfig.scan_layers`)."""
  return flags.DEFINE_bool("scan_layers", None, "Run the decoder layers by one lax.scan over stacked parameters "
                           "(False: unrolled, which compiles every layer but decodes a weight-bound batch about 2x "
                           "faster on a CPU). Default: unrolled on a CPU, scanned on a GPU or TPU.")


def scan_layers(holder: flags.FlagHolder) -> bool:
  """`--scan_layers` as given; by default unrolled on a CPU, where XLA copies each layer's weights out of
  the stack at every step of a scan (a weight-bound decode step at about half the speed: docs/BENCHMARKS.md,
  "Scanned vs unrolled layers"), and scanned on a GPU or TPU, which compiles one layer body for all."""
  import jax  # pylint: disable=import-outside-toplevel
  return holder.value if holder.value is not None else jax.default_backend() != "cpu"


def config_value(holder: flags.FlagHolder) -> ml_collections.ConfigDict:
  """The config `define_config` defined; a file that does not load is an error naming it."""
  config = holder.value
  if isinstance(config, ml_collections.ConfigDict):
    return config
  try:
    config.keys()  # ml_collections defers a failed load's error to the first access
  except OSError as e:
    _config_not_loaded(e)
  except AttributeError:  # e.g. None: get_config() forgot to return
    pass
  fail(f"--config={config_flags.get_config_filename(flags.FLAGS['config'])}: get_config() returned "
       f"{type(config).__name__}, not a ConfigDict")


def _config_not_loaded(e: OSError) -> NoReturn:
  """ml_collections' OSError for a config file that did not load ends with the reason."""
  given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config=")]
  name = given[-1] if given else flags.FLAGS["config"].default_as_str.strip("'")
  fail(f"--config={name}: cannot load it ({str(e).strip().splitlines()[-1].strip()})")


def _unknown_key(e: Exception, argv: list[str]) -> str:
  """ml_collections reports an unknown --config.* key as a bare KeyError (inside an AttributeError,
  with a suggestion on a second line): name the key once, the flag, and the suggestion. An old key
  (in a flag, or in the config file's line that raised) is named with its new name."""
  source = "\n".join(frame.line or "" for frame in traceback.extract_tb(e.__traceback__))
  while isinstance(e.args[0] if e.args else None, Exception):
    e = e.args[0]
  first, *rest = str(e.args[0] if e.args else e).split("\n")
  key = first.strip("'\"")
  bad = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.") and key in a.split("=")[0].split(".")]
  renamed = _renamed([flag.removeprefix("--config.") for flag in bad] + _dotted(source))
  if renamed:
    return renamed
  suggestion = re.search(r'Did you mean "([^"]+)"', " ".join(rest))
  return (f"unknown config key {key!r} in {', '.join(bad) or 'the --config overrides'}"
          + (f" (did you mean {suggestion.group(1)!r}?)" if suggestion else "")
          + "; every key and its default: --keys, or tlt_jax/config.py")


def _dotted(source: str) -> list[str]:
  """Every `section.key` in `source` (Python code that sets config keys, e.g. `c.drafter.warmup_steps = 4`)."""
  return re.findall(r"(?=\.(\w+\.\w+)\b)", source)


def _renamed(keys: list[str]) -> str | None:
  """The error for the first of `keys` (dotted, below `config.`) that is an old config key, if any."""
  from tlt_jax import config as config_lib  # pylint: disable=import-outside-toplevel  (slow to import; --config CLIs only)
  return next(filter(None, map(config_lib.renamed, keys)), None)


def check_sampling_flags(**holders: flags.FlagHolder) -> None:
  """Checks each flag, given under its SamplingParams field name, with SamplingParams' own bounds
  (`sampling.check_field`) when the flags are parsed."""
  from tlt_jax.rollout import sampling  # pylint: disable=import-outside-toplevel
  for field, holder in holders.items():
    def check(value, field=field):
      try:
        sampling.check_field(field, value)
      except ValueError as e:
        raise flags.ValidationError(str(e)) from None
      return True
    flags.register_validator(holder.name, check)


@contextlib.contextmanager
def named(flag: str, value: str) -> Iterator[None]:
  """Failures to load what `--flag=value` names (missing or damaged files: OSError, ValueError) become
  an InputError naming the flag."""
  try:
    yield
  except (InputError, files.OutputError):
    raise
  except (OSError, ValueError) as e:
    raise InputError(f"--{flag}={value}: {e}") from None


def check_output(flag: str, path: str, inputs: dict[str, str | None], *, kind: str | None = None,
                 is_own: Callable[[str], bool] | None = None, overwrite: bool = False) -> None:
  """Checks, before any work, that `--flag=path` can be written and replaces no input: it is none of
  `inputs` (flag -> path) and contains none of them. A file output (`kind` None) must not be a
  directory; a directory output of `kind` (e.g. "a drafter checkpoint") replaces an existing
  non-empty directory only when `is_own` recognises it as an earlier output of that kind and
  `overwrite` is set."""
  for name, value in inputs.items():
    if value is not None and os.path.exists(value) and files.contains(path, value):
      relation = "is" if files.contains(value, path) else "holds"
      raise InputError(f"--{flag}={path} {relation} --{name}={value}: writing it would delete that input; "
                       f"choose another --{flag}")
  if kind is None:
    if os.path.isdir(path):
      raise InputError(f"--{flag}={path} is a directory; it names the output file")
  else:
    try:
      files.check_replaceable(path, kind, is_own)
    except files.OutputError as e:
      raise InputError(f"--{flag}={path}: {e} (choose another --{flag}, or remove it yourself)") from None
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
      raise InputError(f"--{flag}={path} already holds {kind}; pass --overwrite to replace it")
  try:
    files.check_writable(path)
  except files.OutputError as e:
    raise InputError(f"--{flag}={path}: {e}") from None


def token_budgets(prompts: list[list[int]], max_new_tokens: int, max_positions: int) -> tuple[int, dict[int, int]]:
  """Each prompt may generate `max_new_tokens`, or what the model's `max_positions` leave after it
  (give the engine `max_total_len=max_positions`): one long prompt cuts its own budget only. Returns
  the largest budget (the engine's capacity) and the cut budgets (prompt index -> tokens), which are
  reported on stderr."""
  cut = {i: max_positions - len(p) for i, p in enumerate(prompts) if len(p) + max_new_tokens > max_positions}
  if cut:
    first = min(cut)
    logging.warning("%d of %d prompts are too long for --max_new_tokens=%d within the model's %d positions; each "
                    "generates at most what is left (prompt %d: %d tokens, %d new), the others %d", len(cut),
                    len(prompts), max_new_tokens, max_positions, first, len(prompts[first]), cut[first],
                    max_new_tokens)
  return min(max_new_tokens, max_positions - min(map(len, prompts))), cut
