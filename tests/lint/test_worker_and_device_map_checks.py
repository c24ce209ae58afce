"""cuda-init-before-fork: GPU work in forked DataLoader workers; device-map-with-ddp:
a Hugging Face device_map that spreads each process's model over every GPU.

Neither can fail for real on this CPU-only machine (both need CUDA), so these
lint the patterns; the messages quote the errors users report.
"""

from __future__ import annotations

import pytest
from snippets import lint_snippet

HEADER = """
import os
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM
from accelerate import Accelerator
"""


def fork_lines(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["cuda-init-before-fork"])]


def device_map_lines(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["device-map-with-ddp"])]


def test_a_dataset_moving_items_to_the_gpu_in_forked_workers_is_reported():
    lines = fork_lines(
        """
        class Feats(Dataset):
            def __init__(self, rows, local_rank):
                self.rows, self.local_rank = rows, local_rank
            def __getitem__(self, i):
                return torch.tensor(self.rows[i], device=self.local_rank)
        dist.init_process_group("nccl")
        feats = Feats([[1.0]], int(os.environ["LOCAL_RANK"]))
        loader = DataLoader(feats, batch_size=4, num_workers=os.cpu_count())
        """
    )
    assert lines == [6]


def test_a_collate_fn_calling_cuda_is_reported_once_for_two_loaders():
    lines = fork_lines(
        """
        def to_gpu(batch):
            return torch.stack(batch).cuda()
        dist.init_process_group("nccl")
        train = DataLoader(list(range(8)), collate_fn=to_gpu, num_workers=2)
        val = DataLoader(list(range(8)), collate_fn=to_gpu, num_workers=2)
        """
    )
    assert lines == [3]


def test_a_worker_helper_moving_to_its_own_tensors_device_is_not_reported():
    # blind set aq 02: a mel transform cached per device and moved `.to(y.device)`,
    # y the CPU audio the worker loaded; the same helper's `.to(self.device)` is a move.
    body = """
        _cache = {}
        def mel(y, n_mels):
            key = str(y.device)
            if key not in _cache:
                _cache[key] = torch.nn.Identity().to(y.device)
            return _cache[key](y.unsqueeze(0))
        class Clips(Dataset):
            def __init__(self, files):
                self.files = files
            def __getitem__(self, i):
                audio = torch.load(self.files[i])
                return mel(audio, 80)
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        loader = DataLoader(Clips(["a.pt"]), batch_size=4, num_workers=4)
        """
    assert fork_lines(body) == []
    moved = body.replace(".to(y.device)", ".to(DEVICE)").replace(
        "_cache = {}", "_cache = {}\n        DEVICE = 'cuda'"
    )
    assert fork_lines(moved) == [7]


def test_workers_spawned_absent_or_on_the_cpu_are_not_reported():
    lines = fork_lines(
        """
        class Feats(Dataset):
            def __init__(self, rows, device):
                self.rows, self.device = rows, device
            def __getitem__(self, i):
                return torch.tensor(self.rows[i]).to(self.device)
        dist.init_process_group("nccl")
        a = DataLoader(Feats([[1.0]], "cuda"), num_workers=2, multiprocessing_context="spawn")
        b = DataLoader(Feats([[1.0]], "cuda"), num_workers=0)
        c = DataLoader(Feats([[1.0]], device="cpu"), num_workers=2)
        d = DataLoader(Feats([[1.0]], "cuda"))
        """
    )
    assert lines == []


def test_a_start_method_chosen_for_the_script_silences_it():
    lines = fork_lines(
        """
        class Feats(Dataset):
            def __getitem__(self, i):
                return torch.ones(2).cuda()
        torch.multiprocessing.set_start_method("spawn")
        dist.init_process_group("nccl")
        loader = DataLoader(Feats(), num_workers=2)
        """
    )
    assert lines == []


ACTORS = """
import torch.multiprocessing as mp

def act(net, device):
    return net.to(device)

def actor_loop(actor_id, device):
    net = act(torch.nn.Linear(4, 2), device)

def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    {init}
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    for i in range(4):
        p = {process}(target=actor_loop, args=(i, device), daemon=True)
        p.start()
"""


@pytest.mark.parametrize(
    "init, process, reported",
    [
        # blind set bl's 13: Ape-X actors forked after the learner set its GPU
        ("torch.cuda.set_device(local_rank)", "mp.Process", [16]),
        ("model = torch.nn.Linear(4, 2).cuda()", "mp.Process", [16]),
        # a spawn context, or CUDA not yet touched when the actors start
        ("torch.cuda.set_device(local_rank)", 'mp.get_context("spawn").Process', []),
        ("pass", "mp.Process", []),
    ],
    ids=["set-device", "cuda-model", "spawn-context", "before-cuda"],
)
def test_actor_processes_forked_after_cuda_and_moving_to_the_gpu(init, process, reported):
    assert fork_lines(ACTORS.format(init=init, process=process)) == reported


NOTEBOOK = """
import torch.multiprocessing as mp

def train_fn(rank, world_size):
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    model = torch.nn.Linear(4, 2).to(torch.device("cuda", rank))

probe = torch.nn.Linear(4, 2).cuda()
if __name__ == "__main__":
    {start}
"""


@pytest.mark.parametrize(
    ("start", "reported"),
    [
        # blind set fq's 10: a notebook's sanity check on the GPU at import, then a fork
        ('mp.start_processes(train_fn, args=(2,), nprocs=2, start_method="fork")', [10]),
        ('mp.start_processes(train_fn, args=(2,), nprocs=2, start_method="spawn")', []),
        ("mp.spawn(train_fn, args=(2,), nprocs=2)", []),
    ],
    ids=["fork", "spawn-method", "spawn"],
)
def test_processes_started_by_fork_after_cuda_at_import(start, reported):
    assert fork_lines(NOTEBOOK.format(start=start)) == reported


def test_device_map_auto_under_a_process_group_or_an_accelerate_training_loop_is_reported():
    assert device_map_lines(
        """
        dist.init_process_group("nccl")
        model = AutoModelForCausalLM.from_pretrained("m", device_map="auto", load_in_4bit=True)
        """
    ) == [3]
    assert device_map_lines(
        """
        accelerator = Accelerator()
        model = AutoModelForCausalLM.from_pretrained("m", device_map="balanced")
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
        accelerator.backward(model(**batch).loss)
        """
    ) == [3]


def test_device_map_auto_in_a_script_its_own_launch_line_runs_as_several_processes():
    # blind set aq 10: a Seq2SeqTrainer script (the Trainer starts DDP itself) whose
    # docstring launches it with torchrun; one process launched is no data parallelism
    body = """
        \"\"\"Fine-tune Whisper.

        torchrun --nproc_per_node=4 train.py --model openai/whisper-small
        \"\"\"
        from transformers import Seq2SeqTrainer
        model = AutoModelForCausalLM.from_pretrained("m", device_map="auto")
        Seq2SeqTrainer(model=model).train()
        """
    assert device_map_lines(body) == [7]
    assert device_map_lines(body.replace("--nproc_per_node=4", "--nproc_per_node=1")) == []
    assert device_map_lines(body.replace("torchrun --nproc_per_node=4", "python")) == []


def test_a_device_map_to_the_ranks_own_gpu_or_one_inferring_process_is_not():
    assert (
        device_map_lines(
            """
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        model = AutoModelForCausalLM.from_pretrained("m", device_map={"": local_rank})
        if dist.get_rank() == 0:
            judge = AutoModelForCausalLM.from_pretrained("j", device_map="auto")
        """
        )
        == []
    )
    assert (
        device_map_lines(
            """
        accelerator = Accelerator()
        model = AutoModelForCausalLM.from_pretrained("m", device_map="auto")
        print(model.generate(**accelerator.prepare(batch)))
        """
        )
        == []
    )


@pytest.mark.parametrize(
    ("device_map", "reported"),
    [
        # blind set de's 18: a single-GPU QLoRA recipe's map under torchrun
        ('{"": 0}', [5]),
        ('"cuda:0"', [5]),
        ('{"": local_rank}', []),  # each process its own GPU
        ('"cuda"', []),  # the current device: each process's own after set_device
        ('{"": "cpu"}', []),
    ],
)
def test_a_device_map_to_one_fixed_gpu_under_a_process_per_gpu(device_map, reported):
    body = f"""
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        model = AutoModelForCausalLM.from_pretrained("m", device_map={device_map})
        """
    found = lint_snippet(HEADER, body, ["hardcoded-device"])
    assert [line for line, _ in found] == reported


@pytest.mark.parametrize(
    ("device", "guard", "reported"),
    [
        # blind sets ic's 01 and ie's 14: every rank's FAISS index copied to GPU 0
        ("0", "", [7]),
        ("local_rank", "", []),  # each rank its own GPU
        ("0", "if dist.get_rank() == 0:\n            ", []),  # rank 0's own GPU
    ],
    ids=["fixed", "local rank", "rank 0 only"],
)
def test_a_faiss_index_every_rank_copies_to_one_fixed_gpu(device, guard, reported):
    body = f"""
        import faiss
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        res = faiss.StandardGpuResources()
        {guard}index = faiss.index_cpu_to_gpu(res, {device}, faiss.IndexFlatIP(128))
        """
    found = lint_snippet(HEADER, body, ["hardcoded-device"])
    assert [line for line, _ in found] == reported
