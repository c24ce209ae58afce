"""The registry of checks: `@check("cause-id")` on a function of a module in checks/.

A check reads a `Script` (the parsed file and its traces) and yields
`Finding`s for the cause id (data/causes.yaml, or a KB cause in kb/causes/)
it is registered under, or for one of its ids when a single walk of the
script serves several; several checks may share a cause id.
`assistant.lint.checks` imports every area module, which registers its
checks here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from assistant.lint.model import Script
from assistant.results import Finding

Check = Callable[[Script], Iterator[Finding]]


@dataclass(frozen=True)
class RegisteredCheck:
    """A check and the cause ids its findings carry (one, for most checks)."""

    cause_ids: tuple[str, ...]
    run: Check

    @property
    def name(self) -> str:
        return f"{self.run.__module__}.{self.run.__name__}"


CHECKS: list[RegisteredCheck] = []
"""Every registered check, in the order their modules register them."""


def check(*cause_ids: str) -> Callable[[Check], Check]:
    """Register a check whose findings carry one of `cause_ids`."""

    def register(function: Check) -> Check:
        CHECKS.append(RegisteredCheck(cause_ids, function))
        return function

    return register
