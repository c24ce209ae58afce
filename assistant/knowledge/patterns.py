r"""Error signatures: the one place where KB regexes are compiled and matched.

KB files come from many hands (team layers, pull requests), so no signature
may make a query slow. Matching runs on RE2 (google-re2, a declared
dependency), whose time is linear in the text whatever the pattern: `(a+)+$`
over 10,000 characters takes microseconds instead of never ending under
Python's backtracking `re`.

Every signature must pass two rules, here and in `assistant kb lint`:

- RE2 must take it (no lookaround, no backreferences, no possessive
  quantifiers or atomic groups, repeat counts up to 1000);
- it must not be able to backtrack exponentially in `re`: no repeat around
  an unbounded repeat (`(a+)+`, `(\w+\s?)*`, `(a*){20}`), and no unbounded
  repeat of alternatives that can start alike (`(a|ab)*`). These are the
  shapes that make a 30-character text take minutes; polynomial shapes
  (`a.*a.*a.*x`) pass, and are safe only because RE2 runs them.

Fallback policy: when the re2 module cannot be imported, signatures are still
validated by the same rules (checked statically, so `kb lint` gives the same
answer), but nothing matches them, and the first search says so on stderr.
Python's `re` is no fallback: the rules above cannot exclude polynomial
blow-ups (`a.*a.*a.*x` never finishes on a 2,000-character line), and a
query that hangs is worse than one that loses its strongest signal (the
lexical and dense signals still rank the causes).

All matching is case-insensitive. Under RE2, `\w`, `\d`, `\s` and `\b` are
ASCII-only (in `re` they are Unicode): write Chinese text literally.

    sig = compile_signature(r"environment variable (\w+) expected")
    sig.search(log).group(1)                     # 'RANK'
    errors = PatternSet.from_patterns([r"Duplicate GPU detected", r"both on CUDA device"])
    errors.search(log)                           # the first signature's match, or None
    errors.matching(log)                         # every Signature that matches
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

try:  # the linear engine; see the fallback policy above
    import re2
except ImportError:  # pragma: no cover - tested with linear=False
    re2 = None

try:  # Python 3.11+
    import re._constants as sre_constants
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants
    import sre_parse

LINEAR_ENGINE = re2 is not None  # False: signatures are validated but never matched
MAX_PATTERN_LENGTH = 2000  # characters: a signature is an error line, not a grammar
NO_ENGINE_NOTICE = (
    "assistant: google-re2 is not installed, so error signatures are not matched "
    "(pip install google-re2)"
)

_UNBOUNDED = sre_constants.MAXREPEAT
_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT)
_POSSESSIVE = getattr(sre_constants, "POSSESSIVE_REPEAT", None)  # 3.11+: `a++`
_LOOKAROUND = (sre_constants.ASSERT, sre_constants.ASSERT_NOT)
_BACKREFS = (sre_constants.GROUPREF, sre_constants.GROUPREF_EXISTS)
_ATOMIC = getattr(sre_constants, "ATOMIC_GROUP", None)  # 3.11+: `(?>...)`
_notice_given = False


class PatternError(ValueError):
    """A signature that is not a regex, or that a query could not run safely."""


@dataclass(frozen=True)
class Signature:
    """One validated signature; `search` behaves like `re.Pattern.search`."""

    source: str
    compiled: object | None  # the RE2 pattern; None where RE2 is missing

    def search(self, text: str):
        """The first match in `text` (with .group(), .span()), or None."""
        if self.compiled is None:
            _notice_no_engine()
            return None
        return self.compiled.search(text)


def _notice_no_engine() -> None:
    global _notice_given
    if not _notice_given:
        _notice_given = True
        print(NO_ENGINE_NOTICE, file=sys.stderr)


class PatternSet:
    """Several signatures searched together, e.g. the alternatives that name one cause."""

    def __init__(self, signatures: Iterable[Signature]):
        self.signatures = tuple(signatures)

    @classmethod
    def from_patterns(
        cls, patterns: Iterable[str], linear: bool | None = None, skip_invalid: bool = False
    ) -> PatternSet:
        """Compile every pattern; raise PatternError on the first bad one.

        With `skip_invalid`, bad patterns are left out instead: for reading an
        index built before a rule existed, where a query must still answer.
        """
        compiled = []
        for pattern in patterns:
            try:
                compiled.append(compile_signature(pattern, linear))
            except PatternError:
                if not skip_invalid:
                    raise
        return cls(compiled)

    def search(self, text: str):
        """The match of the first signature (in order) that matches, or None."""
        for signature in self.signatures:
            found = signature.search(text)
            if found is not None:
                return found
        return None

    def matching(self, text: str) -> list[Signature]:
        """Every signature that matches somewhere in `text`."""
        return [s for s in self.signatures if s.search(text) is not None]

    def __len__(self) -> int:
        return len(self.signatures)


def compile_signature(pattern: str, linear: bool | None = None) -> Signature:
    """Validate and compile a KB signature (case-insensitive); PatternError says why not.

    `linear` chooses whether RE2 compiles it (default: when installed); without
    it the same rules are checked statically and the signature matches nothing
    (see the fallback policy in the module docstring).
    """
    linear = LINEAR_ENGINE if linear is None else linear
    if not isinstance(pattern, str) or not pattern.strip():
        raise PatternError("a signature must be a non-empty string")
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise PatternError(f"longer than {MAX_PATTERN_LENGTH} characters")
    tree = _parse(pattern)
    risk = backtracking_risk(tree)
    if risk:
        raise PatternError(f"{risk}; it could take exponential time in Python's re")
    if linear:
        return Signature(pattern, _compile_re2(pattern))
    unsupported = re2_unsupported(tree)
    if unsupported:
        raise PatternError(f"the linear engine (RE2) cannot take {unsupported}")
    return Signature(pattern, None)


def _parse(pattern: str):
    try:
        return sre_parse.parse(pattern, re.IGNORECASE)
    except (re.error, RecursionError, OverflowError) as exc:
        raise PatternError(f"not a valid regex: {exc}") from None


def _re2_options():
    options = re2.Options()
    options.case_sensitive = False
    options.log_errors = False  # the reason comes back in the exception
    return options


def _compile_re2(pattern: str):
    try:
        return re2.compile(pattern, _re2_options())
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise PatternError(f"the linear engine (RE2) cannot take it: {reason}") from None


# -- static checks over Python's parse tree ----------------------------------------


def _children(tree) -> Iterable:
    """The sub-patterns directly under the nodes of a parsed pattern."""
    for op, arg in tree:
        if op in _REPEATS or (_POSSESSIVE is not None and op == _POSSESSIVE):
            yield arg[2]
        elif op == sre_constants.SUBPATTERN:
            yield arg[-1]
        elif op == sre_constants.BRANCH:
            yield from arg[1]
        elif op in _LOOKAROUND:
            yield arg[1]
        elif op == sre_constants.GROUPREF_EXISTS:
            yield from (sub for sub in arg[1:] if sub is not None)
        elif _ATOMIC is not None and op == _ATOMIC:
            yield arg


def _has_unbounded_repeat(tree) -> bool:
    for op, arg in tree:
        if op in _REPEATS and arg[1] == _UNBOUNDED and _can_be_long(arg[2]):
            return True
        if any(_has_unbounded_repeat(sub) for sub in _children([(op, arg)])):
            return True
    return False


def _can_be_long(tree) -> bool:
    """Whether a repeated body matches something (an empty body cannot backtrack)."""
    return tree.getwidth()[1] > 0


def _first_chars(tree) -> set | None:
    """Characters a sub-pattern can start with (lower-cased), or None for 'anything'."""
    for op, arg in tree:
        if op == sre_constants.LITERAL:
            return {chr(arg).lower()}
        if op == sre_constants.SUBPATTERN:
            return _first_chars(arg[-1])
        if op in _REPEATS:
            first = _first_chars(arg[2])
            if arg[0] > 0 or first is None:
                return first
            return None  # an optional start: the rest may start with anything
        if op == sre_constants.BRANCH:
            sets = [_first_chars(branch) for branch in arg[1]]
            if any(s is None for s in sets):
                return None
            return set().union(*sets)
        if op in (sre_constants.AT,):
            continue
        return None  # classes, `.`, categories: treat as overlapping everything
    return None


def _overlapping_branches(tree) -> bool:
    for op, arg in tree:
        if op == sre_constants.SUBPATTERN:
            return _overlapping_branches(arg[-1])
        if op == sre_constants.BRANCH:
            starts = [_first_chars(branch) for branch in arg[1]]
            for i, first in enumerate(starts):
                for other in starts[i + 1 :]:
                    if first is None or other is None or first & other:
                        return True
            return False
    return False


def backtracking_risk(tree) -> str | None:
    """Why a parsed pattern can backtrack catastrophically in `re`, or None.

    Two shapes cover the classic exponential cases: a repeat with a large or
    unbounded count around another unbounded repeat (`(a+)+`, `(\\w+\\s?)*`,
    `(a*){20}`), and an unbounded repeat of alternatives that can start with
    the same character (`(a|ab)*`). Polynomial shapes such as `.*x.*y` stay
    allowed: RE2 runs them in linear time and `re` on one error line in
    milliseconds.
    """
    if isinstance(tree, str):
        tree = _parse(tree)
    for op, arg in tree:
        if op in _REPEATS:
            _, high, body = arg
            many = high == _UNBOUNDED or high >= 10
            if many and _has_unbounded_repeat(body):
                return "nested quantifier (a repeat inside a repeat, like (a+)+)"
            if high == _UNBOUNDED and _overlapping_branches(body):
                return "repeated alternatives that can match the same text (like (a|ab)*)"
        for sub in _children([(op, arg)]):
            risk = backtracking_risk(sub)
            if risk:
                return risk
    return None


def re2_unsupported(tree) -> str | None:
    """What RE2 cannot take in a parsed pattern (lookaround, backreferences), or None.

    Used when RE2 itself is not installed, so that `kb lint` gives the same
    answer with or without it.
    """
    if isinstance(tree, str):
        tree = _parse(tree)
    for op, arg in tree:
        if op in _LOOKAROUND:
            return "lookahead or lookbehind"
        if op in _BACKREFS:
            return "a backreference"
        if op is not None and op in (_POSSESSIVE, _ATOMIC):
            return "a possessive quantifier or an atomic group"
        if op in _REPEATS and arg[1] != _UNBOUNDED and arg[1] > 1000:
            return "a repeat count above 1000"
        for sub in _children([(op, arg)]):
            found = re2_unsupported(sub)
            if found:
                return found
    return None
