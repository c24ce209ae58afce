"""The model of library_backbone_run_without_its_head.py with the fix: the
backbone's own classifier is replaced by nn.Identity() before DDP wraps the
model, so every parameter left produces the loss. Linted, not run.

    torchrun --nproc_per_node=4 correct_library_backbone_head_removed.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class ReID(nn.Module):
    def __init__(self, num_ids):
        super().__init__()
        backbone = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.neck = nn.BatchNorm1d(2048)
        self.classifier = nn.Linear(2048, num_ids, bias=False)

    def forward(self, x):
        b = self.backbone
        x = b.maxpool(b.relu(b.bn1(b.conv1(x))))
        x = b.layer4(b.layer3(b.layer2(b.layer1(x))))
        feat = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.classifier(self.neck(feat))


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(ReID(751).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(10):
        images = torch.randn(16, 3, 256, 128, device="cuda")
        ids = torch.randint(0, 751, (16,), device="cuda")
        loss = F.cross_entropy(model(images), ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
