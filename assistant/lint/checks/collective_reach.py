"""Collectives that only some ranks reach: rank 0 waits in a barrier the others never call."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.model import Script, short
from assistant.lint.ranks import (
    OTHER_RANKS,
    RANK_ZERO,
    RankBranch,
    other_side,
    rank_branch_sides,
    some_rank_runs,
)
from assistant.lint.registry import check
from assistant.lint.torchapi import is_collective
from assistant.lint.tracer import same_file_callees
from assistant.results import Finding


@check("collective-mismatch")
def check_collective_only_some_ranks_reach(script: Script) -> Iterator[Finding]:
    """A collective that only rank 0 (or only the other ranks) reaches: the rest hang."""
    blocks: dict[int, list[ast.stmt]] = {}
    graph: CallGraph | None = None  # both built on the first guarded collective
    reaches: dict[str, CollectiveReach] = {}
    for trace in script.traces:
        for call in trace:
            if not call.rank_path or not is_collective(call.name):
                continue
            if not some_rank_runs(call.rank_path):
                continue  # the single-process path, or tests no rank passes together
            collective = short(call.name)
            if collective not in reaches:
                graph = graph or CallGraph(script)
                blocks = blocks or statement_blocks(script)
                reaches[collective] = CollectiveReach(
                    script, collective, graph.reaching(collective), blocks
                )
            reach = reaches[collective]
            # Innermost first: a paired `if` inside can still sit in a rank-0-only caller.
            lonely = next((b for b in reversed(call.rank_path) if not reach.answered(b)), None)
            if lonely is None:
                continue
            yield script.finding(
                "collective-mismatch",
                call.node,
                f"{collective}() runs on {lonely.side} (the `if` on line {lonely.test_if.lineno}); "
                "every rank must call each collective, or the others hang",
            )


def statement_blocks(script: Script) -> dict[int, list[ast.stmt]]:
    """id of each statement -> the statement list (body, else, loop body) it is in."""
    blocks: dict[int, list[ast.stmt]] = {}
    for node in script.nodes:
        for _name, value in ast.iter_fields(node):
            if isinstance(value, list) and value and all(isinstance(v, ast.stmt) for v in value):
                blocks.update((id(stmt), value) for stmt in value)
    return blocks


class CollectiveReach:
    """Which statements reach one collective, directly or through same-file functions.

    Every answer is cached, so a file with thousands of guarded collectives
    costs one pass per statement, not one per pair of them.
    """

    def __init__(
        self,
        script: Script,
        collective: str,
        functions: set[str],
        blocks: dict[int, list[ast.stmt]],
    ):
        self.script = script
        self.collective = collective
        self.blocks = blocks
        self.functions = functions  # the same-file functions that reach it
        self.statement_cache: dict[int, bool] = {}
        self.paired_ifs: dict[int, set[int]] = {}  # id of a block -> ids of its paired ifs

    def answered(self, branch: RankBranch) -> bool:
        """The ranks outside `branch` reach it too: in the other branch, or in a paired `if`."""
        test_if = branch.test_if
        other = test_if.orelse if branch.branch == "body" else test_if.body
        return self.statements(other) or self.paired(test_if)

    def paired(self, test_if: ast.If) -> bool:
        """`if rank != 0: barrier()` ... `if rank == 0: barrier()`: each rank calls it once."""
        block = self.blocks.get(id(test_if), [])
        if id(block) not in self.paired_ifs:
            self.paired_ifs[id(block)] = self.pairs_in(block)
        return id(test_if) in self.paired_ifs[id(block)]

    def pairs_in(self, block: list[ast.stmt]) -> set[int]:
        """ids of the rank `if`s of a block matched with one for the other side."""
        paired: set[int] = set()
        unmatched: dict[str, list[ast.stmt]] = {RANK_ZERO: [], OTHER_RANKS: []}  # stacks
        for stmt in block:
            side = self.reaching_side(stmt)
            if side is None:
                continue
            partners = unmatched[other_side(side)]
            if not partners:
                unmatched[side].append(stmt)
                continue
            paired.update((id(stmt), id(partners.pop())))  # the nearest one before it
        return paired

    def reaching_side(self, stmt: ast.stmt) -> str | None:
        """For an `if` on the rank that reaches the collective in one branch only: who runs it."""
        if not isinstance(stmt, ast.If):
            return None
        body_side, else_side = rank_branch_sides(stmt.test, self.script)
        in_body, in_else = self.statements(stmt.body), self.statements(stmt.orelse)
        if in_body == in_else:
            return None
        side = body_side if in_body else else_side
        return side if side in (RANK_ZERO, OTHER_RANKS) else None

    def statements(self, stmts: list[ast.stmt]) -> bool:
        return any(self.statement(stmt) for stmt in stmts)

    def statement(self, stmt: ast.stmt) -> bool:
        if id(stmt) not in self.statement_cache:
            self.statement_cache[id(stmt)] = any(
                self.call(node) for node in ast.walk(stmt) if isinstance(node, ast.Call)
            )
        return self.statement_cache[id(stmt)]

    def call(self, node: ast.Call) -> bool:
        if short(self.script.name_of(node.func)) == self.collective:
            return True
        return any(f in self.functions for f in same_file_callees(self.script, node.func, None))


class CallGraph:
    """Who calls whom among the file's functions, and the calls each makes by short name."""

    def __init__(self, script: Script):
        self.callers: dict[str, set[str]] = {}  # callee -> functions that call it
        self.called: dict[str, set[str]] = {}  # function -> short names of what it calls
        for name, func in script.functions.items():
            called = self.called.setdefault(name, set())
            for node in (n for stmt in func.body for n in ast.walk(stmt)):
                if not isinstance(node, ast.Call):
                    continue
                called.add(short(script.name_of(node.func)))
                for callee in same_file_callees(script, node.func, None):
                    self.callers.setdefault(callee, set()).add(name)

    def reaching(self, collective: str) -> set[str]:
        """Functions that call `collective`, directly or through each other.

        Worked backwards from the direct callers, without recursion: a chain
        of thousands of functions is as cheap as one.
        """
        reaching = {name for name, called in self.called.items() if collective in called}
        pending = list(reaching)
        while pending:
            for caller in self.callers.get(pending.pop(), ()):
                if caller not in reaching:
                    reaching.add(caller)
                    pending.append(caller)
        return reaching
