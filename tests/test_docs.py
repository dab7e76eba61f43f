"""The docs: every public name documented, every code block taken from a file, every snippet run.

The site itself is built by `make docs` (`mkdocs build --strict`), which `make test` runs first.
"""

from __future__ import annotations

import importlib
import re
import runpy
import types
from pathlib import Path

import pytest
import torch

import fmp._scaler

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SNIPPETS = ROOT / "examples" / "snippets"
# One reference page per public namespace.
PAGES = {
    "fmp": "fmp.md",
    "fmp.autocast": "autocast.md",
    "fmp.optim": "optim.md",
    "fmp.optim.schedule": "schedule.md",
    "fmp.nn": "nn.md",
    "fmp.remat": "remat.md",
    "fmp.debug": "debug.md",
    "fmp.interop": "interop.md",
    "fmp.serialization": "serialization.md",
    "fmp.distributed": "distributed.md",
    "fmp.fp8": "fp8.md",
}
# Module-level values (constants, type aliases) carry no `__doc__` of their own: their documentation
# is the attribute docstring next to the assignment, which mkdocstrings renders.
VALUES = (str, int, float, tuple, torch.dtype, types.MappingProxyType, types.UnionType, types.GenericAlias)


def directives(page: str) -> set[str]:
    return set(re.findall(r"^::: (\S+)$", (DOCS / "reference" / page).read_text(), re.MULTILINE))


def public_names() -> list[tuple[str, str]]:
    return [(ns, name) for ns in PAGES for name in importlib.import_module(ns).__all__]


def attribute_docstring(obj_module: str, name: str) -> str:
    """The string literal right after `name = ...` (or `name: T = ...`) in the module that defines it."""
    source = Path(importlib.import_module(obj_module).__file__ or "").read_text()
    match = re.search(rf'^{name}\b[^\n]*=.*?\n(?:\)\n)?"""(.+?)"""', source, re.MULTILINE | re.DOTALL)
    return match.group(1).strip() if match else ""


def defining_module(ns: str, name: str) -> str:
    """The private module a namespace imports `name` from (read from its `__init__`)."""
    init = Path(importlib.import_module(ns).__file__ or "").read_text()
    match = re.search(rf"^from (\S+) import {name}$", init, re.MULTILINE)
    return match.group(1) if match else ns


def test_every_namespace_has_its_page_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for ns, page in PAGES.items():
        assert f"reference/{page}" in nav, ns
        assert f"::: {ns}" in (DOCS / "reference" / page).read_text(), ns


@pytest.mark.parametrize(("ns", "name"), public_names(), ids=lambda v: v)
def test_every_public_name_has_a_docstring_and_a_reference_entry(ns: str, name: str) -> None:
    obj = getattr(importlib.import_module(ns), name)
    if isinstance(obj, types.ModuleType):
        assert obj.__name__ in PAGES, f"{ns}.{name}: a public module with no reference page"
        doc = obj.__doc__
    else:
        assert f"{ns}.{name}" in directives(PAGES[ns]), f"{ns}.{name} has no `::: {ns}.{name}` in {PAGES[ns]}"
        if isinstance(obj, VALUES) or getattr(obj, "__module__", None) in ("typing", "collections.abc", "types"):
            doc = attribute_docstring(defining_module(ns, name), name)
        else:
            doc = obj.__doc__
    assert doc and doc.strip(), f"{ns}.{name} has no docstring"


def test_every_python_block_in_the_docs_is_included_from_a_file() -> None:
    pages = [*DOCS.rglob("*.md"), ROOT / "README.md"]
    found = 0
    for page in pages:
        text = page.read_text()
        for block in re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
            if page.name == "README.md":
                continue  # README cannot include files: its one block is checked against the quickstart below
            lines = block.strip().splitlines()
            assert len(lines) == 1 and re.fullmatch(r'--8<-- "examples/snippets/\w+\.py(:[\w-]+)?"', lines[0]), (
                f"{page.relative_to(ROOT)}: a python block written inline, not included from examples/snippets/:\n"
                f"{block}"
            )
            path, _, section = lines[0].split('"')[1].partition(":")
            source = (ROOT / path).read_text()
            assert not section or f"# --8<-- [start:{section}]" in source, f"{path} has no section {section}"
            found += 1
    assert found >= 10


def test_the_readme_quickstart_is_the_snippet_file() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert blocks == [(SNIPPETS / "quickstart.py").read_text()]


@pytest.mark.parametrize("snippet", sorted(p.name for p in SNIPPETS.glob("*.py")))
def test_snippet_runs(snippet: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Eager here: the snippets show how to call the API, and a compile costs 20 s a step
    # (test_examples.py runs the quickstart compiled).
    monkeypatch.setattr(torch, "compile", lambda fn=None, **options: fn)
    monkeypatch.chdir(tmp_path)
    state = torch.get_rng_state()
    try:
        torch.manual_seed(0)
        runpy.run_path(str(SNIPPETS / snippet), run_name="__main__")
    finally:
        torch.set_rng_state(state)
        # A GradientBuffer compiles its unscale lazily and keeps it: drop the one made while
        # torch.compile was patched out, or later tests in this process would get it uncompiled.
        fmp._scaler._compiled.cache_clear()


FOLDERS = sorted(
    [path.parent for path in (ROOT / "fmp").glob("*/__init__.py")]
    + [ROOT / "fmp", ROOT / "benchmarks", ROOT / "examples", ROOT / "tests"],
)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda folder: str(folder.relative_to(ROOT)))
def test_every_folder_has_a_readme_that_names_what_it_holds(folder: Path) -> None:
    # A newcomer finds a concern by its folder: its README names every module, script and subfolder,
    # so a file added without a line there fails here. Test files are named by their concern, not listed.
    readme = (folder / "README.md").read_text()
    held = [path.name for path in folder.glob("*.py") if not path.name.startswith(("__init__", "test_"))]
    held += [f"{path.name}/" for path in folder.iterdir() if path.is_dir() and not path.name.startswith((".", "_"))]
    missing = [name for name in held if f"`{name}`" not in readme]
    assert not missing, f"{folder.relative_to(ROOT)}/README.md does not name {missing}"
