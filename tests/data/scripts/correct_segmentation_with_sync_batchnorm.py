"""The segmentation script of batchnorm_segmentation_two_crops_per_gpu.py with
the recipe's fix: its BatchNorm layers become SyncBatchNorm before DDP, so
each layer normalises over every GPU's crops together (on GPUs, under NCCL)."""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class TinySegNet(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.encoder = nn.Sequential(conv_bn(3, 16), conv_bn(16, 32))
        self.head = nn.Conv2d(32, classes, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=2, help="per GPU")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    torch.manual_seed(dist.get_rank())
    images, masks = torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16, 32, 32))
    dataset = TensorDataset(images, masks)
    sampler = DistributedSampler(dataset)
    train_loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    val_loader = DataLoader(dataset, batch_size=1)
    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(TinySegNet()).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.cuda(), y.cuda()
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        correct = sum((model(x.cuda()).argmax(1) == y.cuda()).float().mean() for x, y in val_loader)
    print(f"rank {os.environ['RANK']} pixel accuracy {correct / len(val_loader):.3f}")
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
