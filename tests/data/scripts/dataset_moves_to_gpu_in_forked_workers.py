"""A Dataset that encodes on the GPU inside DataLoader workers (cuda-init-before-fork).

The main process has set its device and started NCCL before the loader forks
its six workers; the first worker to move the clip to the GPU fails with
"Cannot re-initialize CUDA in forked subprocess".
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class EncodedClips(Dataset):
    def __init__(self, clips: list[torch.Tensor], device: torch.device) -> None:
        self.clips, self.device = clips, device
        self.encoder = None

    def _encoder(self) -> nn.Module:
        if self.encoder is None:
            self.encoder = nn.Conv1d(1, 4, 3).to(self.device)  # expect: cuda-init-before-fork
        return self.encoder

    def __len__(self) -> int:
        return len(self.clips)

    @torch.no_grad()
    def __getitem__(self, i: int) -> torch.Tensor:
        return self._encoder()(self.clips[i].to(self.device)).cpu()


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    dataset = EncodedClips([torch.randn(1, 1, 100) for _ in range(64)], device)
    loader = DataLoader(
        dataset, batch_size=8, sampler=DistributedSampler(dataset), num_workers=6
    )
    for batch in loader:
        print(batch.shape, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
