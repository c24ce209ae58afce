"""Mistakes at the seam between a framework that starts the processes and wraps
the model out of sight (Lightning, the Hugging Face Trainer) and the author's
code: a tensor put on the GPU in a LightningModule's __init__ (hardcoded-device),
a cache built in a DataModule's setup() (dataset-cache-race), the wrapped model's
attributes read in a Trainer hook (ddp-wrapper-attribute)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from snippets import lint_snippet

from assistant.lint.model import parse_script
from assistant.lint.torchapi import framework_processes

LIGHTNING = """
import os
import torch
import lightning.pytorch as pl
from torch import nn
"""

MODULE = """
class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 1).cuda()
        self.weight = {placement}
"""

HF = """
from transformers import Trainer
import torch
"""


def lines(prelude: str, body: str, cause: str) -> list[int]:
    return [line for line, _ in lint_snippet(prelude, body, [cause])]


@pytest.mark.parametrize(
    ("launch", "several"),
    [
        ("pl.Trainer(devices=4, strategy='ddp')", True),
        ("pl.Trainer()", True),  # devices="auto": every GPU, with DDP
        ("pl.Trainer(**cfg.trainer)", True),
        ("pl.Trainer(devices=1)", False),
        ("pl.Trainer(accelerator='cpu')", False),
        ("L.Fabric(devices=8)", True),
        ("ray.train.torch.TorchTrainer(loop, scaling_config=cfg)", True),
        ("composer.Trainer(model=m)", True),
        ("torch.optim.SGD(params)", False),
    ],
)
def test_which_frameworks_start_a_process_per_gpu(launch: str, several: bool):
    source = "import lightning as L\nimport lightning.pytorch as pl\nimport ray.train.torch\nimport composer\nimport torch\n"
    assert framework_processes(parse_script(source + launch + "\n")) is several


@pytest.mark.parametrize(
    "placement",
    ["torch.tensor([3.0]).cuda()", 'torch.ones(3).to("cuda")', 'torch.zeros(3, device="cuda")'],
)
def test_a_tensor_on_the_gpu_in_a_lightning_module_init_is_reported(placement: str):
    body = MODULE.format(placement=placement) + "pl.Trainer(devices=4).fit(Net())\n"
    assert lines(LIGHTNING, body, "hardcoded-device") == [6]


@pytest.mark.parametrize(
    "body",
    [
        # one device: cuda:0 is the process's own GPU
        MODULE.format(placement="torch.tensor([3.0]).cuda()")
        + "pl.Trainer(devices=1).fit(Net())\n",
        # a buffer (Lightning moves it), a CPU tensor, an explicit GPU of its own
        MODULE.format(placement="torch.tensor([3.0])") + "pl.Trainer(devices=4).fit(Net())\n",
        MODULE.format(placement="torch.tensor([3.0]).cuda(local_rank)")
        + "pl.Trainer(devices=4).fit(Net())\n",
        # not a LightningModule: a plain module is placed by the script itself
        (
            "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.w = torch.ones(3).cuda()\npl.Trainer(devices=4)\n"
        ),
    ],
    ids=["one-device", "cpu-tensor", "own-gpu", "plain-module"],
)
def test_quiet_where_the_tensor_ends_on_its_rank(body: str):
    assert lines(LIGHTNING, body, "hardcoded-device") == []


DATAMODULE = """
class Data(pl.LightningDataModule):
    def {hook}(self, stage=None):
        if not os.path.exists("cache.pt"):
            torch.save(build(), "cache.pt")
        self.data = torch.load("cache.pt")
"""


def test_a_cache_built_in_setup_is_reported():
    body = (
        DATAMODULE.format(hook="setup") + "pl.Trainer(devices=2).fit(Model(), datamodule=Data())\n"
    )
    assert lines(LIGHTNING, body, "dataset-cache-race") == [5]


@pytest.mark.parametrize(
    "body",
    [
        DATAMODULE.format(hook="prepare_data")
        + "pl.Trainer(devices=2).fit(Model(), datamodule=Data())\n",
        DATAMODULE.format(hook="setup") + "pl.Trainer(devices=1).fit(Model(), datamodule=Data())\n",
        DATAMODULE.format(hook="setup").replace(
            "        if not", "        if self.trainer.is_global_zero and not"
        )
        + "pl.Trainer(devices=2).fit(Model(), datamodule=Data())\n",
    ],
    ids=["prepare-data", "one-device", "rank-zero"],
)
def test_quiet_where_one_process_builds_the_cache(body: str):
    assert lines(LIGHTNING, body, "dataset-cache-race") == []


HOOKED = """
class MyTrainer(Trainer):
    def {hook}(self, model, inputs, *args, **kwargs):
        out = model(**inputs)
        {read}
        return out.loss
"""


@pytest.mark.parametrize("hook", ["compute_loss", "training_step", "prediction_step"])
def test_the_wrapped_models_own_attribute_in_a_trainer_hook_is_reported(hook: str):
    assert lines(
        HF, HOOKED.format(hook=hook, read="n = model.config.num_labels"), "ddp-wrapper-attribute"
    ) == [5]


@pytest.mark.parametrize(
    "read",
    [
        "n = self.model.config.num_labels",  # the unwrapped model the Trainer keeps
        "n = sum(p.numel() for p in model.parameters())",  # nn.Module's API
        "n = (model.module if hasattr(model, 'module') else model).config",
        "n = getattr(model, 'config', None)",
    ],
    ids=["self-model", "module-api", "probed-module", "getattr"],
)
def test_quiet_where_the_hook_reads_what_the_wrapper_has(read: str):
    assert lines(HF, HOOKED.format(hook="compute_loss", read=read), "ddp-wrapper-attribute") == []


def test_a_trainer_class_of_the_files_own_is_not_the_hugging_face_one():
    own = "class Trainer:\n    pass\n" + HOOKED.format(hook="compute_loss", read="n = model.config")
    assert lines("import torch\n", own, "ddp-wrapper-attribute") == []


def test_reentrant_checkpointing_under_lightnings_find_unused_strategy_is_reported():
    body = """
    from transformers import AutoModel
    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.encoder = AutoModel.from_pretrained("bert-base-uncased")
            self.encoder.gradient_checkpointing_enable()
    pl.Trainer(devices=8, strategy="ddp_find_unused_parameters_true").fit(Net())
    """
    assert lines(LIGHTNING, body, "ddp-reentrant-checkpoint") == [7]
    quiet = body.replace("ddp_find_unused_parameters_true", "ddp")
    assert lines(LIGHTNING, quiet, "ddp-reentrant-checkpoint") == []


FABRIC_RESUME = """
import lightning as L
fabric = L.Fabric(devices=4)
fabric.launch()
model = Net()
ckpt = torch.load("last.ckpt"{options})
model.load_state_dict(ckpt["model"])
model = fabric.setup(model)
"""


def test_a_checkpoint_every_fabric_process_loads_onto_cuda0_is_reported():
    assert lines("import torch\n", FABRIC_RESUME.format(options=""), "checkpoint-map-location") == [
        6
    ]
    placed = FABRIC_RESUME.format(options=', map_location="cpu"')
    assert lines("import torch\n", placed, "checkpoint-map-location") == []


ARGUMENTS = """
from transformers import TrainingArguments
ds = {{"train_micro_batch_size_per_gpu": {micro}, "gradient_accumulation_steps": "auto"}}
args = TrainingArguments(output_dir="out", {fields}deepspeed=ds)
"""


@pytest.mark.parametrize(
    ("micro", "fields", "reported"),
    [
        (16, "per_device_train_batch_size=32, ", [3]),
        (16, "", [3]),  # TrainingArguments' default is 8 per device
        (8, "", []),
        ('"auto"', "per_device_train_batch_size=32, ", []),
        (16, "per_device_train_batch_size=16, ", []),
        (16, "per_device_train_batch_size=batch, ", []),  # a value the file does not fix
        (16, "**overrides, ", []),
    ],
)
def test_a_deepspeed_batch_size_that_contradicts_the_arguments(micro, fields, reported):
    source = ARGUMENTS.format(micro=micro, fields=fields)
    assert lines("", source, "deepspeed-config-mismatch") == reported


DEEPSPEED_ITSELF = """
import copy
import deepspeed
TEMPLATE = {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
ds_config = copy.deepcopy(TEMPLATE)
ds_config["train_micro_batch_size_per_gpu"] = 4
FILL
engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)
"""


@pytest.mark.parametrize(
    "lr, fill, reported",
    [
        # blind set bb's 12: the Trainer template's "auto" handed to DeepSpeed itself
        ('"auto"', 'ds_config["bf16"]["enabled"] = True', [9]),
        ("2e-5", "pass", [9]),  # bf16.enabled is still "auto"
        ("2e-5", 'ds_config["bf16"]["enabled"] = True', []),
        ("2e-5", 'ds_config["bf16"] = {"enabled": True}', []),
    ],
)
def test_auto_values_handed_to_deepspeed_initialize_itself(lr, fill, reported):
    source = DEEPSPEED_ITSELF.replace("LR", lr).replace("FILL", fill)
    assert lines("", source, "deepspeed-config-mismatch") == reported


def test_a_local_rank_flag_that_only_reaches_training_arguments_is_not_every_ranks_default():
    body = """
    import argparse
    from transformers import TrainingArguments
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-rank", "--local_rank", type=int, default=-1)
    args = parser.parse_args()
    TrainingArguments(output_dir="out", local_rank=args.local_rank)
    """
    assert lines("", body, "local-rank-not-from-env") == []
    own_use = body + "torch.cuda.set_device(args.local_rank)\n"
    assert lines("import torch\n", own_use, "local-rank-not-from-env") == [5]


RAY = """
import torch
import torch.distributed as dist
import ray.train.torch
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

def train_loop(config):
    model = ray.train.torch.prepare_model(Net())
    torch.save({"model": model.state_dict()}, "model.pt")
    total = torch.tensor([1.0, 2.0])
    dist.all_reduce(total)

def export():
    state = torch.load("model.pt", map_location="cpu")
    model = Net()
    model.load_state_dict(state["model"])

TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=4, use_gpu=GPU))
"""


def test_ray_trains_prepared_models_in_ddp_and_on_nccl_with_gpus():
    source = RAY.replace("GPU", "True")
    assert lines("", source, "state-dict-module-prefix") == [17]
    assert lines("", source, "nccl-with-cpu-tensors") == [12]
    assert lines("", RAY.replace("GPU", "False"), "nccl-with-cpu-tensors") == []  # gloo on CPUs


SYNCED_LOG = """
class Net(pl.LightningModule):
    def on_validation_epoch_end(self):
        mae = torch.stack(self.errors).mean()
        if {test}:
            self.log("val/mae", mae, {options})
"""


@pytest.mark.parametrize("test", ["self.trainer.is_global_zero", "self.global_rank == 0"])
def test_a_synced_log_on_rank_zero_only_is_reported(test: str):
    body = SYNCED_LOG.format(test=test, options="sync_dist=True")
    assert lines(LIGHTNING, body, "experiment-logger-ddp") == [6]


@pytest.mark.parametrize(
    ("test", "options"),
    [
        ("self.trainer.is_global_zero", "rank_zero_only=True"),  # what Lightning asks for there
        ("self.current_epoch > 3", "sync_dist=True"),  # every rank takes the same branch
        ("self.trainer.is_global_zero", ""),
    ],
)
def test_quiet_where_every_rank_logs_or_nothing_syncs(test: str, options: str):
    body = SYNCED_LOG.format(test=test, options=options)
    assert lines(LIGHTNING, body, "experiment-logger-ddp") == []


FABRIC_SAVE = """
import lightning as L
from lightning.fabric.strategies import FSDPStrategy
fabric = L.Fabric(devices=4, strategy=STRATEGY)
fabric.launch()
model, opt = fabric.setup(Net(), torch.optim.AdamW(params))
if fabric.global_rank == 0:
    torch.save(model.state_dict(), "best.pt")
"""


@pytest.mark.parametrize(
    ("strategy", "reported"),
    [("FSDPStrategy()", [8]), ('"fsdp"', [8]), ('"ddp"', [])],
)
def test_a_fabric_fsdp_models_state_dict_on_rank_zero_only(strategy: str, reported: list[int]):
    source = FABRIC_SAVE.replace("STRATEGY", strategy)
    assert lines("import torch\n", source, "fsdp-state-dict") == reported


SRUN_DOC = '''"""Cluster job:
    LAUNCH
"""
import os
world_size = int(os.environ.get("WORLD_SIZE", 1))
'''


@pytest.mark.parametrize(
    ("launch", "reported"),
    [
        ("srun python train.py --epochs 10", [5]),
        ("srun --ntasks-per-node=4 python3 -u train.py", [5]),
        ("srun torchrun --nnodes 2 --nproc_per_node 4 train.py", []),
        ("srun python -m torch.distributed.run --nproc_per_node 4 train.py", []),
        ("torchrun --nproc_per_node 4 train.py", []),
    ],
)
def test_a_file_that_says_srun_starts_it_but_reads_torchruns_variables(
    launch: str, reported: list[int]
):
    assert lines("", SRUN_DOC.replace("LAUNCH", launch), "slurm-without-torchrun") == reported


SLURM_INIT = """\
import os
import torch
def init_distributed_mode(args):
    if "RANK" in os.environ:
        args.rank = int(os.environ["RANK"])
        args.gpu = int(os.environ["LOCAL_RANK"])
    elif "SLURM_PROCID" in os.environ:
        args.rank = int(os.environ["SLURM_PROCID"])
        args.gpu = GPU
    torch.cuda.set_device(args.gpu)
"""


@pytest.mark.parametrize(
    ("gpu", "reported"),
    [
        # blind set ai's 16: the task's index in the whole job, as the GPU
        ("args.rank", [10]),
        ('int(os.environ["SLURM_PROCID"])', [10]),
        # the task's index on its node
        ('int(os.environ["SLURM_LOCALID"])', []),
        ("args.rank % torch.cuda.device_count()", []),
    ],
)
def test_a_gpu_index_copied_from_the_global_task_index_is_reported(gpu: str, reported: list[int]):
    source = SLURM_INIT.replace("GPU", gpu)
    assert lines("", source, "slurm-without-torchrun") == reported


COMPOSER = """
from composer import Trainer
from composer.utils import dist
from torch.utils.data import DataLoader
train_dl = DataLoader(train_ds, batch_size=64, shuffle=True{sampler})
Trainer(model=model, train_dataloader=train_dl, max_duration="3ep").fit()
"""


def test_composer_leaves_the_sampler_to_the_script():
    missing = COMPOSER.format(sampler="")
    assert lines("", missing, "missing-distributed-sampler") == [5]
    given = COMPOSER.format(sampler=", sampler=dist.get_sampler(train_ds)").replace(
        "shuffle=True", "shuffle=False"
    )
    assert lines("", given, "missing-distributed-sampler") == []


SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"


def run_spawning(script: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.mark.slow
def test_a_lambda_handed_to_spawn_fails_to_pickle_and_the_partial_twin_runs(tmp_path):
    broken = run_spawning(SCRIPTS / "spawn_object_holding_a_lambda.py", tmp_path)
    assert broken.returncode != 0
    assert "Can't pickle local object" in broken.stderr
    fixed = run_spawning(SCRIPTS / "correct_spawn_object_holding_a_partial.py", tmp_path)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert fixed.stdout.count("trained rank") == 2


SPAWNED_MODULE = """
class Data(pl.LightningDataModule):
    def __init__(self, width):
        super().__init__()
        def pad(rows):
            return rows
        self.collate = FIELD
pl.Trainer(devices=4, strategy=STRATEGY).fit(model, datamodule=Data(8))
"""


@pytest.mark.parametrize(
    ("field", "strategy", "reported"),
    [
        ("lambda rows: rows", '"ddp_spawn"', [7]),
        ("pad", '"ddp_spawn"', [7]),  # a function defined inside the method
        ("lambda rows: rows", '"ddp"', []),  # each process builds its own object
        ("functools.partial(pad_rows, width=width)", '"ddp_spawn"', []),
    ],
)
def test_an_unpicklable_field_under_a_spawn_strategy(field, strategy, reported):
    body = SPAWNED_MODULE.replace("FIELD", field).replace("STRATEGY", strategy)
    assert lines(LIGHTNING, body, "spawn-pickle-error") == reported


RAY_LOOP = """
import torch
import ray.train.torch
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader
DEVICE = "cuda:0"

def train_loop(config):
    model = ray.train.torch.prepare_model(Net())
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True)
    PREPARE
    dev_loader = DataLoader(dev_set, batch_size=256)
    for x, y in train_loader:
        loss_fn(model(x.to(DEVICE)), y.to(DEVICE)).backward()

TorchTrainer(train_loop).fit()
"""


def test_ray_workers_need_prepared_loaders_and_their_own_devices():
    unprepared = RAY_LOOP.replace("PREPARE", "pass")
    found = lint_snippet("", unprepared, ["missing-distributed-sampler"])
    assert [line for line, _ in found] == [10, 12]
    assert "ray.train.torch.prepare_data_loader" in found[0][1].message
    prepared = RAY_LOOP.replace(
        "PREPARE", "train_loader = ray.train.torch.prepare_data_loader(train_loader)"
    )
    assert (
        lines("", prepared, "missing-distributed-sampler") == []
    )  # the dev loader reads all on purpose
    assert lines("", prepared, "hardcoded-device") == [6]


DEEPSPEED_BY_HAND = """
import deepspeed
import torch
from torch.utils.data import DataLoader
deepspeed.init_distributed(BACKEND)
loader = DataLoader(dataset, batch_size=8, shuffle=True)
ENGINE
for batch in loader:
    x = batch.cuda()
"""


@pytest.mark.parametrize(
    ("backend", "engine", "causes"),
    [
        # blind set fb's 01 and 17: DeepSpeed starts the group, so the loader is every rank's
        ("", "engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)",
         [("missing-distributed-sampler", 6)]),
        # no engine to set each rank's device: NCCL (DeepSpeed's default) on cuda:0 everywhere
        ("", "", [("missing-distributed-sampler", 6), ("set-device-order", 5)]),
        ('dist_backend="gloo"', "", [("missing-distributed-sampler", 6)]),
    ],
)  # fmt: skip
def test_deepspeeds_own_start_of_the_group_makes_the_script_distributed(backend, engine, causes):
    body = DEEPSPEED_BY_HAND.replace("BACKEND", backend).replace("ENGINE", engine)
    found = [
        (f.cause_id, line)
        for line, f in lint_snippet("", body, ["missing-distributed-sampler", "set-device-order"])
    ]
    assert sorted(found) == sorted(causes)
