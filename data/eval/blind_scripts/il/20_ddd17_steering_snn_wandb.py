"""Steering-angle regression on DDD17 with a spiking ResNet (snnTorch neurons).

Preprocessed with tools/ddd17_export.py: per recording <rec>_frames.npy
[N, T, 2, 130, 173] uint8 (10 bins per 50 ms window) and <rec>_steering.npy [N] (deg).
Recording lists follow the split of Binas et al. / Maqueda et al.

    torchrun --nproc_per_node=4 20_ddd17_steering_snn_wandb.py --root /data/ddd17_export --splits splits.json
"""
import argparse
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import snntorch as snn
from snntorch import surrogate


class RecordingWindows(Dataset):
    def __init__(self, prefix, train):
        self.frames = np.load(prefix + "_frames.npy", mmap_mode="r")
        self.steer = np.load(prefix + "_steering.npy").astype(np.float32)
        self.train = train

    def __len__(self):
        return len(self.steer)

    def __getitem__(self, i):
        x = torch.from_numpy(np.ascontiguousarray(self.frames[i])).float().clamp_(max=6) / 6
        y = float(self.steer[i])
        if self.train and np.random.rand() < 0.5:
            x, y = x.flip(-1), -y  # mirror the scene and the steering direction
        return x, torch.tensor([y / 180.0])


class SpikingResBlock(nn.Module):
    def __init__(self, cin, cout, stride, beta, grad):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.n1 = snn.Leaky(beta=beta, spike_grad=grad)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.n2 = snn.Leaky(beta=beta, spike_grad=grad)
        self.sc = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) \
            if (stride != 1 or cin != cout) else nn.Identity()

    def init_state(self):
        return [self.n1.init_leaky(), self.n2.init_leaky()]

    def forward(self, x, state):
        s1, m1 = self.n1(self.b1(self.c1(x)), state[0])
        s2, m2 = self.n2(self.b2(self.c2(s1)) + self.sc(x), state[1])
        return s2, [m1, m2]


class SteeringSNN(nn.Module):
    def __init__(self, beta=0.85):
        super().__init__()
        grad = surrogate.atan(alpha=2.0)
        self.stem = nn.Sequential(nn.Conv2d(2, 32, 5, 2, 2, bias=False), nn.BatchNorm2d(32))
        self.stem_lif = snn.Leaky(beta=beta, spike_grad=grad)
        self.blocks = nn.ModuleList([SpikingResBlock(32, 64, 2, beta, grad), SpikingResBlock(64, 128, 2, beta, grad),
                                     SpikingResBlock(128, 256, 2, beta, grad)])
        self.head = nn.Linear(256, 1)

    def forward(self, x):  # [B, T, 2, H, W]
        m0 = self.stem_lif.init_leaky()
        states = [b.init_state() for b in self.blocks]
        feats = 0
        for t in range(x.size(1)):
            h, m0 = self.stem_lif(self.stem(x[:, t]), m0)
            for i, blk in enumerate(self.blocks):
                h, states[i] = blk(h, states[i])
            feats = feats + h.mean(dim=(2, 3))
        return self.head(feats / x.size(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--splits", required=True, help="json with 'train' and 'test' recording names")
    ap.add_argument("--out", default="checkpoints/ddd17_snn")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--wandb-project", default="ddd17-steering")
    ap.add_argument("--run-name", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.splits) as f:
        splits = json.load(f)
    train_set = ConcatDataset([RecordingWindows(os.path.join(args.root, r), True) for r in splits["train"]])
    test_set = ConcatDataset([RecordingWindows(os.path.join(args.root, r), False) for r in splits["test"]])

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SteeringSNN()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))

    wandb.init(project=args.wandb_project, name=args.run_name, config={**vars(args), "world_size": world})
    wandb.watch(model, log="gradients", log_freq=500)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_rmse, step = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x)
            loss = F.mse_loss(pred, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if step % 50 == 0:
                wandb.log({"train/mse": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)
            step += 1

        model.eval()
        preds, targets = [], []
        with torch.no_grad():
            for x, y in test_loader:
                preds.append(model.module(x.to(device)).squeeze(1) * 180.0)
                targets.append(y.to(device).squeeze(1) * 180.0)
        preds, targets = torch.cat(preds), torch.cat(targets)
        err = preds - targets
        sums = torch.stack([(err ** 2).sum(), targets.sum(), (targets ** 2).sum(), err.sum(),
                            torch.tensor(float(err.numel()), device=device)])
        dist.all_reduce(sums)
        n = sums[4]
        rmse = torch.sqrt(sums[0] / n).item()
        var_t = (sums[2] / n - (sums[1] / n) ** 2)
        var_e = (sums[0] / n - (sums[3] / n) ** 2)
        ev = (1 - var_e / var_t.clamp(min=1e-8)).item()  # explained variance
        wandb.log({"test/rmse_deg": rmse, "test/explained_variance": ev, "epoch": epoch}, step=step)

        if rank == 0:
            print(f"epoch {epoch}: RMSE {rmse:.2f} deg, EVA {ev:.4f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if rmse < best_rmse:
                best_rmse = rmse
                torch.save(ckpt, os.path.join(args.out, "best.pt"))

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
