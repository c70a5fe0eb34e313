"""The docs hold together: every relative link and `#anchor` in README.md and docs/*.md resolves, every
command in the README's `bash` blocks names flags its tool defines and config keys that exist, every
tool line in the configs' docstrings and the notebooks names its tool's flags and keys (required
ones given), the README's reward examples score what the scorer passes them, and the README stays short."""

import ast
import collections
import importlib.util
import json
import os
import re

import ml_collections
import pytest

from tlt_jax import config as config_lib
from tlt_jax.rl import rewards

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


_TOOL = re.compile(r"-m (tlt_jax\.\w+)((?:[ \t]+--[\w.]+(?:=[^\s`]+)?)*)")

def _tool_lines() -> dict[str, list[tuple[str, list[str]]]]:
  """tool -> (where, flags) of each `python -m tlt_jax.<tool>` line in the configs' docstrings and the
  notebooks' code cells (a cell's `args = f"..."` spliced in, its {placeholders} filled)."""
  found = collections.defaultdict(list)
  texts = [(f"configs/{n}", ast.get_docstring(ast.parse(_read(f"configs/{n}"))) or "")
           for n in sorted(os.listdir(os.path.join(REPO, "configs"))) if n.endswith(".py")]
  for name in sorted(os.listdir(os.path.join(REPO, "colab"))):
    if name.endswith(".ipynb"):
      for cell in json.loads(_read(f"colab/{name}"))["cells"]:
        source = "".join(cell["source"])
        args = re.search(r'args = f"([^"]*)"', source)
        source = source.replace("{args}", args.group(1) if args else "")
        texts += [(f"colab/{name}", re.sub(r"\{[^{}]*\}", "X", source))] if cell["cell_type"] == "code" else []
  for where, text in texts:
    for m in _TOOL.finditer(text.replace("\\\n", " ")):
      found[m.group(1)].append((where, m.group(2).split()))
  return found


def _required(tool: str) -> list[set[str]]:
  """The tool's required flags, each as the set of which one must be given."""
  text = _read(tool.replace(".", "/") + ".py")
  return [{name} for name in re.findall(r"DEFINE_\w+\(\s*\"(\w+)\".*required=True\)", text)] + \
      [set(re.findall(r"\w+", group)) for group in
       re.findall(r"mark_flags_as_mutual_exclusive\(\[([^]]*)\], required=True\)", text)]


def _config_file(flag: str) -> ml_collections.ConfigDict:
  """What `--config=FILE[:variant]` loads."""
  path, _, variant = flag.partition(":")
  spec = importlib.util.spec_from_file_location("config_file", os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


def test_tool_lines_in_configs_and_notebooks_name_flags_and_keys_that_exist_and_the_required_flags():
  lines = _tool_lines()
  assert {"tlt_jax.main", "tlt_jax.train_drafter", "tlt_jax.convert_gguf", "tlt_jax.sft"} <= set(lines)
  for tool, commands in lines.items():
    defined = _defined_flags(tool)
    for where, args in commands:
      given = dict(a.removeprefix("--").partition("=")[::2] for a in args)
      config = _config_file(given["config"]) if "config" in given else config_lib.base()
      for flag in given:
        assert flag in defined or flag.startswith("config.") and "config" in defined, f"{where}: {tool} --{flag}"
        assert not flag.startswith("config.") or _has_key(config, flag.removeprefix("config.")), f"{where}: --{flag}"
      for need in _required(tool):
        assert len(need & set(given)) == 1, f"{where}: {tool} needs one of {sorted(need)}: {args}"


def test_readme_is_short_and_the_docs_are_a_results_page():
  assert len(_read("README.md").encode()) <= 10 * 1024
  pages = ("docs/BENCHMARKS.md", "docs/GPU.md", "docs/STATUS.md")
  assert sum(len(_read(d).encode()) for d in pages) < 72 * 1024
  assert all(len(_read(d).encode()) < 8 * 1024 for d in DOCS if d.startswith("docs") and d not in pages)


def test_the_key_table_names_trls_keys_and_ours():
  """docs/KEYS.md: each TRL name is a GRPOConfig field, a GRPOTrainer argument or a ModelConfig / PEFT LoraConfig
  field of the installed TRL 1.16 and PEFT; each of ours (`a.b`, and `a.b`, `c` for its sibling a.c) is a key."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import inspect  # pylint: disable=import-outside-toplevel
  import peft  # pylint: disable=import-outside-toplevel
  import trl  # pylint: disable=import-outside-toplevel
  trl_names = ({f.name for c in (trl.GRPOConfig, trl.ModelConfig) for f in dataclasses.fields(c)}
               | set(inspect.signature(trl.GRPOTrainer.__init__).parameters)
               | {f.name for f in dataclasses.fields(peft.LoraConfig)})
  keys = {k for k, _ in config_lib.leaves(config_lib.base())}
  rows = [line.split(" | ") for line in _read("docs/KEYS.md").splitlines() if line.startswith("| `")
          or line.startswith("| -") and not line.startswith("|---")]
  assert len(rows) > 25
  for trl_cell, _, ours in rows:
    for name in re.findall(r"`(\w+)`", trl_cell.removeprefix("| ")):
      assert name in trl_names or name in ("cispo", "group", "batch", "none", "_neg", "_min"), f"TRL has no {name!r}"
    for first, siblings in re.findall(r"`([a-z_]+(?:\.[a-z_]+)*)`((?:, `[a-z_]+`)*)", ours):
      parent = first.rpartition(".")[0]
      for key in [first] + [f"{parent}.{s}" for s in re.findall(r"`(\w+)`", siblings)]:
        assert key in keys or first in ("sample", "batch", "none"), f"KEYS.md: no {key}"


def test_the_tiny_defaults_figures_are_those_recorded():
  """The README's and BENCHMARKS' figures of the tiny default are the recorded 3-seed run's
  (docs/figures/tiny_default.json, written from experiments/seeds.py's seeds.json)."""
  record = json.loads(_read("docs/figures/tiny_default.json"))
  held = [r["held_out"] for r in record["runs"]]
  r3 = lambda x: f"{x:.3f}"
  first, last = [h["first"]["reward"] for h in held], [h["last"]["reward"] for h in held]
  cell = (f"held-out reward {r3(min(first))}-{r3(max(first))} -> {r3(min(last))}-{r3(max(last))}, "
          f"{len(held)} seeds, each rise beyond its confidence interval")
  assert cell in _read("README.md")
  assert all(h["verdict"] == "up" and h["change"] > h["change_ci95"] for h in held)
  benchmarks = _read("docs/BENCHMARKS.md")
  for run, h in zip(record["runs"], held):
    row = (f"| {run['seed']} | {r3(h['first']['reward'])} +- {r3(h['first']['ci95'])} | {r3(h['last']['reward'])} +- "
           f"{r3(h['last']['ci95'])} | **{h['change']:+.3f} +- {r3(h['change_ci95'])}** | "
           f"{h['first']['answered']:.0%} -> {h['last']['answered']:.0%} |")
    assert row in benchmarks


def _section(path: str, anchor: str) -> str:
  """The text of `path`'s section with heading #anchor, to the next heading of its level or above."""
  lines, out, level = _read(path).splitlines(), [], None
  for line in lines:
    heading = re.match(r"(#{1,6}) (.+)$", line)
    if heading and level is not None and len(heading.group(1)) <= level:
      break
    if heading and level is None and _slug(heading.group(2)) == anchor:
      level = len(heading.group(1))
    if level is not None:
      out.append(line)
  assert out, f"{path}: no heading #{anchor}"
  return "\n".join(out)


def _leaves(obj) -> list[float]:
  if isinstance(obj, dict):
    return [v for x in obj.values() for v in _leaves(x)]
  if isinstance(obj, list):
    return [v for x in obj for v in _leaves(x)]
  return [float(obj)] if isinstance(obj, (int, float)) and not isinstance(obj, bool) else []


RECORDS = sorted(f for f in os.listdir(os.path.join(REPO, "docs", "figures")) if f.endswith(".json"))


@pytest.mark.parametrize("name", RECORDS)
def test_every_record_says_what_ran_where_and_when(name):
  record = json.loads(_read(f"docs/figures/{name}"))
  assert {"machine", "commit", "date"} <= set(record) and ({"command", "commands"} & set(record)), name
  assert re.match(r"2\d{3}-\d\d-\d\d", record["date"]) and re.fullmatch(r"[0-9a-f]{7,40}(\+changes)?", record["commit"])


def test_every_readme_result_is_in_the_record_its_section_links():
  """Each figure of the README's results table (a decimal in a link's text: 1.83x, 0.207, 27%) is in the
  BENCHMARKS section the link opens and in a record that section links (a value rounding to it), and
  the row's date is that record's."""
  table = _read("README.md").split("## Results", 1)[1]
  rows = [line for line in table.splitlines() if line.startswith("| ") and "](docs/" in line]
  assert len(rows) >= 8
  for row in rows:
    date = row.rstrip(" |").rsplit("| ", 1)[1]
    for text, anchor in re.findall(r"\[([^\]]+)\]\(docs/BENCHMARKS\.md#([^)]+)\)", row):
      section = _section("docs/BENCHMARKS.md", anchor)
      names = re.findall(r"\(figures/(\w+\.json)\)", section)
      assert names, f"README {text!r}: #{anchor} links no record"
      records = [json.loads(_read(f"docs/figures/{n}")) for n in names]
      assert date in [r["date"][:10] for r in records], f"README {text!r}: {date} is none of {names}' dates"
      for number, unit in re.findall(r"(\d+\.\d+|\d+(?=%))(%| min)?", text):
        assert number in section, f"README {text!r}: {number} not in BENCHMARKS #{anchor}"
        scale = {"%": 0.01, " min": 60.0}.get(unit, 1.0)  # a record holds fractions and seconds
        value, half = float(number) * scale, 0.5 * 10 ** -len(number.partition(".")[2]) * scale + 1e-12
        assert any(abs(v - value) <= half for r in records for v in _leaves(r)), (
            f"README {text!r}: {number}{unit} is in none of {names}")


def test_the_readmes_reward_functions_score_string_and_chat_prompts(tmp_path):
  """The README's verl and TRL examples, through the scorer's own calls: a TRL completion is the text on a
  string prompt (the tiny world's) and the assistant's messages on a chat prompt."""
  block = next(b for b in re.findall(r"```python\n(.*?)```", _read("README.md"), re.S) if "def has_answer" in b)
  (tmp_path / "r.py").write_text(block)
  items = [rewards.Item(None, "so #### 4", "4", {}, prompt=prompt) for prompt in
           ("2 + 2?", [{"role": "user", "content": "2 + 2?"}])]
  assert rewards.call(f"{tmp_path}/r.py:has_answer", items) == ("ok", [1.0, 1.0], {}, {})
  assert rewards.call(f"{tmp_path}/r.py:compute_score", items) == ("ok", [1.0, 1.0], {}, {})


def test_the_sections_code_and_configs_cite_exist():
  """`docs/BENCHMARKS.md, "Section"` in a config or module names a heading that is there."""
  headings = {m.group(1) for m in re.finditer(r"^#+ (.+)$", _read("docs/BENCHMARKS.md"), re.M)}
  cited = []
  for folder in ("configs", "tlt_jax", "experiments"):
    for dirpath, _, files in os.walk(os.path.join(REPO, folder)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(dirpath, name)
          text = re.sub(r"\s*\n\s*#?\s*", " ", open(path, encoding="utf-8").read())  # citations wrap lines
          cited += [(os.path.relpath(path, REPO), c) for c in re.findall(r'docs/BENCHMARKS\.md, "([^"]+)"', text)]
  assert cited and all(c in headings for _, c in cited), [x for x in cited if x[1] not in headings]
