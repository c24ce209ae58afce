"""SimCLR-style pretraining: the NT-Xent loss compares each embedding with
every rank's (gathered with autograd), but the ResNet and its projection head
keep plain BatchNorm, so each GPU normalises its own images alone and the
loss learns from those per-GPU statistics."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        grad = torch.stack(grads)
        dist.all_reduce(grad)
        return grad[dist.get_rank()]


def nt_xent(z1, z2, temperature=0.2):
    z = F.normalize(torch.cat([torch.cat(GatherLayer.apply(z1)), torch.cat(GatherLayer.apply(z2))]))
    sim = z @ z.t() / temperature
    sim.fill_diagonal_(float("-inf"))
    n = z.shape[0] // 2
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    backbone = torchvision.models.resnet50()
    backbone.fc = nn.Sequential(
        nn.Linear(2048, 2048), nn.BatchNorm1d(2048), nn.ReLU(), nn.Linear(2048, 128)
    )
    model = DDP(backbone.cuda(), device_ids=[local_rank])  # expect: batchnorm-not-synced
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    for step in range(1000):
        view1 = torch.randn(128, 3, 224, 224, device="cuda")
        view2 = torch.randn(128, 3, 224, 224, device="cuda")
        z1, z2 = model(torch.cat([view1, view2])).chunk(2)  # one forward for both views
        loss = nt_xent(z1, z2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
