"""Checks on a user's regular expression before it is compiled into a token automaton.

outlines-core compiles with Rust's `regex` crate into a DFA. Syntax accepted here is the subset
that Python's `re` parses and that a DFA can express: no look-around, backreferences, atomic
groups or possessive repeats, and no anchors except a leading `^` and a trailing `$` (which
are implied anyway, since the whole output must match). The size check turns the usual cause
of a compile that takes minutes (`.{0,5000}`) into an immediate error.
"""

from __future__ import annotations

try:  # Python 3.11+
    from re import _constants as sre
    from re import _parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants as sre  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

import re

MAX_REGEX_CHARS = 50_000
# Roughly one automaton state per position of the expanded pattern; each state is scanned
# against the whole vocabulary, so compile time grows with this (~10 ms per wide position on
# a 49k vocabulary).
MAX_REGEX_POSITIONS = 2048

_UNSUPPORTED = {
    sre.GROUPREF: "backreferences",
    sre.GROUPREF_EXISTS: "conditional groups",
    sre.ASSERT: "look-ahead/look-behind assertions",
    sre.ASSERT_NOT: "look-ahead/look-behind assertions",
}
for _name, _what in (("ATOMIC_GROUP", "atomic groups"),
                     ("POSSESSIVE_REPEAT", "possessive repeats")):
    if hasattr(sre, _name):
        _UNSUPPORTED[getattr(sre, _name)] = _what
_BEGIN = (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING)
_END = (sre.AT_END, sre.AT_END_STRING)


def check_regex(pattern: object, field: str = "regex") -> str:
    """Validate a pattern and return it without its leading `^` / trailing `$` anchors, and
    with `\\d` meaning the ASCII digits [0-9] (as in JSON Schema; Python's and Rust's `\\d`
    also match other scripts' digits, which a model will happily pick and no JSON or int
    parser outside Python reads). Raises ValueError naming `field` and the problem."""
    if not isinstance(pattern, str):
        raise ValueError(f"{field} must be a string, got {type(pattern).__name__}")
    if len(pattern) > MAX_REGEX_CHARS:
        raise ValueError(f"{field} is {len(pattern)} characters; the limit is {MAX_REGEX_CHARS}")
    tree = parse(pattern, field)
    items = list(tree.data)
    if items and items[0][0] == sre.AT and items[0][1] in _BEGIN:
        prefix = "^" if pattern.startswith("^") else "\\A" if pattern.startswith("\\A") else None
        if prefix is None:
            raise ValueError(f"{field}: put the leading anchor first in the pattern")
        pattern = pattern[len(prefix):]
        items = items[1:]
    if items and items[-1][0] == sre.AT and items[-1][1] in _END:
        suffix = _trailing_anchor(pattern)
        if suffix is None:
            raise ValueError(f"{field}: put the trailing anchor last in the pattern")
        pattern = pattern[: -len(suffix)]
        items = items[:-1]
    _check_items(items, field)
    if tree.state.flags & (sre.SRE_FLAG_ASCII | sre.SRE_FLAG_LOCALE):
        raise ValueError(f"{field}: the (?a) and (?L) flags are not supported")
    pattern = _ascii_digits(pattern)
    positions = _positions(items)
    if positions > MAX_REGEX_POSITIONS:
        raise ValueError(
            f"{field}: the pattern expands to about {positions} positions, more than the "
            f"{MAX_REGEX_POSITIONS} a token automaton is built for; large bounded repeats "
            "such as {0,5000} are the usual cause (use * or a smaller bound)")
    return pattern


def _ascii_digits(pattern: str) -> str:
    """\\d -> [0-9], except inside a negated class, where narrowing \\d would widen it."""
    out, i, in_class, negated = [], 0, False, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            if pattern[i + 1] == "d" and not negated:
                out.append("0-9" if in_class else "[0-9]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class, negated = True, pattern.startswith("[^", i)
        elif c == "]" and in_class:
            in_class = negated = False
        out.append(c)
        i += 1
    return "".join(out)


def parse(pattern: str, field: str):
    try:
        return sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise ValueError(f"{field}: invalid regular expression: {exc}") from None


def _trailing_anchor(pattern: str) -> str | None:
    for suffix in ("\\Z", "$"):
        if pattern.endswith(suffix):
            # An odd number of backslashes before it would make it a literal.
            head = pattern[: -len(suffix)]
            if (len(head) - len(head.rstrip("\\"))) % 2 == 0:
                return suffix
    return None


def _check_items(items, field: str) -> None:
    for op, arg in items:
        if op in _UNSUPPORTED:
            raise ValueError(f"{field}: {_UNSUPPORTED[op]} are not supported")
        if op == sre.AT:
            raise ValueError(f"{field}: anchors and word boundaries are only supported as a "
                             "leading ^ and a trailing $")
        for sub in _children(op, arg):
            _check_items(sub, field)


def _children(op, arg) -> list:
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT) or op == getattr(sre, "POSSESSIVE_REPEAT", None):
        return [list(arg[2])]
    if op == sre.SUBPATTERN:
        return [list(arg[3])]
    if op == sre.BRANCH:
        return [list(b) for b in arg[1]]
    if op == getattr(sre, "ATOMIC_GROUP", None):
        return [list(arg)]
    return []


def _positions(items) -> int:
    """A size estimate: positions of the pattern with every repeat unrolled."""
    total = 0
    for op, arg in items:
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            lo, hi, sub = arg
            inner = _positions(list(sub))
            copies = lo + 1 if hi == sre.MAXREPEAT else hi
            total += inner * max(copies, 1)
        elif op == sre.SUBPATTERN:
            total += _positions(list(arg[3]))
        elif op == sre.BRANCH:
            total += sum(_positions(list(b)) for b in arg[1])
        else:
            total += 1
    return total


# -- patterns inside JSON strings -------------------------------------------------------------

# Characters a JSON string may not contain raw: the quote, the backslash, control characters.
_JSON_UNSAFE = '"\\\\\\x00-\\x1F\\x7F'
_JSON_SAFE_ANY = f"[^{_JSON_UNSAFE}]"
_ESCAPE_OUTSIDE = {"D": f"[^0-9{_JSON_UNSAFE}]", "W": f"[^\\w{_JSON_UNSAFE}]",
                   "S": f"[^\\s{_JSON_UNSAFE}]", "s": "[ ]"}


def json_string_pattern(pattern: str, field: str) -> str:
    """A JSON Schema `pattern` rewritten to match only text that can sit raw between the
    quotes of a JSON string: `.`, negated classes and \\D \\W \\S exclude the quote, the
    backslash and control characters, and \\s becomes a space. A pattern that can still match
    one of those (a literal quote, say) is refused."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if not in_class and nxt in _ESCAPE_OUTSIDE:
                out.append(_ESCAPE_OUTSIDE[nxt])
            elif in_class and nxt == "s":
                out.append(" ")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if in_class:
            in_class = c != "]"
            out.append(c)
        elif c == "[":
            in_class = True
            if pattern.startswith("[^", i):
                out.append("[^" + _JSON_UNSAFE)
                i += 2
                continue
            out.append(c)
        elif c == ".":
            out.append(_JSON_SAFE_ANY)
        else:
            out.append(c)
        i += 1
    rewritten = check_regex("".join(out), field)
    if _can_match_unsafe(list(parse(rewritten, field).data)):
        raise ValueError(f"{field}: the pattern can match a quote, a backslash or a control "
                         "character, which a JSON string must escape")
    return rewritten


_UNSAFE_CODES = (*range(0x20), 0x22, 0x5C, 0x7F)


def _unsafe_char(code: int) -> bool:
    return code in _UNSAFE_CODES


def _can_match_unsafe(items) -> bool:
    for op, arg in items:
        if op == sre.LITERAL and _unsafe_char(arg):
            return True
        if op in (sre.NOT_LITERAL, sre.ANY):
            return True
        if op == sre.IN and _set_has_unsafe(arg):
            return True
        if any(_can_match_unsafe(sub) for sub in _children(op, arg)):
            return True
    return False


def _set_has_unsafe(members) -> bool:
    if members and members[0][0] == sre.NEGATE:
        # A negated set is safe when it excludes every unsafe character.
        return not all(_set_contains(members[1:], code) for code in _UNSAFE_CODES)
    return any(_set_contains(members, code) for code in _UNSAFE_CODES)


def _set_contains(members, code: int) -> bool:
    char = chr(code)
    for op, arg in members:
        if op == sre.LITERAL and arg == code:
            return True
        if op == sre.RANGE and arg[0] <= code <= arg[1]:
            return True
        if op == sre.CATEGORY:
            probe = {sre.CATEGORY_DIGIT: r"\d", sre.CATEGORY_NOT_DIGIT: r"\D",
                     sre.CATEGORY_SPACE: r"\s", sre.CATEGORY_NOT_SPACE: r"\S",
                     sre.CATEGORY_WORD: r"\w", sre.CATEGORY_NOT_WORD: r"\W"}.get(arg)
            if probe is None or re.fullmatch(probe, char):
                return True
    return False
