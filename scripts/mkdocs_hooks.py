"""MkDocs hook of the documentation site (mkdocs.yml): the BAPOConfig field tables, and TRL-style docstrings rendered.

A page holding the line ``<!-- bapo-config-fields -->`` gets, in its place, one table per group of the fields
BAPOConfig adds to TRL's GRPOConfig: name, type, default and the ``metadata["help"]`` the command line shows. So the
reference cannot drift from the code: it is the code's own text, read at every build.

The docstrings follow TRL's conventions, which mkdocstrings' Google-style parser does not know; :class:`TRLDocstrings`
(a griffe extension, loaded by mkdocs.yml's mkdocstrings options) rewrites them before they are parsed:

* a parameter line ``name (`float`, *optional*, defaults to `0.5`):`` becomes ``name (float):`` (the default column
  comes from the signature); ``` `int` or `None` ``` becomes ``int | None``;
* Hugging Face links (``[`BAPOTrainer`]``, ``[`~trl.GRPOConfig`]``: ``~`` shows the last name only) and Sphinx roles
  (``:class:`BAPOSettings```, ``:func:``, ``:mod:``, ``:meth:``) become links: to the object's entry in this site where
  it has one (an optional cross-reference: code without a link where it has none), to TRL's documentation for
  ``trl.GRPOConfig``/``trl.GRPOTrainer``, and plain code for anything else.

:func:`on_post_page` keeps identifiers in table cells whole (Material lets code break anywhere, which cut the field
names of narrow columns mid-word): they break only after an ``_`` or a ``.``.
"""

from __future__ import annotations

import dataclasses
import html
import re

import griffe

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
    """Markdown: the fields BAPOConfig adds to TRL's GRPOConfig (its own and those it inherits from
    RolloutSettings), one table per option group (:mod:`bapo_trl.trainer.option_groups`, the groups
    ``bapo train --help`` shows), each field with its type, default and help."""
    from trl import GRPOConfig

    from bapo_trl.trainer.bapo_config import BAPOConfig
    from bapo_trl.trainer.option_groups import GROUPS

    trl_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    own = [f for f in dataclasses.fields(BAPOConfig) if f.name not in trl_fields]
    by_name = {f.name: f for f in own}
    out = []
    for title, description, names in GROUPS:
        rows = []
        for name in names:
            field = by_name[name]
            type_name = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
            rows.append(f"| `{name}` | `{_cell(type_name)}` | {_cell(_default(field))} | "
                        f"{_cell(field.metadata.get('help', ''))} |")
        out += [f"### {title.removeprefix('BAPO: ').capitalize()}", "", description, "",
                "| field | type | default | help |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, config_tables())
    return markdown


# --- TRL-style docstrings -------------------------------------------------------------------------------------------

#: TRL names whose documentation page is known: name -> page of https://huggingface.co/docs/trl/ (anchor: the name)
TRL_PAGES = {"trl.GRPOConfig": "grpo_trainer", "trl.GRPOTrainer": "grpo_trainer"}
TRL_DOCS = "https://huggingface.co/docs/trl"
#: ``name (`type`, *optional*, defaults to `x`):`` (a parameter line of a TRL-style docstring)
PARAMETER = re.compile(r"^(?P<indent>[ \t]*)(?P<name>\*{0,2}\w+) \((?P<annotation>.*)\):(?P<rest>.*)$", flags=re.M)
#: ``[`Name`]`` / ``[`~module.Name`]``, not followed by ``(url)`` or ``[ref]`` (a Markdown link already)
HF_LINK = re.compile(r"\[`(?P<name>~?[\w.]+)`\](?![(\[])")
#: ``:class:`Name``` / ``:func:`~module.name``` ...
SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|obj|data|exc|const):`(?P<name>~?[\w.]+)`")


def clean_annotation(annotation: str) -> str:
    """```float`, *optional*, defaults to `0.5``` -> ``float``; ```int` or `None``` -> ``int | None``; an
    annotation without TRL's markup is returned as it is."""
    if "`" not in annotation and "*optional*" not in annotation and "defaults to" not in annotation:
        return annotation
    parts = [part.strip() for part in re.split(r",\s*(?=\*optional\*|defaults? to\b|optional\b)", annotation)]
    type_part = parts[0] if parts and not parts[0].startswith(("*optional*", "default", "optional")) else ""
    type_part = type_part.replace("`", "").strip()
    return re.sub(r"\s+or\s+", " | ", type_part)


def _exports() -> dict[str, str]:
    """bapo_trl's public names (``bapo_trl.BAPOConfig``, imported lazily) -> the module path they are defined at."""
    import bapo_trl

    places = {}
    for name, where in bapo_trl._EXPORTS.items():  # "module" or "module:attribute" (bapo_trl.core.lazy)
        module, _, attribute = where.partition(":")
        places[name] = f"{module}.{attribute or name}"
    return places


def resolve(name: str, obj) -> str | None:
    """The full path of ``name`` as written in ``obj``'s docstring (absolute, relative ``.settings.X``, or a name in
    ``obj``'s scope), or None when it cannot be told."""
    exports = _exports()
    if name.startswith("."):  # relative to the package of obj's module, as an import would be
        module = obj.module
        package = module.path if module.is_package else module.path.rsplit(".", 1)[0]
        dots = len(name) - len(name.lstrip("."))
        package = package.rsplit(".", dots - 1)[0] if dots > 1 else package
        return f"{package}.{name.lstrip('.')}"
    if name.startswith("bapo_trl.") and name[len("bapo_trl."):] in exports:
        return exports[name[len("bapo_trl."):]]
    if name.startswith(("bapo_trl.", "trl.")):
        return name
    try:
        return obj.resolve(name)
    except Exception:  # griffe's NameResolutionError, or a scope it cannot read
        return exports.get(name)


def reference(written: str, obj) -> str:
    """Markdown for a reference written ``written`` (``~`` first: show the last name only) in ``obj``'s docstring."""
    name = written.lstrip("~")
    shown = name.split(".")[-1] if written.startswith("~") else name.lstrip(".")
    target = resolve(name, obj)
    if target in TRL_PAGES:
        return f"[`{shown}`]({TRL_DOCS}/{TRL_PAGES[target]}#{target})"
    if target and target.startswith("bapo_trl."):  # a link where the site documents it, else plain code
        return f'<autoref identifier="{html.escape(target)}" optional><code>{html.escape(shown)}</code></autoref>'
    return f"`{shown}`"


def rewrite_docstring(text: str, obj) -> str:
    """``text`` with TRL's parameter annotations, Hugging Face links and Sphinx roles in mkdocstrings' terms."""

    def parameter(match: re.Match) -> str:
        annotation = clean_annotation(match["annotation"])
        typed = f" ({annotation})" if annotation else ""
        return f"{match['indent']}{match['name']}{typed}:{match['rest']}"

    text = PARAMETER.sub(parameter, text)
    text = HF_LINK.sub(lambda m: reference(m["name"], obj), text)
    return SPHINX_ROLE.sub(lambda m: reference(m["name"], obj), text)


def _objects(obj):
    """``obj`` and every object defined under it (aliases, i.e. imported names, skipped)."""
    yield obj
    for member in list(obj.members.values()):
        if not member.is_alias:
            yield from _objects(member)


class TRLDocstrings(griffe.Extension):
    """Rewrites every docstring of a loaded package (:func:`rewrite_docstring`) before mkdocstrings parses it."""

    def on_package(self, *, pkg, **kwargs) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rewrite_docstring(obj.docstring.value, obj)


# --- Identifiers in table cells -------------------------------------------------------------------------------------

#: Material's ``code { word-break: break-word }`` lets a narrow column cut a name anywhere: a table cell that is one
#: identifier gets the class ``cell-name``, which breaks only where :func:`on_post_page` puts a ``<wbr>`` (after ``_``,
#: and after a ``.`` before a letter).
TABLE_CODE_CSS = "<style>.md-typeset code.cell-name { word-break: normal; overflow-wrap: normal; }</style>"
CELL_IDENTIFIER = re.compile(r"(<td>\s*)<code>([\w.]+)</code>")


def on_post_page(output: str, page, config) -> str:
    def cell(match: re.Match) -> str:
        name = re.sub(r"(_|\.(?=[A-Za-z]))", r"\1<wbr>", match[2])
        return f'{match[1]}<code class="cell-name">{name}</code>'

    output = CELL_IDENTIFIER.sub(cell, output)
    return output.replace("</head>", f"{TABLE_CODE_CSS}</head>", 1)
