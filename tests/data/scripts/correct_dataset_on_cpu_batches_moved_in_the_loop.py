"""Workers only read CPU tensors; the loop moves each batch to the GPU, and a
loader that must touch CUDA in its workers spawns them (no finding expected)."""

import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Clips(Dataset):
    def __init__(self, clips: list[torch.Tensor], device: str = "cpu") -> None:
        self.clips, self.device = clips, device

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.clips[i].to(torch.float32)


class GpuClips(Clips):
    def __getitem__(self, i: int) -> torch.Tensor:
        return self.clips[i].cuda()


def pad(batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(batch).pin_memory()


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    clips = [torch.randn(1, 100) for _ in range(64)]
    dataset = Clips(clips)
    loader = DataLoader(
        dataset, batch_size=8, sampler=DistributedSampler(dataset), num_workers=4, collate_fn=pad
    )
    for batch in loader:
        print(batch.to(device, non_blocking=True).shape, flush=True)
    on_gpu = GpuClips(clips)
    spawned = DataLoader(
        on_gpu, batch_size=8, sampler=DistributedSampler(on_gpu), num_workers=2,
        multiprocessing_context="spawn",
    )
    in_process = DataLoader(on_gpu, batch_size=8, sampler=DistributedSampler(on_gpu), num_workers=0)
    for batch in [*spawned, *in_process]:
        print(batch.shape, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
