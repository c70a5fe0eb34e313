"""The docs hold together: every relative link and `#anchor` in README.md and docs/*.md resolves, every
command in the README's `bash` blocks names flags its tool defines and config keys that exist, and
the README stays short."""

import json
import os
import re

import pytest

from tlt_jax import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(REPO, "docs")))
                        if f.endswith(".md")]
ABSL_FLAGS = {"help", "helpfull", "helpshort", "flagfile", "logtostderr", "verbosity", "alsologtostderr"}


def _read(path: str) -> str:
  with open(os.path.join(REPO, path), encoding="utf-8") as f:
    return f.read()


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
  text = re.sub(r"```.*?```", "", _read(path), flags=re.S)  # a '#' in a code block is no heading
  return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def _links(path: str) -> list[str]:
  text = re.sub(r"```.*?```", "", _read(path), flags=re.S)
  return [link for link in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://|mailto:", link)]


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_and_anchor_resolves(doc):
  for link in _links(doc):
    target, _, anchor = link.partition("#")
    target = os.path.normpath(os.path.join(os.path.dirname(doc), target)) if target else doc
    assert os.path.exists(os.path.join(REPO, target)), f"{doc}: {link} points at a missing {target}"
    if anchor:
      assert target.endswith(".md") and anchor in _anchors(target), f"{doc}: {link}: no heading #{anchor} in {target}"


def _commands() -> list[str]:
  """The README's `bash` blocks' commands, continuation lines joined, comments dropped."""
  blocks = re.findall(r"```bash\n(.*?)```", _read("README.md"), flags=re.S)
  lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
  return [re.sub(r"\s#\s.*$", "", line).strip() for line in lines if line.strip()]


def _defined_flags(tool: str) -> set[str]:
  """The absl flags a `python -m tlt_jax.X` module or `python experiments/X.py` script defines, its own
  and the ones tlt_jax/cli.py defines for it."""
  text = _read(tool.replace(".", "/") + ".py" if tool.startswith("tlt_jax.") else tool)
  names = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", text))
  if "cli.define_config(" in text:
    names.add("config")
  if "cli.define_scan_layers(" in text:
    names.add("scan_layers")
  return names | ABSL_FLAGS


def _has_key(config, dotted: str) -> bool:
  for part in dotted.split("."):
    if part not in config:
      return False
    config = config[part]
  return True


def test_readme_commands_name_flags_and_keys_that_exist():
  checked = 0
  base = config_lib.base()
  for command in _commands():
    for part in re.split(r"&&|;|\|", command):
      found = re.match(r"\s*(?:\w+=\S+\s+)*(?:srun .*?)?python (?:-m (tlt_jax\.\w+)|(experiments/\w+\.py))(.*)", part)
      if not found:
        continue
      tool, args = found.group(1) or found.group(2), found.group(3)
      defined = _defined_flags(tool)
      for flag in re.findall(r"(?:^|\s)--([\w.]+)", args):
        if flag.startswith("config."):
          assert "config" in defined and _has_key(base, flag.removeprefix("config.")), f"{command}: --{flag}"
        else:
          assert flag in defined, f"{command}: {tool} has no --{flag}"
        checked += 1
  assert checked > 20


def test_readme_is_short_and_the_docs_are_a_results_page():
  assert len(_read("README.md").encode()) <= 10 * 1024
  assert sum(len(_read(d).encode()) for d in DOCS if d.startswith("docs")) < 72 * 1024


def test_the_tiny_defaults_figures_are_those_recorded():
  """The README's and BENCHMARKS' figures of the tiny default are the recorded 3-seed run's
  (docs/figures/tiny_default.json, written from experiments/seeds.py's seeds.json)."""
  record = json.loads(_read("docs/figures/tiny_default.json"))
  held = [r["held_out"] for r in record["runs"]]
  r3 = lambda x: f"{x:.3f}"
  first, last = [h["first"]["reward"] for h in held], [h["last"]["reward"] for h in held]
  cell = (f"held-out reward {r3(min(first))}-{r3(max(first))} -> {r3(min(last))}-{r3(max(last))} over "
          f"{len(held)} seeds, each rise {min(h['change'] / h['change_ci95'] for h in held):.1f}-"
          f"{max(h['change'] / h['change_ci95'] for h in held):.1f}x its 95% interval")
  assert cell in _read("README.md")
  assert all(h["verdict"] == "up" for h in held)
  benchmarks = _read("docs/BENCHMARKS.md")
  for run, h in zip(record["runs"], held):
    row = (f"| {run['seed']} | {r3(h['first']['reward'])} +- {r3(h['first']['ci95'])} | {r3(h['last']['reward'])} +- "
           f"{r3(h['last']['ci95'])} | **{h['change']:+.3f} +- {r3(h['change_ci95'])}** | "
           f"{h['first']['answered']:.0%} -> {h['last']['answered']:.0%} |")
    assert row in benchmarks
