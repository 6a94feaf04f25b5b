"""What crosses the sandbox's pipes: one JSON object per line, values inside it tagged. Standard library only: the
trainer imports this file as rlcli.rewards.sandbox.wire, the harness as `wire`, a copy in its working directory.

A value is JSON with tags for what JSON lacks:

    None, bool, str, list, float (inf and nan too)   as JSON
    int                                              a JSON number; past 2**63 {"int": HEX} (no 4300-digit limit)
    bytes                                            {"bytes": BASE64}
    tuple, set, frozenset                            {"tuple": [...]}, {"set": [...]}, {"frozenset": [...]}
    dict                                             {"dict": [[KEY, VALUE], ...]}
    complex                                          {"complex": [REAL, IMAG]}

A subclass goes as its base type (a Counter as a dict, a namedtuple as a tuple, an IntEnum as an int), so the
trainer only ever decodes plain built-in values: nothing the program defined crosses, and no `__eq__` of its making
takes part in a comparison. Anything else (a function, a generator, a Fraction, a value nested past DEPTH) has no
encoding: `tag` raises Unencodable.
"""

from __future__ import annotations

import base64
import json

DEPTH = 100  # nesting levels a value may have
BIG = 1 << 63


class Unencodable(ValueError):
    """The value, or a part of it, has no encoding."""


class Malformed(ValueError):
    """Text that is not a message of this protocol, or not a value `tag` can have written."""


def tag(x, depth=0):
    """`x` as a JSON-ready structure. Raises Unencodable."""
    if x is None or x is True or x is False:
        return x
    if isinstance(x, int):
        x = int.__int__(x)  # the plain int of a subclass, not what its own __int__ says
        return x if -BIG < x < BIG else {"int": hex(x)}
    if isinstance(x, float):
        return float.__float__(x)
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, bytes):
        return {"bytes": base64.b64encode(x).decode()}
    if isinstance(x, complex):
        return {"complex": [float(x.real), float(x.imag)]}
    if depth >= DEPTH:
        raise Unencodable(f"nested deeper than {DEPTH}")
    depth += 1
    if isinstance(x, list):
        return [tag(v, depth) for v in list.__iter__(x)]
    if isinstance(x, tuple):
        return {"tuple": [tag(v, depth) for v in tuple.__iter__(x)]}
    if isinstance(x, frozenset):
        return {"frozenset": [tag(v, depth) for v in frozenset.__iter__(x)]}
    if isinstance(x, set):
        return {"set": [tag(v, depth) for v in set.__iter__(x)]}
    if isinstance(x, dict):
        return {"dict": [[tag(k, depth), tag(v, depth)] for k, v in dict.items(x)]}
    raise Unencodable(f"a {type(x).__name__} has no encoding")


def untag(x, depth=0):
    """The value of `tag`'s structure (as json.loads gives it back). Raises Malformed."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if depth > DEPTH:
        raise Malformed(f"nested deeper than {DEPTH}")
    depth += 1
    if isinstance(x, list):
        return [untag(v, depth) for v in x]
    if not isinstance(x, dict) or len(x) != 1:
        raise Malformed(f"not a tagged value: {str(x)[:80]}")
    ((kind, v),) = x.items()
    try:
        if kind == "int" and isinstance(v, str):
            return int(v, 16)
        if kind == "bytes" and isinstance(v, str):
            return base64.b64decode(v, validate=True)
        if kind == "complex" and isinstance(v, list) and len(v) == 2 and all(type(p) is float for p in v):
            return complex(*v)
        if kind == "tuple" and isinstance(v, list):
            return tuple(untag(e, depth) for e in v)
        if kind == "set" and isinstance(v, list):
            return {untag(e, depth) for e in v}
        if kind == "frozenset" and isinstance(v, list):
            return frozenset(untag(e, depth) for e in v)
        if kind == "dict" and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
            return {untag(k, depth): untag(e, depth) for k, e in v}
    except (ValueError, TypeError) as e:  # bad hex or base64, an unhashable key or member
        raise Malformed(f"{kind}: {type(e).__name__}: {str(e)[:80]}") from None
    raise Malformed(f"not a tagged value: {str(x)[:80]}")


def message(**fields) -> bytes:
    """One protocol message: a JSON object on one line."""
    return (json.dumps(fields, separators=(",", ":")) + "\n").encode()


def parse(line: bytes) -> dict:
    """A message line back as its fields. Raises Malformed."""
    try:
        fields = json.loads(line)
    except (ValueError, RecursionError) as e:  # bad JSON (UnicodeDecodeError is a ValueError), nested past the stack
        raise Malformed(f"not JSON: {str(e)[:80]}") from None
    if not isinstance(fields, dict):
        raise Malformed("not a JSON object")
    return fields
