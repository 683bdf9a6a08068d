"""MkDocs hook of the documentation site (mkdocs.yml): writes the BAPOConfig field tables from the fields' own help.

A page holding the line ``<!-- bapo-config-fields -->`` gets, in its place, one table per group of the fields
BAPOConfig adds to TRL's GRPOConfig: name, type, default and the ``metadata["help"]`` the command line shows. So the
reference cannot drift from the code: it is the code's own text, read at every build.
"""

from __future__ import annotations

import dataclasses

MARKER = "<!-- bapo-config-fields -->"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return f"`{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{field.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def config_tables() -> str:
    """Markdown: the fields BAPOConfig declares (the search) and those it inherits from RolloutSettings (where
    batches come from), each with its type, default and help."""
    from trl import GRPOConfig

    from bapo_trl.rollout.settings import RolloutSettings
    from bapo_trl.trainer.bapo_config import BAPOConfig

    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    rollout = {f.name for f in dataclasses.fields(RolloutSettings)}
    groups = {"The bound search (`BAPOConfig`)": [], "Where batches come from (`RolloutSettings`)": []}
    for field in dataclasses.fields(BAPOConfig):
        if field.name in inherited and field.name not in rollout:
            continue
        group = "Where batches come from (`RolloutSettings`)" if field.name in rollout else (
            "The bound search (`BAPOConfig`)")
        type_name = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        groups[group].append(f"| `{field.name}` | `{_cell(type_name)}` | {_cell(_default(field))} | "
                             f"{_cell(field.metadata.get('help', ''))} |")
    out = []
    for title, rows in groups.items():
        out += [f"### {title}", "", "| field | type | default | help |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, config_tables())
    return markdown
