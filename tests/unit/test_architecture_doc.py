"""docs/architecture.md cannot go stale silently: every path it gives exists, every file its rooms table
lists is in that room, and every code name it quotes (a function, class, method, attribute or config field,
in backticks) is defined somewhere in the project's code."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
CODE = ("operators", "pipelines", "benchmarks")

# Backticked words on the page that are not the project's code names: a row's prompt and group ids and a
# file a run writes, and the third-party APIs the page names (Ray Data's, vLLM's).
NOT_CODE = {"arith-00158", "s000001-g0000", "step_000001.parquet", "map_batches", "WeightTransferEngine",
            "start_weight_update", "finish_weight_update", "get_weight_version", "init_weight_transfer_engine"}


def quoted(text: str) -> list[str]:
    """What the page puts in backticks (a quote may wrap onto the next line); commands (`streamrl ...`)
    are not code names."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " ")  # the picture has no quotes
    return [t for t in re.findall(r"`([^`]+)`", prose) if not t.startswith("streamrl")]


def defined_names() -> set[str]:
    """Every name the project's code defines: functions, classes, methods, parameters, assigned attributes
    and variables, and annotated fields (pydantic and dataclass fields)."""
    names: set[str] = set()
    for package in CODE:
        for file in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.keyword) and node.arg:
                    names.add(node.arg)
    return names


def test_every_path_on_the_page_exists():
    text = DOC.read_text()
    paths = {word for token in quoted(text) + re.findall(r"\(((?:operators|pipelines|benchmarks|tests|docs)/[^)\s:,]+)",
                                                           text)
             for word in re.findall(r"(?:operators|pipelines|benchmarks|tests|docs)/[\w/.]+", token)}
    paths |= set(re.findall(r"(?<![\w/])((?:operators|pipelines|benchmarks|tests|docs)/[\w/]+\.(?:py|md))", text))
    assert paths, "the page names no path: the check would check nothing"
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/.")).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_file_in_the_rooms_table_is_in_its_room():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    assert len(rows) >= 8, "the rooms table went missing"
    missing = []
    for row in rows:
        room, files = row.split("|")[1].strip().strip("`"), row.split("|")[2]
        for name in re.findall(r"`([\w/]+\.py)`", files):
            if not (ROOT / room / name).is_file():
                missing.append(f"{room}{name}")
    assert not missing, f"the rooms table lists files that are not in their room: {missing}"


def test_every_code_name_on_the_page_is_defined():
    names = defined_names()
    unknown = []
    for token in quoted(DOC.read_text()):
        for word in re.split(r"[\s,/]+", token):
            word = word.strip("().:;")
            if not word or "/" in token or word in NOT_CODE or word.endswith((".py", ".md")):
                continue
            if not re.fullmatch(r"[A-Za-z_][\w.]*(\([^)]*\))?", word):
                continue
            for part in re.sub(r"\(.*\)$", "", word).split("."):
                if part and part not in names and not part.isdigit():
                    unknown.append(f"{part} (in `{token}`)")
    assert not unknown, f"docs/architecture.md quotes names the code does not define: {sorted(set(unknown))}"


def test_the_checker_fails_on_a_stale_name(tmp_path, monkeypatch):
    """The check itself: a page quoting a name nobody defines fails it."""
    page = tmp_path / "architecture.md"
    page.write_text("| `operators/` | `generate.py` |\n" * 8 + "The loop calls `no_such_function_anywhere`.\n")
    monkeypatch.setattr(sys.modules[__name__], "DOC", page)
    try:
        test_every_code_name_on_the_page_is_defined()
    except AssertionError as err:
        assert "no_such_function_anywhere" in str(err)
    else:
        raise AssertionError("a stale name passed the check")


def test_every_module_is_in_a_room_of_the_table():
    """A newcomer finds every module on the page: each folder's row lists all its modules."""
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2]
            for line in DOC.read_text().splitlines() if line.startswith("| `")}
    unlisted = []
    for package in ("operators", "pipelines"):
        for file in sorted((ROOT / package).rglob("*.py")):
            if file.name == "__init__.py":
                continue
            room = file.parent.relative_to(ROOT).as_posix() + "/"
            if f"`{file.name}`" not in rows.get(room, ""):
                unlisted.append(file.relative_to(ROOT).as_posix())
    assert not unlisted, f"modules in no room of docs/architecture.md's table: {unlisted}"
