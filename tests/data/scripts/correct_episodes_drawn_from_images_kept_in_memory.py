"""Few-shot episodes on every rank (no finding expected): the task sampler reads
the image folder once through a DataLoader, keeps every image in memory by
class, and each rank draws its own N-way K-shot tasks from a generator seeded
with its rank; the meta-gradients are averaged by DDP. No rank iterates the
dataset as an epoch, so there is nothing for a DistributedSampler to split."""

import os
import random

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets import ImageFolder


class TaskSampler:
    def __init__(self, root, rng):
        folder = ImageFolder(root, transform=transforms.ToTensor())
        loader = DataLoader(folder, batch_size=256, num_workers=4)
        images, labels = zip(*[(x, y) for x, y in loader])
        images, labels = torch.cat(images), torch.cat(labels)
        self.by_class = {c: images[labels == c] for c in labels.unique().tolist()}
        self.rng = rng

    def sample(self, ways, shots):
        classes = self.rng.sample(sorted(self.by_class), ways)
        support = []
        for label, c in enumerate(classes):
            pool = self.by_class[c]
            picks = self.rng.sample(range(len(pool)), shots)
            support.append((pool[picks], torch.full((shots,), label)))
        return torch.cat([s for s, _ in support]), torch.cat([y for _, y in support])


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    sampler = TaskSampler("/data/miniimagenet/train", random.Random(1000 + dist.get_rank()))
    model = DDP(nn.Sequential(nn.Flatten(), nn.LazyLinear(5)).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(10000):
        images, labels = sampler.sample(ways=5, shots=5)
        loss = nn.functional.cross_entropy(model(images.cuda()), labels.cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0 and step % 500 == 0:
            print(f"step {step} loss {loss.item():.3f}")
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
