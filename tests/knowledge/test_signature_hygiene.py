"""KB signatures name failures, not healthy output, and each shows in a symptom.

The verdicts read their error patterns from the KB signatures only
(assistant/verdicts/signatures.py), and retrieval weighs a signature match
most. So a signature that a healthy run prints (NCCL_DEBUG=INFO's transport
and environment lines) pulls a cause into every pasted INFO log, and a
signature no symptom shows is untested wording.
"""

from __future__ import annotations

import pytest

from assistant.knowledge.catalog import load_quietly
from assistant.knowledge.patterns import PatternSet, compile_signature

# A healthy 2-GPU, one-node run under NCCL_DEBUG=INFO with NCCL_SOCKET_IFNAME and
# NCCL_IB_DISABLE exported, in NCCL 2.19-2.21's format (host:pid:tid [dev] NCCL INFO ...):
# bootstrap, network selection, P2P/IPC and P2P/CUMEM channels, Init COMPLETE.
HEALTHY_NCCL_INFO = """\
gpu-node-1:20811:20811 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth0
gpu-node-1:20811:20811 [0] NCCL INFO Bootstrap : Using eth0:10.42.0.7<0>
gpu-node-1:20811:20811 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal implementation
gpu-node-1:20811:20811 [0] NCCL INFO cudaDriverVersion 12040
NCCL version 2.20.5+cuda12.4
gpu-node-1:20811:20869 [0] NCCL INFO NCCL_IB_DISABLE set by environment to 1.
gpu-node-1:20811:20869 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth0
gpu-node-1:20811:20869 [0] NCCL INFO NET/Socket : Using [0]eth0:10.42.0.7<0>
gpu-node-1:20811:20869 [0] NCCL INFO Using network Socket
gpu-node-1:20811:20869 [0] NCCL INFO ncclCommInitRank comm 0x55d0c2a0e350 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 1000 commId 0x7c3a1e2f9d4b8a61 - Init START
gpu-node-1:20811:20869 [0] NCCL INFO Setting affinity for GPU 0 to ffff,ffffffff
gpu-node-1:20811:20869 [0] NCCL INFO Channel 00/02 :    0   1
gpu-node-1:20811:20869 [0] NCCL INFO Channel 01/02 :    0   1
gpu-node-1:20811:20869 [0] NCCL INFO Trees [0] 1/-1/-1->0->-1 [1] 1/-1/-1->0->-1
gpu-node-1:20811:20869 [0] NCCL INFO P2P Chunksize set to 524288
gpu-node-1:20811:20869 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
gpu-node-1:20812:20870 [1] NCCL INFO Channel 01/0 : 1[1] -> 0[0] via P2P/CUMEM
gpu-node-1:20811:20869 [0] NCCL INFO Connected all rings
gpu-node-1:20811:20869 [0] NCCL INFO Connected all trees
gpu-node-1:20811:20869 [0] NCCL INFO 2 coll channels, 0 collnet channels, 0 nvls channels, 2 p2p channels, 2 p2p channels per peer
gpu-node-1:20811:20869 [0] NCCL INFO comm 0x55d0c2a0e350 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 1000 commId 0x7c3a1e2f9d4b8a61 - Init COMPLETE
"""


@pytest.fixture(scope="module")
def kb():
    knowledge = load_quietly()
    assert knowledge is not None, "the built-in KB must load"
    return knowledge


def test_the_healthy_block_is_a_real_info_block():
    lines = HEALTHY_NCCL_INFO.splitlines()
    assert len(lines) >= 20
    assert sum(" NCCL INFO " in line for line in lines) == len(lines) - 1  # and the version line
    assert "via P2P/IPC" in HEALTHY_NCCL_INFO and "Init COMPLETE" in HEALTHY_NCCL_INFO


def test_healthy_nccl_info_lines_match_no_cause_signature(kb):
    found = []
    for cause_id, cause in kb.causes.items():
        for line in HEALTHY_NCCL_INFO.splitlines():
            for signature in PatternSet.from_patterns(cause.signatures).matching(line):
                found.append(f"{cause_id}: {signature.source!r} matches {line!r}")
    assert not found, "\n".join(found)


def test_every_signature_shows_in_a_symptom_of_its_own_cause(kb):
    """A signature is error text as it appears: some symptom of the cause shows it."""
    unshown = [
        f"{cause_id}: {source!r}"
        for cause_id, cause in kb.causes.items()
        for source in cause.signatures
        if not any(compile_signature(source).search(text) for text in cause.symptoms)
    ]
    assert not unshown, "\n".join(unshown)


def test_a_tool_bound_cause_names_its_tool_in_every_symptom(kb):
    """`named_by` lowers a cause for reports that never name its tool: the
    cause's own symptoms, as people report it, must name it."""
    unnamed = [
        f"{cause_id}: {symptom!r}"
        for cause_id, cause in kb.causes.items()
        if cause.named_by
        for symptom in cause.symptoms
        if PatternSet.from_patterns(cause.named_by).search(symptom) is None
    ]
    assert not unnamed, "\n".join(unnamed)


# Wordings the verdicts used to carry as their own regexes, each from real output
# (torch's sources and warnings, CUDA's error strings, user reports), with the
# cause whose signature must now name it.
NAMED = [
    (
        "RuntimeError: CUDA error: no kernel image is available for execution on the device",
        "nccl-version-mismatch",
    ),
    (
        (
            "UserWarning: NVIDIA GeForce RTX 4090 with CUDA capability sm_89 is not compatible "
            "with the current PyTorch installation."
        ),
        "nccl-version-mismatch",
    ),
    (
        "RuntimeError: CUDA driver initialization failed, you might not have a CUDA gpu.",
        "no-cuda-visible",
    ),
    ("RuntimeError: CUDA error: no CUDA-capable device is detected", "no-cuda-visible"),
    (
        "Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=3, OpType=ALLREDUCE)",
        "collective-mismatch",
    ),
    ("KeyError: 'MASTER_ADDR'", "launched-without-torchrun"),
    ("KeyError: 'MASTER_PORT'", "launched-without-torchrun"),
    (
        (
            "[E socket.cpp:793] [c10d] The client socket has timed out after 1800s while trying "
            "to connect to (127.0.0.1, 48391)."
        ),
        "master-endpoint-mismatch",
    ),
    (
        "The client socket has timed out after 600000ms while trying to connect to (172.17.0.9, 46229).",
        "master-endpoint-mismatch",
    ),
]


@pytest.mark.parametrize("text, cause_id", NAMED)
def test_the_error_wording_is_named_by_its_cause(kb, text, cause_id):
    assert PatternSet.from_patterns(kb.causes[cause_id].signatures).search(text), text


# Generic lines every failing (or healthy) run can print: a cause whose signature
# caught them would be pulled to the top of unrelated reports.
GENERIC = [
    # ncclSystemError: shm-too-small and network-interface alike; the probes decide.
    (
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
        "ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for details)"
    ),
    (
        "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5 ncclUnhandledCudaError"
    ),
    (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
        "peer [127.0.0.1]:4331. This is typically caused by a remote worker crashing."
    ),
    (
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [10.0.0.2]:29501: "
        "Connection reset by peer"
    ),
    # What a user set or tried, and messages many causes print on the way down: as
    # signatures they named the first label 1 time in 5 (NCCL_SOCKET_IFNAME=), 2 in 6
    # (NCCL_IB_*=), 4 in 8 (NCCL_P2P_DISABLE=1), 3 in 7 (the watchdog's aftermath),
    # 1 in 3 (clients joined) and 0 in 4 (CUDA error: out of memory) over the
    # labelled reports (data/eval/README.md, "Session 23"). They stay symptoms.
    "os.environ['NCCL_P2P_DISABLE'] made no difference; with NCCL_P2P_DISABLE=1 it works",
    "export NCCL_SOCKET_IFNAME=eno1 on both nodes",
    "I set NCCL_IB_DISABLE=1 and NCCL_IB_GID_INDEX=3 and it still hangs",
    (
        "[Rank 3] Some NCCL operations have failed or timed out. Due to the asynchronous "
        "nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data."
    ),
    "torch.distributed.DistStoreError: Timed out after 1801 seconds waiting for clients. 1/2 clients joined.",
    "RuntimeError: CUDA error: out of memory",
    # DataParallel's wrapper of any replica's exception: the exception names the cause
    "RuntimeError: Caught RuntimeError in replica 1 on device 1.",
]


@pytest.mark.parametrize("text", GENERIC)
def test_generic_lines_name_no_cause(kb, text):
    named = signature_owners(kb, text)
    assert not named, named


def signature_owners(kb, text: str) -> list[str]:
    """The causes whose signatures match `text`."""
    return [
        cause_id
        for cause_id, cause in kb.causes.items()
        if PatternSet.from_patterns(cause.signatures).search(text)
    ]


# An attribute missing on the DDP / DataParallel wrapper: a public name is user code
# reading the model through the wrapper; a private one is a library calling torch
# internals another release has or lacks. _orig_mod (torch.compile's module, read
# through the wrapper) is private and the user's at once: both causes name it.
WRAPPER = "ddp-wrapper-attribute"
VERSIONS = "library-version-mismatch"
WRAPPER_ATTRIBUTES = [
    ("AttributeError: 'DistributedDataParallel' object has no attribute 'generate'", [WRAPPER]),
    ("ModuleAttributeError: 'DataParallel' object has no attribute 'encode'", [WRAPPER]),
    (
        "AttributeError: 'DistributedDataParallel' object has no attribute '_orig_mod'",
        [WRAPPER, VERSIONS],
    ),
    (
        "AttributeError: 'MMDistributedDataParallel' object has no attribute '_sync_params'",
        [VERSIONS],
    ),
    (
        "AttributeError: 'DistributedDataParallel' object has no attribute '_module_copies'",
        [VERSIONS],
    ),
    ("AttributeError: 'DistributedDataParallel' object has no attribute '_other_name'", [VERSIONS]),
]


@pytest.mark.parametrize("text, cause_ids", WRAPPER_ATTRIBUTES)
def test_a_wrapper_attribute_names_its_cause_by_whose_name_it_is(kb, text, cause_ids):
    named = [
        other
        for other in (WRAPPER, VERSIONS)
        if PatternSet.from_patterns(kb.causes[other].signatures).search(text)
    ]
    assert named == cause_ids, text


# DataParallel's own checks of a forward written for one GPU: each names that cause only.
DATAPARALLEL_CONTRACT = [
    # next(self.parameters()) in forward: empty in a DataParallel replica since torch 1.5
    "StopIteration: Caught StopIteration in replica 1 on device 1.",
    # PyTorch 1.2 and older checked the gathered outputs with a bare assert
    (
        '  File "torch/nn/parallel/_functions.py", line 54, in forward\n'
        "    assert all(map(lambda i: i.is_cuda, inputs))\nAssertionError"
    ),
]


@pytest.mark.parametrize("text", DATAPARALLEL_CONTRACT)
def test_dataparallels_own_checks_name_the_forward_contract_only(kb, text):
    assert signature_owners(kb, text) == ["dataparallel-unsafe-model"]
