"""Pipeline.doctor and run_named, fed with recorded facts (no launch).

RecordedRunner plays recorded probe runs back through the runner's interface,
so these tests check how doctor assembles and judges a machine we do not
have; the real runner is tested in test_runner.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from assistant.config import contract_ids
from assistant.pipeline import Pipeline
from assistant.probing.recorded import RecordedRunner
from assistant.probing.registry import probe_names

FACTS = Path(__file__).parents[1] / "fixtures" / "facts"


CAUSE = """\
id: set-device-order
title: set_device comes too late or not at all
title_zh: set_device 调用太晚或没有调用
summary: NCCL builds its communicator on the wrong device.
summary_zh: NCCL 在错误的设备上建立通信器。
why: The current device decides where NCCL and bare .cuda() calls go.
signatures: ['barrier\\(\\) using device']
symptoms: ['DDP 找不到设备']
fix: Set the device from LOCAL_RANK before init_process_group.
fix_code: torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
risks: None worth noting.
probes: [set_device_order]
references: [{title: DDP tutorial, url: https://pytorch.org/tutorials/intermediate/ddp_tutorial.html}]
"""
THREAD = """\
id: order-thread
title: where does set_device go
lang: zh
question: set_device 放哪里
answers:
- {id: a1, text: 放到 init_process_group 后面, lang: zh, claims: [set-device-order], stance: unverified, advice: set-device-after-init}
- {id: a2, text: 直接删掉 set_device, lang: zh, claims: [set-device-order], stance: wrong, advice: remove-set-device}
- {id: a3, text: 先 set_device 再 init, lang: zh, claims: [set-device-order], stance: right, advice: set-device-before-init}
- {id: a4, text: 检查 LOCAL_RANK, lang: zh, claims: [set-device-order], stance: right}
"""


@pytest.fixture
def order_kb(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "kb"
    (root / "causes").mkdir(parents=True)
    (root / "threads").mkdir()
    (root / "causes" / "set-device-order.yaml").write_text(CAUSE, encoding="utf-8")
    (root / "threads" / "order-thread.yaml").write_text(THREAD, encoding="utf-8")
    monkeypatch.setenv("ASSISTANT_KB", str(root))
    return root


def test_doctor_judges_every_contract_cause_confirmed_first(order_kb):
    runner = RecordedRunner(FACTS / "busy_port.json")
    result = Pipeline(runner=runner).doctor()
    assert runner.calls[-1] == probe_names()  # every registered probe, in the protocol's order
    assert set(runner.runs) == set(probe_names())
    assert sorted(c.id for c in result.causes) == sorted(contract_ids())
    assert result.causes[0].id == "master-port-in-use"
    assert result.causes[0].verdict.verdict == "confirmed"
    assert result.causes[-1].verdict.verdict == "ruled_out"
    assert result.query is None and result.root_error is None
    assert [p.name for p in result.probes] == runner.calls[-1]
    payload = result.to_json()
    assert payload["query"] is None and len(payload["causes"]) == len(contract_ids())


def test_doctor_settles_the_seed_advice_with_the_set_device_probe(order_kb):
    result = Pipeline(runner=RecordedRunner(FACTS / "healthy_8gpu.json")).doctor()
    cause = next(c for c in result.causes if c.id == "set-device-order")
    assert cause.title == "set_device comes too late or not at all"
    assert cause.probes == ["set_device_order"]
    # only answers with an advice tag are listed: those are what the probe settles
    # what the machine showed sits beside the community's stance, never over it
    here = {a.answer_id: a.here for a in cause.answers}
    assert here == {"a1": "confirmed_here", "a2": "refuted_here", "a3": "confirmed_here"}
    assert {a.answer_id: a.stance for a in cause.answers}["a2"] == "wrong"
    assert cause.verdict.refutes == ["remove-set-device"]


def test_doctor_falls_back_to_ids_when_the_kb_does_not_load(tmp_path, monkeypatch):
    monkeypatch.setenv("ASSISTANT_KB", str(tmp_path / "missing"))
    result = Pipeline(runner=RecordedRunner(FACTS / "cvd_empty.json")).doctor(lang="zh")
    assert all(c.title == c.id for c in result.causes)
    top = result.causes[0]
    assert top.verdict.verdict == "confirmed"
    assert any("CUDA_VISIBLE_DEVICES" in line for line in top.verdict.evidence)
    assert any("空值" in line for c in result.causes for line in c.verdict.evidence)


def test_run_named_runs_just_those_probes():
    runner = RecordedRunner(FACTS / "shm_64mb.json")
    runs = Pipeline(runner=runner).run_named(["system", "devices"])
    assert [r.name for r in runs] == ["system", "devices"]


def test_runner_verdicts_and_doctor_work_without_the_heavy_stack():
    """A bare GPU node has no pydantic, PyYAML, faiss or textual: doctor still works there."""
    code = textwrap.dedent(
        f"""
        import importlib.abc, json, sys

        class Missing(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("pydantic", "yaml", "faiss", "textual", "rich", "click", "torch",
                                          "sentence_transformers"):
                    raise ImportError(f"no module named {{name}} on this node")

        sys.meta_path.insert(0, Missing())
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from assistant.probing.recorded import RecordedRunner
        from assistant.pipeline import Pipeline
        result = Pipeline(runner=RecordedRunner(__import__("pathlib").Path({str(FACTS / "two_ranks_one_gpu.json")!r}))).doctor()
        print(json.dumps([c.id for c in result.causes if c.verdict.verdict == "confirmed"]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    confirmed = json.loads(done.stdout.strip().splitlines()[-1])
    assert "duplicate-gpu-per-rank" in confirmed
