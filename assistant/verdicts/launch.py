"""Verdicts on how the job was launched: torchrun, LOCAL_RANK, world size, main guard."""

from __future__ import annotations

from assistant.results import Verdict
from assistant.verdicts.devices import script_picks_device
from assistant.verdicts.inputs import (
    Inputs,
    as_int,
    judges,
    undecided,
    verdict,
)

# --- launch -------------------------------------------------------------------


@judges("launched-without-torchrun")
def launched_without_torchrun(i: Inputs) -> Verdict:
    evidence = []
    match = i.error_names("launched-without-torchrun")
    launch = i.facts("launch_env")
    missing = [(r["rank"], r["facts"]["missing"]) for r in launch if r["facts"].get("missing")]
    for rank, names in missing:
        evidence.append(
            i.t(
                "rank {rank} was started without {names}: not by torchrun",
                "rank {rank} 启动时没有 {names}：不是用 torchrun 启动的",
                rank=rank,
                names=", ".join(names),
            )
        )
    if launch and not missing:
        evidence.append(
            i.t(
                "under torchrun every rank here gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT",
                "在本机用 torchrun 启动时，每个 rank 都拿到了 RANK、LOCAL_RANK、WORLD_SIZE、LOCAL_WORLD_SIZE、MASTER_ADDR 和 MASTER_PORT",
            )
        )
    if match:
        name = next((g for g in match.groups() if g), "RANK")
        line = i.t(
            "the error says {name} is not set: the script was not started by torchrun (or got no rank and world size)",
            "报错说 {name} 没有设置：脚本不是用 torchrun 启动的（或者没有拿到 rank 和 world_size）",
            name=name,
        )
        return verdict("confirmed", [line] + evidence, source="error")
    if missing:
        return verdict("confirmed", evidence, source="probe")
    if i.root_error is not None and i.root_error.rank is not None:
        line = i.t(
            "the error comes from rank {rank}, so the process group knew its rank",
            "报错来自 rank {rank}，说明进程组已经拿到了 rank",
            rank=i.root_error.rank,
        )
        return verdict("ruled_out", [line] + evidence, source="error")
    return undecided(i, ("launch_env",), evidence)


@judges("local-rank-not-from-env")
def local_rank_not_from_env(i: Inputs) -> Verdict:
    evidence = []
    launch = i.facts("launch_env")
    if launch:
        local_ranks = sorted({r["facts"]["env"].get("LOCAL_RANK") for r in launch}, key=str)
        if not any(r["facts"].get("local_rank_args") for r in launch):
            evidence.append(
                i.t(
                    "torchrun here passes LOCAL_RANK ({values}) only in the environment, no --local-rank argument: an argparse default gives every rank the same device",
                    "本机 torchrun 只通过环境变量传 LOCAL_RANK（{values}），不传 --local-rank 参数：用 argparse 默认值的话，每个 rank 都会拿到同一张卡",
                    values=", ".join(str(v) for v in local_ranks),
                )
            )
    evidence.extend(script_picks_device(i))
    return undecided(i, ("launch_env", "devices"), evidence)


@judges("local-rank-arg-mismatch")
def local_rank_arg_mismatch(i: Inputs) -> Verdict:
    evidence = []
    launch = i.facts("launch_env")
    passed = sorted({a for r in launch for a in r["facts"].get("local_rank_args") or []})
    if passed:
        evidence.append(
            i.t(
                "the launcher passed {args} to the script",
                "启动器给脚本传了 {args}",
                args=", ".join(passed),
            )
        )
    elif launch:
        evidence.append(
            i.t(
                "torchrun here passes no --local-rank argument; read os.environ['LOCAL_RANK'] instead",
                "本机 torchrun 不传 --local-rank 参数；请改读 os.environ['LOCAL_RANK']",
            )
        )
    if i.error_names("local-rank-arg-mismatch"):
        line = i.error_line(
            "the error says the script rejects the --local-rank argument its launcher passed: {error}",
            "报错说脚本不认启动器传入的 --local-rank 参数：{error}",
        )
        return verdict("confirmed", [line] + evidence, source="error")
    return undecided(i, ("launch_env",), evidence)


@judges("world-size-mismatch")
def world_size_mismatch(i: Inputs) -> Verdict:
    launch = i.facts("launch_env")
    evidence = []
    if i.error_names("world-size-mismatch"):
        evidence.append(
            i.t(
                "the error shows the rendezvous waiting for ranks that never joined",
                "报错显示 rendezvous 在等一直没有加入的 rank",
            )
        )
    if not launch:
        return undecided(i, ("launch_env",), evidence)
    sizes = {r["facts"]["env"].get("WORLD_SIZE") for r in launch}
    ranks = [as_int(r["facts"]["env"].get("RANK")) for r in launch]
    world = as_int(next(iter(sizes))) if len(sizes) == 1 else None
    complete = len(launch) == len(i.runs["launch_env"].ranks)
    if len(sizes) > 1:
        line = i.t(
            "ranks disagree on WORLD_SIZE: {sizes}",
            "各 rank 的 WORLD_SIZE 不一致：{sizes}",
            sizes=", ".join(
                f"rank {r['rank']}: {r['facts']['env'].get('WORLD_SIZE')}" for r in launch
            ),
        )
        return verdict("confirmed", [line] + evidence, source="probe")
    if len(set(ranks)) < len(ranks) or (
        complete and world is not None and sorted(ranks) != list(range(world))
    ):
        line = i.t(
            "RANK values {ranks} are not 0..{last} once each",
            "RANK 取值 {ranks} 不是 0..{last} 各一次",
            ranks=sorted(ranks, key=lambda v: -1 if v is None else v),
            last=(world or len(ranks)) - 1,
        )
        return verdict("confirmed", [line] + evidence, source="probe")
    evidence.append(
        i.t(
            "torchrun here gives {n} rank(s) RANK 0..{last} and WORLD_SIZE {world}: a mismatch would come from an explicit world_size or rank in the script",
            "本机 torchrun 给 {n} 个 rank 分配了 RANK 0..{last}、WORLD_SIZE {world}：若不一致，来自脚本里显式写的 world_size 或 rank",
            n=len(launch),
            last=len(launch) - 1,
            world=world,
        )
    )
    user_world = next((r["facts"].get("user_env") or {} for r in launch), {}).get("WORLD_SIZE")
    if user_world:
        evidence.append(
            i.t(
                "your environment exports WORLD_SIZE={value}; torchrun overrides it, a plain python start would use it",
                "你的环境里导出了 WORLD_SIZE={value}；torchrun 会覆盖它，直接用 python 启动则会用它",
                value=user_world,
            )
        )
    return verdict("inconclusive", evidence, source="probe")


@judges("missing-main-guard")
def missing_main_guard(i: Inputs) -> Verdict:
    evidence = []
    methods = sorted(
        {r["facts"].get("default_start_method") for r in i.facts("launch_env")} - {None}
    )
    for method in methods:
        if method == "fork":
            evidence.append(
                i.t(
                    "the default start method here is fork: DataLoader workers do not re-import the script; mp.spawn and the spawn method still do",
                    "本机默认的进程启动方式是 fork：DataLoader worker 不会重新导入脚本；mp.spawn 和 spawn 方式仍然会",
                )
            )
        else:
            evidence.append(
                i.t(
                    'the default start method here is {method}: every worker process re-imports the script, so code outside `if __name__ == "__main__":` runs again',
                    '本机默认的进程启动方式是 {method}：每个子进程都会重新导入脚本，`if __name__ == "__main__":` 之外的代码会再跑一遍',
                    method=method,
                )
            )
    if i.error_names("missing-main-guard"):
        line = i.t(
            "the error is Python's message for a process started while the script was still being imported",
            "报错是 Python 在脚本导入过程中又启动新进程时给出的",
        )
        return verdict("confirmed", [line] + evidence, source="error")
    return undecided(i, ("launch_env",), evidence)
