"""Writes ``constraints.txt``: the exact versions of zeroshard's test environment (the ``test`` and ``docs`` extras and
everything they pull in, torch included), read from the packages installed now. Run it after the suite passed with them:

    python3 scripts/freeze_constraints.py > constraints.txt

``scripts/setup.sh`` installs with these pins; ``scripts/test.sh --latest`` ignores them (torch stays held) to test
the newest versions the extras allow.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys

from packaging.requirements import Requirement


def _closure(root: str, extras: set[str]) -> dict[str, str]:
    """Installed name -> version for ``root[extras]`` and everything it requires, as pip would resolve markers."""
    found: dict[str, str] = {}
    pending = [(root, frozenset(extras))]
    while pending:
        name, wanted = pending.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement whose marker excludes this platform, or an optional one not installed
        key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if key in found and not wanted:
            continue
        found[key] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            environments = [{"extra": extra} for extra in wanted] or [{"extra": ""}]
            if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
                pending.append((requirement.name, frozenset(requirement.extras)))
    return found


def main() -> None:
    pins = _closure("zeroshard", {"test", "docs"})
    pins.pop("zeroshard", None)
    sys.stdout.write("# written by scripts/freeze_constraints.py from the environment the whole suite passed in\n")
    for name in sorted(pins):
        sys.stdout.write(f"{name}=={pins[name].split('+')[0]}\n")  # torch's local wheel: 2.13.0, not 2.13.0+cpu


if __name__ == "__main__":
    main()
