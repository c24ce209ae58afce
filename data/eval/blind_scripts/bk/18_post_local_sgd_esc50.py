#!/usr/bin/env python
"""Post-local SGD on ESC-50 environmental sounds (log-mel CNN14-lite).

Phase 1 (--switch-step steps): synchronous SGD, gradients all_reduced every step.
Phase 2: local SGD, parameters averaged every --period steps.
Cross-validation fold --fold is held out, as in the ESC-50 protocol.

    torchrun --nproc_per_node=4 18_post_local_sgd_esc50.py --root /data/ESC-50 --fold 5
"""
import argparse
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--fold", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--switch-step", type=int, default=1500)
    ap.add_argument("--period", type=int, default=16)
    ap.add_argument("--logdir", default="tb/esc50")
    ap.add_argument("--ckpt", default="ckpt/esc50_cnn.pt")
    return ap.parse_args()


class ESC50(Dataset):
    def __init__(self, root, folds, train):
        meta = pd.read_csv(os.path.join(root, "meta", "esc50.csv"))
        meta = meta[meta.fold.isin(folds)].reset_index(drop=True)
        self.files = [os.path.join(root, "audio", f) for f in meta.filename]
        self.labels = meta.target.tolist()
        self.train = train
        self.mel = torchaudio.transforms.MelSpectrogram(44100, n_fft=2048, hop_length=512, n_mels=128)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.fmask = torchaudio.transforms.FrequencyMasking(24)
        self.tmask = torchaudio.transforms.TimeMasking(48)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(self.files[i])
        if self.train:
            shift = int(torch.randint(0, wav.size(1), (1,)))
            wav = torch.roll(wav, shift, dims=1)
        spec = self.db(self.mel(wav))
        if self.train:
            spec = self.tmask(self.fmask(spec))
        return (spec - spec.mean()) / (spec.std() + 1e-5), self.labels[i]


def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class CNN(nn.Module):
    def __init__(self, n_classes=50):
        super().__init__()
        chans = [1, 64, 128, 256, 512]
        self.blocks = nn.ModuleList([conv_bn(a, b) for a, b in zip(chans[:-1], chans[1:])])
        self.fc = nn.Linear(512, n_classes)

    def forward(self, x):
        for b in self.blocks:
            x = F.avg_pool2d(b(x), 2)
        x = x.mean(dim=3)
        x = x.amax(dim=2) + x.mean(dim=2)
        return self.fc(F.dropout(x, 0.3, self.training))


@torch.no_grad()
def average_parameters(model, world):
    for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
        dist.all_reduce(t.data)
        t.data /= world


def average_gradients(model, world):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_folds = [f for f in range(1, 6) if f != args.fold]
    train_ds = ESC50(args.root, train_folds, train=True)
    val_ds = ESC50(args.root, [args.fold], train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64,
                        num_workers=4)

    model = CNN().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))
    writer = SummaryWriter(log_dir=args.logdir)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            local_phase = step >= args.switch_step
            if not local_phase:
                average_gradients(model, world)
            opt.step()
            sched.step()
            step += 1
            if local_phase and step % args.period == 0:
                average_parameters(model, world)
            writer.add_scalar("train/loss", loss.item(), step)
            writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        average_parameters(model, world)
        model.eval()
        c = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                c[0] += (model(x).argmax(1) == y).sum()
                c[1] += y.numel()
        dist.all_reduce(c)
        acc = (c[0] / c[1]).item()
        writer.add_scalar("val/acc", acc, epoch)
        if rank == 0:
            print(f"epoch {epoch} step {step} val acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if acc > best:
                best = acc
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save({"model": model.state_dict(), "epoch": epoch, "acc": acc, "fold": args.fold}, args.ckpt)
        dist.barrier()

    writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
