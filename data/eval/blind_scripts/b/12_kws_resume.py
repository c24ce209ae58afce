"""Keyword spotting on Speech Commands v2 (35 words), M5-style 1D CNN, DDP with resume.

    torchrun --nproc_per_node=4 12_kws_resume.py --ckpt-dir ckpt/kws
    torchrun --nproc_per_node=4 12_kws_resume.py --ckpt-dir ckpt/kws --resume ckpt/kws/last.pt
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LABELS = sorted("backward bed bird cat dog down eight five follow forward four go happy house learn "
                "left marvin nine no off on one right seven sheila six stop three tree two up visual "
                "wow yes zero".split())


class SubsetSC(Dataset):
    def __init__(self, root, subset, sample_rate=16000, new_rate=8000):
        self.ds = torchaudio.datasets.SPEECHCOMMANDS(root, download=False, subset=subset)
        self.resample = torchaudio.transforms.Resample(sample_rate, new_rate)
        self.num_samples = new_rate

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        wav, sr, label, *_ = self.ds[i]
        wav = self.resample(wav)
        if wav.size(-1) < self.num_samples:
            wav = F.pad(wav, (0, self.num_samples - wav.size(-1)))
        return wav[:, :self.num_samples], LABELS.index(label)


class M5(nn.Module):
    def __init__(self, n_output=35, stride=16, n_channel=64):
        super().__init__()
        self.conv1 = nn.Conv1d(1, n_channel, kernel_size=80, stride=stride)
        self.bn1 = nn.BatchNorm1d(n_channel)
        self.conv2 = nn.Conv1d(n_channel, n_channel, kernel_size=3)
        self.bn2 = nn.BatchNorm1d(n_channel)
        self.conv3 = nn.Conv1d(n_channel, 2 * n_channel, kernel_size=3)
        self.bn3 = nn.BatchNorm1d(2 * n_channel)
        self.conv4 = nn.Conv1d(2 * n_channel, 2 * n_channel, kernel_size=3)
        self.bn4 = nn.BatchNorm1d(2 * n_channel)
        self.fc1 = nn.Linear(2 * n_channel, n_output)

    def forward(self, x):
        x = F.max_pool1d(F.relu(self.bn1(self.conv1(x))), 4)
        x = F.max_pool1d(F.relu(self.bn2(self.conv2(x))), 4)
        x = F.max_pool1d(F.relu(self.bn3(self.conv3(x))), 4)
        x = F.max_pool1d(F.relu(self.bn4(self.conv4(x))), 4)
        x = F.adaptive_avg_pool1d(x, 1).squeeze(-1)
        return self.fc1(x)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./speech_commands")
    p.add_argument("--ckpt-dir", default="ckpt/kws")
    p.add_argument("--resume", default="")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    if rank == 0:
        os.makedirs(args.data, exist_ok=True)
        os.makedirs(args.ckpt_dir, exist_ok=True)
        torchaudio.datasets.SPEECHCOMMANDS(args.data, download=True)
    dist.barrier()

    train_set = SubsetSC(args.data, "training")
    val_set = SubsetSC(args.data, "validation")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = M5(n_output=len(LABELS)).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.1)

    start_epoch, best = 0, 0.0
    if args.resume:
        checkpoint = torch.load(args.resume)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start_epoch = checkpoint["epoch"] + 1
        best = checkpoint["best"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(1, device=device)
        for wav, target in train_loader:
            wav, target = wav.to(device, non_blocking=True), target.to(device, non_blocking=True)
            loss = F.cross_entropy(model(wav), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        scheduler.step()
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (world * len(train_loader))

        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for wav, target in val_loader:
                wav, target = wav.to(device), target.to(device)
                stats[0] += (model(wav).argmax(-1) == target).sum()
                stats[1] += target.numel()
        dist.all_reduce(stats)
        acc = (stats[0] / stats[1]).item()

        if rank == 0:
            print(f"epoch {epoch}: train_loss={train_loss:.4f} val_acc={acc:.4f} ({time.time() - t0:.0f}s)")
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "best": max(best, acc),
            }
            torch.save(state, os.path.join(args.ckpt_dir, "last.pt"))
            if acc > best:
                torch.save(state, os.path.join(args.ckpt_dir, "best.pt"))
        best = max(best, acc)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
