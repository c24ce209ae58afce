"""Convolutional SNN on N-MNIST (snnTorch + Tonic), spike-count MSE loss.

Based on snnTorch tutorial 7, scaled out with DDP.

    torchrun --nproc_per_node=4 08_nmnist_csnn_snntorch.py --data ./data --epochs 30
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import snntorch as snn
from snntorch import functional as SF
from snntorch import surrogate
import tonic
import tonic.transforms as transforms


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--ckpt-dir", default="./checkpoints/nmnist_csnn")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--time-bins", type=int, default=30)
    parser.add_argument("--num-workers", type=int, default=4)
    return parser.parse_args()


class CSNN(nn.Module):
    def __init__(self, beta=0.5):
        super().__init__()
        grad = surrogate.atan()
        self.conv1 = nn.Conv2d(2, 12, 5)
        self.lif1 = snn.Leaky(beta=beta, spike_grad=grad)
        self.conv2 = nn.Conv2d(12, 32, 5)
        self.lif2 = snn.Leaky(beta=beta, spike_grad=grad)
        self.fc = nn.Linear(32 * 5 * 5, 10)
        self.lif3 = snn.Leaky(beta=beta, spike_grad=grad)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        # x: [T, B, 2, 34, 34]; membranes start at rest for every batch
        mem1, mem2, mem3 = self.lif1.init_leaky(), self.lif2.init_leaky(), self.lif3.init_leaky()
        spk_rec = []
        for t in range(x.size(0)):
            spk1, mem1 = self.lif1(self.pool(self.conv1(x[t])), mem1)
            spk2, mem2 = self.lif2(self.pool(self.conv2(spk1)), mem2)
            spk3, mem3 = self.lif3(self.fc(spk2.flatten(1)), mem3)
            spk_rec.append(spk3)
        return torch.stack(spk_rec)  # [T, B, 10]


def get_datasets(root, time_bins):
    sensor_size = tonic.datasets.NMNIST.sensor_size
    tf = transforms.Compose([
        transforms.Denoise(filter_time=10000),
        transforms.ToFrame(sensor_size=sensor_size, n_time_bins=time_bins),
    ])
    train = tonic.datasets.NMNIST(save_to=root, train=True, transform=tf)
    test = tonic.datasets.NMNIST(save_to=root, train=False, transform=tf)
    return train, test


def collate(batch):
    frames = torch.stack([torch.as_tensor(f, dtype=torch.float32) for f, _ in batch], dim=1)
    targets = torch.as_tensor([t for _, t in batch])
    return frames, targets


@torch.no_grad()
def test_accuracy(net, loader, device):
    net.eval()
    correct = torch.zeros(2, device=device)
    for data, targets in loader:
        data, targets = data.to(device), targets.to(device)
        spk = net(data)
        correct[0] += spk.sum(0).argmax(1).eq(targets).sum()
        correct[1] += targets.numel()
    return correct


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        get_datasets(args.data, args.time_bins)  # download once
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()
    train_set, test_set = get_datasets(args.data, args.time_bins)

    train_sampler = DistributedSampler(train_set, shuffle=True)
    # 10k test samples divide evenly over 1/2/4/8 GPUs, so nothing is padded
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, sampler=test_sampler, collate_fn=collate,
                             num_workers=args.num_workers, pin_memory=True)

    model = DDP(CSNN(args.beta).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    loss_fn = SF.mse_count_loss(correct_rate=0.8, incorrect_rate=0.2)

    best_acc = 0.0
    best_path = os.path.join(args.ckpt_dir, "best.pt")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        stats = torch.zeros(3, device=device)
        for data, targets in train_loader:
            data = data.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            spk_rec = model(data)
            loss = loss_fn(spk_rec, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stats[0] += loss.detach() * targets.numel()
            stats[1] += SF.accuracy_rate(spk_rec, targets) * targets.numel()
            stats[2] += targets.numel()
        dist.all_reduce(stats)

        test_stats = test_accuracy(model, test_loader, device)
        dist.all_reduce(test_stats)
        test_acc = (test_stats[0] / test_stats[1]).item()

        if rank == 0:
            print(f"Epoch {epoch:02d} | loss {stats[0] / stats[2]:.4f} | train acc {stats[1] / stats[2]:.4f} "
                  f"| test acc {test_acc:.4f} | {time.time() - tic:.1f}s", flush=True)
            if test_acc > best_acc:
                best_acc = test_acc
                torch.save({"model": model.state_dict(), "epoch": epoch, "test_acc": test_acc}, best_path)

    dist.barrier()
    if rank == 0:
        # final report with the best weights on the full test set, single GPU
        net = CSNN(args.beta).to(device)
        ckpt = torch.load(best_path, map_location=device)
        net.load_state_dict(ckpt["model"])
        full_loader = DataLoader(test_set, batch_size=256, collate_fn=collate, num_workers=args.num_workers)
        res = test_accuracy(net, full_loader, device)
        print(f"best epoch {ckpt['epoch']}: test acc {(res[0] / res[1]).item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
