"""Which hosts and slots a multi-node job uses: DeepSpeed's hostfile and its ``--include`` / ``--exclude`` /
``--num_nodes`` / ``--num_gpus`` filters. Pure: text and flags in, an ordered ``{host: [slot, ...]}`` out, and a
``ValueError`` naming the line or flag for bad input."""

from __future__ import annotations

import re
from typing import Optional

Resources = dict[str, list[int]]  # host -> slot indices (GPUs) it contributes, in hostfile order

_LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\d+)$")
# a host name reaches ssh/pdsh arguments and remote shells: letters, digits, '.', '_', '-', not led by '-' (which
# ssh would read as an option); no ',' (pdsh's list separator), ':' or '@' (the --include/--exclude syntax)
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
MAX_SLOTS = 4096  # per host; a larger count is a typo, not a machine


def parse_hostfile(text: str, source: str = "hostfile") -> Resources:
    """``worker-0 slots=8`` per line; ``#`` starts a comment; blank lines are skipped."""
    hosts: Resources = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{source}:{number}: '{raw.strip()}' is not 'HOST slots=N'")
        host, slots = match["host"], int(match["slots"])
        if not _HOST.fullmatch(host):
            raise ValueError(
                f"{source}:{number}: host {host!r} is not a plain host name (letters, digits, '.', '_' and '-', not "
                "starting with '-')"
            )
        if slots > MAX_SLOTS:
            raise ValueError(f"{source}:{number}: host '{host}' has slots={slots}; at most {MAX_SLOTS} per host")
        if host in hosts:
            raise ValueError(f"{source}:{number}: host '{host}' is listed twice")
        if slots < 1:
            raise ValueError(f"{source}:{number}: host '{host}' has slots={slots}; it needs at least 1")
        hosts[host] = list(range(slots))
    if not hosts:
        raise ValueError(f"{source}: no hosts (expected lines like 'worker-0 slots=8')")
    return hosts


def parse_filter(spec: str, hosts: Resources, flag: str) -> Resources:
    """``worker-0:0,1@worker-1``: hosts separated by ``@``, each optionally followed by ``:`` and slot indices
    (none: all its slots). Every host and slot must exist in ``hosts``."""
    chosen: Resources = {}
    for part in spec.split("@"):
        host, _, slots = part.partition(":")
        if host not in hosts:
            raise ValueError(f"{flag} '{spec}': unknown host '{host}' (the hostfile has {', '.join(hosts)})")
        if not slots:
            chosen[host] = list(hosts[host])
            continue
        try:
            indices = [int(s) for s in slots.split(",")]
        except ValueError:
            raise ValueError(f"{flag} '{spec}': slots of '{host}' must be integers, got '{slots}'") from None
        for index in indices:
            if index not in hosts[host]:
                raise ValueError(
                    f"{flag} '{spec}': slot {index} of host '{host}' is out of range (it has slots "
                    f"0-{len(hosts[host]) - 1})"
                )
        kept = chosen.setdefault(host, [])
        for index in indices:
            if index not in kept:
                kept.append(index)
    return chosen


def check_resource_flags(
    include: Optional[str], exclude: Optional[str], num_nodes: Optional[int], num_gpus: Optional[int]
) -> None:
    """DeepSpeed's rule, with or without a hostfile: ``--include`` / ``--exclude`` choose hosts and slots, so neither
    goes with the other or with ``--num_nodes`` / ``--num_gpus`` (a ``ValueError`` naming the flags)."""
    for flag, spec in (("--include", include), ("--exclude", exclude)):
        if spec is not None and not spec.strip():
            raise ValueError(f"{flag} is empty: name hosts (and slots), e.g. 'worker-0:0,1@worker-1', or drop it")
    if include and exclude:
        raise ValueError("--include and --exclude cannot be used together")
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise ValueError("--include/--exclude choose the hosts and slots; drop --num_nodes/--num_gpus")


def filter_resources(hosts: Resources, include: Optional[str] = None, exclude: Optional[str] = None) -> Resources:
    """``hosts`` after ``--include`` (only what it names, slots in order) or ``--exclude`` (all but what it names;
    a host left without slots is dropped, so the answer may be empty)."""
    check_resource_flags(include, exclude, None, None)
    if include:
        chosen = parse_filter(include, hosts, "--include")
        return {host: sorted(chosen[host]) for host in hosts if host in chosen}
    if not exclude:
        return {host: list(slots) for host, slots in hosts.items()}
    dropped = parse_filter(exclude, hosts, "--exclude")
    kept = {host: [s for s in slots if s not in dropped.get(host, [])] for host, slots in hosts.items()}
    return {host: slots for host, slots in kept.items() if slots}


def select_resources(
    hosts: Resources,
    include: Optional[str] = None,
    exclude: Optional[str] = None,
    num_nodes: Optional[int] = None,
    num_gpus: Optional[int] = None,
) -> Resources:
    """The hosts and slots the job runs on, in hostfile order (DeepSpeed's rules: ``--include`` keeps only what
    it names, ``--exclude`` drops what it names; otherwise the first ``--num_nodes`` hosts and the first
    ``--num_gpus`` slots of each)."""
    check_resource_flags(include, exclude, num_nodes, num_gpus)
    if include or exclude:
        kept = filter_resources(hosts, include, exclude)
        if not kept:
            raise ValueError(f"--exclude '{exclude}' leaves no slot to run on")
        return kept
    chosen = dict(hosts)
    if num_nodes is not None:
        if not 1 <= num_nodes <= len(hosts):
            raise ValueError(f"--num_nodes {num_nodes}: the hostfile has {len(hosts)} host(s)")
        chosen = dict(list(hosts.items())[:num_nodes])
    if num_gpus is not None:
        short = [f"{host} (slots={len(slots)})" for host, slots in chosen.items() if len(slots) < num_gpus]
        if num_gpus < 1 or short:
            raise ValueError(f"--num_gpus {num_gpus} is more than the slots of {', '.join(short) or 'any host'}")
        chosen = {host: slots[:num_gpus] for host, slots in chosen.items()}
    return chosen
