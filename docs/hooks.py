"""mkdocs hook: generates the autocast op reference from `fmp.autocast.CUDA` and `fmp.autocast.CPU`.

`docs/reference/autocast-ops.md` holds the page's prose and the marker `<!-- autocast-op-tables -->`;
at build time the marker becomes one section per device, one list of ops per `Cast`, read from the
rule tables themselves, so the page follows the code.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- autocast-op-tables -->"

_DEVICES = (("CUDA", '`rules="cuda"`, the default on every device'), ("CPU", '`rules="cpu"`'))
_HEADINGS = {
    "LOWER": ("Ops cast to the autocast dtype", "floating inputs cast to float16 or bfloat16."),
    "FLOAT32": ("Ops cast to float32", "floating inputs cast to float32."),
    "PROMOTE": ("Ops cast to the widest input dtype", "every input cast to the widest floating dtype among them."),
    "FLOAT32_UNLESS_FLOAT16": ("Ops refused under float16", "an error under float16, float32 otherwise."),
}


def op_tables() -> str:
    """The markdown of every rule set: per device, per `Cast`, the sorted op names."""
    from fmp.autocast import CPU
    from fmp.autocast import CUDA
    from fmp.autocast import Cast

    out: list[str] = []
    for (name, how), rules in zip(_DEVICES, (CUDA, CPU), strict=True):
        out += [f"## {name} (`fmp.autocast.{name}`, {how})", ""]
        out += [f"{len(rules)} ops.", ""]
        for cast in Cast:
            ops = sorted(op for op, rule in rules.items() if rule is cast)
            if not ops:
                continue
            heading, what = _HEADINGS[cast.name]
            out += [f"### {heading} ({name})", "", f"`Cast.{cast.name}`, {len(ops)} ops: {what}", ""]
            out += [", ".join(f"`{op}`" for op in ops), ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Replace the marker on the op reference page with the generated tables."""
    if MARKER in markdown:
        return markdown.replace(MARKER, op_tables())
    return markdown
