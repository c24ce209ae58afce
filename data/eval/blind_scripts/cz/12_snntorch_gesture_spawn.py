"""DVS Gesture with snntorch conv-BN-Leaky blocks, launched with torch.multiprocessing.spawn.

    python 12_snntorch_gesture_spawn.py --gpus 4 --data /data/tonic --epochs 60
"""
import argparse
import os
import socket
import time

import numpy as np
import snntorch as snn
import tonic
import tonic.transforms as transforms
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from snntorch import surrogate
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def frame_transform(T):
    return transforms.Compose([
        transforms.Downsample(spatial_factor=0.25),
        transforms.ToFrame(sensor_size=(32, 32, 2), n_time_bins=T),
    ])


class GestureSNN(nn.Module):
    def __init__(self, beta=0.9, num_classes=11):
        super().__init__()
        sg = surrogate.fast_sigmoid(slope=25)
        self.conv1, self.bn1 = nn.Conv2d(2, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
        self.conv2, self.bn2 = nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64)
        self.conv3, self.bn3 = nn.Conv2d(64, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128)
        self.lif1 = snn.Leaky(beta=beta, spike_grad=sg, learn_beta=True)
        self.lif2 = snn.Leaky(beta=beta, spike_grad=sg, learn_beta=True)
        self.lif3 = snn.Leaky(beta=beta, spike_grad=sg, learn_beta=True)
        self.fc = nn.Linear(128 * 4 * 4, num_classes)
        self.lif_out = snn.Leaky(beta=beta, spike_grad=sg, reset_mechanism="none")

    def forward(self, x):  # x: [T, B, 2, 32, 32]
        m1, m2, m3 = self.lif1.init_leaky(), self.lif2.init_leaky(), self.lif3.init_leaky()
        m_out = self.lif_out.init_leaky()
        mem_rec, rate = [], 0.0
        for t in range(x.shape[0]):
            s1, m1 = self.lif1(F.max_pool2d(self.bn1(self.conv1(x[t])), 2), m1)
            s2, m2 = self.lif2(F.max_pool2d(self.bn2(self.conv2(s1)), 2), m2)
            s3, m3 = self.lif3(F.max_pool2d(self.bn3(self.conv3(s2)), 2), m3)
            _, m_out = self.lif_out(self.fc(s3.flatten(1)), m_out)
            mem_rec.append(m_out)
            rate = rate + (s1.mean() + s2.mean() + s3.mean()) / 3
        return torch.stack(mem_rec), rate / x.shape[0]


def to_tensor_batch(batch):
    frames = torch.stack([torch.as_tensor(f, dtype=torch.float32) for f, _ in batch])  # [B, T, 2, 32, 32]
    frames = torch.clamp(frames, max=5.0) / 5.0
    return frames.transpose(0, 1).contiguous(), torch.tensor([y for _, y in batch])


@torch.no_grad()
def evaluate_full(net, dataset, device):
    """Rank-0 only: whole test split on the unwrapped model, in eval mode (BN running stats)."""
    net.eval()
    loader = DataLoader(dataset, batch_size=64, shuffle=False, num_workers=4, collate_fn=to_tensor_batch)
    correct, n = 0, 0
    for x, y in loader:
        mem, _ = net(x.to(device))
        correct += (mem.mean(0).argmax(1).cpu() == y).sum().item()
        n += y.numel()
    return correct / n


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    tf = frame_transform(args.T)
    train_set = tonic.datasets.DVSGesture(save_to=args.data, train=True, transform=tf)
    test_set = tonic.datasets.DVSGesture(save_to=args.data, train=False, transform=tf)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        collate_fn=to_tensor_batch, pin_memory=True, drop_last=True)

    net = GestureSNN().to(device)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    # SyncBN keeps running stats identical across ranks; snntorch's membrane buffers stay local
    model = DDP(net, device_ids=[rank], broadcast_buffers=False)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world_size, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    best, bad_epochs = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            mem, rate = model(x)
            # cross entropy on the membrane at every step
            loss = sum(F.cross_entropy(m, y) for m in mem) / mem.shape[0] + args.rate_reg * rate
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(agg)

        decision = [None]
        if rank == 0:
            acc = evaluate_full(model.module, test_set, device)
            if acc > best:
                best, bad_epochs = acc, 0
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.out, "best.pt"))
            else:
                bad_epochs += 1
            print(f"epoch {epoch} loss {(agg[0] / agg[1]).item():.4f} test {acc:.4f} best {best:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            decision = [bad_epochs >= args.patience]
        dist.broadcast_object_list(decision, src=0)
        if decision[0]:
            if rank == 0:
                print("early stop", flush=True)
            break

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--data", default="/data/tonic")
    ap.add_argument("--out", default="runs/snntorch_gesture")
    ap.add_argument("--T", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--rate-reg", type=float, default=0.05)
    ap.add_argument("--patience", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    # download / extract once in the parent, before any worker exists
    tonic.datasets.DVSGesture(save_to=args.data, train=True)
    tonic.datasets.DVSGesture(save_to=args.data, train=False)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
