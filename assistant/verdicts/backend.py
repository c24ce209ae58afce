"""Verdicts on the process-group backend: NCCL availability, CPU tensors, P2P,
collective timeouts, and causes only the error text decides."""

from __future__ import annotations

from assistant.results import Verdict
from assistant.verdicts.devices import _gpu_records, _no_gpu
from assistant.verdicts.inputs import (
    COLLECTIVE_MISMATCH,
    COLLECTIVE_TIMEOUT,
    CONNECTION_CLOSED,
    CPU_TENSORS,
    DDP_CPU_MODULE,
    JUDGES,
    NCCL_MISSING,
    PG_NOT_INITIALIZED,
    UNUSED_PARAMETERS,
    Inputs,
    _by_error,
    _not_run,
    _quote,
    _undecided,
    _verdict,
    judges,
)

# --- backend ------------------------------------------------------------------


@judges("nccl-not-available")
def _nccl_not_available(i: Inputs) -> Verdict:
    records = i.facts("backend")
    evidence = []
    if i.error_match(NCCL_MISSING):
        evidence.append(i.error_line())
    if not records:
        return _undecided(i, ("backend",), evidence)
    facts = records[0]["facts"]
    platform = facts.get("platform")
    if facts["available"].get("nccl"):
        version = next((r["facts"].get("nccl") for r in i.facts("versions")), None)
        line = i.t(
            "this torch has NCCL{version}",
            "这个 torch 带有 NCCL{version}",
            version=f" {version}" if version else "",
        )
        return _verdict("ruled_out", [line] + evidence)
    if platform in ("Windows", "Darwin"):
        line = i.t(
            "there is no NCCL on {platform}: use the gloo backend",
            "{platform} 上没有 NCCL：请用 gloo 后端",
            platform=platform,
        )
        return _verdict("confirmed", [line] + evidence)
    line = i.t(
        "{platform} has NCCL; this torch build lacks it (see no-cuda-visible)",
        "{platform} 平台本身有 NCCL；是这个 torch 版本没带（见 no-cuda-visible）",
        platform=platform,
    )
    return _verdict("ruled_out", [line] + evidence)


@judges("nccl-with-cpu-tensors")
def _nccl_with_cpu_tensors(i: Inputs) -> Verdict:
    evidence = []
    for record in i.facts("backend"):
        text = (record["facts"].get("nccl") or {}).get("cpu_tensor_error")
        if text:
            evidence.append(
                i.t(
                    "here NCCL answers a CPU tensor with: {error}",
                    "本机上 NCCL 收到 CPU 张量时报：{error}",
                    error=_quote(text, 120),
                )
            )
            break
    if i.error_match(CPU_TENSORS):
        line = i.error_line(
            "the error is NCCL refusing a CPU tensor: {error}", "报错是 NCCL 拒绝 CPU 张量：{error}"
        )
        return _verdict("confirmed", [line] + evidence)
    records = i.facts("backend")
    if records and not records[0]["facts"]["available"].get("nccl"):
        return _verdict("not_applicable", [i.t("this torch has no NCCL", "这个 torch 没有 NCCL")])
    no_gpu = _no_gpu(i)
    if no_gpu:
        return no_gpu
    skipped = next(
        (
            r["facts"]["nccl"].get("reason")
            for r in records
            if (r["facts"].get("nccl") or {}).get("result") == "skipped"
        ),
        None,
    )
    if skipped and not evidence:
        evidence.append(
            i.t(
                "the backend probe skipped NCCL: {reason}",
                "backend 探针跳过了 NCCL：{reason}",
                reason=skipped,
            )
        )
    return _undecided(i, ("backend",), evidence)


@judges("p2p-hang")
def _p2p_hang(i: Inputs) -> Verdict:
    no_gpu = _no_gpu(i)
    if no_gpu:
        return no_gpu
    gpus = _gpu_records(i)
    if gpus and max(r["facts"]["device_count"] for r in gpus) < 2:
        return _verdict(
            "not_applicable",
            [
                i.t(
                    "fewer than two GPUs per node: no peer-to-peer traffic",
                    "每个节点不到两张 GPU：没有点对点传输",
                )
            ],
        )
    evidence = _p2p_facts(i)
    run = i.runs.get("backend")
    nccl = next(
        (r["facts"].get("nccl") or {} for r in (run.ranks if run else []) if r.get("facts")), {}
    )
    iommu_translates = any(
        t.startswith("DMA")
        for r in i.facts("system")
        for t in (r["facts"].get("iommu") or {}).get("types", [])
    )
    if run is not None and run.status == "timeout" and nccl.get("step") == "all_reduce":
        line = i.t(
            "the NCCL all_reduce hung across the GPUs while gloo worked",
            "gloo 正常，但跨 GPU 的 NCCL all_reduce 卡住了",
        )
        return _verdict("confirmed" if iommu_translates else "inconclusive", [line] + evidence)
    if nccl.get("result") == "wrong_result":
        line = i.t("the NCCL all_reduce returned wrong values", "NCCL all_reduce 返回了错误的结果")
        return _verdict("confirmed", [line] + evidence)
    if nccl.get("result") == "ok":
        world = len(run.ranks)
        line = i.t(
            "a {mib} MiB NCCL all_reduce across {n} GPUs finished in {ms} ms with correct values",
            "跨 {n} 张 GPU 的 {mib} MiB NCCL all_reduce 用时 {ms} ms，结果正确",
            mib=(nccl.get("elements") or 0) * 4 // (1024 * 1024),
            n=world,
            ms=round((nccl.get("seconds") or 0) * 1000, 1),
        )
        if world > 1:
            return _verdict("ruled_out", [line] + evidence)
    return _undecided(i, ("backend", "system"), evidence)


def _p2p_facts(i: Inputs) -> list[str]:
    lines = []
    for record in i.facts("system"):
        facts = record["facts"]
        if (facts.get("env") or {}).get("NCCL_P2P_DISABLE") in ("1", "true"):
            lines.append(
                i.t(
                    "NCCL_P2P_DISABLE=1 is set: P2P is off",
                    "已设置 NCCL_P2P_DISABLE=1：点对点传输已关闭",
                )
            )
        p2p = facts.get("p2p") or {}
        if p2p.get("pairs"):
            missing = [f"{a}->{b}" for a, b, ok in p2p["pairs"] if not ok]
            if not missing:
                lines.append(
                    i.t("every GPU pair has P2P access", "所有 GPU 两两之间都能点对点访问")
                )
            elif len(missing) == len(p2p["pairs"]):
                lines.append(
                    i.t(
                        "no GPU pair has P2P access: NCCL goes through host memory",
                        "没有任何 GPU 对能点对点访问：NCCL 经主机内存传输",
                    )
                )
            else:
                lines.append(
                    i.t(
                        "GPU pairs without P2P access: {pairs}",
                        "不能点对点访问的 GPU 对：{pairs}",
                        pairs=", ".join(missing),
                    )
                )
        types = (facts.get("iommu") or {}).get("types") or []
        if any(t.startswith("DMA") for t in types):
            lines.append(
                i.t(
                    "the IOMMU translates device DMA ({types}): a known cause of P2P hangs",
                    "IOMMU 在转换设备 DMA（{types}）：这是点对点传输卡住的已知原因",
                    types=", ".join(types),
                )
            )
    return lines


@judges("collective-timeout")
def _collective_timeout(i: Inputs) -> Verdict:
    if not i.error_match(COLLECTIVE_TIMEOUT):
        return _not_run()
    evidence = [i.error_line()]
    for record in i.facts("backend")[:1]:
        gloo = record["facts"].get("gloo") or {}
        if gloo.get("result") == "ok":
            evidence.append(
                i.t(
                    "a gloo all_reduce across {n} ranks takes {ms} ms here: the collective itself is fast, so a rank was late",
                    "本机 {n} 个 rank 的 gloo all_reduce 只要 {ms} ms：集合通信本身很快，是某个 rank 迟到了",
                    n=record.get("world_size"),
                    ms=round((gloo.get("seconds") or 0) * 1000, 1),
                )
            )
    return _verdict("confirmed", evidence)


@judges("uneven-inputs")
def _uneven_inputs(i: Inputs) -> Verdict:
    if i.error_match(CONNECTION_CLOSED):
        line = i.t(
            "the error shows a peer that left while others still waited, as when one rank finishes its data early",
            "报错显示某个对端已经退出而其他 rank 还在等待，就像某个 rank 提前跑完了数据",
        )
        return _verdict("inconclusive", [line])
    return _not_run()


JUDGES["unused-parameters"] = _by_error(
    UNUSED_PARAMETERS,
    "the error is DDP's message for parameters without a gradient: {error}",
    "这是 DDP 在有参数没有梯度时的报错：{error}",
)
JUDGES["ddp-device-ids-cpu-module"] = _by_error(
    DDP_CPU_MODULE,
    "the error is DDP refusing device_ids for a module on the CPU: {error}",
    "这是 DDP 拒绝为 CPU 上的模型设置 device_ids 的报错：{error}",
)
JUDGES["process-group-not-initialized"] = _by_error(
    PG_NOT_INITIALIZED,
    "the error says a torch.distributed call ran before init_process_group: {error}",
    "报错说在 init_process_group 之前就调用了 torch.distributed：{error}",
)
JUDGES["collective-mismatch"] = _by_error(
    COLLECTIVE_MISMATCH,
    "the error is a collective mismatch between ranks: {error}",
    "报错是各 rank 之间的集合通信不一致：{error}",
)
