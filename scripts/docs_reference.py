"""Writes the generated reference pages of the documentation site (``bash scripts/docs.sh`` runs it first):

- ``config.md``: every key of the config schema (``zeroshard/config/schema.py``), grouped by DeepSpeed's sections, with
  its type, default, what it does (``scripts/config_meanings.toml``: DeepSpeed's meaning, and zeroshard's where it
  adds a key) and zeroshard's status: honoured, satisfied whatever its value (with why), or refused (with why);
- ``cli.md``: the ``zeroshard`` command's subcommands and flags, from their argument parsers.

    python3 scripts/docs_reference.py docs/reference      # write them
    python3 scripts/docs_reference.py --check docs/reference  # exit 1 if they differ from what is there

``tests/unit/test_docs.py`` runs the check, so the pages cannot drift from the code.
"""

from __future__ import annotations

import argparse
import enum
import io
import json
import sys
import typing
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import tomllib
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's zeroshard, whatever else is installed
MEANINGS = ROOT / "scripts" / "config_meanings.toml"


def _sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """(dotted path, section model) for the root and every nested section, in the schema's order."""
    out = [(prefix, model)]
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        if sub is not None:
            out += _sections(sub, f"{prefix}{field.alias or name}.")
    return out


def _section_type(annotation: Any):
    for t in [annotation, *typing.get_args(annotation)]:
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _type_name(annotation: Any) -> str:
    """A type as a config writer reads it: ``int or "auto" or null``, ``"mean" or "sum"``, ``list of str``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        return " or ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "object"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " or ".join(json.dumps(m.value) for m in annotation)
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "{...}" if isinstance(value, BaseModel) else json.dumps(value)
    value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, float) and value == int(value) and abs(value) >= 1e6:
        return f"{value:.0e}"
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def rows() -> list[dict]:
    """One row per key of the schema (sections included), with everything the page shows."""
    from zeroshard.config.schema import REMOVED_IN_DEEPSPEED, UNSUPPORTED_FEATURE_BLOCKS, ZeroshardConfig

    meanings = tomllib.loads(MEANINGS.read_text())
    out = []
    for prefix, model in _sections(ZeroshardConfig):
        for name, field in model.model_fields.items():
            key = f"{prefix}{field.alias or name}"
            extra = field.json_schema_extra or {}
            if "refused" in extra:
                status = f"refused unless the default: {extra['refused']}"
            elif "satisfied" in extra:
                status = f"satisfied whatever its value: {extra['satisfied']}"
            elif "warned" in extra:
                status = f"accepted, not acted on (warned unless the default): {extra['warned']}"
            elif key in REMOVED_IN_DEEPSPEED:
                status = f'refused (DeepSpeed 0.19 removed {REMOVED_IN_DEEPSPEED[key]}); warned when "enabled": false'
            elif key in UNSUPPORTED_FEATURE_BLOCKS:
                status = "refused when enabled (a DeepSpeed feature zeroshard does not implement)"
            else:
                status = "honoured"
            if field.alias and field.alias != name:
                status += f" (also accepted as `{name}`)"
            out.append({"section": prefix.rstrip(".") or "top level", "key": key, "type": _type_name(field.annotation),
                        "default": _default(field), "meaning": meanings.get(key, ""), "status": status})  # fmt: skip
    return out


def config_page() -> str:
    lines = [
        "# Configuration keys",
        "",
        "Generated by `scripts/docs_reference.py` from the config schema (`zeroshard/config/schema.py`); a test",
        "regenerates it and fails on any difference. Every key DeepSpeed 0.19 documents is here, with zeroshard's",
        "own beside them. Status: **honoured** (does what DeepSpeed documents), **satisfied** (every value is",
        "already what zeroshard does), **accepted, not acted on** (a tuning knob of a mechanism zeroshard replaces:",
        "any value but the default is named in one warning saying why), **refused** (any value but the default is an",
        "error naming the key). A key",
        "the schema does not know is named in a warning and dropped (a misspelling of a known one is an error with",
        "a did-you-mean).",
        "",
    ]
    section = None
    for row in rows():
        if row["section"] != section:
            section = row["section"]
            lines += ["", f"## `{section}`" if section != "top level" else "## Top level", "",
                      "| key | type | default | meaning | status |", "|---|---|---|---|---|"]  # fmt: skip
        cells = [f"`{row['key']}`", f"`{row['type']}`", f"`{row['default']}`", row["meaning"], row["status"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def cli_page() -> str:
    from zeroshard.estimator.cli import build_parser as estimate_parser
    from zeroshard.launcher.cli import build_parser
    from zeroshard.launcher.convert import convert_main

    parts = ["# Command line", "", "Generated by `scripts/docs_reference.py` from the commands' own parsers.", ""]
    helps = [("zeroshard", build_parser().format_help()), ("zeroshard estimate", estimate_parser().format_help())]
    out = io.StringIO()
    with redirect_stdout(out):
        try:
            convert_main(["--help"])
        except SystemExit:
            pass
    helps.insert(1, ("zeroshard convert", out.getvalue()))
    for title, text in helps:
        parts += [f"## `{title}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    pages = {"config.md": config_page(), "cli.md": cli_page()}
    stale = []
    for name, text in pages.items():
        path = Path(args.directory) / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
    if stale:
        print(f"stale generated pages {stale}: run `python3 scripts/docs_reference.py {args.directory}`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
