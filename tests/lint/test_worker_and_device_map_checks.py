"""cuda-init-before-fork: GPU work in forked DataLoader workers; device-map-with-ddp:
a Hugging Face device_map that spreads each process's model over every GPU.

Neither can fail for real on this CPU-only machine (both need CUDA), so these
lint the patterns; the messages quote the errors users report.
"""

from __future__ import annotations

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
