"""`assistant lint`: each fixture under tests/data/scripts/ is named for its mistake
and marks the lines that must be reported with `# expect: <cause id>`; the
correct_*.py scripts carry no marker and must produce no finding, and so must
scripts kept there for run-time tests that say `# lint: no findings`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from assistant.errors import UserError
from assistant.lint import CHECKS, lint_script, lint_source
from assistant.lint.model import parse_script
from assistant.lint.tracer import trace_script

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
CONTRACT = Path(__file__).parents[2] / "data" / "causes.yaml"
MARKER = re.compile(r"#\s*expect:\s*([a-z0-9-]+)")
CLEAN_MARKER = "# lint: no findings"
FIXTURES = sorted(SCRIPTS.glob("*.py"))


def expected_findings(path: Path) -> set[tuple[str, int]]:
    """(cause id, line) for every `# expect:` marker in a fixture."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return {
        (match.group(1), number)
        for number, line in enumerate(lines, start=1)
        for match in MARKER.finditer(line)
    }


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_fixture_reports_exactly_its_marked_lines(path: Path) -> None:
    found = {(f.cause_id, f.line) for f in lint_script(path)}
    assert found == expected_findings(path)


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_only_correct_scripts_are_unmarked(path: Path) -> None:
    # A broken fixture without a marker would pass the test above vacuously.
    clean = path.stem.startswith("correct_") or CLEAN_MARKER in path.read_text(encoding="utf-8")
    assert bool(expected_findings(path)) != clean, (
        f"{path.name}: mark the lines lint must report with `# expect: <cause id>`, "
        f"or, for a script kept here for run-time tests, add a line `{CLEAN_MARKER}`"
    )


def test_every_check_has_a_broken_fixture_and_uses_contract_ids() -> None:
    contract = {c["id"] for c in yaml.safe_load(CONTRACT.read_text())["causes"]}
    # Causes the KB added beyond the contract (missing-distributed-sampler) may have checks too.
    kb_causes = {path.stem for path in (CONTRACT.parents[1] / "kb" / "causes").glob("*.yaml")}
    marked = {cause for path in FIXTURES for cause, _line in expected_findings(path)}
    registered = {cause for check in CHECKS for cause in check.cause_ids}
    assert registered <= contract | kb_causes
    assert registered <= marked


@pytest.mark.parametrize("check", CHECKS, ids=[c.run.__name__ for c in CHECKS])
def test_each_check_fires_on_a_fixture_and_only_under_its_cause_ids(check) -> None:
    # Two checks may share a cause id, and one check may serve two: each check, and each
    # of its ids, must still be exercised by a fixture.
    found = set()
    for path in FIXTURES:
        script = parse_script(path.read_text(encoding="utf-8"), str(path))
        script.traces = trace_script(script)
        found |= set(check.run(script))
    assert found, f"{check.name} reports nothing on any fixture"
    assert {f.cause_id for f in found} == set(check.cause_ids)


def test_checks_live_one_area_per_module_under_checks() -> None:
    modules = {check.run.__module__ for check in CHECKS}
    assert all(m.startswith("assistant.lint.checks.") for m in modules)
    assert len(modules) >= 5


def test_every_check_says_what_it_reports() -> None:
    assert all((check.run.__doc__ or "").strip() for check in CHECKS)


def test_findings_carry_path_and_sorted_lines() -> None:
    path = SCRIPTS / "barrier_only_on_rank_zero.py"
    findings = lint_script(path)
    assert [f.line for f in findings] == sorted(f.line for f in findings)
    assert all(f.path == str(path) and f.message for f in findings)


def test_only_dash_spelling_is_reported_too() -> None:
    source = (
        "import argparse, os\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--local-rank', type=int, default=int(os.environ['LOCAL_RANK']))\n"
    )
    assert [(f.cause_id, f.line) for f in lint_source(source)] == [("local-rank-arg-mismatch", 3)]


def test_required_local_rank_flag_is_an_arg_mismatch() -> None:
    source = (
        "import argparse\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--local_rank', '--local-rank', type=int, required=True)\n"
    )
    causes = [f.cause_id for f in lint_source(source)]
    assert causes == ["local-rank-arg-mismatch", "local-rank-not-from-env"]


@pytest.mark.parametrize(
    "env, reported",
    [
        # blind set ah's 01: LOCAL_RANK only written from the flag, never read
        (
            'if "LOCAL_RANK" not in os.environ:\n    os.environ["LOCAL_RANK"] = str(args.local_rank)\n',
            True,
        ),
        ('os.environ["LOCAL_RANK"] = str(args.local_rank)\n', True),
        # read: the flag falls back to it, or it overrides the flag
        ('args.local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))\n', False),
        (
            'if "LOCAL_RANK" in os.environ:\n    args.local_rank = int(os.environ["LOCAL_RANK"])\n',
            False,
        ),
    ],
)
def test_a_local_rank_flag_exported_as_local_rank_is_still_the_flags(env, reported) -> None:
    source = (
        "import argparse, os\nimport torch\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--local_rank', '--local-rank', type=int, default=0)\n"
        "args = p.parse_args()\n" + env + "torch.cuda.set_device(args.local_rank)\n"
    )
    causes = [f.cause_id for f in lint_source(source)]
    assert ("local-rank-not-from-env" in causes) == reported, causes


def test_spawn_at_module_level_is_reported_on_its_own_line() -> None:
    source = (
        "import torch.multiprocessing as mp\ndef work(rank):\n    pass\nmp.spawn(work, nprocs=2)\n"
    )
    assert [(f.cause_id, f.line) for f in lint_source(source)] == [("missing-main-guard", 4)]


@pytest.mark.parametrize(
    "backend, start, reported",
    [
        ("gloo", "", True),  # Windows and macOS spawn the loader's workers: they re-import
        ("nccl", "", False),  # NCCL runs on Linux, where the workers fork
        ("nccl", "mp.set_start_method('spawn')\n", True),
        ("nccl", "mp.set_start_method('fork')\n", False),
    ],
)
def test_a_loader_with_workers_at_import_time_matters_where_workers_spawn(
    backend, start, reported
) -> None:
    # blind set bd's 18: a launch.py tutorial on NCCL, all at module level
    source = (
        "import torch.distributed as dist\nimport torch.multiprocessing as mp\n"
        "from torch.utils.data import DataLoader\n"
        + start
        + f"dist.init_process_group('{backend}')\n"
        "loader = DataLoader(data, batch_size=8, num_workers=2)\n"
        "for batch in loader:\n    pass\n"
    )
    found = [f.cause_id for f in lint_source(source) if f.cause_id == "missing-main-guard"]
    assert bool(found) == reported


def test_collective_in_both_branches_is_not_a_mismatch() -> None:
    source = (
        "import torch.distributed as dist\n"
        "def main():\n"
        "    dist.init_process_group('gloo')\n"
        "    if dist.get_rank() != 0:\n"
        "        dist.barrier()\n"
        "    else:\n"
        "        dist.barrier()\n"
        "main()\n"
    )
    assert lint_source(source) == []


def test_collective_only_on_other_ranks_is_a_mismatch() -> None:
    source = (
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() != 0:\n"
        "    dist.barrier()\n"
    )
    findings = lint_source(source)
    assert [(f.cause_id, f.line) for f in findings] == [("collective-mismatch", 4)]
    assert "every rank but 0" in findings[0].message


def test_dist_calls_in_a_file_without_init_are_reported() -> None:
    source = "import torch.distributed as dist\nprint(dist.get_world_size())\n"
    assert [(f.cause_id, f.line) for f in lint_source(source)] == [
        ("process-group-not-initialized", 2)
    ]


def test_imported_setup_helper_silences_the_missing_init() -> None:
    source = (
        "import torch.distributed as dist\n"
        "from mylib.distributed import setup_distributed\n"
        "setup_distributed()\n"
        "print(dist.get_world_size())\n"
    )
    assert lint_source(source) == []


def findings_of(source: str, cause: str | None = None) -> list[tuple[str, int]]:
    return [(f.cause_id, f.line) for f in lint_source(source) if cause in (None, f.cause_id)]


MESH_FIRST = (
    "import torch.distributed as dist\n"
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "def main():\n"
    "    mesh = init_device_mesh('cpu', (2,), mesh_dim_names=('dp',))\n"
    "    rank = dist.get_rank()\n"
    "    dist.barrier()\n"
    "main()\n"
)


def test_a_device_mesh_starts_the_default_group() -> None:
    """DeviceMesh's constructor calls init_process_group() when no group exists
    (blind set gh: 3D meshes made with no init_process_group of their own); a
    call before the mesh still needs a group it does not have."""
    assert findings_of(MESH_FIRST) == []
    before = MESH_FIRST.replace(
        "    mesh = init_device_mesh('cpu', (2,), mesh_dim_names=('dp',))\n"
        "    rank = dist.get_rank()\n",
        "    rank = dist.get_rank()\n"
        "    mesh = init_device_mesh('cpu', (2,), mesh_dim_names=('dp',))\n",
    )
    findings = lint_source(before)
    assert [(f.cause_id, f.line) for f in findings] == [("process-group-not-initialized", 4)]
    assert "init_device_mesh(), which starts it, comes later (line 5)" in findings[0].message


def test_a_mesh_made_first_really_starts_the_group_under_torchrun(torchrun, tmp_path) -> None:
    script = tmp_path / "mesh_first.py"
    script.write_text(MESH_FIRST + "assert dist.get_world_size() == 2\n")
    result = torchrun(script)
    assert result.returncode == 0, result.stderr[-2000:]
    broken = tmp_path / "rank_first.py"
    broken.write_text("import torch.distributed as dist\ndist.get_rank()\n")
    assert "Default process group has not been initialized" in torchrun(broken).stderr


# blind set gh: 3D-parallel scripts whose only process-group start is the device mesh
MESH_JOB = (
    "import os\nimport torch\nimport wandb\n"
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "def main():\n"
    "    mesh = init_device_mesh('cuda', (2, 2, 2), mesh_dim_names=('pp', 'dp', 'tp'))\n"
    "    is_last = mesh['pp'].get_local_rank() == 1\n"
    "    if is_last:\n"
    "        wandb.init(project='x')\n"
    "    torch.save({'step': 1}, 'trainer_state.pt')\n"
    "main()\n"
)


def test_a_script_that_only_makes_a_device_mesh_is_distributed() -> None:
    """Every check that asks whether the script runs as one process of several counts
    the mesh as the process group's start: a save and a tracker's run on many ranks."""
    found = {cause: line for cause, line in findings_of(MESH_JOB)}
    assert found.get("checkpoint-written-by-every-rank") == 10
    assert found.get("experiment-logger-ddp") == 9
    single = MESH_JOB.replace("init_device_mesh('cuda', (2, 2, 2), ", "dict(")
    assert findings_of(single) == []


def test_a_tracker_under_a_test_that_many_ranks_pass_is_said_to_run_on_those() -> None:
    [logger] = [f for f in lint_source(MESH_JOB) if f.cause_id == "experiment-logger-ddp"]
    assert "wandb.init runs on every rank where `is_last` holds, not on one" in logger.message
    plain = MESH_JOB.replace(
        "    if is_last:\n        wandb.init", "    if True:\n        pass\n    wandb.init"
    )
    [logger] = [f for f in lint_source(plain) if f.cause_id == "experiment-logger-ddp"]
    assert logger.message.startswith("wandb.init runs on every rank: N runs")


def test_a_trackers_init_is_not_a_distributed_setup_helper() -> None:
    """`wandb.init()` starts an experiment run, not a process group: a file whose only
    "init" is a tracker's still has no process group (blind set gh's 06 read it as one)."""
    source = (
        "import wandb\n"
        "import torch.distributed as dist\n"
        "print(dist.get_world_size())\n"
        "wandb.init(project='x')\n"
    )
    findings = lint_source(source)
    assert [(f.cause_id, f.line) for f in findings] == [("process-group-not-initialized", 3)]
    assert "init_process_group is never called in this file" in findings[0].message
    # and a tracker's init first does not silence a file with no process group at all
    first = source.replace(
        "print(dist.get_world_size())\nwandb.init(project='x')\n",
        "wandb.init(project='x')\nprint(dist.get_world_size())\n",
    )
    assert findings_of(first) == [("process-group-not-initialized", 4)]


# The twins of the correct_* fixtures that real repositories' scripts gave
# (data/eval/README.md, "Session 18"): each narrowing still reports the mistake.
DDP_HEADER = (
    "import os\n"
    "import torch\n"
    "from torch import nn\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
)


@pytest.mark.parametrize(
    "replaced, reported",
    [
        ("    device = torch.device('cuda', LOCAL_RANK)\n", False),
        ("    device = torch.device('cuda', 1)\n", True),
        ("", True),
    ],
)
def test_a_one_process_cuda0_default_the_ranks_own_device_replaces_is_quiet(
    replaced, reported
) -> None:
    # blind set be's 05: YOLOv5's train.py picks cuda:0, then the rank's GPU under DDP
    source = (
        DDP_HEADER
        + "import torch.distributed as dist\n"
        + "LOCAL_RANK = int(os.getenv('LOCAL_RANK', -1))\n"
        + "def main():\n"
        + "    device = torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')\n"
        + "    if LOCAL_RANK != -1:\n"
        + "        torch.cuda.set_device(LOCAL_RANK)\n"
        + replaced.replace("    device", "        device")
        + "        dist.init_process_group('nccl')\n"
        + "    model = DDP(nn.Linear(4, 4).to(device), device_ids=[LOCAL_RANK])\n"
    )
    found = [line for cause, line in findings_of(source) if cause == "hardcoded-device"]
    assert (8 in found) == reported, found


def test_cuda_without_set_device_is_reported_when_the_file_wraps_in_ddp_itself() -> None:
    # No init here and no imported setup helper: nothing else can have set the device.
    source = DDP_HEADER + "model = DDP(nn.Linear(4, 4).cuda())\n"
    assert findings_of(source) == [("hardcoded-device", 5)]


def test_a_constant_visible_devices_list_does_not_give_each_process_its_gpu() -> None:
    source = (
        DDP_HEADER + "import torch.distributed as dist\n"
        'os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"\n'
        'dist.init_process_group("nccl")\n'
        "x = torch.ones(1).cuda()\n"
    )
    assert findings_of(source) == [("set-device-order", 7), ("hardcoded-device", 8)]


def test_gpu_zero_in_a_helper_every_rank_calls_is_reported() -> None:
    # evaluate() runs on rank 0 and, below, on every rank: GPU 0 is not every rank's own.
    source = (
        DDP_HEADER + "def evaluate(x):\n"
        "    return x.cuda(0)\n"
        "rank = int(os.environ['RANK'])\n"
        "if rank == 0:\n"
        "    evaluate(torch.ones(1))\n"
        "evaluate(torch.ones(2))\n"
    )
    assert findings_of(source) == [("hardcoded-device", 6)]


@pytest.mark.parametrize(
    "option, setting, reported",
    [
        # blind set cl's 14: the single-GPU script's --gpuid option, one value for all
        ("p.add_argument('--gpuid', type=int, default=0)\n", "", True),
        ("p.add_argument('--gpuid', type=int, default=0)\n", "args.gpuid = local_rank\n", False),
        # the launcher's per-process option is local-rank-not-from-env's
        ("p.add_argument('--local_rank', type=int, default=0)\n", "", False),
    ],
)
def test_a_gpu_index_from_an_option_is_the_same_on_every_rank(option, setting, reported) -> None:
    name = "local_rank" if "local_rank'" in option else "gpuid"
    source = (
        DDP_HEADER
        + "import argparse\nimport torch.distributed as dist\n"
        + "p = argparse.ArgumentParser()\n"
        + option
        + "args = p.parse_args()\n"
        + "local_rank = int(os.environ['LOCAL_RANK'])\n"
        + setting
        + "torch.cuda.set_device(local_rank)\n"
        + 'dist.init_process_group("nccl")\n'
        + f"loss_fn = torch.nn.BCEWithLogitsLoss().cuda(args.{name})\n"
    )
    found = findings_of(source, "hardcoded-device")
    assert bool(found) == reported, found


@pytest.mark.parametrize(
    "setting, reported",
    [
        ("GPU = 0\n", True),  # br's 12: left from the single-GPU script
        ("GPU = 0\nGPU = int(os.environ['LOCAL_RANK'])\n", False),  # set to the rank's too
        ("GPU = 0\ndef place(x, GPU):\n    return x.cuda(GPU)\n", False),  # a parameter too
    ],
)
def test_a_gpu_index_the_file_only_sets_to_one_number_is_the_same_on_every_rank(
    setting, reported
) -> None:
    source = (
        DDP_HEADER
        + "import torch.distributed as dist\n"
        + setting
        + "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
        + 'dist.init_process_group("nccl")\n'
        + "target = torch.zeros(4).cuda(GPU)\n"
    )
    line = source.count("\n")
    assert findings_of(source, "hardcoded-device") == (
        [("hardcoded-device", line)] if reported else []
    )


def test_device_ids_on_a_model_built_here_or_by_a_torch_constructor_is_reported() -> None:
    for build in ("nn.Linear(4, 4)", "torchvision.models.resnet18()", "Net()"):
        source = (
            DDP_HEADER + "import torchvision\n"
            "class Net(nn.Module):\n    pass\n"
            f"model = {build}\n"
            "model = DDP(model, device_ids=[int(os.environ['LOCAL_RANK'])])\n"
        )
        assert findings_of(source) == [("ddp-device-ids-cpu-module", 9)], build


@pytest.mark.parametrize("moved", [True, False])
def test_device_ids_follow_a_pair_of_models_built_in_one_tuple_assignment(moved) -> None:
    # a GAN's two networks: `G, D = Gen().to(dev), Disc().to(dev)`, each wrapped on its own
    move = ".to(int(os.environ['LOCAL_RANK']))" if moved else ""
    source = (
        DDP_HEADER
        + f"netG, netD = nn.Linear(4, 4){move}, nn.Linear(4, 2){move}\n"
        + "netG = DDP(netG, device_ids=[int(os.environ['LOCAL_RANK'])])\n"
        + "netD = DDP(netD, device_ids=[int(os.environ['LOCAL_RANK'])])\n"
    )
    expected = [] if moved else [("ddp-device-ids-cpu-module", 6), ("ddp-device-ids-cpu-module", 7)]
    assert findings_of(source) == expected


@pytest.mark.parametrize("moved", [True, False])
@pytest.mark.parametrize(
    "wrap",
    ["nn.SyncBatchNorm.convert_sync_batchnorm({})", "torch.compile({})", "{}"],
)
def test_device_ids_look_through_wrappers_that_keep_the_module_where_it_is(wrap, moved) -> None:
    # convert_sync_batchnorm builds its SyncBatchNorm layers from the moved parameters
    source = (
        DDP_HEADER
        + "model = nn.Linear(4, 4)\n"
        + ("model = model.to(int(os.environ['LOCAL_RANK']))\n" if moved else "\n")
        + f"model = DDP({wrap.format('model')}, device_ids=[int(os.environ['LOCAL_RANK'])])\n"
    )
    expected = [] if moved else [("ddp-device-ids-cpu-module", 7)]
    assert findings_of(source) == expected, wrap


@pytest.mark.parametrize(
    "loop, reported",
    [
        # blind set ir's 14 and 15: the frozen parts and the trained one moved in one loop
        ("for m in (text_encoder, model):\n    m.requires_grad_(False).to(0)\n", False),
        ("for m in [text_encoder, model]:\n    m.requires_grad_(False)\n    m.to(0)\n", False),
        ("for m in (text_encoder, other):\n    m.to(0)\n", True),  # not the wrapped one
        ("for m in (text_encoder, model):\n    m.requires_grad_(False)\n", True),  # no move
    ],
)
def test_a_module_moved_by_a_loop_over_the_modules_is_moved(loop, reported) -> None:
    source = (
        DDP_HEADER
        + "text_encoder, model, other = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)\n"
        + loop
        + "model = DDP(model, device_ids=[int(os.environ['LOCAL_RANK'])])\n"
    )
    wrap = source.count("\n")  # the last line
    expected = [("ddp-device-ids-cpu-module", wrap)] if reported else []
    assert findings_of(source) == expected


@pytest.mark.parametrize("moved", [True, False])
def test_a_deep_copy_is_where_its_original_is(moved) -> None:
    # blind set is's 10: a candidate network copied from the best one, then wrapped
    move = ".to(int(os.environ['LOCAL_RANK']))" if moved else ""
    source = (
        DDP_HEADER
        + "import copy\n"
        + f"best = nn.Linear(4, 4){move}.eval()\n"
        + "candidate = copy.deepcopy(best)\n"
        + "model = DDP(candidate, device_ids=[int(os.environ['LOCAL_RANK'])])\n"
    )
    assert findings_of(source) == ([] if moved else [("ddp-device-ids-cpu-module", 8)])


@pytest.mark.parametrize(
    "after, reported",
    [
        # blind sets bd's 15 and be's 18: the move comes on the line after the wrap
        ("model = model.to(int(os.environ['LOCAL_RANK']))\n", True),
        ("model.to(int(os.environ['LOCAL_RANK']))\n", True),
        ("", True),
    ],
)
def test_a_module_moved_only_after_ddp_wraps_it_is_still_on_the_cpu(after, reported) -> None:
    source = (
        DDP_HEADER
        + "model = nn.Linear(4, 4)\n"
        + "model = DDP(model, device_ids=[int(os.environ['LOCAL_RANK'])])\n"
        + after
    )
    assert findings_of(source) == ([("ddp-device-ids-cpu-module", 6)] if reported else [])
    # moved in a helper the file calls first: where it runs is not read, so it counts
    helper = source.replace(
        "model = nn.Linear(4, 4)\n",
        "def place():\n    model.to(int(os.environ['LOCAL_RANK']))\nmodel = nn.Linear(4, 4)\n",
    )
    assert findings_of(helper) == []


@pytest.mark.parametrize(
    "placed, reported",
    [
        ("model.head.to(int(os.environ['LOCAL_RANK']))\n", False),  # part by part (bs's 05)
        ("model.blocks.head.to(int(os.environ['LOCAL_RANK']))\n", False),
        ("other.head.to(int(os.environ['LOCAL_RANK']))\n", True),  # another model's part
        ("modelx.to(int(os.environ['LOCAL_RANK']))\n", True),  # a name that only starts alike
    ],
)
def test_a_module_placed_part_by_part_before_the_wrap_is_not_said_never_moved(
    placed, reported
) -> None:
    source = (
        DDP_HEADER
        + "model = nn.Sequential(nn.Linear(4, 4))\n"
        + placed
        + "model = DDP(model, device_ids=[int(os.environ['LOCAL_RANK'])])\n"
    )
    assert findings_of(source) == ([("ddp-device-ids-cpu-module", 7)] if reported else [])


@pytest.mark.parametrize(
    "factory, reported",
    [
        # blind set cg's 09: the file's factory returns the module it moved
        ("    return nn.SyncBatchNorm.convert_sync_batchnorm(m).to(device)\n", False),
        ("    m = m.cuda(device)\n    return m\n", False),
        ("    return m\n", True),
    ],
)
def test_a_module_the_files_factory_moves_before_returning_it_is_on_its_device(
    factory, reported
) -> None:
    source = (
        DDP_HEADER
        + "def build_model(n, device):\n"
        + "    m = nn.Linear(4, n)\n"
        + factory
        + "local_rank = int(os.environ['LOCAL_RANK'])\n"
        + "net = DDP(build_model(10, local_rank), device_ids=[local_rank])\n"
    )
    line = source.count("\n")
    expected = [("ddp-device-ids-cpu-module", line)] if reported else []
    assert findings_of(source, "ddp-device-ids-cpu-module") == expected


@pytest.mark.parametrize(
    "factory, reported",
    [
        # blind set dq's 03: pruned = Net(...).to(model's device); return pruned
        ("    m = nn.Linear(4, n).to(device)\n    return m\n", False),
        ("    m = nn.Linear(4, n)\n    return m\n", True),
    ],
)
def test_a_name_the_files_factory_filled_then_wrapped_in_place_is_on_its_device(
    factory, reported
) -> None:
    source = (
        DDP_HEADER
        + "def prune(n, device):\n"
        + factory
        + "local_rank = int(os.environ['LOCAL_RANK'])\n"
        + "student = prune(10, local_rank)\n"
        + "student = nn.SyncBatchNorm.convert_sync_batchnorm(student)\n"
        + "net = DDP(student, device_ids=[local_rank])\n"
    )
    line = source.count("\n")
    expected = [("ddp-device-ids-cpu-module", line)] if reported else []
    assert findings_of(source, "ddp-device-ids-cpu-module") == expected


@pytest.mark.parametrize(
    "init, reported",
    [
        ("self.model = model", False),  # cc's 16: a loss wrapper that holds the moved model
        ("self.model = model\n        self.head = nn.Linear(4, 2)", True),  # a layer of its own
    ],
)
def test_a_wrapper_module_around_a_moved_model_is_on_its_device(init, reported) -> None:
    source = (
        DDP_HEADER
        + "class LossWrapper(nn.Module):\n"
        + "    def __init__(self, model):\n"
        + "        super().__init__()\n"
        + f"        {init}\n"
        + "model = nn.Linear(4, 4).to(int(os.environ['LOCAL_RANK']))\n"
        + "net = DDP(LossWrapper(model), device_ids=[int(os.environ['LOCAL_RANK'])])\n"
    )
    line = source.count("\n")
    expected = [("ddp-device-ids-cpu-module", line)] if reported else []
    assert findings_of(source, "ddp-device-ids-cpu-module") == expected


@pytest.mark.parametrize("moved", [True, False])
def test_device_ids_on_a_model_a_helper_returns_with_other_values_is_not_judged(moved) -> None:
    # blind set at 04: `student, macs = prune(dense.to(device))` (a tuple from one call:
    # the file does not show which device the helper's model is on), then a
    # convert_sync_batchnorm of itself, which keeps it there
    source = (
        DDP_HEADER
        + "def prune(model):\n    return model, 0\n"
        + "dense = nn.Linear(4, 4)\n"
        + ("dense = dense.to(int(os.environ['LOCAL_RANK']))\n" if moved else "\n")
        + "student, macs = prune(dense)\n"
        + "student = nn.SyncBatchNorm.convert_sync_batchnorm(student)\n"
        + "student = DDP(student, device_ids=[int(os.environ['LOCAL_RANK'])])\n"
    )
    assert findings_of(source) == []
    # built here and only wrapped in place: still never moved
    built = source.replace("student, macs = prune(dense)\n", "student = nn.Linear(4, 4)\n")
    assert findings_of(built) == [("ddp-device-ids-cpu-module", 11)]


def test_device_ids_on_a_parameter_is_not_judged_by_another_functions_same_name() -> None:
    # blind set ce's 19: the wrapped name is the function's parameter; main's
    # `model = None` / `model = train(...)` are another function's bindings
    source = (
        DDP_HEADER
        + "def fresh():\n    return nn.Linear(4, 4).to(int(os.environ['LOCAL_RANK']))\n"
        + "def train(model, epochs):\n"
        + "    ddp = DDP(model, device_ids=[int(os.environ['LOCAL_RANK'])])\n"
        + "    return model\n"
        + "def main():\n"
        + "    model = None\n"
        + "    model = train(fresh(), 1)\n"
    )
    line = (
        source.splitlines().index(
            "    ddp = DDP(model, device_ids=[int(os.environ['LOCAL_RANK'])])"
        )
        + 1
    )
    assert findings_of(source, "ddp-device-ids-cpu-module") == []
    rebound = source.replace("    ddp = DDP(model,", "    model = DDP(model,")
    assert findings_of(rebound, "ddp-device-ids-cpu-module") == []
    # the same name assigned in the function itself is judged there
    assigned = source.replace(
        "def train(model, epochs):\n", "def train(model, epochs):\n    model = nn.Linear(4, 4)\n"
    )
    assert findings_of(assigned, "ddp-device-ids-cpu-module") == [
        ("ddp-device-ids-cpu-module", line + 1)
    ]


@pytest.mark.parametrize(
    "setup, test",
    [
        ("master_process = True\nif ddp:\n    master_process = rank == 0\n", "master_process"),
        ("ngpus_per_node = 8\n", "rank % ngpus_per_node == 0"),
        ("", "rank % torch.cuda.device_count() == 0"),
        ("", "gpu_id == 0"),
        ("", "args.distributed and args.rank == 0"),
        ("", "not args.multiprocessing_distributed or rank == 0"),
        ("main_device = rank is None or rank == 0\n", "main_device"),
    ],
)
def test_rank_zero_idioms_of_real_scripts_are_read_as_rank_zero(setup, test) -> None:
    # nanoGPT's flag, ImageNet's first rank of each node, the tutorials' gpu_id, and a
    # test that holds on every rank when not distributed: a barrier there hangs.
    source = (
        "import torch\nimport torch.distributed as dist\n"
        'dist.init_process_group("gloo")\nrank = dist.get_rank()\n'
        + setup
        + f"if {test}:\n    dist.barrier()\n"
    )
    line = source.count("\n")
    assert findings_of(source) == [("collective-mismatch", line)], test


def test_rank_modulo_an_unrelated_number_is_not_rank_zero() -> None:
    source = (
        "import torch.distributed as dist\n"
        'dist.init_process_group("gloo")\n'
        "if dist.get_rank() % 2 == 0:\n    dist.barrier()\n"
    )
    assert findings_of(source) == []


def test_a_helper_is_traced_from_its_callers_rank_test() -> None:
    # The helper comes first in the file; walked alone it would look like every rank's.
    source = (
        "import torch.distributed as dist\n"
        "class Trainer:\n"
        "    def _sync(self):\n"
        "        dist.barrier()\n"
        "    def train(self):\n"
        "        if self.gpu_id == 0:\n"
        "            self._sync()\n"
    )
    findings = lint_source(source)
    assert [(f.cause_id, f.line) for f in findings] == [("collective-mismatch", 4)]
    assert "rank 0 only" in findings[0].message


# Classes of miss from broken scripts written by helpers who never saw the linter
# (data/eval/README.md, "Session 18"): each failed before its change.
NCCL_HEADER = 'import torch\nimport torch.distributed as dist\ndist.init_process_group("nccl")\n'


def test_a_cpu_tensor_reduced_in_a_nested_callback_is_reported() -> None:
    source = NCCL_HEADER + (
        "def main(trainer):\n"
        "    def on_batch_end(losses):\n"
        "        avg = torch.tensor(sum(losses) / len(losses))\n"
        "        dist.all_reduce(avg)\n"
        "    trainer.add_callback(on_batch_end)\n"
    )
    assert findings_of(source, "nccl-with-cpu-tensors") == [("nccl-with-cpu-tensors", 7)]


@pytest.mark.parametrize(
    "made, flagged",
    [
        # blind set by's 02: DETR's num_boxes, a count made a CPU tensor, then reduced
        ("    n = torch.as_tensor([n], dtype=torch.float)\n", True),
        ("    n = torch.as_tensor([n], dtype=torch.float, device=device)\n", False),
        # made on the CPU only on one branch: what it holds at the collective is unknown
        ("    if use_cpu:\n        n = torch.as_tensor([n])\n", False),
    ],
)
def test_the_last_assignment_above_a_collective_decides_its_device(made, flagged) -> None:
    source = NCCL_HEADER + (
        "def num_boxes(targets, device, use_cpu):\n"
        "    n = sum(len(t) for t in targets)\n" + made + "    if dist.is_initialized():\n"
        "        dist.all_reduce(n)\n"
        "    return n\n"
    )
    line = source.count("\n") - 1
    expected = [("nccl-with-cpu-tensors", line)] if flagged else []
    assert findings_of(source, "nccl-with-cpu-tensors") == expected


@pytest.mark.parametrize(
    ("group", "flagged"),
    [
        # blind set fa's 13: statistics summed on the CPU over a gloo group the file made
        ("stats_group", False),
        ("self_group", True),  # a group on the default backend
        (None, True),
    ],
)
def test_a_cpu_tensor_reduced_over_a_gloo_group(group, flagged) -> None:
    passed = "" if group is None else f", group={group}"
    source = NCCL_HEADER + (
        'stats_group = dist.new_group(backend="gloo")\n'
        "self_group = dist.new_group()\n"
        "def statistics(files):\n"
        "    counts = torch.zeros(3, dtype=torch.float64)\n"
        f"    dist.all_reduce(counts{passed})\n"
    )
    expected = [("nccl-with-cpu-tensors", 8)] if flagged else []
    assert findings_of(source, "nccl-with-cpu-tensors") == expected


@pytest.mark.parametrize(
    ("reset", "flagged"),
    [
        # blind set fj's 10: running sums a metric keeps in CPU fields, joined and reduced
        (
            "self.sums = torch.zeros(3, dtype=torch.float64)\n        self.count = torch.zeros(1)",
            True,
        ),
        (
            "self.sums = torch.zeros(3, device=d)\n        self.count = torch.zeros(1, device=d)",
            False,
        ),
        # moved where they are made elsewhere: not every value of the fields is on the CPU
        (
            (
                "self.sums, self.count = torch.zeros(3), torch.zeros(1)\n"
                "    def to(self, d):\n"
                "        self.sums, self.count = self.sums.to(d), self.count.to(d)"
            ),
            False,
        ),
    ],
)
def test_fields_made_on_the_cpu_in_another_method_then_reduced(reset, flagged) -> None:
    source = NCCL_HEADER + (
        "class Accumulator:\n"
        "    def reset(self, d):\n        " + reset + "\n"
        "    def compute(self):\n"
        "        buf = torch.cat([self.sums, self.count])\n"
        "        dist.all_reduce(buf)\n"
        "        return buf\n"
    )
    line = source.count("\n") - 1
    expected = [("nccl-with-cpu-tensors", line)] if flagged else []
    assert findings_of(source, "nccl-with-cpu-tensors") == expected


@pytest.mark.parametrize(
    ("made", "flagged"),
    [
        # blind set fz's 02: a loss table kept in CPU fields, each all-reduced as it is
        ("torch.zeros(n)", True),
        ("torch.zeros(n, device=d)", False),
    ],
)
def test_a_field_made_on_the_cpu_reduced_as_it_is(made, flagged) -> None:
    source = NCCL_HEADER + (
        "class LossHistory:\n"
        f"    def __init__(self, n, d):\n        self.sum = {made}\n"
        "    def sync(self):\n"
        "        dist.all_reduce(self.sum)\n"
    )
    line = source.count("\n")
    expected = [("nccl-with-cpu-tensors", line)] if flagged else []
    assert findings_of(source, "nccl-with-cpu-tensors") == expected


def test_a_cpu_tensor_reassigned_only_after_the_collective_is_reported() -> None:
    source = NCCL_HEADER + (
        "def sync(count, total):\n"
        "    t = torch.tensor([count, total], dtype=torch.float64)\n"
        "    dist.all_reduce(t)\n"
        "    t = t.tolist()\n"
        "    return t\n"
    )
    assert findings_of(source, "nccl-with-cpu-tensors") == [("nccl-with-cpu-tensors", 6)]


@pytest.mark.parametrize(
    "parts, flagged",
    [
        # blind sets cq's 11 and cs's 17: the gathered parts listed, then sent in a loop
        ("torch.cat(probs), torch.cat(ids)", True),
        ("torch.cat(probs).to(device), torch.cat(ids).to(device)", False),
    ],
)
def test_a_collective_in_a_loop_over_listed_tensors_sends_each_of_them(parts, flagged) -> None:
    source = NCCL_HEADER + (
        "def collect(model, loader, device, world):\n"
        "    probs, ids = [], []\n"
        "    for x, i in loader:\n"
        "        probs.append(model(x.to(device)).sigmoid().cpu())\n"
        "        ids.append(i)\n"
        f"    local = ({parts})\n"
        "    out = []\n"
        "    for t in local:\n"
        "        bufs = [torch.empty_like(t) for _ in range(world)]\n"
        "        dist.all_gather(bufs, t)\n"
        "        out.append(torch.cat(bufs))\n"
        "    return out\n"
    )
    found = findings_of(source, "nccl-with-cpu-tensors")
    assert bool(found) == flagged, found


@pytest.mark.parametrize(
    "stacked, flagged",
    [
        # blind set hz's 10: the CPU predictions' concatenation stacked with the ids
        ("torch.stack([torch.cat(probs), torch.cat(ids).float()], 1)", True),
        ("torch.stack([torch.cat(probs), torch.cat(ids).float()], 1).to(device)", False),
    ],
)
def test_a_stack_of_lists_held_on_the_cpu_is_on_the_cpu(stacked, flagged) -> None:
    source = NCCL_HEADER + (
        "def collect(model, loader, device, world):\n"
        "    probs, ids = [], []\n"
        "    for x, i in loader:\n"
        "        probs.append(model(x.to(device)).sigmoid().cpu())\n"
        "        ids.append(i)\n"
        f"    local = {stacked}\n"
        "    bufs = [torch.zeros_like(local) for _ in range(world)]\n"
        "    dist.all_gather(bufs, local)\n"
    )
    found = findings_of(source, "nccl-with-cpu-tensors")
    assert bool(found) == flagged, found


@pytest.mark.parametrize(
    "converted, flagged",
    [
        # a numpy result turned into a CPU tensor under its own name (blind set ap's 04)
        ("cm = torch.from_numpy(cm)", True),
        ("cm = torch.tensor(cm)", True),
        ("cm = torch.from_numpy(cm).to(device)", False),
        ("cm = torch.tensor(cm, device=device)", False),
    ],
)
def test_a_name_converted_from_numpy_to_a_cpu_tensor_is_on_the_cpu(converted, flagged) -> None:
    source = NCCL_HEADER + (
        "def sync(labels, preds, device):\n"
        "    cm = confusion_matrix(labels, preds)\n"
        f"    {converted}\n"
        "    dist.all_reduce(cm)\n"
    )
    expected = [("nccl-with-cpu-tensors", 7)] if flagged else []
    assert findings_of(source, "nccl-with-cpu-tensors") == expected, converted


@pytest.mark.parametrize(
    "made, flagged",
    [
        # a stack or cat keeps its parts' device: one CPU part makes it CPU
        ("torch.stack([loss.sum(), torch.tensor(float(n))]).double()", True),
        ("torch.cat([torch.zeros(2), torch.ones(2)])", True),
        ("rewards.sum()", True),  # rewards below is made on the CPU
        ("scores.cpu().mean()", True),
        ("torch.stack([loss.sum(), torch.tensor(float(n), device=loss.device)])", False),
        ("rewards.sum().to(loss.device)", False),
        ("torch.stack([loss.sum(), loss.mean()])", False),
        # arithmetic with numbers or fields keeps the device (blind set aj's 11)
        ("torch.tensor([float(n), 1.0]) / args.meta_batch_size", True),
        ("2 * rewards + 1", True),
        ("torch.tensor([float(n), 1.0]).to(loss.device) / args.meta_batch_size", False),
        ("rewards * loss", False),  # a 0-dim CPU tensor times a CUDA one is on the GPU
    ],
)
def test_a_tensor_built_from_cpu_tensors_is_on_the_cpu(made, flagged) -> None:
    source = NCCL_HEADER + (
        "def sync(loss, scores, n, reward_list):\n"
        "    rewards = torch.tensor(reward_list)\n"
        f"    moments = {made}\n"
        "    dist.all_reduce(moments)\n"
    )
    expected = [("nccl-with-cpu-tensors", 7)] if flagged else []
    assert findings_of(source, "nccl-with-cpu-tensors") == expected, made


@pytest.mark.parametrize(
    "made, flagged",
    [
        ("torch.zeros(4, 2)", True),  # blind set at 18: head importance summed on the CPU
        ("torch.zeros(4, 2, device=device)", False),
        ("scores.cpu()", True),
        ("scores", False),  # what the caller passed: not known here
    ],
)
def test_a_tensor_a_helper_returns_in_a_tuple_is_where_the_helper_made_it(made, flagged) -> None:
    source = NCCL_HEADER + (
        "def importance(scores, device):\n"
        f"    total = {made}\n"
        "    return total, 3\n"
        "def main(scores, device):\n"
        "    imp, n = importance(scores, device)\n"
        "    dist.all_reduce(imp)\n"
    )
    expected = [("nccl-with-cpu-tensors", 9)] if flagged else []
    assert findings_of(source, "nccl-with-cpu-tensors") == expected, made


@pytest.mark.parametrize(
    "appended, flagged",
    [
        ("torch.sigmoid(logits).float().cpu()", True),  # blind set ae's 20
        ("torch.sigmoid(logits).float()", False),  # stays on the GPU
        ("logits.cpu() if i % 2 else logits", False),  # not every item is on the CPU
    ],
)
def test_a_list_of_cpu_tensors_joined_then_gathered_is_on_the_cpu(appended, flagged) -> None:
    """`scores = []`, `scores.append(p.cpu())`, `scores = torch.cat(scores)`, then
    all_gather(..., scores): the list is no tensor; the joined one is where its items are."""
    source = NCCL_HEADER + (
        "def predict(model, loader, world):\n"
        "    scores, labels = [], []\n"
        "    for i, (x, y) in enumerate(loader):\n"
        "        logits = model(x.cuda())\n"
        f"        scores.append({appended})\n"
        "    scores, n = torch.cat(scores), len(loader)\n"
        "    gathered = [torch.empty_like(scores) for _ in range(world)]\n"
        "    dist.all_gather(gathered, scores)\n"
    )
    expected = [("nccl-with-cpu-tensors", 11)] if flagged else []
    assert findings_of(source, "nccl-with-cpu-tensors") == expected, appended


@pytest.mark.parametrize(
    "appended, passed, flagged",
    [
        # blind set ea's 09: features moved to the CPU, then handed to a gathering helper
        ("F.normalize(f).cpu()", "torch.cat(feats)", True),
        ("F.normalize(f)", "torch.cat(feats)", False),
        ("F.normalize(f).cpu()", "torch.cat(feats).cuda()", False),  # moved back first
    ],
)
def test_a_cpu_tensor_handed_to_a_helper_that_gathers_it(appended, passed, flagged) -> None:
    source = NCCL_HEADER + (
        "def all_gather_cat(t):\n"
        "    bufs = [torch.empty_like(t) for _ in range(dist.get_world_size())]\n"
        "    dist.all_gather(bufs, t)\n"
        "    return torch.cat(bufs)\n"
        "def inference(net, loader):\n"
        "    feats = []\n"
        "    for x in loader:\n"
        "        f = net(x.cuda())\n"
        f"        feats.append({appended})\n"
        f"    return all_gather_cat({passed})\n"
    )
    found = findings_of(source, "nccl-with-cpu-tensors")
    assert bool(found) == flagged, found


def test_a_tensor_made_on_the_gpu_in_one_branch_is_not_judged() -> None:
    source = NCCL_HEADER + (
        "if torch.cuda.is_available():\n"
        "    t = torch.ones(1, device='cuda')\n"
        "else:\n"
        "    t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
    )
    assert findings_of(source, "nccl-with-cpu-tensors") == []


def test_a_helper_that_returns_a_rank_test_is_read_as_one() -> None:
    source = (
        "import torch.distributed as dist\n"
        'dist.init_process_group("gloo")\n'
        "def is_main():\n"
        '    """True on the first process."""\n'
        "    return dist.get_rank() == 0\n"
        "if is_main():\n"
        "    dist.barrier()\n"
    )
    assert findings_of(source) == [("collective-mismatch", 7)]


@pytest.mark.parametrize(
    "setup, name",
    [
        ("engine, *_ = deepspeed.initialize(model=model)", "deepspeed.initialize()"),
        ("deepspeed.init_distributed()", "deepspeed.init_distributed()"),
        ("accelerator = Accelerator()", "accelerate.Accelerator()"),
        # blind set de's 02: TrainingArguments sets up the devices in __post_init__
        ("args = TrainingArguments(output_dir='out')", "transformers.TrainingArguments()"),
    ],
)
def test_a_rank_asked_before_a_library_starts_the_group_is_reported(setup, name) -> None:
    source = (
        "import deepspeed\nimport torch.distributed as dist\n"
        "from accelerate import Accelerator\nfrom transformers import TrainingArguments\n"
        "def main(model):\n"
        "    rank = dist.get_rank()\n"
        f"    {setup}\n"
        "    print(rank, dist.get_rank())\n"
    )
    # (DeepSpeed's init_distributed alone, NCCL with no device set, is set-device-order's too)
    findings = [f for f in lint_source(source) if f.cause_id != "set-device-order"]
    assert [(f.cause_id, f.line) for f in findings] == [("process-group-not-initialized", 6)]
    assert f"{name}, which starts it, comes later (line 7)" in findings[0].message


HYDRA_CONFIG = (
    "from dataclasses import dataclass\nimport torch\nimport torch.distributed as dist\n"
    "@dataclass\nclass DistConfig:\n    backend: str = 'nccl'\n    local_rank: int = 0\n"
    "def main(cfg):\n    SET\n    torch.cuda.set_device(cfg.dist.local_rank)\n"
    "    dist.init_process_group(cfg.dist.backend)\n"
)


@pytest.mark.parametrize(
    ("set_it", "reported"),
    [
        # blind set fn's 03: a Hydra structured config's local rank that no launcher sets
        ("pass", [("local-rank-not-from-env", 7)]),
        ('cfg.dist.local_rank = int(os.environ["LOCAL_RANK"])', []),
        ("cfg.dist.local_rank = args.local_rank", []),
    ],
)
def test_a_config_dataclass_local_rank_nothing_sets(set_it, reported) -> None:
    source = "import os\n" + HYDRA_CONFIG.replace("SET", set_it)
    assert findings_of(source, "local-rank-not-from-env") == [(c, n + 1) for c, n in reported]


@pytest.mark.parametrize(
    "trainer",
    [
        # the GPU comes from the trainer's own field, not from the config's default
        (
            "        self.local_rank = dist.get_rank() % torch.cuda.device_count()\n"
            "        torch.cuda.set_device(self.local_rank)\n"
        ),
        # the config is built with the rank the launcher gave
        (
            "        cfg = DistConfig(local_rank=int(os.environ['LOCAL_RANK']))\n"
            "        torch.cuda.set_device(cfg.local_rank)\n"
        ),
    ],
)
def test_a_config_dataclass_local_rank_the_file_does_not_use_as_is(trainer) -> None:
    source = (
        "import os\n"
        + HYDRA_CONFIG.split("def main")[0]
        + "class Trainer:\n    def __init__(self):\n"
        + trainer
    )
    assert findings_of(source, "local-rank-not-from-env") == []


@pytest.mark.parametrize(
    ("documented", "reported"),
    [
        ("", []),
        ('"""deepspeed --num_gpus 8 train.py --deepspeed_config ds.json"""\n', []),
        # blind set fb's 16: a DeepSpeed script its own text launches with torchrun only
        (
            '"""Fine-tune.\n\n    torchrun --nproc_per_node 8 train.py --train data.jsonl\n"""\n',
            [("local-rank-not-from-env", 8)],
        ),
    ],
)
def test_deepspeeds_launcher_passes_the_underscore_local_rank_flag(documented, reported) -> None:
    source = documented + (
        "import argparse\nimport deepspeed\n"
        "parser = argparse.ArgumentParser()\n"
        'parser.add_argument("--local_rank", type=int, default=-1)\n'
        "parser = deepspeed.add_config_arguments(parser)\n"
        "args = parser.parse_args()\n"
        "print(args.local_rank)\n"
    )
    assert findings_of(source, "local-rank-not-from-env") == reported


@pytest.mark.parametrize(
    "launch, reported",
    [
        # blind set ej's 12: a Trainer with a DeepSpeed config, run by that launcher
        ("deepspeed --num_gpus=8 train.py --deepspeed ds.json", False),
        ("python -m torch.distributed.launch --nproc_per_node=8 train.py", True),
    ],
)
def test_a_file_that_documents_the_deepspeed_launcher_takes_its_flag(launch, reported) -> None:
    source = (
        f'"""Fine-tune.\n\nLaunch:\n    {launch}\n"""\n'
        "import argparse\n"
        "parser = argparse.ArgumentParser()\n"
        'parser.add_argument("--local_rank", type=int, default=-1)\n'
        "args = parser.parse_args()\n"
        "print(args.local_rank)\n"
    )
    found = [cause for cause, _line in findings_of(source)]
    assert ("local-rank-arg-mismatch" in found) == reported


@pytest.mark.parametrize(
    "launch, causes",
    [
        # blind sets gs-hh (twelve files): torchrun passes no flag of either spelling,
        # so the flag's default is what goes wrong, not its spelling
        ("torchrun --nproc_per_node=4 train.py", ["local-rank-not-from-env"]),
        (
            "python -m torch.distributed.launch --nproc_per_node=4 train.py",
            ["local-rank-arg-mismatch", "local-rank-not-from-env"],
        ),
        ("", ["local-rank-arg-mismatch", "local-rank-not-from-env"]),  # launch not shown
    ],
)
def test_a_local_rank_flag_of_a_file_launched_by_torchrun_is_not_a_spelling_mismatch(
    launch, causes
) -> None:
    source = (
        f'"""Train.\n\n    {launch}\n"""\n'
        "import argparse\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        "parser = argparse.ArgumentParser()\n"
        'parser.add_argument("--local_rank", type=int, default=0)\n'
        "args = parser.parse_args()\n"
        "torch.cuda.set_device(args.local_rank)\n"
        'dist.init_process_group("nccl")\n'
    )
    assert sorted(cause for cause, _line in findings_of(source)) == causes


def test_a_download_in_the_parent_before_spawning_runs_once() -> None:
    source = (
        "import torch.distributed as dist\nimport torch.multiprocessing as mp\n"
        "import torchvision\n"
        "def worker(rank, world_size):\n"
        '    dist.init_process_group("gloo", rank=rank, world_size=world_size)\n'
        '    torchvision.datasets.MNIST("data", download=True)\n'
        'if __name__ == "__main__":\n'
        '    torchvision.datasets.MNIST("data", download=True)\n'
        "    mp.spawn(worker, args=(2,), nprocs=2)\n"
    )
    # the parent's download runs once; the workers' own, after it, find the files
    assert findings_of(source) == []


def test_a_fixed_device_variable_left_from_a_single_gpu_config_is_reported() -> None:
    source = DDP_HEADER + (
        'device = "cuda:0"\n'
        "local_rank = int(os.environ['LOCAL_RANK'])\n"
        "model = DDP(nn.Linear(4, 4).to(device), device_ids=[local_rank])\n"
    )
    assert findings_of(source) == [("hardcoded-device", 5)]
    # nanoGPT sets it per rank once DDP is on: quiet
    per_rank = source.replace(
        "local_rank = int(os.environ['LOCAL_RANK'])\n",
        "local_rank = int(os.environ['LOCAL_RANK'])\ndevice = f'cuda:{local_rank}'\n",
    )
    assert findings_of(per_rank) == []


def test_a_fixed_device_variable_with_a_cpu_fallback_is_reported_too() -> None:
    # the single-GPU tutorial line: "cuda:0" if CUDA is there, else the CPU
    fixed = 'device = "cuda:0" if torch.cuda.is_available() else "cpu"\n'
    source = (
        DDP_HEADER
        + fixed
        + (
            "local_rank = int(os.environ['LOCAL_RANK'])\n"
            "model = DDP(nn.Linear(4, 4).to(device), device_ids=[local_rank])\n"
        )
    )
    assert findings_of(source) == [("hardcoded-device", 5)]
    # a plain "cuda" falls back to the current device, which set_device chose: quiet
    current = source.replace('"cuda:0" if', '"cuda" if')
    assert findings_of(current) == []
    # a value that depends on the rank in either branch is not fixed
    per_rank = source.replace('"cuda:0" if', "f\"cuda:{os.environ['LOCAL_RANK']}\" if")
    assert findings_of(per_rank) == []


def test_a_helper_whose_device_parameter_defaults_to_a_fixed_gpu_is_reported_where_unused() -> None:
    helper = (
        'def to_device(batch, device="cuda:0"):\n'
        "    return [t.to(device) for t in batch]\n"
        "local_rank = int(os.environ['LOCAL_RANK'])\n"
        "model = DDP(nn.Linear(4, 4).to(local_rank), device_ids=[local_rank])\n"
    )
    bare = DDP_HEADER + helper + "x, y = to_device([torch.ones(4), torch.ones(4)])\n"
    assert findings_of(bare) == [("hardcoded-device", 5)]
    # every call passes the rank's device: the default is never used
    given = bare.replace("torch.ones(4)])", "torch.ones(4)], local_rank)")
    assert findings_of(given) == []
    named = bare.replace("torch.ones(4)])", "torch.ones(4)], device=local_rank)")
    assert findings_of(named) == []


def test_a_gpu_index_handed_on_as_a_librarys_device_id_places_work() -> None:
    # blind set ei's 12: a DALI pipeline built with device_id=device_id, defaulting to 0
    helper = (
        "def dali_loader(root, batch_size, device_id=0):\n"
        "    return DALIClassificationIterator(pipe(root, batch_size, device_id=device_id))\n"
        "local_rank = int(os.environ['LOCAL_RANK'])\n"
        "model = DDP(nn.Linear(4, 4).to(local_rank), device_ids=[local_rank])\n"
    )
    bare = DDP_HEADER + helper + "loader = dali_loader('/data', 64)\n"
    assert findings_of(bare) == [("hardcoded-device", 5)]
    given = bare.replace("'/data', 64)", "'/data', 64, device_id=local_rank)")
    assert findings_of(given) == []


def test_a_parameter_handed_on_as_a_librarys_device_keyword_places_work() -> None:
    # blind set cb's 05: MONAI's sliding_window_inference(..., sw_device=sw_device)
    helper = (
        'def predict(net, image, sw_device="cuda:0"):\n'
        '    return sliding_window_inference(image, 96, 2, net, sw_device=sw_device, device="cpu")\n'
        "local_rank = int(os.environ['LOCAL_RANK'])\n"
        "model = DDP(nn.Linear(4, 4).to(local_rank), device_ids=[local_rank])\n"
    )
    bare = DDP_HEADER + helper + "pred = predict(model, torch.ones(4))\n"
    assert findings_of(bare) == [("hardcoded-device", 5)]
    given = bare.replace("torch.ones(4))", "torch.ones(4), sw_device=local_rank)")
    assert findings_of(given) == []


def test_a_class_whose_init_defaults_to_a_fixed_gpu_is_reported_where_constructed_without_it() -> (
    None
):
    meter = (
        "class Meter:\n"
        '    def __init__(self, classes, ignore=255, device="cuda:0"):\n'
        "        self.hist = torch.zeros(classes, classes, device=device)\n"
        "local_rank = int(os.environ['LOCAL_RANK'])\n"
        "model = DDP(nn.Linear(4, 4).to(local_rank), device_ids=[local_rank])\n"
    )
    bare = DDP_HEADER + meter + "meter = Meter(10, 0)\n"
    findings = lint_source(bare)
    assert [(f.cause_id, f.line) for f in findings] == [("hardcoded-device", 6)]
    assert findings[0].message.startswith('Meter()\'s device defaults to "cuda:0"')
    # self is not a call's argument: the third value given is the device
    assert findings_of(bare.replace("Meter(10, 0)", "Meter(10, 0, local_rank)")) == []
    assert findings_of(bare.replace("Meter(10, 0)", "Meter(10, device=local_rank)")) == []
    # another method's default is reached through an object, not read
    method = bare.replace("__init__", "reset").replace("meter = Meter(10, 0)", "Meter().reset(10)")
    assert findings_of(method) == []


def test_a_gpu_index_left_at_zero_in_a_class_that_keeps_it_is_reported() -> None:
    """Blind set ad's 15: a prefetching loader's `local_rank=0` kept as self.local_rank
    and used by its other methods; constructed without it, every rank prefetches to GPU 0."""
    loader = (
        "class Prefetcher:\n"
        "    def __init__(self, loader, local_rank=0):\n"
        "        self.loader, self.local_rank = loader, local_rank\n"
        "        self.gpu = local_rank\n"
        "        self.stream = torch.cuda.Stream(local_rank)\n"
        "    def __iter__(self):\n"
        "        for x in self.loader:\n"
        "            yield x.to(device=self.gpu, non_blocking=True)\n"
        "local_rank = int(os.environ['LOCAL_RANK'])\n"
        "torch.cuda.set_device(local_rank)\n"
        "model = DDP(nn.Linear(4, 4).cuda(), device_ids=[local_rank])\n"
    )
    bare = DDP_HEADER + loader + "batches = Prefetcher(train_loader)\n"
    findings = lint_source(bare)
    assert [(f.cause_id, f.line) for f in findings] == [("hardcoded-device", 6)]
    assert "local_rank defaults to 0 (GPU 0)" in findings[0].message
    given = bare.replace("Prefetcher(train_loader)", "Prefetcher(train_loader, local_rank)")
    assert findings_of(given) == []
    # a rank's number is no GPU's: `rank=0` is a sampler's default, not a device
    sampler = loader.replace("local_rank=0", "rank=0").replace(
        "= loader, local_rank", "= loader, rank"
    )
    sampler = sampler.replace("self.gpu = local_rank", "self.gpu = rank").replace(
        "Stream(local_rank)", "Stream(rank)"
    )
    assert findings_of(DDP_HEADER + sampler + "batches = Prefetcher(train_loader)\n") == []


def test_a_bare_cuda_default_is_gpu_zero_only_where_no_process_sets_its_device() -> None:
    """Blind set ae's 15: tensors made on `device="cuda"` by default, in a file that
    never calls set_device, all land on GPU 0; after set_device "cuda" is the rank's."""
    data = (
        "class Collocation:\n"
        '    def __init__(self, n, device="cuda"):\n'
        "        self.x = torch.rand(n, 2, device=device)\n"
        "local_rank = int(os.environ['LOCAL_RANK'])\n"
        "model = DDP(nn.Linear(2, 1).to(f'cuda:{local_rank}'), device_ids=[local_rank])\n"
        "points = Collocation(1000)\n"
    )
    source = DDP_HEADER + data
    assert findings_of(source) == [("hardcoded-device", 6)]
    placed = source.replace(
        "local_rank = int(os.environ['LOCAL_RANK'])\n",
        "local_rank = int(os.environ['LOCAL_RANK'])\ntorch.cuda.set_device(local_rank)\n",
    )
    assert findings_of(placed) == []


def test_a_sampler_chosen_by_a_conditional_expression_is_followed() -> None:
    source = (
        "import torch.distributed as dist\n"
        "from torch.utils.data import DataLoader\n"
        "from torch.utils.data.distributed import DistributedSampler\n"
        "def main(args, dataset):\n"
        '    dist.init_process_group("gloo")\n'
        "    sampler = DistributedSampler(dataset) if args.distributed else None\n"
        "    loader = DataLoader(dataset, batch_size=8, sampler=sampler)\n"
        "    for epoch in range(10):\n"
        "        for batch in loader:\n"
        "            print(batch)\n"
    )
    assert findings_of(source) == [("sampler-set-epoch", 6)]


def test_gloo_script_needs_no_set_device() -> None:
    source = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
    assert lint_source(source) == []


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"train\.py: no such file"):
        lint_script(tmp_path / "train.py")


def test_directory_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="is a directory"):
        lint_script(tmp_path)


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\n\n\ndef main(:\n    pass\n")
    with pytest.raises(UserError) as caught:
        lint_script(script)
    message = str(caught.value)
    assert message.startswith(f"{script}:4: not valid Python:")
    assert "\n" not in message


def test_non_utf8_bytes_are_replaced_not_fatal(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_bytes(b"# caf\xe9\nimport torch\nx = torch.device('cuda:0')\n")
    assert [(f.cause_id, f.line) for f in lint_script(script)] == [("hardcoded-device", 3)]


def test_world_size_from_a_module_constant_is_hard_coded() -> None:
    source = (
        "import torch.distributed as dist\n"
        "WORLD_SIZE = 4\n"
        "def main(rank):\n"
        "    dist.init_process_group('gloo', world_size=WORLD_SIZE, rank=rank)\n"
    )
    findings = lint_source(source)
    assert [(f.cause_id, f.line) for f in findings] == [("world-size-mismatch", 4)]
    assert "world_size=WORLD_SIZE, WORLD_SIZE = 4" in findings[0].message


def test_reassigned_module_name_is_not_a_constant() -> None:
    source = (
        "import os\n"
        "import torch.distributed as dist\n"
        "world_size = 1\n"
        "world_size = int(os.environ['WORLD_SIZE'])\n"
        "dist.init_process_group('gloo', world_size=world_size, rank=int(os.environ['RANK']))\n"
    )
    assert lint_source(source) == []


def test_rank_zero_only_caller_is_named_not_the_paired_barrier() -> None:
    # The barrier pair inside load_examples is fine; the `if` that lets only rank 0
    # call it (line 24) is the one to fix.
    findings = lint_script(SCRIPTS / "barrier_in_rank_zero_only_caller.py")
    assert [f.line for f in findings] == [15]
    assert "rank 0 only (the `if` on line 24)" in findings[0].message


def test_unread_local_rank_flag_suggests_both_spellings_only() -> None:
    source = (
        "import argparse, os\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--local_rank', type=int, default=-1)\n"
        "local_rank = int(os.environ['LOCAL_RANK'])\n"
    )
    findings = lint_source(source)
    assert [(f.cause_id, f.line) for f in findings] == [("local-rank-arg-mismatch", 3)]
    assert "accept both spellings" in findings[0].message
    assert "read os.environ" not in findings[0].message


@pytest.mark.parametrize(
    ("name", "waits_for_every_rank"),
    [
        ("torch.distributed.barrier", True),
        ("accelerator.wait_for_everyone", True),
        ("self.accelerator.gather_for_metrics", True),
        ("self.all_gather", True),  # a LightningModule's
        ("fabric.barrier", True),
        ("self.trainer.strategy.barrier", True),
        ("torch.gather", False),  # a tensor op
        ("outputs.reduce", False),
        ("pool.broadcast", False),
        ("trainer.barrier", False),  # no such Lightning API
    ],
)
def test_library_collectives_are_told_from_look_alikes(name, waits_for_every_rank):
    from assistant.lint.torchapi import is_collective

    assert is_collective(name) is waits_for_every_rank


def test_a_logger_only_a_dead_method_or_a_one_process_group_reaches_is_not_reported() -> None:
    header = (
        "import torch.distributed as dist\nimport wandb\n"
        'dist.init_process_group("gloo")\n'
        "if dist.get_rank() == 0:\n    wandb.init(project='p')\n"
    )
    logging = "def sample():\n    wandb.log({'x': 1})\n"
    assert findings_of(header + logging) == []  # nothing calls sample()
    called = header + logging + "sample()\n"
    assert findings_of(called) == [("experiment-logger-ddp", 7)]
    one = called.replace('"gloo")', '"gloo", world_size=1, rank=0)')
    assert "experiment-logger-ddp" not in {cause for cause, _line in findings_of(one)}


@pytest.mark.parametrize(
    "start, reported",
    [
        # another tracker's run started by every process (blind set ap's 06)
        ("with mlflow.start_run(run_name='tweedie'):\n    mlflow.log_metric('x', 1)", True),
        ("run = neptune.init_run(project='p')", True),
        ("exp = Experiment(project_name='p')", True),
        # on rank 0 only, or one run per rank named for it
        (
            (
                "if dist.get_rank() == 0:\n    with mlflow.start_run(run_name='t'):\n"
                "        mlflow.log_metric('x', 1)"
            ),
            False,
        ),
        ("run = neptune.init_run(name=f'rank{dist.get_rank()}')", False),
    ],
)
def test_a_trackers_run_started_on_every_rank(start: str, reported: bool) -> None:
    source = (
        "import torch.distributed as dist\nimport mlflow\nimport neptune\n"
        "from comet_ml import Experiment\n"
        'dist.init_process_group("gloo")\n' + start + "\n"
    )
    assert (("experiment-logger-ddp", 6) in findings_of(source)) is reported


def test_a_value_only_rank_zero_sets_makes_its_none_test_a_rank_zero_branch() -> None:
    # `vae = None; if rank == 0: vae = load()` ... `if vae is not None: log()`: only rank 0
    # can pass; an argument, or a value set on every rank, is any rank's.
    header = (
        "import torch.distributed as dist\nimport wandb\n"
        'dist.init_process_group("gloo")\n'
        "if dist.get_rank() == 0:\n    wandb.init(project='p')\n"
        "def sample(vae):\n    wandb.log({'x': vae})\n"
    )
    rank_zero_set = (
        "def main():\n    vae = None\n    if dist.get_rank() == 0:\n        vae = object()\n"
        "    if vae is not None:\n        sample(vae)\n"
        "    if vae:\n        dist.barrier()\n"
        "main()\n"
    )
    found = findings_of(header + rank_zero_set)
    assert ("experiment-logger-ddp", 7) not in found
    assert ("collective-mismatch", 15) in found  # the barrier only rank 0 reaches
    every_rank_set = rank_zero_set.replace("if dist.get_rank() == 0:", "if True:")
    assert ("experiment-logger-ddp", 7) in findings_of(header + every_rank_set)
    parameter = rank_zero_set.replace(
        "def main():\n    vae = None", "def main(vae=None):\n    pass"
    )
    parameter = parameter.replace("main()\n", "main(object())\n")
    assert ("experiment-logger-ddp", 7) in findings_of(header + parameter)


def test_a_dataclass_post_init_runs_where_the_config_is_built() -> None:
    # the generated __init__ calls __post_init__: built before init_process_group,
    # its get_world_size() has no group to ask
    source = (
        "import dataclasses\nimport torch.distributed as dist\n"
        "@dataclasses.dataclass\nclass Config:\n    batch: int = 64\n"
        "    def __post_init__(self):\n        self.per_rank = self.batch // dist.get_world_size()\n"
        "def main():\n    cfg = Config()\n    dist.init_process_group('gloo')\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    assert findings_of(source) == [("process-group-not-initialized", 7)]
    later = source.replace(
        "    cfg = Config()\n    dist.init_process_group('gloo')\n",
        "    dist.init_process_group('gloo')\n    cfg = Config()\n",
    )
    assert findings_of(later) == []


def test_a_loader_over_a_subset_picked_in_a_loop_over_this_ranks_share_is_sharded() -> None:
    """Federated averaging simulated on several GPUs: each rank trains the clients
    of its own strided share, each client's loader a Subset of its indices."""
    source = (
        "import torch.distributed as dist\n"
        "from torch.utils.data import DataLoader, Subset\n"
        "def run(model, train_set, client_idx, clients, opt):\n"
        '    dist.init_process_group("gloo")\n'
        "    rank, world = dist.get_rank(), dist.get_world_size()\n"
        "    mine = clients[rank::world]\n"
        "    for cid in mine:\n"
        "        loader = DataLoader(Subset(train_set, client_idx[cid]), batch_size=8, shuffle=True)\n"
        "        for x, y in loader:\n"
        "            model(x).sum().backward()\n"
        "            opt.step()\n"
        "    for p in model.parameters():\n"
        "        dist.all_reduce(p.data)\n"  # the clients' weights averaged: one model
    )
    assert findings_of(source, "missing-distributed-sampler") == []
    # every rank looping over all the clients trains on the same data
    every = source.replace("    for cid in mine:", "    for cid in clients:")
    assert findings_of(every, "missing-distributed-sampler") == [("missing-distributed-sampler", 8)]


def test_each_misplaced_spawn_argument_names_the_parameter_and_why() -> None:
    """By name, by annotation and by the process count: what lands where, and the fix."""
    swapped = [f.message for f in lint_script(SCRIPTS / "spawn_arguments_in_swapped_order.py")]
    by_name, index_first, by_count = swapped
    assert "hands world_size to train_worker's parameter config_path" in by_name
    assert "has a parameter world_size of its own" in by_name
    assert "put args in the order of train_worker's parameters" in by_name
    assert "hands cfg to evaluate_worker's parameter rank" in index_first
    assert "give evaluate_worker the process index as its first parameter" in index_first
    assert "hands ngpus to sample_worker's parameter gpu" in by_count
    assert "a process's own index given the number of processes (nprocs)" in by_count
    [annotated] = lint_script(SCRIPTS / "spawn_arguments_against_their_annotations.py")
    assert "hands config to train_worker's parameter world_size" in annotated.message
    assert "annotated int but given an object of TrainConfig" in annotated.message


@pytest.mark.parametrize("order, reported", [("n_gpus, CFG", True), ("CFG, n_gpus", False)])
def test_a_module_constant_is_matched_with_its_parameter_whatever_the_case(order, reported):
    # blind set ba's 05: the notebook's CFG dict handed to worker(rank, cfg, world_size)
    source = (
        "import torch\nimport torch.multiprocessing as mp\n"
        "CFG = {'lr': 1e-3}\n"
        "def worker(rank, cfg, world_size):\n    print(cfg['lr'], world_size)\n"
        "if __name__ == '__main__':\n"
        "    n_gpus = torch.cuda.device_count()\n"
        f"    mp.spawn(worker, args=({order}), nprocs=n_gpus)\n"
    )
    found = [f.message for f in lint_source(source) if f.cause_id == "mp-spawn-arguments"]
    assert bool(found) == reported, found
    if reported:
        assert "hands CFG to worker's parameter world_size" in found[0]
        assert "has a parameter cfg of its own" in found[0]


@pytest.mark.parametrize(
    "elsewhere, reported",
    [
        # blind set cn's 20: `train` is also another function's parameter (a
        # dataset's train=False), which does not rebind the module's worker
        (
            "class Windows:\n    def __init__(self, rows, train=False):\n        self.train = train\n",
            True,
        ),
        ("def fit(data):\n    train = data[:10]\n    return train\n", True),
        # rebound where the spawn looks it up: not the file's function any more
        ("train = make_worker()\n", False),
    ],
)
def test_a_worker_name_another_function_binds_is_still_the_files_function(elsewhere, reported):
    source = (
        "import torch\nimport torch.multiprocessing as mp\n"
        + elsewhere
        + "def train(args, rank, world_size):\n    print(args.lr, rank, world_size)\n"
        "if __name__ == '__main__':\n"
        "    world_size = torch.cuda.device_count()\n"
        "    mp.spawn(train, args=(args, world_size), nprocs=world_size)\n"
    )
    found = [f.message for f in lint_source(source) if f.cause_id == "mp-spawn-arguments"]
    assert bool(found) == reported, found


@pytest.mark.parametrize(
    "step, reported",
    [
        ("_, loss = model(x, y)\nloss.backward()\n", True),
        ("_, loss = model(x, y)\nloss.mean().backward()\n", False),
        ("pred = model(x)\ntorch.nn.functional.mse_loss(pred, y).backward()\n", False),
    ],
    ids=["unpacked-loss", "averaged", "loss-outside"],
)
def test_a_loss_returned_beside_the_prediction_is_gathered_into_a_vector(step, reported) -> None:
    # forward returns (pred, self.loss_fn(pred, y)): DataParallel gathers one loss per GPU
    source = (
        "import torch\nfrom torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.head = nn.Linear(4, 1)\n"
        "        self.loss_fn = nn.SmoothL1Loss()\n"
        "    def forward(self, x, y=None):\n"
        "        pred = self.head(x)\n"
        "        if y is not None:\n"
        "            return pred, self.loss_fn(pred, y)\n"
        "        return pred\n"
        "model = nn.DataParallel(Net()).cuda()\n" + step  # a move keeps the wrapper
    )
    found = findings_of(source, "dataparallel-unsafe-model")
    assert bool(found) == reported, found


@pytest.mark.parametrize(
    "step, reported",
    [
        ("output, loss, stats = model_with_loss(batch)\nloss.backward()\n", True),
        ("output, loss, stats = model_with_loss(batch)\nloss.mean().backward()\n", False),
    ],
    ids=["unpacked-loss", "averaged"],
)
def test_a_loss_unpacked_from_a_loss_module_inside_forward_is_gathered_into_a_vector(
    step, reported
) -> None:
    # blind set be's 15 (CenterNet): a ModelWithLoss whose forward unpacks the
    # criterion's (loss, stats) and returns the loss beside the outputs
    source = (
        "import torch\nfrom torch import nn\n"
        "from lib.utils.data_parallel import DataParallel\n"
        "class ModelWithLoss(nn.Module):\n"
        "    def __init__(self, model, loss):\n"
        "        super().__init__()\n"
        "        self.model = model\n"
        "        self.loss = loss\n"
        "    def forward(self, batch):\n"
        "        outputs = self.model(batch['input'])\n"
        "        loss, loss_stats = self.loss(outputs[-1], batch)\n"
        "        return outputs[-1], loss, loss_stats\n"
        "def run_epoch(model_with_loss, loader):\n"
        "    for batch in loader:\n"
        + "".join(f"        {line}\n" for line in step.splitlines())
        + "model_with_loss = ModelWithLoss(net, CtdetLoss(opt))\n"
        "model_with_loss = DataParallel(model_with_loss, device_ids=[0, 1]).cuda()\n"
        "run_epoch(model_with_loss, loader)\n"
    )
    found = findings_of(source, "dataparallel-unsafe-model")
    assert bool(found) == reported, found


@pytest.mark.parametrize(
    "built, reported",
    [
        # blind set cw's 07: a method that returns the module itself after the move
        ("nn.Linear(4, 4).to(int(os.environ['LOCAL_RANK'])).train()", False),
        ("nn.Linear(4, 4).cuda().eval().requires_grad_(True)", False),
        ("nn.Linear(4, 4).train()", True),
    ],
)
def test_a_move_followed_by_a_method_that_returns_the_module_is_a_move(built, reported) -> None:
    source = (
        DDP_HEADER
        + f"model = {built}\n"
        + "net = DDP(model, device_ids=[int(os.environ['LOCAL_RANK'])])\n"
    )
    found = findings_of(source, "ddp-device-ids-cpu-module")
    assert bool(found) == reported, found


@pytest.mark.parametrize(
    "init, reported",
    [
        # blind set cv's 09: every rank starts a run of the same name; the group names
        # the experiment's folds, not one run per rank
        ("wandb.init(project='p', group=args.exp, name=f'{args.exp}_fold{fold}')", True),
        ("wandb.init(project='p')", True),
        # one run per rank, grouped: the documented way
        ("wandb.init(project='p', group=args.exp)", False),
        ("wandb.init(project='p', group=args.exp, name=f'rank{dist.get_rank()}')", False),
        ("wandb.init(project='p', mode='online' if dist.get_rank() == 0 else 'disabled')", False),
    ],
)
def test_wandb_runs_grouped_per_rank_or_named_alike(init, reported) -> None:
    source = (
        "import torch.distributed as dist\nimport wandb\n"
        'dist.init_process_group("gloo")\nfold = 0\n' + init + "\n"
    )
    found = findings_of(source, "experiment-logger-ddp")
    assert bool(found) == reported, found


@pytest.mark.parametrize(
    ("given", "reported"),
    [
        # blind set gb's 01: a DALI pipeline built on GPU 0 by every rank
        ("device_id=0", [("hardcoded-device", 8)]),
        ("device_id=local_rank", []),
    ],
)
def test_a_librarys_gpu_index_given_as_a_number(given, reported) -> None:
    source = (
        "import os\nimport torch\nimport torch.distributed as dist\n"
        'local_rank = int(os.environ["LOCAL_RANK"])\ntorch.cuda.set_device(local_rank)\n'
        'dist.init_process_group("nccl")\n'
        "from nvidia.dali import pipeline_def\n"
        f"pipe = imagenet_pipe(batch_size=64, num_threads=4, {given}, seed=12)\n"
    )
    assert findings_of(source, "hardcoded-device") == reported


@pytest.mark.parametrize(
    ("pin", "reported"),
    [
        # blind sets gg's 07 and 13 (correct): each worker sees its own GPU alone, as cuda:0
        ('os.environ["CUDA_VISIBLE_DEVICES"] = gpus[rank]', []),
        ("os.environ.update(CUDA_VISIBLE_DEVICES=gpus[rank], MASTER_PORT='29500')", []),
        # gl's 02 (correct): the worker's environment built as dict(os.environ, ...)
        ("env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[rank])", []),
        ('env = {"CUDA_VISIBLE_DEVICES": gpus[rank]}', []),
        ("pass", [("hardcoded-device", 10)]),
    ],
    ids=["subscript", "update", "dict-call", "dict", "none"],
)
def test_cuda0_is_each_workers_own_gpu_where_it_sees_one(pin, reported) -> None:
    source = (
        "import os\nimport torch\nimport torch.distributed as dist\n"
        "import torch.multiprocessing as mp\n"
        "def worker(rank, gpus):\n"
        f"    {pin}\n"
        "    dist.init_process_group('nccl', rank=rank, world_size=len(gpus))\n"
        "    model = torch.nn.Linear(4, 2)\n"
        "    x = torch.randn(2, 4)\n"
        "    model = model.to('cuda:0')\n"
        "if __name__ == '__main__':\n"
        "    mp.spawn(worker, args=(['2', '3'],), nprocs=2)\n"
    )
    assert findings_of(source, "hardcoded-device") == reported


# blind set gr's 16 (correct): a context manager whose barrier pair straddles its yield
MAIN_FIRST = (
    "from contextlib import contextmanager\nimport torch.distributed as dist\n"
    "@contextmanager\ndef main_process_first():\n"
    "    if dist.get_rank() != 0:\n        dist.barrier()\n"
    "    try:\n        yield\n    finally:\n"
    "        if dist.get_rank() == 0:\n            SECOND\n"
    "def main():\n    dist.init_process_group('gloo')\n"
    "    with main_process_first():\n        data = load()\n"
    "main()\n"
)


@pytest.mark.parametrize(
    ("second", "reported"),
    [("dist.barrier()", []), ("pass", [("collective-mismatch", 6)])],
    ids=["paired-in-finally", "unpaired"],
)
def test_a_barrier_pair_across_a_try_finally_is_one_call_per_rank(second, reported) -> None:
    assert findings_of(MAIN_FIRST.replace("SECOND", second), "collective-mismatch") == reported


@pytest.mark.parametrize(
    "text, address, reported",
    [
        # blind set gy's 03: the tutorial's setup() on two PCs
        ("Run one copy on each PC.", '"localhost"', True),
        ("Split over two machines.", '"127.0.0.1"', True),
        ("#SBATCH --nodes=2", '"localhost"', True),
        # one machine, or the graph's nodes: a loopback master is right there
        ("Four processes on this workstation.", '"localhost"', False),
        ("Features of every node of the graph.", '"localhost"', False),
        # the address of rank 0's machine, given to every machine
        ("Run one copy on each PC.", 'os.environ.get("MASTER_IP", "192.168.1.10")', False),
    ],
)
def test_a_loopback_master_address_is_reported_where_the_job_spans_machines(
    text, address, reported
) -> None:
    source = (
        f'"""Train.\n\n{text}\n"""\n'
        "import os\n"
        "import torch.distributed as dist\n"
        f'os.environ["MASTER_ADDR"] = {address}\n'
        'os.environ["MASTER_PORT"] = "12355"\n'
        'dist.init_process_group("gloo", rank=0, world_size=2)\n'
    )
    found = findings_of(source, "master-endpoint-mismatch")
    assert bool(found) == reported, found


def test_a_loopback_tcp_init_method_on_several_machines_is_reported() -> None:
    source = (
        '"""Run one copy on each PC."""\n'
        "import torch.distributed as dist\n"
        'dist.init_process_group("gloo", init_method="tcp://127.0.0.1:23456", rank=0, world_size=2)\n'
    )
    assert findings_of(source, "master-endpoint-mismatch") == [("master-endpoint-mismatch", 3)]


@pytest.mark.parametrize(
    "launch, index, reported",
    [
        # blind set gy's 14: one GPU in each of two machines, the GPU named by the rank
        ("torchrun --nnodes=2 --nproc_per_node=1 train.py", 'int(os.environ["RANK"])', True),
        ("torchrun --nnodes=2 --nproc_per_node=1 train.py", "dist.get_rank()", True),
        ("Run one copy on each PC.", "rank", True),
        # one machine: the rank is the local rank; or the local rank itself
        ("torchrun --nproc_per_node=4 train.py", 'int(os.environ["RANK"])', False),
        ("torchrun --nnodes=2 --nproc_per_node=4 train.py", 'int(os.environ["LOCAL_RANK"])', False),
        (
            "torchrun --nnodes=2 --nproc_per_node=4 train.py",
            "rank % torch.cuda.device_count()",
            False,
        ),
    ],
)
def test_a_gpu_named_by_the_global_rank_is_reported_where_the_job_spans_machines(
    launch, index, reported
) -> None:
    source = (
        f'"""Train.\n\n    {launch}\n"""\n'
        "import os\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        'rank = int(os.environ["RANK"])\n'
        f"torch.cuda.set_device({index})\n"
        'dist.init_process_group("nccl")\n'
    )
    found = findings_of(source, "local-rank-not-from-env")
    assert bool(found) == reported, found


PACKED_TAGGER = """
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True, bidirectional=True)
        self.out = nn.Linear(32, 2)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = UNPACK
        return self.out(out)


model = WRAP
"""


@pytest.mark.parametrize(
    "unpack, wrap, reported",
    [
        # blind set ia's 15: each replica pads to its own slice's longest track
        ("pad_packed_sequence(out, batch_first=True)", "nn.DataParallel(Tagger()).cuda()", [16]),
        (
            "pad_packed_sequence(out, batch_first=True, total_length=x.size(1))",
            "nn.DataParallel(Tagger()).cuda()",
            [],
        ),
        # one process per GPU: each pads its own batch, nothing gathers the replicas
        ("pad_packed_sequence(out, batch_first=True)", "Tagger().cuda()", []),
    ],
    ids=["data-parallel", "total-length", "no-data-parallel"],
)
def test_a_packed_sequence_unpadded_to_the_inputs_length_under_data_parallel(
    unpack, wrap, reported
) -> None:
    source = PACKED_TAGGER.replace("UNPACK", unpack).replace("WRAP", wrap)
    found = findings_of(source, "dataparallel-unsafe-model")
    assert [line for _, line in found] == reported


STATEFUL = """
import torch
from torch import nn


class Neuron(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Linear(8, 8)
        self.v = None

    def forward(self, x):
        v = self.ff(x) if self.v is None else 0.9 * self.v + self.ff(x)
        SET
        return v


model = WRAP
"""


@pytest.mark.parametrize(
    "set_state, wrap, reported",
    [
        # blind sets il's 19, ik's 13, im's 04: state kept on the module between calls
        ("self.v = v", "nn.DataParallel(Neuron()).cuda()", [14]),
        ("self.v = v", "Neuron().cuda()", []),  # no replicas: the module keeps it
        ("self.last = v", "nn.DataParallel(Neuron()).cuda()", []),  # never read again
    ],
    ids=["data-parallel", "plain", "never read"],
)
def test_state_set_in_forward_under_data_parallel_is_lost(set_state, wrap, reported) -> None:
    source = STATEFUL.replace("SET", set_state).replace("WRAP", wrap)
    found = findings_of(source, "dataparallel-unsafe-model")
    assert [line for _, line in found] == reported
