"""Regular expressions a config matches against every module name (``tensor_parallel.partition_config.layer_specs``),
bounded before they run.

Python's ``re`` backtracks and has no time limit: ``.*`` written twelve times then ``Z`` takes minutes on a
40-character module name without a ``Z``, and an unbounded repeat of something that can match in two ways takes
exponential time. So a pattern is refused by its cost, an upper bound on the number of ways a backtracking match of
a name of ``length`` characters can proceed (:func:`match_ways`):

- a character, a class, an anchor: 1 way; a sequence: the product of its parts'; alternatives: their sum;
- a repeat of ``lo..hi`` copies of a body of ``w`` ways: ``sum over c in lo..min(hi, length) of w^c``: ``length``
  + 1 for ``.*`` (where to stop), ``w^hi`` for a bounded repeat of an ambiguous body (``(.*){1,40}`` is 40 ``.*``);
- an unbounded repeat of an ambiguous body (``(.*.*)*``, ``(a|ab)*``): exponential in the length, refused by shape.

A pattern is accepted when its ways for a name of :data:`NAME_LENGTH` characters stay within :data:`MAX_WAYS`
(three ``.*`` in a row do; four do not), and each match checks the bound again for the name it is given, so no
accepted pattern is slow on any module name.
"""

from __future__ import annotations

import functools

try:  # Python >= 3.11 names them privately
    import re._constants as sre_constants
    import re._parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants
    import sre_parse

MAX_PATTERN_LENGTH = 512
NAME_LENGTH = 128  # the name length a pattern is checked at when the config is read (module names are shorter)
MAX_WAYS = 10_000_000  # about a second of the slowest kind of backtracking (alternatives) in CPython's re
_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, getattr(sre_constants, "POSSESSIVE_REPEAT", None))


class PatternCostError(ValueError):
    """A pattern could take too long to match a module name."""


def check_pattern(pattern: str, length: int = NAME_LENGTH) -> None:
    """Refuse ``pattern`` (a ``ValueError`` naming it and the fix) unless it compiles, is at most
    :data:`MAX_PATTERN_LENGTH` characters, has no unbounded repeat of an ambiguous body and its ways for a name of
    ``length`` characters stay within :data:`MAX_WAYS`."""
    import re

    if not isinstance(pattern, str):
        raise ValueError(f"pattern {pattern!r} must be a string, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise PatternCostError(
            f"pattern {pattern[:40]!r}... is {len(pattern)} characters long; at most {MAX_PATTERN_LENGTH}"
        )
    try:
        re.compile(pattern)
    except re.error as err:
        raise ValueError(f"pattern {pattern!r} is not a regular expression: {err}") from None
    if _backtracks_without_bound(sre_parse.parse(pattern)):
        raise PatternCostError(
            f"pattern {pattern!r} can take exponential time to match (a repeated group that holds another unbounded "
            "repeat or an alternation, e.g. '(.*.*)*Z'); it is matched against every module name: write it without "
            "the nested repeat, e.g. r'.*\\.q_proj$'"
        )
    ways = match_ways(pattern, length)
    if ways > MAX_WAYS:
        raise PatternCostError(
            f"pattern {pattern!r} can backtrack in more than {MAX_WAYS:.0e} ways on a module name of {length} "
            f"characters ({_describe(ways)}: each unbounded repeat such as '.*' multiplies the ways by the name's "
            "length, a repeated group by its count); it is matched against every module name: use at most three "
            r"unbounded repeats and anchor on the names' dots, e.g. r'.*\.layers\.\d+\.self_attn\.q_proj$'"
        )


def _describe(ways: int) -> str:
    return "more than 1e30" if ways >= _CAP else f"{ways:.2e}"


_CAP = 10**30  # ways are counted up to here: any more is refused alike


@functools.lru_cache(maxsize=1024)
def match_ways(pattern: str, length: int) -> int:
    """An upper bound on the ways a backtracking ``re.match`` of ``pattern`` can proceed on a name of ``length``
    characters (see the module docstring), counted up to 1e30."""
    return _ways(sre_parse.parse(pattern), length)


def _ways(parsed, length: int) -> int:
    total = 1
    for op, argument in parsed:
        total = min(_CAP, total * _node_ways(op, argument, length))
    return total


def _node_ways(op, argument, length: int) -> int:
    if op in _REPEATS:
        lo, hi, body = argument
        hi = min(hi, length + 1)  # a body of width 0 still stops after one empty round
        if lo > hi:
            return 1
        each = _ways(body, length)
        if each == 1:
            return hi - lo + 1
        return min(_CAP, (hi - lo + 1) * _capped_power(each, hi))
    if op is sre_constants.BRANCH:
        return min(_CAP, sum(_ways(alternative, length) for alternative in argument[1]))
    if op is sre_constants.GROUPREF_EXISTS:
        _, yes, no = argument
        return min(_CAP, _ways(yes, length) + (_ways(no, length) if no is not None else 1))
    subpatterns = _subpatterns(argument)
    if not subpatterns:
        return 1
    ways = 1
    for sub in subpatterns:  # a group, an atomic group, a lookaround: its body's ways
        ways = min(_CAP, ways * _ways(sub, length))
    return ways


def _capped_power(base: int, exponent: int) -> int:
    result = 1
    for _ in range(exponent):
        result = min(_CAP, result * base)
        if result == _CAP:
            break
    return result


def _backtracks_without_bound(parsed) -> bool:
    """Whether a parsed regular expression repeats, without bound, something that can itself match in more than one
    way (another unbounded repeat, or alternatives): the shapes whose failing match backtracks exponentially."""
    for op, argument in parsed:
        if op in _REPEATS:
            _, most, body = argument
            if most == sre_constants.MAXREPEAT and _ambiguous(body):
                return True
        if any(_backtracks_without_bound(sub) for sub in _subpatterns(argument)):
            return True
    return False


def _ambiguous(parsed) -> bool:
    for op, argument in parsed:
        if op is sre_constants.BRANCH or (op in _REPEATS and argument[1] == sre_constants.MAXREPEAT):
            return True
        if any(_ambiguous(sub) for sub in _subpatterns(argument)):
            return True
    return False


def _subpatterns(argument) -> list:
    if isinstance(argument, sre_parse.SubPattern):
        return [argument]
    if isinstance(argument, (list, tuple)):
        return [found for item in argument for found in _subpatterns(item)]
    return []


__all__ = ["MAX_PATTERN_LENGTH", "MAX_WAYS", "NAME_LENGTH", "PatternCostError", "check_pattern", "match_ways"]
