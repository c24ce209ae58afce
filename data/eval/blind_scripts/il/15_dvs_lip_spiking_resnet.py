"""Word-level lip reading on DVS-Lip (100 words) with a spiking ResNet front-end
and a spiking temporal head.

Events (npy, fields t/x/y/p, 128x128 mouth crops) are binned into T frames.

    torchrun --nproc_per_node=4 15_dvs_lip_spiking_resnet.py --root /data/DVS-Lip --T 30
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from spikingjelly.activation_based import functional, layer, neuron, surrogate


class DVSLip(Dataset):
    def __init__(self, root, split, T, train):
        base = os.path.join(root, split)
        self.words = sorted(os.listdir(base))
        self.samples = [(os.path.join(base, w, f), i) for i, w in enumerate(self.words)
                        for f in sorted(os.listdir(os.path.join(base, w))) if f.endswith(".npy")]
        self.T, self.train = T, train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        ev = np.load(path)
        t = ev["t"].astype(np.float64)
        tb = np.clip(((t - t[0]) / max(t[-1] - t[0], 1) * self.T).astype(np.int64), 0, self.T - 1)
        frames = np.zeros((self.T, 2, 128, 128), np.float32)
        np.add.at(frames, (tb, ev["p"].astype(np.int64), ev["y"].astype(np.int64), ev["x"].astype(np.int64)), 1)
        frames = torch.from_numpy(frames)
        if self.train:
            y0, x0 = np.random.randint(0, 17, size=2)
            frames = frames[..., y0:y0 + 112, x0:x0 + 112]
            if np.random.rand() < 0.5:
                frames = frames.flip(-1)
        else:
            frames = frames[..., 8:120, 8:120]
        return frames, label


def sn():
    return neuron.LIFNode(tau=2.0, detach_reset=True, surrogate_function=surrogate.ATan(), step_mode="m")


class SpikingBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = nn.Sequential(
            layer.SeqToANNContainer(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)), sn(),
            layer.SeqToANNContainer(nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)))
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = layer.SeqToANNContainer(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.out = sn()

    def forward(self, x):
        return self.out(self.body(x) + self.short(x))


class LipSNN(nn.Module):
    def __init__(self, n_words=100):
        super().__init__()
        self.stem = nn.Sequential(
            layer.SeqToANNContainer(nn.Conv2d(2, 64, 5, 2, 2, bias=False), nn.BatchNorm2d(64)), sn(),
            layer.SeqToANNContainer(nn.MaxPool2d(3, 2, 1)))
        chans, blocks, cin = [64, 128, 256, 512], [], 64
        for i, c in enumerate(chans):
            blocks += [SpikingBlock(cin, c, 1 if i == 0 else 2), SpikingBlock(c, c, 1)]
            cin = c
        self.blocks = nn.Sequential(*blocks)
        self.pool = layer.SeqToANNContainer(nn.AdaptiveAvgPool2d(1))
        # temporal head: 1D conv over time on the pooled spike features
        self.temporal = nn.Sequential(nn.Conv1d(512, 512, 5, padding=2, bias=False), nn.BatchNorm1d(512), nn.ReLU(),
                                      nn.Conv1d(512, 512, 5, padding=2, bias=False), nn.BatchNorm1d(512), nn.ReLU())
        self.fc = nn.Linear(512, n_words)

    def forward(self, x):  # x [T, N, 2, 112, 112]
        f = self.pool(self.blocks(self.stem(x))).flatten(2)       # [T, N, 512]
        f = self.temporal(f.permute(1, 2, 0))                    # [N, 512, T]
        return self.fc(f.mean(-1))


def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for frames, labels in loader:
            frames = frames.to(device, non_blocking=True).transpose(0, 1).contiguous()
            labels = labels.to(device, non_blocking=True)
            logits = model(frames)
            functional.reset_net(model)
            correct += (logits.argmax(1) == labels).sum().item()
            total += labels.numel()
    stats = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="exp/dvs_lip_snn")
    ap.add_argument("--T", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    train_set = DVSLip(args.root, "train", args.T, train=True)
    test_set = DVSLip(args.root, "test", args.T, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = LipSNN(len(train_set.words))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        tic = time.time()
        run = torch.zeros(2, device=device)
        for frames, labels in train_loader:
            frames = frames.to(device, non_blocking=True).transpose(0, 1).contiguous()
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(ddp_model(frames), labels, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(ddp_model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            functional.reset_net(ddp_model)
            run += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(run)

        acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: loss {(run[0] / run[1]).item():.4f} test acc {acc:.4f} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
