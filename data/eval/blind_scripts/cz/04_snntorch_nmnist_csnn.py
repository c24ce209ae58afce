"""
Convolutional SNN on N-MNIST with snntorch + tonic, data-parallel over GPUs.

    torchrun --nproc_per_node=4 04_snntorch_nmnist_csnn.py --data ./data --epochs 20
"""
import argparse
import os
import time

import snntorch as snn
import snntorch.functional as SF
import tonic
import tonic.transforms as transforms
import torch
import torch.distributed as dist
import torch.nn as nn
from snntorch import surrogate
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class CSNN(nn.Module):
    def __init__(self, beta=0.5, num_classes=10):
        super().__init__()
        grad = surrogate.atan()
        self.conv1 = nn.Conv2d(2, 12, 5)
        self.lif1 = snn.Leaky(beta=beta, spike_grad=grad)
        self.conv2 = nn.Conv2d(12, 32, 5)
        self.lif2 = snn.Leaky(beta=beta, spike_grad=grad)
        self.fc = nn.Linear(32 * 5 * 5, num_classes)
        self.lif3 = snn.Leaky(beta=beta, spike_grad=grad)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        """x: [T, B, 2, 34, 34] -> output spikes [T, B, classes], hidden rate"""
        mem1 = self.lif1.init_leaky()
        mem2 = self.lif2.init_leaky()
        mem3 = self.lif3.init_leaky()
        spk_out, hidden = [], 0.0
        for step in range(x.size(0)):
            spk1, mem1 = self.lif1(self.pool(self.conv1(x[step])), mem1)
            spk2, mem2 = self.lif2(self.pool(self.conv2(spk1)), mem2)
            spk3, mem3 = self.lif3(self.fc(spk2.flatten(1)), mem3)
            spk_out.append(spk3)
            hidden = hidden + spk1.mean() + spk2.mean()
        return torch.stack(spk_out), hidden / (2 * x.size(0))


def pad_time_collate(batch):
    """Pad variable-length frame sequences (ToFrame with time_window) along T."""
    frames, targets = zip(*batch)
    T = max(f.shape[0] for f in frames)
    out = torch.zeros(len(frames), T, *frames[0].shape[1:])
    for i, f in enumerate(frames):
        out[i, : f.shape[0]] = torch.as_tensor(f, dtype=torch.float32)
    return out.transpose(0, 1), torch.as_tensor(targets)


def get_loaders(args, rank):
    sensor_size = tonic.datasets.NMNIST.sensor_size
    frame_tf = transforms.Compose([
        transforms.Denoise(filter_time=10000),
        transforms.ToFrame(sensor_size=sensor_size, time_window=args.time_window),
    ])
    if rank == 0:  # download once
        tonic.datasets.NMNIST(save_to=args.data, train=True)
        tonic.datasets.NMNIST(save_to=args.data, train=False)
    dist.barrier()
    train_set = tonic.datasets.NMNIST(save_to=args.data, transform=frame_tf, train=True)
    test_set = tonic.datasets.NMNIST(save_to=args.data, transform=frame_tf, train=False)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=pad_time_collate, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, sampler=test_sampler,
                             collate_fn=pad_time_collate, num_workers=args.workers, pin_memory=True)
    return train_loader, test_loader, train_sampler


def evaluate(net, loader, device):
    net.eval()
    correct, total = 0, 0
    with torch.no_grad():
        for data, targets in loader:
            data, targets = data.to(device), targets.to(device)
            spk_rec, _ = net(data)
            correct += (spk_rec.sum(0).argmax(1) == targets).sum().item()
            total += targets.size(0)
    return correct / total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--ckpt-dir", default="./ckpt")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--time-window", type=int, default=1000, help="microseconds per frame")
    parser.add_argument("--rate-reg", type=float, default=1e-2)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_loader, test_loader, train_sampler = get_loaders(args, rank)

    net = CSNN(beta=args.beta).to(device)
    # no BatchNorm here; snntorch keeps the membrane in buffers, which must stay per rank
    net = DDP(net, device_ids=[local_rank], broadcast_buffers=False)

    # lr given for batch 128; scale linearly with the global batch
    lr = args.lr * args.batch_size * world_size / 128
    optimizer = torch.optim.Adam(net.parameters(), lr=lr, betas=(0.9, 0.999))
    loss_fn = SF.mse_count_loss(correct_rate=0.8, incorrect_rate=0.2)

    best_acc = 0.0
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        net.train()
        t0 = time.time()
        for i, (data, targets) in enumerate(train_loader):
            data, targets = data.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            spk_rec, hidden_rate = net(data)
            loss = loss_fn(spk_rec, targets) + args.rate_reg * hidden_rate
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            if rank == 0 and i % 50 == 0:
                acc = SF.accuracy_rate(spk_rec, targets)
                print(f"epoch {epoch} iter {i}/{len(train_loader)} loss {loss.item():.4f} "
                      f"batch acc {acc * 100:.2f}% rate {hidden_rate.item():.3f}")

        test_acc = evaluate(net.module, test_loader, device)
        if rank == 0:
            print(f"== epoch {epoch}: test accuracy {test_acc * 100:.2f}% ({time.time() - t0:.0f}s)")
            torch.save({"epoch": epoch, "model": net.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "test_acc": test_acc},
                       os.path.join(args.ckpt_dir, "csnn_last.pt"))
            if test_acc > best_acc:
                best_acc = test_acc
                torch.save(net.module.state_dict(), os.path.join(args.ckpt_dir, "csnn_best.pt"))

    if rank == 0:
        print(f"best test accuracy: {best_acc * 100:.2f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
