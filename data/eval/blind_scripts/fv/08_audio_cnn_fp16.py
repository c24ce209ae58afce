"""Audio event classification (log-mel CNN14-style network).

History: apex.amp opt_level O2 + apex DDP, launched with
torch.distributed.launch. Moved to torch.cuda.amp and native DDP (torchrun).
"""
import argparse
import csv
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", required=True)
    ap.add_argument("--audio-root", required=True)
    ap.add_argument("--num-classes", type=int, default=527)
    ap.add_argument("--sample-rate", type=int, default=32000)
    ap.add_argument("--clip-seconds", type=float, default=10.0)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="exp/cnn14")
    return ap.parse_args()


class ClipDataset(Dataset):
    def __init__(self, csv_path, root, sr, seconds, num_classes, train):
        with open(csv_path) as f:
            self.rows = [(r["path"], [int(x) for x in r["labels"].split(";")]) for r in csv.DictReader(f)]
        self.root, self.sr, self.n = root, sr, int(sr * seconds)
        self.num_classes, self.train = num_classes, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, labels = self.rows[i]
        wav, sr = torchaudio.load(os.path.join(self.root, path))
        wav = wav.mean(0)
        if sr != self.sr:
            wav = torchaudio.functional.resample(wav, sr, self.sr)
        if wav.numel() >= self.n:
            start = random.randint(0, wav.numel() - self.n) if self.train else 0
            wav = wav[start:start + self.n]
        else:
            wav = F.pad(wav, (0, self.n - wav.numel()))
        target = torch.zeros(self.num_classes)
        target[labels] = 1.0
        return wav, target, i


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.AvgPool2d(2))


class CNN14(nn.Module):
    def __init__(self, sr, num_classes):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(sr, n_fft=1024, hop_length=320, n_mels=64)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.bn0 = nn.BatchNorm2d(64)
        chans = [1, 64, 128, 256, 512, 1024, 2048]
        self.blocks = nn.Sequential(*[conv_block(a, b) for a, b in zip(chans[:-1], chans[1:])])
        self.fc1 = nn.Linear(2048, 2048)
        self.fc_out = nn.Linear(2048, num_classes)

    def forward(self, wav):
        with torch.autocast("cuda", enabled=False):
            x = self.db(self.mel(wav.float())).unsqueeze(1)          # B,1,M,T
        x = self.bn0(x.transpose(1, 2)).transpose(1, 2)
        x = self.blocks(x)
        x = x.mean(dim=2)
        x = x.max(dim=2)[0] + x.mean(dim=2)
        x = F.dropout(F.relu(self.fc1(x)), 0.5, self.training)
        return self.fc_out(x)


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    preds, targets, idxs = [], [], []
    for wav, target, idx in loader:
        wav = wav.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            preds.append(torch.sigmoid(model(wav).float()))
        targets.append(target.to(device))
        idxs.append(idx.to(device))
    preds, targets, idxs = torch.cat(preds), torch.cat(targets), torch.cat(idxs)
    all_p = [torch.empty_like(preds) for _ in range(world_size)]
    all_t = [torch.empty_like(targets) for _ in range(world_size)]
    all_i = [torch.empty_like(idxs) for _ in range(world_size)]
    dist.all_gather(all_p, preds)
    dist.all_gather(all_t, targets)
    dist.all_gather(all_i, idxs)
    model.train()
    # DistributedSampler pads the last shard; drop the repeated clips
    i_np = torch.cat(all_i).cpu().numpy()
    _, uniq = np.unique(i_np, return_index=True)
    p, t = torch.cat(all_p).cpu().numpy()[uniq], torch.cat(all_t).cpu().numpy()[uniq]
    keep = t.sum(0) > 0
    return average_precision_score(t[:, keep], p[:, keep], average="macro")


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_set = ClipDataset(args.train_csv, args.audio_root, args.sample_rate, args.clip_seconds,
                            args.num_classes, train=True)
    val_set = ClipDataset(args.val_csv, args.audio_root, args.sample_rate, args.clip_seconds,
                          args.num_classes, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = CNN14(args.sample_rate, args.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    if args.fp16:
        # keep the O2 recipe: fp16 weights, batchnorm in fp32
        model.half()
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.float()
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * world_size * args.batch_size / 256
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, amsgrad=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_map = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0, running = time.time(), torch.zeros((), device=device)
        for step, (wav, target, _) in enumerate(train_loader):
            wav, target = wav.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                logits = model(wav)
            loss = F.binary_cross_entropy_with_logits(logits.float(), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running += loss.detach()
        dist.all_reduce(running)
        train_loss = running.item() / (world_size * len(train_loader))

        mAP = evaluate(model, val_loader, device, world_size)
        if rank == 0:
            print(f"epoch {epoch} train_loss {train_loss:.4f} mAP {mAP:.4f} ({time.time() - t0:.0f}s)")
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "mAP": mAP},
                       os.path.join(args.out, "last.pt"))
            if mAP > best_map:
                best_map = mAP
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
