"""The same SimCLR with the encoder built without a classifier (num_classes=0), as
such code is fixed: every parameter gets a gradient each step. Lint only."""

import os

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class SimCLR(nn.Module):
    def __init__(self, arch: str) -> None:
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=False, num_classes=0)
        self.projector = nn.Sequential(nn.Linear(self.backbone.embed_dim, 256), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.backbone.forward_features(x)[:, 0])


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(SimCLR("vit_small_patch16_224").cuda(), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(10):
        a, b = torch.randn(8, 3, 224, 224).cuda(), torch.randn(8, 3, 224, 224).cuda()
        za, zb = F.normalize(model(a), dim=1), F.normalize(model(b), dim=1)
        loss = F.cross_entropy(za @ zb.T / 0.1, torch.arange(8).cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
