"""Checks of the documentation and the source text.

TensorFlow runs only in the subprocess of the README example.

* Nothing describes how the software was developed: no issue numbers, no
  development rounds or sessions, no commit hashes of this repository.
* Every relative link of README.md and docs/ points at an existing file
  (and, for a link into a markdown file, at an existing heading).
* README.md stays a short guide, with the one test command `.ci/run` runs.
* Every module docstring of tf_dct/ is short (MODULE_DOCSTRING_MAX_LINES);
  conventions in detail belong in docs/.
* The Python example of README.md's "Using it" section runs and prints a
  finite loss and a payload smaller than dense's.
"""

from __future__ import annotations

import ast
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

from absl.testing import absltest

ROOT = pathlib.Path(__file__).resolve().parent.parent

README_MAX_LINES = 220
# Source lines a module docstring of tf_dct/ may span, quotes included.
MODULE_DOCSTRING_MAX_LINES = 30
# `.ci/run` runs the README line that starts with this.
CI_COMMAND_PREFIX = 'pip install -e ".[test]" && '
# The README section whose ```python block must run, and what it prints.
EXAMPLE_SECTION = "## Using it"
EXAMPLE_OUTPUT = re.compile(
    r"^loss (?P<loss>\S+), payload (?P<ratio>\S+)x smaller than dense$")
EXAMPLE_TIMEOUT_SECONDS = 300

# Nouns that follow the verb "issue" ("every replica must issue 2
# collectives"), so that use of the word is not taken for an issue number.
_ISSUED_THINGS = (r"(?:collectives?|all-reduces?|all-gathers?|ops?|reads?|"
                  r"writes?|requests?|calls?|rpcs?|steps?|exchanges?|"
                  r"pushes?|messages?|collective)")
# (name, pattern) of a mention of development history.
HISTORY_PATTERNS = [
    ("issue number", re.compile(r"\bissues?\s*#\d+\b", re.IGNORECASE)),
    ("issue number", re.compile(
        rf"\bissue\s+\d+\b(?!\s+{_ISSUED_THINGS}\b)", re.IGNORECASE)),
    ("issue numbers", re.compile(
        r"\bissues\s+\d+(?:\s*(?:,|and|&)\s*#?\d+)+\b", re.IGNORECASE)),
    # A bare "#23": two digits or more, not part of a word ("keras#20585"
    # names an upstream repository's issue), an HTML entity, a URL or a
    # quoted colour code; one digit only after a word that introduces it.
    ("issue reference", re.compile(r"(?<![\w&#/'\"`])#\d{2,}\b(?![\w-])")),
    ("issue reference", re.compile(
        r"\b(?:see|in|from|fix(?:es|ed)?|close[sd]?|resolve[sd]?|pr|bug|"
        r"ticket|pull request)\s+#\d+\b", re.IGNORECASE)),
    ("development round", re.compile(
        r"\bround\s+\d+\b(?!\s+of\s+(?:the\s+)?(?:ring|all-|reduce|gather|"
        r"exchange|tree|loop))(?!\s+(?:decimals?|digits?|places?)\b)",
        re.IGNORECASE)),
    ("development round", re.compile(
        r"\b(?:development|dev|review|coding|work(?:ing)?|feedback|this|"
        r"previous|earlier|prior|last)\s+rounds?\b(?!\s+of\b)",
        re.IGNORECASE)),
    # "session" in lower case only: `tf.compat.v1.Session` is TensorFlow's.
    ("development session", re.compile(
        r"\b(?i:this|previous|last|next|earlier|prior|later|development|dev|"
        r"coding|review|work(?:ing)?|pairing)\s+sessions?\b")),
    ("development session", re.compile(r"\bsessions?\s+\d+\b")),
    ("commit hash", re.compile(
        r"\bcommit(?:s|ted)?\s+(?:in\s+|as\s+)?`?[0-9a-f]{7,40}\b",
        re.IGNORECASE)),
]
# A bare hexadecimal word of commit-hash length with at least one digit
# (so that English words such as "defaced" are not asked about), not a
# "#colour" or a "0x" constant. It counts only if this repository has a
# commit by that name.
HEX_CANDIDATE = re.compile(r"(?<![\w#])(?<!0x)(?=[a-f]*\d)[0-9a-f]{7,40}(?!\w)")


def history_files() -> list[pathlib.Path]:
  """The files that must not mention development history."""
  files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
  files += sorted((ROOT / "docs").rglob("*.md"))
  for room in ("tf_dct", "bench", "models"):
    files += sorted((ROOT / room).rglob("*.py"))
  files += sorted(p for p in (ROOT / "launch").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix != ".pyc")
  return [p for p in files if p.is_file()]


def history_mentions(text: str) -> list[tuple[int, str, str]]:
  """(line, kind, match) of every pattern of HISTORY_PATTERNS in `text`."""
  found = []
  for number, line in enumerate(text.splitlines(), 1):
    for kind, pattern in HISTORY_PATTERNS:
      found += [(number, kind, m.group(0)) for m in pattern.finditer(line)]
  return found


def hex_candidates(text: str) -> set[str]:
  return set(HEX_CANDIDATE.findall(text))


def git_available() -> bool:
  if shutil.which("git") is None:
    return False
  done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-dir"],
                        capture_output=True, check=False)
  return done.returncode == 0


def is_commit(name: str) -> bool:
  """Whether `name` names a commit of this repository (`git cat-file -e`)."""
  done = subprocess.run(
      ["git", "-C", str(ROOT), "cat-file", "-e", f"{name}^{{commit}}"],
      capture_output=True, check=False)
  return done.returncode == 0


def section(markdown: str, heading: str) -> str | None:
  """The text under the line `heading` up to the next heading of its level
  or higher (None if there is no such line). Headings inside fenced code
  blocks do not count."""
  level = len(heading) - len(heading.lstrip("#"))
  lines = markdown.splitlines()
  prose = [line.rstrip() for line in without_code(markdown).splitlines()]
  if heading not in prose:
    return None
  start = prose.index(heading) + 1
  end = len(lines)
  for number in range(start, len(prose)):
    m = re.match(r"(#{1,6})\s", prose[number])
    if m and len(m.group(1)) <= level:
      end = number
      break
  return "\n".join(lines[start:end])


def python_blocks(markdown: str) -> list[str]:
  """The contents of the ```python fenced blocks of `markdown`."""
  return [m.group(1) for m in re.finditer(
      r"^```python[ \t]*\n(.*?)^```[ \t]*$", markdown,
      re.MULTILINE | re.DOTALL)]


def without_code(markdown: str) -> str:
  """`markdown` with fenced code blocks and inline code spans blanked
  (kept as empty lines, so line numbers stay)."""
  out, fence = [], None
  for line in markdown.splitlines():
    marker = re.match(r"\s*(`{3,}|~{3,})", line)
    if fence is None and marker:
      fence = marker.group(1)[0] * 3
      out.append("")
    elif fence is not None:
      if line.strip().startswith(fence):
        fence = None
      out.append("")
    else:
      out.append(re.sub(r"`+[^`]*`+", "``", line))
  return "\n".join(out)


def anchor(heading: str) -> str:
  """GitHub's anchor of a heading's text."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
  """Every heading anchor of a markdown file (repeats get -1, -2, ...)."""
  seen, out = {}, set()
  text = without_code_keep_headings(path.read_text(encoding="utf-8"))
  for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.MULTILINE):
    base = anchor(m.group(1))
    count = seen.get(base, 0)
    seen[base] = count + 1
    out.add(base if count == 0 else f"{base}-{count}")
  return out


def without_code_keep_headings(markdown: str) -> str:
  """`markdown` without its fenced code blocks (whose "#" lines are code);
  inline code stays, since it is part of a heading's anchor text."""
  out, fence = [], None
  for line in markdown.splitlines():
    marker = re.match(r"\s*(`{3,}|~{3,})", line)
    if fence is None and marker:
      fence = marker.group(1)[0] * 3
    elif fence is not None:
      if line.strip().startswith(fence):
        fence = None
    else:
      out.append(line)
  return "\n".join(out)


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def broken_links(path: pathlib.Path) -> list[str]:
  """The relative links of a markdown file that point at nothing."""
  broken = []
  text = without_code(path.read_text(encoding="utf-8"))
  for number, line in enumerate(text.splitlines(), 1):
    for m in LINK.finditer(line):
      target = m.group(1)
      if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, mailto:, ...
        continue
      file_part, _, fragment = target.partition("#")
      dest = (path.parent / file_part).resolve() if file_part else path
      where = f"{path.relative_to(ROOT)}:{number}: {target}"
      if not dest.exists():
        broken.append(f"{where} (no such file)")
      elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
        broken.append(f"{where} (no such heading in {dest.name})")
  return broken


class HistoryTest(absltest.TestCase):
  """No file describes the software's development history."""

  def test_patterns_fire_on_history_and_not_on_legitimate_text(self):
    for text in ("fixed in issue 23", "see issue #23", "(#23)", "Issue 7: x",
                 "see #7", "issues 4 and 7", "done in round 3",
                 "the previous session", "This session adds", "session 2",
                 "after a development round", "commit 1a2b3c4",
                 "committed as 1a2b3c4d"):
      self.assertTrue(history_mentions(text), text)
    for text in ("tf.compat.v1.Session", "with tf.Session() as s",
                 "color '#ff0000' or \"#123456\"", "upstream keras#20585",
                 "every replica must issue 2 collectives",
                 "it issues 3 all-reduces", "round 2 of the ring all-reduce",
                 "round 3 decimals", "round-robin over 4 workers",
                 "rounds up", "2654435761 % (1 << 32)", "0x9e3779b1",
                 "&#123;", "https://example.com/page#12",
                 "the previous round of the exchange"):
      self.assertFalse(history_mentions(text), text)
    self.assertEqual(hex_candidates("a 1a2b3c4 b deadbeef c #1a2b3c4 0x1a2b3c4d"),
                     {"1a2b3c4"})

  def test_no_history_in_docs_and_sources(self):
    files = history_files()
    self.assertGreater(len(files), 50)
    found = []
    for path in files:
      text = path.read_text(encoding="utf-8", errors="replace")
      found += [f"{path.relative_to(ROOT)}:{line}: {kind}: {match!r}"
                for line, kind, match in history_mentions(text)]
    self.assertEmpty(found, "development history mentioned:\n" + "\n".join(found))

  def test_no_commit_hashes_of_this_repository(self):
    if not git_available():
      self.skipTest("git or the repository's history is not available")
    where = {}
    for path in history_files():
      text = path.read_text(encoding="utf-8", errors="replace")
      for name in hex_candidates(text):
        where.setdefault(name, str(path.relative_to(ROOT)))
    found = [f"{where[name]}: {name}" for name in sorted(where)
             if is_commit(name)]
    self.assertEmpty(found, "commit hashes mentioned:\n" + "\n".join(found))


class LinksTest(absltest.TestCase):

  def test_anchor_of_a_heading(self):
    self.assertEqual(anchor("Model parallelism: `logical_device(i)`"),
                     "model-parallelism-logical_devicei")
    self.assertEqual(anchor("DCT-MP splits: what `--mp_splits` builds"),
                     "dct-mp-splits-what---mp_splits-builds")

  def test_relative_links_point_at_existing_files(self):
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    broken = [b for page in pages for b in broken_links(page)]
    self.assertEmpty(broken, "broken links:\n" + "\n".join(broken))


def module_docstring_lines(source: str) -> int:
  """How many source lines the module docstring of `source` spans (0: none)."""
  body = ast.parse(source).body
  if (body and isinstance(body[0], ast.Expr)
      and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)):
    return body[0].end_lineno - body[0].lineno + 1
  return 0


class ModuleDocstringTest(absltest.TestCase):

  def test_module_docstring_lines(self):
    self.assertEqual(module_docstring_lines('"""One line."""\nx = 1\n'), 1)
    self.assertEqual(module_docstring_lines('"""A.\n\nB.\n"""\n'), 4)
    self.assertEqual(module_docstring_lines("x = 1\n"), 0)
    self.assertEqual(module_docstring_lines("# c\n\n'''A.\nB.'''\n"), 2)

  def test_library_module_docstrings_are_short(self):
    files = sorted((ROOT / "tf_dct").rglob("*.py"))
    self.assertGreater(len(files), 30)
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in files
            if (n := module_docstring_lines(p.read_text(encoding="utf-8")))
            > MODULE_DOCSTRING_MAX_LINES]
    self.assertEmpty(long, f"module docstrings over {MODULE_DOCSTRING_MAX_LINES} "
                     "lines (move the details to docs/):\n" + "\n".join(long))


class ReadmeTest(absltest.TestCase):

  def test_readme_is_short_and_has_one_ci_command(self):
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    self.assertLessEqual(len(lines), README_MAX_LINES)
    commands = [line for line in lines if line.startswith(CI_COMMAND_PREFIX)]
    self.assertLen(commands, 1, commands)


class ReadmeExampleTest(absltest.TestCase):
  """The README's Python example runs as a user would run it."""

  def test_section_and_blocks(self):
    text = "# T\n## A\n```python\n# not a heading\nx = 1\n```\n### B\ny\n## C\nz\n"
    self.assertEqual(section(text, "## A"),
                     "```python\n# not a heading\nx = 1\n```\n### B\ny")
    self.assertIsNone(section(text, "## D"))
    self.assertEqual(python_blocks(section(text, "## A")),
                     ["# not a heading\nx = 1\n"])
    self.assertEqual(python_blocks("```\nx\n```\n```bash\ny\n```\n"), [])

  def test_using_it_example_runs(self):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    text = section(readme, EXAMPLE_SECTION)
    if text is None:
      self.fail(f"README.md has no section {EXAMPLE_SECTION!r}")
    blocks = python_blocks(text)
    if not blocks:
      self.fail(f"README.md's section {EXAMPLE_SECTION!r} has no ```python "
                "block to run")
    self.assertLen(blocks, 1, f"README.md's section {EXAMPLE_SECTION!r} "
                   "should have one ```python block")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_USE_LEGACY_KERAS", None)  # set by conftest, not by a user
    try:
      done = subprocess.run(
          [sys.executable, "-c", blocks[0]], cwd=ROOT, env=env,
          capture_output=True, text=True, check=False,
          timeout=EXAMPLE_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
      self.fail(f"README.md's {EXAMPLE_SECTION!r} example did not finish in "
                f"{EXAMPLE_TIMEOUT_SECONDS} s")
    report = (f"README.md's {EXAMPLE_SECTION!r} example exited with "
              f"{done.returncode}\nstdout:\n{done.stdout}\nstderr:\n"
              f"{done.stderr[-5000:]}")
    self.assertEqual(done.returncode, 0, report)
    found = [m for m in map(EXAMPLE_OUTPUT.match, done.stdout.splitlines())
             if m]
    self.assertLen(found, 1, "expected one line 'loss <L>, payload <R>x "
                   "smaller than dense'\n" + report)
    loss, ratio = float(found[0]["loss"]), float(found[0]["ratio"])
    self.assertTrue(math.isfinite(loss), f"loss {loss} is not finite\n{report}")
    self.assertGreater(ratio, 1.0, f"payload not smaller than dense\n{report}")


if __name__ == "__main__":
  absltest.main()
