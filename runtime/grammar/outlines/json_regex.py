"""Regular expressions for JSON pieces that outlines-core's schema converter lacks or builds
too large: integer and number ranges, a depth-limited generic JSON value, bounded digits.

Every regex here matches a *subset* of what its JSON Schema allows, never more: the output is
always valid, at worst less varied (numbers have at most 16 digits, ranges with non-integer
bounds are rounded inwards).
"""

from __future__ import annotations

import math

# Digits in the integer part, digits after the point, digits of an exponent. Unbounded digit
# runs let a model write numbers until max_new_tokens; these bounds stop that cheaply.
MAX_INT_DIGITS = 16
MAX_FRACTION_DIGITS = 16
MAX_EXPONENT_DIGITS = 2  # 1e99 at most: every JSON parser reads it as a finite double
_MAX_MAGNITUDE = 10 ** MAX_INT_DIGITS - 1

STRING_CHAR = r'(?:[^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'
STRING = f'"{STRING_CHAR}*"'
# A string whose length is bounded, outside any object or array: the same characters, but a
# quote inside it is written `\u0022` rather than `\"` (the same JSON value). outlines-core
# also builds the automaton that searches for the regex anywhere in a text; there every raw
# quote inside the string could be the opening one of a new match, and tracking those for
# every length up to the bound grows the automaton exponentially (maxLength 20: minutes).
# Inside a container a new match must start with `{"` or `["`, which no string's body holds.
TOP_LEVEL_STRING_CHAR = r'(?:[^"\\\x00-\x1F\x7F-\x9F]|\\[\\/bfnrt]|\\u0022)'
FRACTION = rf"\.[0-9]{{1,{MAX_FRACTION_DIGITS}}}"
INTEGER = rf"-?(?:0|[1-9][0-9]{{0,{MAX_INT_DIGITS - 1}}})"
NUMBER = rf"{INTEGER}(?:{FRACTION})?(?:[eE][+-]?[0-9]{{1,{MAX_EXPONENT_DIGITS}}})?"
PRIMITIVE = f"(?:{STRING}|{NUMBER}|true|false|null)"

# outlines-core's own integer and number pieces, and their digit-bounded replacements.
OUTLINES_DIGIT_RUNS = {
    "(0|[1-9][0-9]*)": f"(0|[1-9][0-9]{{0,{MAX_INT_DIGITS - 1}}})",
    r"(\.[0-9]+)?": f"({FRACTION})?",
    "([eE][+-][0-9]+)?": f"([eE][+-][0-9]{{1,{MAX_EXPONENT_DIGITS}}})?",
}


def whitespace_pattern(max_spaces: int) -> str:
    """What may stand between JSON tokens: up to `max_spaces` spaces, nothing else (no
    newlines or tabs, whose unbounded runs are the classic runaway-whitespace failure)."""
    if max_spaces <= 0:
        return ""
    return "[ ]?" if max_spaces == 1 else f"[ ]{{0,{max_spaces}}}"


def generic_value(depth: int, ws: str) -> str:
    """Any JSON value with containers nested at most `depth` deep. Every extra level
    multiplies the automaton (and its compile time) several times over, so keep it small."""
    if depth <= 0:
        return PRIMITIVE
    inner = generic_value(depth - 1, ws)
    return f"(?:{PRIMITIVE}|{generic_object(inner, ws)}|{generic_array(inner, ws)})"


def generic_object(value: str, ws: str) -> str:
    pair = f"{STRING}{ws}:{ws}{value}"
    return rf"\{{{ws}(?:{pair}(?:{ws},{ws}{pair})*)?{ws}\}}"


def generic_array(value: str, ws: str) -> str:
    return rf"\[{ws}(?:{value}(?:{ws},{ws}{value})*)?{ws}\]"


# -- integer and number ranges ----------------------------------------------------------------


def integer_range(lo: int | None, hi: int | None) -> str | None:
    """Decimal integers in [lo, hi] (None: unbounded, up to MAX_INT_DIGITS digits); None when
    the range is empty."""
    lo = -_MAX_MAGNITUDE if lo is None else max(lo, -_MAX_MAGNITUDE)
    hi = _MAX_MAGNITUDE if hi is None else min(hi, _MAX_MAGNITUDE)
    if lo > hi:
        return None
    parts = []
    if lo < 0:  # negatives -m for m in [max(1, -hi), -lo]
        parts.append("-" + _alternation(_nonneg_range(max(1, -hi), -lo)))
    if hi >= 0:
        parts.append(_alternation(_nonneg_range(max(0, lo), hi)))
    return _alternation(parts)


def number_range(lo: float | None, hi: float | None, lo_exclusive: bool = False,
                 hi_exclusive: bool = False) -> str | None:
    """Decimal numbers (no exponent) inside the bounds; None when none are found.

    A number is sign, integer part I and optional fraction F, so a positive one lies in
    [I, I + 1). Choosing I so that the whole interval fits inside the bounds keeps every
    fraction valid; exact integers are allowed one step further out. Bounds that are not
    integers lose the sliver between them and the next integer inwards.
    """
    pieces: list[str] = []
    # Exact integers.
    int_lo = None if lo is None else (math.floor(lo) + 1 if lo_exclusive else math.ceil(lo))
    int_hi = None if hi is None else (math.ceil(hi) - 1 if hi_exclusive else math.floor(hi))
    exact = integer_range(int_lo, int_hi)
    # Positive with a fraction: x in [I, I + 1) needs I >= lo and I + 1 <= hi.
    frac_lo = max(0, int_lo) if int_lo is not None else 0
    frac_hi = None if hi is None else math.floor(hi) - 1
    positive = _nonneg_or_none(frac_lo, frac_hi)
    # Negative with a fraction: x in (-(I + 1), -I] needs -(I + 1) >= lo and -I <= hi.
    neg_lo = 0 if hi is None or hi >= 0 else (math.floor(-hi) + 1 if hi_exclusive
                                               else math.ceil(-hi))
    neg_hi = None if lo is None else math.floor(-lo) - 1
    negative = _nonneg_or_none(neg_lo, neg_hi)
    if positive:
        pieces.append(f"{positive}{FRACTION}")
    if negative:
        pieces.append(f"-{negative}{FRACTION}")
    if exact:
        pieces.append(exact)
    if not pieces:
        return None
    return _alternation(pieces)


def _nonneg_or_none(lo: int, hi: int | None) -> str | None:
    hi = _MAX_MAGNITUDE if hi is None else min(hi, _MAX_MAGNITUDE)
    if lo > hi:
        return None
    return _alternation(_nonneg_range(lo, hi))


def _nonneg_range(lo: int, hi: int) -> list[str]:
    """Alternatives matching exactly the integers in [lo, hi] (0 <= lo <= hi), written without
    leading zeros: split at powers of ten so that each piece has one digit count."""
    out = []
    while lo <= hi:
        top = min(hi, 10 ** len(str(lo)) - 1)  # the last number with as many digits as lo
        out.extend(_same_length(str(lo), str(top)))
        lo = top + 1
    return out


def _same_length(lo: str, hi: str) -> list[str]:
    """Alternatives for the digit strings between lo and hi, both of the same length.

    Whole decades collapse into one class (`[2-8][0-9]{3}`), so the result stays
    O(digits^2) in size instead of doubling per digit."""
    if lo == hi:
        return [lo]
    rest = len(lo) - 1
    zeros, nines = "0" * rest, "9" * rest
    free = f"[0-9]{{{rest}}}" if rest else ""
    if lo[0] == hi[0]:
        return [lo[0] + _alternation(_same_length(lo[1:], hi[1:]))]
    first, last = int(lo[0]), int(hi[0])
    out = []
    if lo[1:] != zeros:  # lo .. lo[0]99..9
        out.append(lo[0] + _alternation(_same_length(lo[1:], nines)))
        first += 1
    tail = None
    if hi[1:] != nines:  # hi[0]00..0 .. hi
        tail = hi[0] + _alternation(_same_length(zeros, hi[1:]))
        last -= 1
    if first <= last:
        digit = str(first) if first == last else f"[{first}-{last}]"
        out.append(digit + free)
    if tail is not None:
        out.append(tail)
    return out


def _alternation(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"
