"""Verdicts on GPUs: sharing, visible devices, no CUDA, out of memory, and the
set_device order experiment with its variants."""

from __future__ import annotations

from assistant.probing.protocol import VariantOutcome
from assistant.probing.protocol import variant_outcomes as protocol_variant_outcomes
from assistant.results import ProbeRun, Verdict
from assistant.verdicts.inputs import (
    ADVICE_VARIANTS,
    GPU_BUSY_FRACTION,
    VARIANT_NAMES,
    Inputs,
    by_host,
    gist,
    judges,
    kept_open,
    not_run,
    quote,
    short,
    undecided,
    verdict,
)
from assistant.verdicts.signatures import GPU_CAUSES

# --- devices --------------------------------------------------------------------


def gpu_records(i: Inputs) -> list[dict]:
    """devices records of ranks that see CUDA."""
    return [r for r in i.facts("devices") if r["facts"].get("cuda_available")]


def _sharing(i: Inputs) -> list[str]:
    """Evidence lines of ranks that cannot each have a GPU of their own."""
    lines = []
    for host, records in by_host(gpu_records(i)).items():
        by_uuid: dict[str, list[int]] = {}
        for record in records:
            landed = record["facts"]["local_rank_device"]
            if landed.get("uuid"):
                by_uuid.setdefault(landed["uuid"], []).append(record["rank"])
        for uuid, ranks in by_uuid.items():
            if len(ranks) > 1:
                lines.append(
                    i.t(
                        "ranks {ranks} all land on {gpu} with cuda:LOCAL_RANK on {host}",
                        "{host} 上 rank {ranks} 用 cuda:LOCAL_RANK 都落在 {gpu} 上",
                        ranks=", ".join(map(str, ranks)),
                        gpu=short(uuid),
                        host=host,
                    )
                )
        local_world = max(r.get("local_world_size") or 0 for r in records)
        count = min(r["facts"]["device_count"] for r in records)
        if local_world > count:
            gpus = sorted(
                {short(d["uuid"]) for r in records for d in r["facts"].get("visible") or []}
            )
            lines.append(
                i.t(
                    "{n} ranks on {host} but only {count} visible GPU(s) ({gpus}): ranks must share",
                    "{host} 上有 {n} 个 rank，但只看得到 {count} 张 GPU（{gpus}）：只能共用",
                    n=local_world,
                    host=host,
                    count=count,
                    gpus=", ".join(gpus) or "-",
                )
            )
            defaults = {r["facts"]["default_device"]["uuid"] for r in records}
            if len(defaults) == 1 and len(records) > 1:
                lines.append(
                    i.t(
                        "every rank's default device is {gpu}",
                        "每个 rank 的默认设备都是 {gpu}",
                        gpu=short(next(iter(defaults))),
                    )
                )
        failing: dict[str, list[int]] = {}
        for record in records:
            error = record["facts"]["local_rank_device"].get("error")
            if error:
                failing.setdefault(gist(error, 100), []).append(record["rank"])
        for error, ranks in failing.items():
            lines.append(
                i.t(
                    "rank {ranks}: cuda:LOCAL_RANK fails: {error}",
                    "rank {ranks}：cuda:LOCAL_RANK 出错：{error}",
                    ranks=", ".join(map(str, ranks)),
                    error=error,
                )
            )
    lines.extend(_nccl_duplicate_lines(i))
    return lines


def _nccl_duplicate_lines(i: Inputs) -> list[str]:
    """NCCL's own "Duplicate GPU" error from the backend probe."""
    # Not set_device_order: its no-set-device variant puts ranks on one GPU on purpose.
    duplicate = i.signature_set("duplicate-gpu-per-rank")
    for record in i.facts("backend"):
        error = (record["facts"].get("nccl") or {}).get("error") or ""
        match = duplicate.search(error) if error else None
        if match:
            return [
                i.t(
                    "NCCL refused the backend probe's all_reduce: {error}",
                    "backend 探针的 all_reduce 被 NCCL 拒绝：{error}",
                    error=gist(error[match.start() :], 100),
                )
            ]
    return []


def _own_gpus(i: Inputs) -> list[str]:
    """One line saying each rank has a GPU of its own, when it does."""
    records = gpu_records(i)
    if not records or _sharing(i):
        return []
    landed = [f"{r['rank']}->{short(r['facts']['local_rank_device']['uuid'])}" for r in records]
    return [
        i.t(
            "with cuda:LOCAL_RANK each rank gets a GPU of its own here ({pairs})",
            "在本机用 cuda:LOCAL_RANK 时每个 rank 各有一张卡（{pairs}）",
            pairs=", ".join(landed),
        )
    ]


def _default_device_line(i: Inputs) -> list[str]:
    records = gpu_records(i)
    defaults = {r["facts"]["default_device"]["uuid"] for r in records}
    if len(records) > 1 and len(defaults) == 1:
        return [
            i.t(
                "without set_device every rank's current device is cuda:0 ({gpu}): bare .cuda() and 'cuda' land there",
                "不调用 set_device 时每个 rank 的当前设备都是 cuda:0（{gpu}）：.cuda() 和 'cuda' 都会落到这张卡",
                gpu=short(next(iter(defaults))),
            )
        ]
    return []


def script_picks_device(i: Inputs) -> list[str]:
    """Evidence that, on a healthy launch, the device choice is the script's."""
    lines = _own_gpus(i)
    if lines and i.error_names("duplicate-gpu-per-rank"):
        lines.append(
            i.t(
                "so the ranks that share a GPU in your error chose it in the script",
                "所以报错里共用一张卡的 rank，是脚本自己选的设备",
            )
        )
    return lines


def no_gpu(i: Inputs) -> Verdict | None:
    """not_applicable when the devices probe found no CUDA at all."""
    records = i.records("devices")
    if records and all(r["status"] == "not_applicable" for r in records):
        return no_cuda_here(i)
    return None


def no_cuda_here(i: Inputs) -> Verdict:
    """not_applicable: a GPU probe found no CUDA device (said in the user's language)."""
    return verdict(
        "not_applicable", [i.t("no CUDA device visible", "看不到任何 CUDA 设备")], source="probe"
    )


@judges("duplicate-gpu-per-rank")
def duplicate_gpu_per_rank(i: Inputs) -> Verdict:
    sharing = _sharing(i)
    if sharing:
        return verdict("confirmed", sharing, source="probe")
    if i.error_names("duplicate-gpu-per-rank"):
        line = i.error_line(
            "the error says two ranks are on one GPU: {error}",
            "报错说两个 rank 在同一张卡上：{error}",
        )
        return verdict("confirmed", [line] + script_picks_device(i), source="error")
    none_here = no_gpu(i)
    if none_here:
        return none_here
    evidence = _own_gpus(i)
    if evidence:
        evidence.append(
            i.t(
                "if ranks still share a GPU, the script picks the device (see local-rank-not-from-env, hardcoded-device)",
                "如果 rank 仍然共用一张卡，是脚本选设备的方式有问题（见 local-rank-not-from-env、hardcoded-device）",
            )
        )
    return undecided(i, ("devices",), evidence)


@judges("hardcoded-device")
def hardcoded_device(i: Inputs) -> Verdict:
    evidence = i.error_says(
        "hardcoded-device",
        "the error says tensors sit on different GPUs: {error}",
        "报错说张量分在不同的 GPU 上：{error}",
    )
    none_here = no_gpu(i)
    if none_here and not evidence and not i.error_names("duplicate-gpu-per-rank"):
        return none_here
    return undecided(i, ("devices",), evidence + script_picks_device(i) + _default_device_line(i))


@judges("world-size-exceeds-devices")
def world_size_exceeds_devices(i: Inputs) -> Verdict:
    evidence = []
    said = i.error_names("world-size-exceeds-devices")
    if said:
        evidence.append(
            i.t(
                "the error says a rank asked for a GPU index that does not exist ({text})",
                "报错说某个 rank 请求了不存在的 GPU 编号（{text}）",
                text=quote(said.group(0), 60),
            )
        )
    records = gpu_records(i)
    over = []
    for host, mine in by_host(records).items():
        local_world = max(r.get("local_world_size") or 0 for r in mine)
        count = min(r["facts"]["device_count"] for r in mine)
        if local_world > count:
            over.append(
                i.t(
                    "{n} processes on {host} but {count} visible GPU(s)",
                    "{host} 上有 {n} 个进程，但只看得到 {count} 张 GPU",
                    n=local_world,
                    host=host,
                    count=count,
                )
            )
    if over:
        return verdict("confirmed", over + evidence, source="probe")
    none_here = no_gpu(i)
    if none_here and not said:
        return none_here
    if not records:
        return undecided(i, ("devices",), evidence)
    count = min(r["facts"]["device_count"] for r in records)
    local_world = max(r.get("local_world_size") or 0 for r in records)
    sources = {r["facts"].get("nproc_source") for r in i.facts("launch_env")}
    if sources == {"user"}:
        line = i.t(
            "{n} process(es) per node fit the {count} visible GPU(s)",
            "每个节点 {n} 个进程，看得到的 {count} 张 GPU 够用",
            n=local_world,
            count=count,
        )
        if not said:
            return verdict("ruled_out", [line], source="probe")
        script = i.t(
            "so the index in the error comes from the script (RANK used for LOCAL_RANK, or a hardcoded cuda:N)",
            "所以报错里的编号来自脚本（把 RANK 当成 LOCAL_RANK，或写死了 cuda:N）",
        )
        return verdict("inconclusive", evidence + [line, script], source="probe")
    line = i.t(
        "{count} visible GPU(s) here: launch at most {count} process(es) per node",
        "本机看得到 {count} 张 GPU：每个节点最多启动 {count} 个进程",
        count=count,
    )
    return verdict("inconclusive", [line] + evidence, source="probe")


# What the KB's one signature of a setting (not of an error CUDA gave) matches:
# the variable spelled without its S, which CUDA never reads.
MISSPELLED_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICE"


@judges("cuda-visible-devices-mismatch")
def cuda_visible_devices_mismatch(i: Inputs) -> Verdict:
    records = i.facts("devices", ("ok", "failed", "not_applicable"))
    named = i.error_names("cuda-visible-devices-mismatch")
    misspelled = bool(named) and named.group().rstrip(" \t=") == MISSPELLED_VISIBLE_DEVICES
    if misspelled:
        # What this machine's GPUs look like says nothing about a name CUDA ignores.
        said = i.error_says(
            "cuda-visible-devices-mismatch",
            "the error text sets CUDA_VISIBLE_DEVICE (no S), a name CUDA never reads, "
            "so every GPU stays visible: {error}",
            "报错文本里设的是 CUDA_VISIBLE_DEVICE（少了 S），CUDA 不读这个名字，"
            "所有 GPU 仍然可见：{error}",
        )
        return verdict("confirmed", said, source="error")
    said = i.error_says(
        "cuda-visible-devices-mismatch",
        "the error is CUDA's when the visible devices change after CUDA started: {error}",
        "报错是 CUDA 启动后可见设备又被改变时给出的：{error}",
    )
    if not records:
        if said:
            return verdict("confirmed", said, source="error")
        return undecided(i, ("devices",), [])
    problems: list[str] = []
    healthy: list[str] = []
    for mine in by_host(records).values():
        for value in sorted({r["facts"].get("cuda_visible_devices") for r in mine}, key=str):
            same = [r for r in mine if r["facts"].get("cuda_visible_devices") == value]
            problem = _visible_devices_problem(i, value, same)
            (problems if problem else healthy).append(
                problem or _visible_devices_ok(i, value, same)
            )
    if problems:
        return verdict("confirmed", problems + said, source="probe")
    if all(
        r["facts"].get("physical_gpus") in (0, None) and not r["facts"].get("cuda_available")
        for r in records
    ):
        none_here = [i.t("no NVIDIA GPU on this machine", "本机没有 NVIDIA GPU")]
        if said:  # the error came from a GPU machine: this one cannot judge it
            return verdict("confirmed", said + none_here, source="error")
        return verdict("not_applicable", none_here, source="probe")
    if said:
        # A healthy value now does not clear a script that changes it after CUDA started.
        script = i.t(
            "so the script (or a library) changes CUDA_VISIBLE_DEVICES after CUDA started",
            "所以是脚本（或某个库）在 CUDA 启动后改了 CUDA_VISIBLE_DEVICES",
        )
        return verdict("confirmed", said + healthy + [script], source="error")
    return verdict("ruled_out", healthy, source="probe")


def _visible_devices_problem(i: Inputs, value: str | None, records: list[dict]) -> str | None:
    """What is wrong with one CUDA_VISIBLE_DEVICES value, for the ranks that have it."""
    if value is None:
        return None
    physical = max((r["facts"].get("physical_gpus") or 0) for r in records)
    count = min(r["facts"].get("device_count") or 0 for r in records)
    local_world = max(r.get("local_world_size") or 0 for r in records)
    entries = [e.strip() for e in value.split(",")]
    if not value.strip():
        if not physical:
            return i.t(
                "CUDA_VISIBLE_DEVICES is set but empty: it hides every GPU",
                "CUDA_VISIBLE_DEVICES 设成了空值：把所有 GPU 都藏起来了",
            )
        return i.t(
            "CUDA_VISIBLE_DEVICES is set but empty: it hides all {physical} GPU(s)",
            "CUDA_VISIBLE_DEVICES 设成了空值：把 {physical} 张 GPU 全都藏起来了",
            physical=physical,
        )
    duplicates = sorted({e for e in entries if entries.count(e) > 1})
    if duplicates:
        return i.t(
            "CUDA_VISIBLE_DEVICES={value} lists {dup} twice",
            "CUDA_VISIBLE_DEVICES={value} 把 {dup} 列了两次",
            value=value,
            dup=", ".join(duplicates),
        )
    invalid = [
        e
        for e in entries
        if not (
            e.startswith(("GPU-", "MIG-")) or (e.isdigit() and (not physical or int(e) < physical))
        )
    ]
    if invalid:
        return i.t(
            "CUDA_VISIBLE_DEVICES={value} names {bad}, which this machine does not have ({physical} GPU(s))",
            "CUDA_VISIBLE_DEVICES={value} 里的 {bad} 本机没有（共 {physical} 张 GPU）",
            value=value,
            bad=", ".join(invalid),
            physical=physical,
        )
    if count < local_world and physical > count:
        return i.t(
            "CUDA_VISIBLE_DEVICES={value} shows {count} of the {physical} GPUs to {n} ranks",
            "CUDA_VISIBLE_DEVICES={value} 只给 {n} 个 rank 看到 {physical} 张 GPU 中的 {count} 张",
            value=value,
            count=count,
            physical=physical,
            n=local_world,
        )
    return None


def _visible_devices_ok(i: Inputs, value: str | None, records: list[dict]) -> str:
    count = min(r["facts"].get("device_count") or 0 for r in records)
    if value is None:
        physical = max((r["facts"].get("physical_gpus") or 0) for r in records)
        return i.t(
            "CUDA_VISIBLE_DEVICES is not set: it hides none of the {n} GPU(s)",
            "没有设置 CUDA_VISIBLE_DEVICES：{n} 张 GPU 都没有被隐藏",
            n=max(count, physical),
        )
    return i.t(
        "CUDA_VISIBLE_DEVICES={value} shows {count} GPU(s)",
        "CUDA_VISIBLE_DEVICES={value} 可见 {count} 张 GPU",
        value=value,
        count=count,
    )


@judges("no-cuda-visible")
def no_cuda_visible(i: Inputs) -> Verdict:
    records = i.facts("devices", ("ok", "failed", "not_applicable"))
    said = i.error_says("no-cuda-visible")
    if not records:
        if said:
            return verdict("confirmed", said, source="error")
        return undecided(i, ("devices",), [])
    blind = [r for r in records if not r["facts"].get("cuda_available")]
    if blind and not said and i.error_names(*GPU_CAUSES):
        # The pasted error came from a GPU job elsewhere: this machine's lack of
        # a GPU says nothing about it.
        return verdict(
            "not_applicable",
            [
                i.t(
                    "this machine has no GPU, but the error came from a job that used one: "
                    "run the probes on the failing machine",
                    "本机没有 GPU，但报错来自一个用了 GPU 的任务：请在出错的机器上运行探针",
                )
            ],
            source="probe",
        )
    if blind:
        line = _why_no_cuda(i, blind[0]["facts"], blind[0]["rank"])
        return verdict("confirmed", [line] + said, source="probe")
    names = sorted({d["name"] for r in records for d in r["facts"].get("visible") or []})
    count = max(r["facts"]["device_count"] for r in records)
    line = i.t(
        "torch sees {count} GPU(s) on every rank here ({names})",
        "本机每个 rank 的 torch 都能看到 {count} 张 GPU（{names}）",
        count=count,
        names=", ".join(names),
    )
    if not said:
        return verdict("ruled_out", [line], source="probe")
    elsewhere = i.t(
        "so the failing job ran in another environment (another node or container, "
        "another torch, or CUDA_VISIBLE_DEVICES set there)",
        "所以出错的任务跑在别的环境里（别的节点或容器、别的 torch，或那里设置了 CUDA_VISIBLE_DEVICES）",
    )
    return verdict("confirmed", said + [line, elsewhere], source="error")


def _why_no_cuda(i: Inputs, facts: dict, rank: int) -> str:
    if not facts.get("cuda_built"):
        version = next((r["facts"].get("torch") for r in i.facts("versions")), None)
        return i.t(
            "this torch{version} is a CPU-only build",
            "这个 torch{version} 是只支持 CPU 的版本",
            version=f" ({version})" if version else "",
        )
    if facts.get("cuda_visible_devices") is not None and not facts["cuda_visible_devices"].strip():
        return i.t(
            "CUDA_VISIBLE_DEVICES is set but empty: no GPU is visible",
            "CUDA_VISIBLE_DEVICES 设成了空值：看不到任何 GPU",
        )
    if facts.get("cuda_warning") or facts.get("cuda_error"):
        return i.t(
            "CUDA initialisation failed: {message}",
            "CUDA 初始化失败：{message}",
            message=quote(facts.get("cuda_warning") or facts.get("cuda_error"), 140),
        )
    if not facts.get("driver_loaded") and not facts.get("physical_gpus"):
        return i.t(
            "no NVIDIA driver is loaded (no /proc/driver/nvidia)",
            "没有加载 NVIDIA 驱动（没有 /proc/driver/nvidia）",
        )
    return i.t(
        "torch.cuda.is_available() is False on rank {rank}",
        "rank {rank} 上 torch.cuda.is_available() 为 False",
        rank=rank,
    )


@judges("cuda-out-of-memory")
def cuda_out_of_memory(i: Inputs) -> Verdict:
    evidence = []
    for record in gpu_records(i):
        landed = record["facts"]["local_rank_device"]
        free, total = landed.get("free_mib"), landed.get("total_mib")
        if free is not None and total and free < GPU_BUSY_FRACTION * total:
            evidence.append(
                i.t(
                    "{gpu} has {free} MiB free of {total} MiB before any training: another process holds it",
                    "训练开始前 {gpu} 只剩 {free} MiB（共 {total} MiB）：有别的进程占着",
                    gpu=short(landed["uuid"]),
                    free=free,
                    total=total,
                )
            )
    if i.error_names("cuda-out-of-memory"):
        line = i.error_line()
        return verdict("confirmed", [line] + evidence + _default_device_line(i), source="error")
    none_here = no_gpu(i)
    if none_here:
        return none_here
    if not evidence and gpu_records(i):
        evidence.append(
            i.t(
                "every rank's GPU is at least {pct}% free before training",
                "训练开始前每个 rank 的 GPU 至少有 {pct}% 空闲",
                pct=round(100 * (1 - GPU_BUSY_FRACTION)),
            )
        )
    return undecided(i, ("devices",), evidence)


# --- set_device order -----------------------------------------------------------


def variant_outcomes(runs: dict[str, ProbeRun]) -> dict[str, VariantOutcome]:
    """Per set_device_order variant, what it did here, read by the probe protocol.

    One reading for the runner's summary and the verdicts
    (probe_protocol.variant_outcomes): a variant works when every rank
    finished all its collectives and the ranks of a host do not end on one
    current device; a rank's own error explains the ranks that hung for it.
    """
    run = runs.get("set_device_order")
    return protocol_variant_outcomes(run.ranks) if run is not None else {}


def advice_outcomes(runs: dict[str, ProbeRun]) -> tuple[set[str], set[str]]:
    """(refuted, confirmed) advice tags: a variant fails (works) while another works (fails)."""
    outcomes = variant_outcomes(runs)
    any_works = any(o.works for o in outcomes.values())
    any_fails = any(not o.works for o in outcomes.values())
    refuted, confirmed = set(), set()
    for tag, variant in ADVICE_VARIANTS.items():
        if variant not in outcomes:
            continue
        if not outcomes[variant].works and any_works:
            refuted.add(tag)
        if outcomes[variant].works and any_fails:
            confirmed.add(tag)
    return refuted, confirmed


@judges("set-device-order")
def set_device_order(i: Inputs) -> Verdict:
    said = i.error_says(
        "set-device-order",
        "the error says the ranks' CUDA devices were not set before the process group: {error}",
        "报错说建立进程组之前没有设定各 rank 的 CUDA 设备：{error}",
    )
    return kept_open(said, _set_device_order_here(i))


def _set_device_order_here(i: Inputs) -> Verdict:
    """What the set_device_order experiment on this machine says."""
    run = i.runs.get("set_device_order")
    if run is None:
        return not_run()
    if run.status == "not_applicable":
        return no_cuda_here(i)  # the probe's own reason is English
    outcomes = variant_outcomes(i.runs)
    if not outcomes:
        return undecided(i, ("set_device_order",), [])
    evidence = [_variant_line(i, variant, outcome) for variant, outcome in outcomes.items()]
    refuted, _ = advice_outcomes(i.runs)
    working = [v for v, o in outcomes.items() if o.works]
    if len(working) == len(outcomes):
        evidence.insert(0, i.t("every order works here", "本机上每种顺序都能跑通"))
        return verdict("ruled_out", evidence, source="probe")
    if not working:
        evidence.insert(
            0,
            i.t(
                "no order works here, so the failure is not about the order (see duplicate-gpu-per-rank)",
                "本机上哪种顺序都跑不通，所以问题不在顺序（见 duplicate-gpu-per-rank）",
            ),
        )
        return verdict("inconclusive", evidence + i.trouble("set_device_order"), source="probe")
    return verdict("inconclusive", evidence, sorted(refuted), source="probe")


def _variant_line(i: Inputs, variant: str, outcome: VariantOutcome) -> str:
    en, zh = VARIANT_NAMES.get(variant, (variant, variant))
    name = i.t(en, zh)
    if outcome.kind == "hang":
        return i.t(
            "{name}: hangs in {step}", "{name}：卡在 {step}", name=name, step=outcome.step or "?"
        )
    if outcome.kind in ("failed", "error"):
        return i.t(
            "{name}: fails in {step}: {error}",
            "{name}：在 {step} 出错：{error}",
            name=name,
            step=outcome.step or "?",
            error=gist(outcome.error or "?", 100),
        )
    if outcome.kind != "ok":  # interrupted, not applicable
        return i.t("{name}: {kind}", "{name}：{kind}", name=name, kind=outcome.kind)
    if outcome.shared_uuid:
        return i.t(
            "{name}: collectives work, but every rank's current device is {gpu}, where .cuda(), barrier and object collectives go",
            "{name}：集合通信能跑通，但每个 rank 的当前设备都是 {gpu}，.cuda()、barrier 和对象集合通信都会落到这张卡",
            name=name,
            gpu=short(outcome.shared_uuid),
        )
    if not outcome.all_done:
        return i.t(
            "{name}: a rank stopped before the last collective",
            "{name}：有 rank 没跑完所有集合通信",
            name=name,
        )
    return i.t(
        "{name}: barrier, all_reduce and all_gather_object work, one GPU per rank",
        "{name}：barrier、all_reduce 和 all_gather_object 都正常，每个 rank 一张卡",
        name=name,
    )
