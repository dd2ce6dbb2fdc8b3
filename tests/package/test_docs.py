"""The docs cannot drift from the code: README.md and docs/*.md are checked here.

- Every Python block of a page is either an example file included verbatim (between
  `<!-- example: examples/X.py -->` and `<!-- /example -->`), run under the command its
  docstring states (`dtrain run -n 2 examples/X.py`) unless RUN_ELSEWHERE names the test
  that runs it, or a self-contained one-process snippet, executed.
- Every `dtrain <command>` and flag of a shell block exists (`dtrain <command> --help`).
- Every dotted `dtrain.X.Y` name resolves (`dtrain.X` as `import dtrain` offers it), and a
  call shown with keyword arguments has them.
- Every ```toml block is a config `dtrain train` accepts; docs/training.md lists every
  config key with its default; relative links lead to files and headings.

After editing an example, `python -m tests.package.test_docs` pastes it into the pages again.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from dtrain.config import load_config
from dtrain.errors import ConfigError
from tests.support.cli import dtrain
from tests.support.paths import ROOT

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
RUN_ELSEWHERE = {
    "examples/data_parallel.py": "tests/launch/test_launcher.py",
    "examples/parameter_server.py": "tests/ps/test_ps.py",
    "examples/bigger_than_a_rank.py": "tests/layouts/test_split_build.py",
}
"""Examples another test already runs (and checks more closely): not run twice."""
SLOW_EXAMPLES = {"examples/context_parallel.py", "examples/tensor_parallel.py",
                 "examples/zero.py"}
"""Examples of 12-15 s each on 2 cores: they run with make test-slow."""
SHELL = {"bash", "sh", "console", "shell"}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    example: str = ""  # the file it includes, if any

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, each with the example file it includes (if any)."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    pending, i = "", 0
    while i < len(lines):
        line = lines[i]
        marker = re.fullmatch(r"\s*<!-- example: (\S+) -->\s*", line)
        if marker:
            pending = marker.group(1)
        elif line.startswith("```"):
            fence = re.match(r"`{3,}", line).group(0)
            lang, start = line[len(fence):].strip(), i + 1
            i += 1
            while i < len(lines) and not lines[i].startswith(fence):
                i += 1
            found.append(Block(page, start, lang, "\n".join(lines[start:i]) + "\n", pending))
            if pending:
                after = lines[i + 1].strip() if i + 1 < len(lines) else ""
                assert after == "<!-- /example -->", (
                    f"{page.name}:{i + 1}: an included example's block ends with "
                    "<!-- /example -->")
            pending = ""
        elif line.strip() and pending:
            raise AssertionError(f"{page.name}:{i + 1}: <!-- example: {pending} --> is not "
                                 "followed by a fenced block")
        i += 1
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
INCLUDED = sorted({b.example for b in ALL_BLOCKS if b.example})
SNIPPETS = [b for b in ALL_BLOCKS if b.lang == "python" and not b.example]


def test_pages_exist_and_open_with_a_paragraph() -> None:
    names = {p.name for p in DOCS.glob("*.md")}
    index = (DOCS / "index.md").read_text()
    for page in PAGES:
        lines = [line for line in page.read_text().splitlines() if line.strip()]
        assert lines[0].startswith("# "), f"{page.name} starts with its title"
        first = lines[1]
        assert not first.startswith(("#", "-", "*", "|", "`", "<", "!", ">")), (
            f"{page.name}: the title is followed by a paragraph saying what the page covers")
        if page.parent == DOCS and page.name != "index.md":
            assert f"]({page.name})" in index, f"docs/index.md does not link {page.name}"
    assert len((ROOT / "README.md").read_text().splitlines()) < 200, "README.md: under 200 lines"
    assert {"index.md", "architecture.md", "training.md"} <= names


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    found = set()
    for title in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M):
        found.add(re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-"))
    return found


def test_links_lead_to_files_and_headings() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)} links to {target}"
            assert file.exists(), f"{where}: no such file"
            if anchor and file.suffix == ".md":
                assert anchor in anchors(file), f"{where}: no such heading"


@pytest.mark.parametrize("example", INCLUDED)
def test_included_example_is_the_file(example: str) -> None:
    text = (ROOT / example).read_text()
    for block in (b for b in ALL_BLOCKS if b.example == example):
        assert block.lang == "python", f"{block.where}: fence it as ```python"
        assert block.text == text, (
            f"{block.where} differs from {example}: run `python -m tests.package.test_docs`")


def test_every_example_is_on_a_page_and_run() -> None:
    files = {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py")}
    assert files - set(INCLUDED) == set(), "examples that no page includes"
    for example, test in RUN_ELSEWHERE.items():
        assert Path(example).name in (ROOT / test).read_text(), f"{test} does not run {example}"


def example_command(example: str) -> list[str]:
    """The `dtrain run ...` command an example's docstring states for itself."""
    text = (ROOT / example).read_text()
    match = re.search(rf"dtrain (run [^`\n]*{re.escape(example)}[^`\n]*)", text)
    assert match, f"{example}: its docstring states `dtrain run -n 2 {example}`"
    return shlex.split(match.group(1))


@pytest.mark.parametrize("example", [
    pytest.param(e, marks=pytest.mark.slow) if e in SLOW_EXAMPLES else e
    for e in INCLUDED if e not in RUN_ELSEWHERE])
def test_example_runs(example: str) -> None:
    # the session's calibration (tests/conftest.py): auto chooses without measuring
    result = dtrain(*example_command(example), cwd=str(ROOT), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[rank0] " in result.stdout, result.stdout


def shell_commands() -> list[tuple[str, list[str], list[str]]]:
    """Each `dtrain` command of a shell block: (where, command path, flags given)."""
    found = []
    for block in (b for b in ALL_BLOCKS if b.lang in SHELL):
        text = block.text.replace("\\\n", " ")
        for n, line in enumerate(text.splitlines()):
            line = re.sub(r"(^|\s)#.*", "", line.removeprefix("$ "))
            tokens = shlex.split(line)
            for i, token in enumerate(tokens):
                module = token == "dtrain.cli" and i > 0 and tokens[i - 1] == "-m"
                if not (token == "dtrain" or token.endswith("/dtrain") or module):
                    continue
                rest = tokens[i + 1:]
                path = rest[:2] if rest[:1] in (["bench"], ["data"]) else rest[:1]
                if path and path[0].startswith("-"):
                    path = []
                flags = []
                for word in rest[len(path):]:
                    if word in ("&&", "|", ";", "-m") or word.endswith(".py"):
                        break  # the script's own arguments, or the next command
                    if word.startswith("-") and word != "-":
                        flags.append(word.split("=")[0])
                found.append((f"{block.where}+{n}", path, flags))
    return found


NAME = re.compile(r"(?<![\w/.-])dtrain(?:\.[A-Za-z_]\w*)+(?![\w/])")  # not "dtrain.x/1"


def dotted_names() -> tuple[dict[str, str], dict[str, str], list[tuple[str, str, list[str]]]]:
    """Names used as attributes of `dtrain`, module paths (imports, `-m`), and calls with
    keywords, each with where it appears."""
    attributes: dict[str, str] = {}
    modules: dict[str, str] = {}
    calls: list[tuple[str, str, list[str]]] = []
    for page in PAGES:
        text = page.read_text()
        for match in NAME.finditer(text):
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            before = text[max(0, match.start() - 7):match.start()]
            if re.search(r"(from |import |-m )$", before):
                modules.setdefault(match.group(0), where)
                continue
            attributes.setdefault(match.group(0), where)
            if text[match.end():match.end() + 1] == "(":
                keywords = _keywords(text, match.end())
                if keywords:
                    calls.append((where, match.group(0), keywords))
    return attributes, modules, calls


def _keywords(text: str, start: int) -> list[str]:
    """The keyword arguments of the call whose `(` is at `start` (top level only)."""
    depth, quote, args, current = 0, "", [], ""
    for c in text[start:]:
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
            if depth == 1:
                continue
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                break
        elif c == "," and depth == 1:
            args.append(current)
            current = ""
            continue
        current += c
    args.append(current)
    return [m.group(1) for a in args if (m := re.match(r"\s*(\w+)\s*=(?!=)", a))]


PROBE = """
import contextlib, importlib, inspect, io, json, sys, traceback
import dtrain
eager = set(vars(dtrain))  # what `import dtrain` defines, before anything else is imported
asked = json.load(sys.stdin)
out = {"names": [], "helps": {}, "snippets": []}


def resolve(dotted):
    parts = dotted.split(".")
    # the first name as `import dtrain` offers it: defined, or the package's lazy names
    obj = getattr(dtrain, parts[1]) if parts[1] in eager else dtrain.__getattr__(parts[1])
    for i, part in enumerate(parts[2:], start=2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not inspect.ismodule(obj):
                raise
            obj = importlib.import_module(".".join(parts[:i + 1]))
    return obj


for name, where in asked["attributes"].items():
    try:
        resolve(name)
    except Exception as exc:
        out["names"].append(f"{where}: {name} does not resolve ({type(exc).__name__}: {exc})")
for name, where in asked["modules"].items():
    try:
        importlib.import_module(name)
    except Exception as exc:
        out["names"].append(f"{where}: module {name} does not import ({exc})")
for where, name, keywords in asked["calls"]:
    try:
        params = inspect.signature(resolve(name)).parameters
    except Exception:
        continue  # reported above
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = [k for k in keywords if k not in params]
        if unknown:
            out["names"].append(f"{where}: {name}() has no keyword {unknown}")

from dtrain.cli import main
for path in asked["helps"]:
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main([*path, "--help"])
        except SystemExit as exc:
            code = exc.code
    out["helps"][" ".join(path)] = [code, text.getvalue()]

for where, code in asked["snippets"]:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, where, "exec"), {"__name__": "__snippet__"})
    except BaseException:
        out["snippets"].append(where + ": " + traceback.format_exc(limit=-3))
    dtrain.shutdown()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    """One fresh interpreter for the checks that need one: the names first (as a user's
    `import dtrain` sees them), then `dtrain <command> --help`, then the snippets."""
    attributes, modules, calls = dotted_names()
    asked = {"attributes": attributes, "modules": modules, "calls": calls,
             "helps": sorted({tuple(path) for _, path, _ in shell_commands()}),
             "snippets": [(b.where, b.text) for b in SNIPPETS]}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            input=json.dumps(asked), timeout=150, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_public_names_resolve(probe: dict) -> None:
    attributes, _, calls = dotted_names()
    assert "dtrain.DataParallel" in attributes and calls
    assert probe["names"] == [], "\n".join(probe["names"])


def test_shell_commands_and_flags_exist(probe: dict) -> None:
    helps = probe["helps"]
    assert {"run", "train", "export", "plan", "bench comm", "bench scaling"} <= set(helps)
    for where, path, flags in shell_commands():
        code, text = helps[" ".join(path)]
        assert code == 0, f"{where}: `dtrain {' '.join(path)}` is not a command"
        known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))
        missing = [flag for flag in flags if flag not in known]
        assert not missing, f"{where}: `dtrain {' '.join(path)}` has no {missing}"


def test_snippets_run(probe: dict) -> None:
    assert SNIPPETS, "no snippets found"
    assert probe["snippets"] == [], "\n".join(probe["snippets"])


def config_module():
    """The module of `dtrain train`'s config dataclasses."""
    return importlib.import_module("dtrain.config")


def test_toml_blocks_are_valid_configs(tmp_path: Path) -> None:
    """Every TOML block is a training config, or a cluster file for `dtrain plan --hardware`."""
    from dtrain.planner.analytic.hardware import hardware

    config = config_module()
    tomls = [b for b in ALL_BLOCKS if b.lang == "toml"]
    assert tomls
    for block in tomls:
        path = tmp_path / "config.toml"
        path.write_text(block.text)
        try:
            if block.text.lstrip().startswith("[hardware]"):
                hardware(str(path))
            else:
                config.load_config(str(path))
        except Exception as exc:
            raise AssertionError(f"{block.where}: {exc}") from None


def test_config_reference_lists_every_key_and_default() -> None:
    """docs/training.md has a table per section: | `key` | `default` | meaning |."""
    config = config_module()
    text = (DOCS / "training.md").read_text()
    sections = re.split(r"^#+ `\[(\w+)\]`.*$", text, flags=re.M)
    documented = {name: body for name, body in zip(sections[1::2], sections[2::2], strict=True)}
    defaults = config.Config()
    for section in dataclasses.fields(config.Config):
        assert section.name in documented, f"docs/training.md: no `[{section.name}]` heading"
        rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", documented[section.name], flags=re.M)
        keys = {f.name: getattr(getattr(defaults, section.name), f.name)
                for f in dataclasses.fields(getattr(defaults, section.name))}
        assert [k for k, _ in rows] == list(keys), (
            f"docs/training.md [{section.name}]: the keys, in the code's order")
        for key, shown in rows:
            value = tomllib.loads(f"v = {shown}")["v"]
            assert value == keys[key], (
                f"docs/training.md [{section.name}] {key}: {shown}, the code {keys[key]!r}")


def test_architecture_lists_the_layers_of_the_code() -> None:
    """docs/architecture.md's layer table: the modules of `dtrain.import_order.LAYERS`, in order."""
    from dtrain.import_order import LAYERS

    text = (DOCS / "architecture.md").read_text()
    rows = re.findall(r"^\| \d+ \| [^|]+ \| ([^|]+) \|", text, flags=re.M)
    documented = [re.findall(r"`([\w.]+)`", row) for row in rows]
    coded = [[name.removeprefix("dtrain.") for name in names] for _, names in LAYERS]
    assert documented == coded, "docs/architecture.md: the layer table differs from LAYERS"


def test_architecture_names_every_module_of_the_tree() -> None:
    """docs/architecture.md's module table: every module under src/dtrain (a package's
    `__init__.py` may go unnamed), and nothing that is not there. In a row, a name without
    a folder is in the folder of the row's first name."""
    src = ROOT / "src" / "dtrain"
    text = (DOCS / "architecture.md").read_text()
    table = text[text.index("## The modules"):]
    table = table[:table.index("\n## ", 4)]
    named: set[str] = set()
    for cell in re.findall(r"^\| (`[^|]+) \|", table, flags=re.M):
        names = re.findall(r"`([\w./]+\.py)`", cell)
        folder = names[0].rpartition("/")[0]
        named |= {name if "/" in name else f"{folder}/{name}".lstrip("/") for name in names}
    tree = {str(p.relative_to(src)) for p in src.rglob("*.py")}
    packages = {name for name in tree if name.endswith("/__init__.py")}
    assert sorted(named - tree) == [], "named in docs/architecture.md but not in the tree"
    assert sorted(tree - packages - named) == [], "in the tree but not in docs/architecture.md"


NOT_YET = {
    "data parallel": ["buffer re-broadcast"],
    "ZeRO": ["a stage per unit", "FP8 gathers run on a GPU"],
    "mixture of experts": ["MTP with V-shaped pipeline schedules",
                           "FP8 routed experts (waits for a GPU)",
                           "a 1F1B all-to-all overlap outside DualPipeV",
                           "ep with compression"],
    "speed": ["graph-traced collectives (tp, cp, MoE are graph breaks)"],
    "long context": ["GPU fused kernels inside the ring",
                     "MoE capacity and balance loss under cp"],
    "pipeline": ["V schedules with live replicas"],
    "parameter server": ["a lost machine's servers replaced by `dtrain run` itself"],
    "collectives": ["CUDA tensors on `shm`"],
    "adapters and preferences": ["PiSSA",
                                 "DPO in pp and cp, without adapters under ZeRO-3 or resumed"],
    "documents and instructions": ["packed documents in a custom module"],
    "memory": ["parameter offload"],
    "checkpoints": ["`copies` with local SGD/DiLoCo"],
    "choosing a layout": ["tp overlap in the cluster model"],
}
"""The features known not done, by README feature-table row: what its "not yet" cell may
list ("; " between features). A feature built leaves this list and the cell together, and
goes to BUILT."""
BUILT = {
    "a multi-host save without a shared filesystem":
        "tests/launch/test_multihost.py::test_a_hosts_lost_folder_is_refilled_from_the_copies_bit_for_bit",
    "`copies` with the parameter server, live replicas":
        "tests/checkpoint/test_live_copies.py::test_dtrain_train_live_replicas_copy_checkpoints_and_resume_from_either_host",
    "`copies` with the parameter server":
        "tests/ps/test_snapshot_copies.py::test_dtrain_train_with_parameter_servers_resumes_after_a_hosts_disk_is_lost",
    "MTP with pp":
        "tests/models/test_deepseek.py::test_deepseek_tiny_in_two_rank_layouts_equals_one_process",
    "resending a push lost with a crashed server":
        "tests/ps/test_ps.py::test_a_push_in_flight_when_its_server_dies_is_applied_once",
}
"""Features once listed as not yet, now built, with the test that shows each working: no
"not yet" cell may name them again."""
STILL_REFUSED = {
    "checkpoints": [["checkpoint.copies=1", "sync.method='diloco'"],
                    ["checkpoint.copies=1", "sync.method='local_sgd'"]],
    "mixture of experts": [["model.arch='llama'", "model.preset='deepseek-tiny'",
                            "parallel.nproc=2", "parallel.pp=2",
                            "parallel.schedule='dualpipev'", "parallel.microbatches=4"]],
}
"""Configs a row's "not yet" features are refused in (a one-line ConfigError): once one is
accepted, the feature is built and the cell is stale."""


def feature_table() -> dict[str, tuple[str, list[str]]]:
    """README's feature table: row (the first cell's words, links dropped) -> (its working
    cell, the features of its "not yet" cell)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| feature | working | not yet |"):].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        feature, working, not_yet = (cell.strip() for cell in line.strip("|").split(" | "))
        name = re.sub(r"\[([^]]+)\]\([^)]*\)", r"\1", feature)
        rows[name] = (working, [f.strip() for f in not_yet.split("; ") if f.strip()])
    return rows


def test_readme_lists_as_not_yet_only_features_known_not_done() -> None:
    """Each "not yet" cell of README's feature table names only features of NOT_YET (a new
    one is added there with it) and none of BUILT, whose tests exist; a row whose features
    a config still refuses (STILL_REFUSED) is refused them yet."""
    rows = feature_table()
    assert set(NOT_YET) <= set(rows), "NOT_YET names a row README's table does not have"
    for row, (_, not_yet) in rows.items():
        unknown = [f for f in not_yet if f not in NOT_YET.get(row, [])]
        assert unknown == [], f"README's {row!r} row lists {unknown} as not yet: built " \
            "(move it to the working cell and to BUILT) or not (add it to NOT_YET)"
    for feature, test in BUILT.items():
        path, _, name = test.partition("::")
        assert f"def {name}(" in (ROOT / path).read_text(), f"{feature}: {test} is gone"
        assert all(feature not in cell for _, cells in rows.values() for cell in cells), \
            f"README lists {feature!r} as not yet: it is built ({test})"
    for row, configs in STILL_REFUSED.items():
        for sets in configs:
            with pytest.raises(ConfigError, match="is not supported yet"):
                load_config(None, sets)
            assert rows[row][1], f"README's {row!r} row: its not-yet cell was emptied"


def sync_examples() -> None:
    """Paste every included example's file between its markers again."""
    for page in PAGES:
        text = page.read_text()
        new = re.sub(
            r"(<!-- example: (\S+) -->\n```python\n).*?(```\n<!-- /example -->)",
            lambda m: m.group(1) + (ROOT / m.group(2)).read_text() + m.group(3),
            text, flags=re.S)
        if new != text:
            page.write_text(new)
            print(f"updated {page.relative_to(ROOT)}")


if __name__ == "__main__":  # python -m tests.package.test_docs: after editing an example
    sync_examples()
