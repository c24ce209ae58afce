"""Audio-event classification (AudioSet balanced / ESC-style) with an AST-like
spectrogram transformer. DDP, fp16 autocast + GradScaler, SpecAugment, grad accumulation,
checkpoint every epoch for resuming.

torchrun --nproc_per_node=8 20_ddp_audio_cls.py --train_csv meta/train.csv --val_csv meta/eval.csv --out exp/ast
"""
import argparse
import contextlib
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_csv", required=True)
    ap.add_argument("--val_csv", required=True)
    ap.add_argument("--num_classes", type=int, default=527)
    ap.add_argument("--out", default="exp/ast")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--depth", type=int, default=12)
    return ap.parse_args()


class ClipDataset(Dataset):
    def __init__(self, csv, num_classes, train):
        self.df = pd.read_csv(csv)  # columns: path, labels ("3;17;200")
        self.num_classes, self.train = num_classes, train
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=1024, hop_length=160, n_mels=128)
        self.fmask = torchaudio.transforms.FrequencyMasking(24)
        self.tmask = torchaudio.transforms.TimeMasking(96)

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        wav, sr = torchaudio.load(row["path"])
        wav = torchaudio.functional.resample(wav.mean(0, keepdim=True), sr, 16000)
        wav = F.pad(wav, (0, max(0, 160000 - wav.size(1))))[:, :160000]
        spec = (self.mel(wav) + 1e-6).log()  # [1, 128, 1001]
        spec = (spec + 4.27) / 4.57
        if self.train:
            spec = self.tmask(self.fmask(spec))
        target = torch.zeros(self.num_classes)
        target[[int(x) for x in str(row["labels"]).split(";")]] = 1.0
        return spec[:, :, :1000], target


class SpecTransformer(nn.Module):
    def __init__(self, num_classes, dim, depth, patch=16):
        super().__init__()
        self.patch_embed = nn.Conv2d(1, dim, patch, stride=(10, 10))
        n = ((128 - patch) // 10 + 1) * ((1000 - patch) // 10 + 1)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, dim // 64, 4 * dim, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1) + self.pos
        x = self.encoder(x)
        return self.head(self.norm(x[:, 0]))


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    preds, targs = [], []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            preds.append(torch.sigmoid(model(x.to(device)).float()))
        targs.append(y.to(device))
    p, t = torch.cat(preds), torch.cat(targs)
    gp = [torch.zeros_like(p) for _ in range(world)]
    gt = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(gp, p)
    dist.all_gather(gt, t)
    p, t = torch.cat(gp).cpu().numpy(), torch.cat(gt).cpu().numpy()
    valid = t.sum(0) > 0
    model.train()
    return float(average_precision_score(t[:, valid], p[:, valid], average="macro"))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = ClipDataset(args.train_csv, args.num_classes, train=True)
    val_ds = ClipDataset(args.val_csv, args.num_classes, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=32, sampler=val_sampler, num_workers=8)

    model = SpecTransformer(args.num_classes, args.dim, args.depth).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-7, betas=(0.95, 0.999))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[10, 15, 20, 25], gamma=0.5)
    scaler = torch.cuda.amp.GradScaler()
    os.makedirs(args.out, exist_ok=True)

    start_epoch, best_map = 0, 0.0
    last_path = os.path.join(args.out, "last.pt")
    if os.path.exists(last_path):
        ck = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best_map = ck["epoch"] + 1, ck["best_map"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        n_iter = (len(train_loader) // args.accum) * args.accum
        for i, (x, y) in enumerate(train_loader):
            if i >= n_iter:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if last_micro else model.no_sync():
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(x)
                loss = F.binary_cross_entropy_with_logits(logits.float(), y)
                scaler.scale(loss / args.accum).backward()
            if last_micro:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} [{i}/{len(train_loader)}] bce {loss.item():.4f} "
                      f"scale {scaler.get_scale():.0f} {time.time() - t0:.0f}s", flush=True)
        scheduler.step()

        mAP = evaluate(model.module, val_loader, device, world)
        best_map = max(best_map, mAP)
        if rank == 0:
            print(f"epoch {epoch} mAP {mAP:.4f} (best {best_map:.4f})", flush=True)

        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "epoch": epoch, "best_map": best_map}, last_path)
        if mAP >= best_map:
            torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
