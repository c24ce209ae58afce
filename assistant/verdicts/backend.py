"""Verdicts on the process-group backend: NCCL availability, CPU tensors, P2P,
collective timeouts, and causes only the error text decides."""

from __future__ import annotations

from assistant.results import Verdict
from assistant.verdicts.devices import gpu_records, no_gpu
from assistant.verdicts.inputs import (
    JUDGES,
    Inputs,
    by_error,
    judges,
    kept_open,
    not_run,
    quote,
    undecided,
    verdict,
)

# --- backend ------------------------------------------------------------------


@judges("nccl-not-available")
def nccl_not_available(i: Inputs) -> Verdict:
    said = i.error_says(
        "nccl-not-available",
        "the error says this torch has no NCCL: {error}",
        "报错说这个 torch 没有 NCCL：{error}",
    )
    records = i.facts("backend")
    if not records:
        if said:
            return verdict("confirmed", said, source="error")
        return undecided(i, ("backend",), [])
    facts = records[0]["facts"]
    if facts["available"].get("nccl"):
        version = next((r["facts"].get("nccl") for r in i.facts("versions")), None)
        line = i.t(
            "this torch here has NCCL{version}",
            "本机的 torch 带有 NCCL{version}",
            version=f" {version}" if version else "",
        )
        if not said:
            return verdict("ruled_out", [line], source="probe")
        elsewhere = i.t(
            "so the failing job ran another torch build (a CPU-only, Windows or macOS one)",
            "所以出错的任务用的是另一个 torch（CPU 版、Windows 或 macOS 版）",
        )
        return verdict("confirmed", said + [line, elsewhere], source="error")
    return verdict("confirmed", [_why_no_nccl(i, facts.get("platform"))] + said, source="probe")


def _why_no_nccl(i: Inputs, platform: str | None) -> str:
    """Why this machine's torch has no NCCL, and what to do instead."""
    if platform in ("Windows", "Darwin"):
        return i.t(
            "there is no NCCL on {platform}: use the gloo backend",
            "{platform} 上没有 NCCL：请用 gloo 后端",
            platform=platform,
        )
    torch = next((r["facts"] for r in i.facts("versions")), {})
    if torch and not torch.get("torch_cuda"):
        return i.t(
            "this torch ({version}) is a CPU-only build without NCCL: init_process_group('nccl') "
            "fails here; install a CUDA build of torch, or use gloo (see no-cuda-visible)",
            "这个 torch（{version}）是不带 NCCL 的 CPU 版：本机上 init_process_group('nccl') 会失败；"
            "请安装 CUDA 版 torch，或改用 gloo（见 no-cuda-visible）",
            version=torch.get("torch") or "?",
        )
    return i.t(
        "this torch has no NCCL: init_process_group('nccl') fails here; use gloo or a torch build with NCCL",
        "这个 torch 没有 NCCL：本机上 init_process_group('nccl') 会失败；请用 gloo 或带 NCCL 的 torch",
    )


@judges("nccl-with-cpu-tensors")
def nccl_with_cpu_tensors(i: Inputs) -> Verdict:
    here = []
    for record in i.facts("backend"):
        text = (record["facts"].get("nccl") or {}).get("cpu_tensor_error")
        if text:
            here.append(
                i.t(
                    "here NCCL answers a CPU tensor with: {error}",
                    "本机上 NCCL 收到 CPU 张量时报：{error}",
                    error=quote(text, 120),
                )
            )
            break
    if i.error_names("nccl-with-cpu-tensors"):
        line = i.error_line(
            "the error is NCCL refusing a CPU tensor: {error}", "报错是 NCCL 拒绝 CPU 张量：{error}"
        )
        return verdict("confirmed", [line] + here, source="error")
    records = i.facts("backend")
    if records and not records[0]["facts"]["available"].get("nccl"):
        return verdict(
            "not_applicable",
            [i.t("this torch has no NCCL", "这个 torch 没有 NCCL")],
            source="probe",
        )
    none_here = no_gpu(i)
    if none_here:
        return none_here
    skipped = next(
        (
            r["facts"]["nccl"].get("reason")
            for r in records
            if (r["facts"].get("nccl") or {}).get("result") == "skipped"
        ),
        None,
    )
    if skipped and not here:
        here.append(
            i.t(
                "the backend probe skipped NCCL: {reason}",
                "backend 探针跳过了 NCCL：{reason}",
                reason=skipped,
            )
        )
    return undecided(i, ("backend",), here)


@judges("p2p-hang")
def p2p_hang(i: Inputs) -> Verdict:
    # The KB's p2p signatures include NCCL's INFO line "via P2P/IPC", printed
    # by healthy runs too: the error's words only keep the cause open.
    said = i.error_says(
        "p2p-hang",
        "the error shows NCCL peer-to-peer traffic or settings: {error}",
        "报错里有 NCCL 点对点传输的内容：{error}",
    )
    return kept_open(said, _p2p_here(i))


def _p2p_here(i: Inputs) -> Verdict:
    """What this machine's facts say about peer-to-peer hangs."""
    none_here = no_gpu(i)
    if none_here:
        return none_here
    gpus = gpu_records(i)
    if gpus and max(r["facts"]["device_count"] for r in gpus) < 2:
        return verdict(
            "not_applicable",
            [
                i.t(
                    "fewer than two GPUs per node: no peer-to-peer traffic",
                    "每个节点不到两张 GPU：没有点对点传输",
                )
            ],
            source="probe",
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
        value = "confirmed" if iommu_translates else "inconclusive"
        return verdict(value, [line] + evidence, source="probe")
    if nccl.get("result") == "wrong_result":
        line = i.t("the NCCL all_reduce returned wrong values", "NCCL all_reduce 返回了错误的结果")
        return verdict("confirmed", [line] + evidence, source="probe")
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
            return verdict("ruled_out", [line] + evidence, source="probe")
    return undecided(i, ("backend", "system"), evidence)


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
def collective_timeout(i: Inputs) -> Verdict:
    # A timeout is a symptom: a slow rank (this cause) or a rank that never
    # calls the collective (collective-mismatch) end the same way, so the
    # error alone leaves it open; raising the timeout fixes only the first.
    if not i.error_names("collective-timeout"):
        return not_run()
    evidence = [
        i.error_line(
            "the error says a collective timed out: a rank was slow, or never called it "
            "(see collective-mismatch): {error}",
            "报错说集合通信超时：某个 rank 太慢，或根本没调用它（见 collective-mismatch）：{error}",
        )
    ]
    fast = _fast_collective_here(i)
    return verdict("inconclusive", evidence + fast, source="error")


def _fast_collective_here(i: Inputs) -> list[str]:
    """How long a gloo all_reduce takes here, when the backend probe measured one."""
    for record in i.facts("backend")[:1]:
        gloo = record["facts"].get("gloo") or {}
        if gloo.get("result") == "ok":
            return [
                i.t(
                    "a gloo all_reduce across {n} ranks takes {ms} ms here: the collective itself is fast, so a rank was late or never came",
                    "本机 {n} 个 rank 的 gloo all_reduce 只要 {ms} ms：集合通信本身很快，是某个 rank 迟到或没来",
                    n=record.get("world_size"),
                    ms=round((gloo.get("seconds") or 0) * 1000, 1),
                )
            ]
    return []


@judges("collective-mismatch")
def collective_mismatch(i: Inputs) -> Verdict:
    if i.error_names("collective-mismatch"):
        line = i.error_line(
            "the error is a collective mismatch between ranks: {error}",
            "报错是各 rank 之间的集合通信不一致：{error}",
        )
        return verdict("confirmed", [line], source="error")
    if i.error_names("collective-timeout"):
        line = i.error_line(
            "the error says a collective timed out, as when one rank never calls it "
            "(a collective under `if rank == 0:`); --script checks your script for that: {error}",
            "报错说集合通信超时，某个 rank 根本没调用它时（比如写在 `if rank == 0:` 里）也会这样；"
            "--script 可以检查脚本：{error}",
        )
        return verdict("inconclusive", [line], source="error")
    return not_run()


JUDGES["uneven-inputs"] = by_error(
    "uneven-inputs",
    "the error shows a peer that left while others still waited, as when one rank finishes its data early",
    "报错显示某个对端已经退出而其他 rank 还在等待，就像某个 rank 提前跑完了数据",
    "inconclusive",
)
JUDGES["unused-parameters"] = by_error(
    "unused-parameters",
    "the error is DDP's message for parameters without a gradient: {error}",
    "报错是 DDP 在有参数没有梯度时的提示：{error}",
)
JUDGES["ddp-device-ids-cpu-module"] = by_error(
    "ddp-device-ids-cpu-module",
    "the error is DDP refusing device_ids for a module on the CPU: {error}",
    "报错是 DDP 拒绝为 CPU 上的模型设置 device_ids：{error}",
)
JUDGES["process-group-not-initialized"] = by_error(
    "process-group-not-initialized",
    "the error says a torch.distributed call ran before init_process_group: {error}",
    "报错说在 init_process_group 之前就调用了 torch.distributed：{error}",
)
JUDGES["syncbn-without-process-group"] = by_error(
    "syncbn-without-process-group",
    "the error is SyncBatchNorm's, run without a process group or off the GPU: {error}",
    "报错来自没有进程组或不在 GPU 上运行的 SyncBatchNorm：{error}",
)
JUDGES["ddp-wrapper-attribute"] = by_error(
    "ddp-wrapper-attribute",
    "the error is the DDP / DataParallel wrapper lacking an attribute of the model it wraps: {error}",
    "报错是 DDP / DataParallel 包装器上没有被包装模型的属性：{error}",
)
JUDGES["model-differs-across-ranks"] = by_error(
    "model-differs-across-ranks",
    "the error is DDP's check that every rank built the same model: {error}",
    "报错是 DDP 检查各个 rank 的模型是否相同时发现了不同：{error}",
)
JUDGES["interactive-launch"] = by_error(
    "interactive-launch",
    "the error is a launcher refusing, or failing, to start ranks from an interactive session: {error}",
    "报错是启动器拒绝或无法在交互式会话里启动多个 rank：{error}",
)
# CUDA refused in a forked child: torch's "Cannot re-initialize CUDA in forked
# subprocess", or CUDA's own "initialization error" (seen on an H200 from a
# DataLoader worker reading CUDA tensors its parent made). The bare CUDA error
# is also what a driver that failed to load prints, so the error alone only
# points at the fork; the script's finding (lint) is what confirms it.
JUDGES["cuda-init-before-fork"] = by_error(
    "cuda-init-before-fork",
    "the error is CUDA refused in a process, as in one forked after CUDA was set up "
    "(a DataLoader worker): {error}",
    "报错是进程里无法使用 CUDA，CUDA 初始化之后 fork 出来的进程（比如 DataLoader worker）就会这样：{error}",
    "inconclusive",
)
# "device-side assert triggered" is the kernel's own check failing: the cause
# itself, whatever line (a collective, a later .item()) it surfaced at.
JUDGES["device-side-assert"] = by_error(
    "device-side-assert",
    "the error is a CUDA kernel's assert (an index or label out of range): {error}",
    "报错是 CUDA kernel 的断言失败（索引或标签越界）：{error}",
)
JUDGES["dataset-cache-race"] = by_error(
    "dataset-cache-race",
    "the error is a dataset cache file that is missing or cut short while ranks build or read it: {error}",
    "报错是各个 rank 生成或读取数据集缓存时，缓存文件不存在或不完整：{error}",
    "inconclusive",  # a cache cut short by a full disk or an old crash reads the same
)
JUDGES["zero3-partitioned-parameters"] = by_error(
    "zero3-partitioned-parameters",
    "the error shows a parameter still partitioned to an empty placeholder (ZeRO-3 / FSDP shards it): {error}",
    "报错显示参数还是分片后的空占位（ZeRO-3 / FSDP 把它切分了）：{error}",
)
JUDGES["mp-spawn-arguments"] = by_error(
    "mp-spawn-arguments",
    "the error is a TypeError raised by spawn's own call of your function, fn(i, *args): {error}",
    "报错是 spawn 调用你的函数 fn(i, *args) 时抛出的 TypeError：{error}",
)
JUDGES["cuda-extension-build-failure"] = by_error(
    "cuda-extension-build-failure",
    "the error is a CUDA extension failing to build (toolkit, nvcc, ninja or compiler): {error}",
    "报错是 CUDA 扩展编译失败（CUDA 工具包、nvcc、ninja 或编译器）：{error}",
)
JUDGES["terminal-hangup"] = by_error(
    "terminal-hangup",
    "the error shows the launcher stopped by SIGHUP, the signal a closing terminal sends: {error}",
    "报错显示启动器收到了 SIGHUP，也就是终端关闭时发出的信号：{error}",
)
