# Audio event tagging (log-mel + EfficientNet-B0) on the in-house sound dataset.
#
# Runs on the GPU pool through a Kubeflow PyTorchJob:
#   pytorchReplicaSpecs: Master (1) + Worker (1), nvidia.com/gpu: 4
#   command: torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$(RANK)
#            --master_addr=$(MASTER_ADDR) --master_port=$(MASTER_PORT)
#            tagger.py --manifest /mnt/audio/manifests --out /mnt/experiments/audiotag
#   env: WANDB_API_KEY from secret wandb-key, WANDB_PROJECT=audio-tagging
import argparse
import csv
import os
import random
import time

import numpy as np
import soundfile as sf
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import wandb
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sample-rate", type=int, default=32000)
    ap.add_argument("--clip-seconds", type=float, default=10.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--mixup", type=float, default=0.5)
    ap.add_argument("--run-name", default=None)
    return ap.parse_args()


class ClipDataset(Dataset):
    def __init__(self, manifest_csv, classes, sample_rate, clip_seconds, train):
        with open(manifest_csv) as f:
            self.rows = list(csv.DictReader(f))
        self.cls_index = {c: i for i, c in enumerate(classes)}
        self.sr = sample_rate
        self.n = int(sample_rate * clip_seconds)
        self.train = train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        wav, sr = sf.read(row["path"], dtype="float32", always_2d=True)
        wav = torch.from_numpy(wav.mean(1))
        if sr != self.sr:
            wav = torchaudio.functional.resample(wav, sr, self.sr)
        if wav.numel() >= self.n:
            start = random.randint(0, wav.numel() - self.n) if self.train else 0
            wav = wav[start:start + self.n]
        else:
            wav = torch.nn.functional.pad(wav, (0, self.n - wav.numel()))
        target = torch.zeros(len(self.cls_index))
        for lab in row["labels"].split(";"):
            target[self.cls_index[lab]] = 1.0
        return wav, target


class Tagger(nn.Module):
    def __init__(self, n_classes, sample_rate):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=1024, hop_length=320, n_mels=128)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.backbone = timm.create_model("efficientnet_b0", pretrained=True, in_chans=1, num_classes=n_classes)

    def forward(self, wav):
        x = self.db(self.mel(wav)).unsqueeze(1)
        x = (x + 40.0) / 40.0
        return self.backbone(x)


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    scores, targets = [], []
    for wav, y in loader:
        scores.append(torch.sigmoid(model(wav.to(device))).cpu())
        targets.append(y)
    local = (torch.cat(scores), torch.cat(targets))
    parts = [None] * world
    dist.all_gather_object(parts, local)
    model.train()
    s = torch.cat([p[0] for p in parts]).numpy()
    t = torch.cat([p[1] for p in parts]).numpy()
    keep = t.sum(0) > 0
    return float(average_precision_score(t[:, keep], s[:, keep], average="macro"))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.manifest, "classes.txt")) as f:
        classes = [l.strip() for l in f if l.strip()]
    train_ds = ClipDataset(os.path.join(args.manifest, "train.csv"), classes, args.sample_rate,
                           args.clip_seconds, train=True)
    val_ds = ClipDataset(os.path.join(args.manifest, "val.csv"), classes, args.sample_rate,
                         args.clip_seconds, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=64, num_workers=4)

    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "audio-tagging"), name=args.run_name,
                     config={**vars(args), "world_size": world, "n_classes": len(classes)})

    model = Tagger(len(classes), args.sample_rate)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    steps = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps, pct_start=0.1)
    criterion = nn.BCEWithLogitsLoss()

    os.makedirs(args.out, exist_ok=True)
    best_map = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for wav, y in train_dl:
            wav = wav.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            if args.mixup > 0:
                lam = float(np.random.beta(args.mixup, args.mixup))
                perm = torch.randperm(wav.size(0), device=device)
                wav = lam * wav + (1 - lam) * wav[perm]
                y = lam * y + (1 - lam) * y[perm]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(wav)
            loss = criterion(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            global_step += 1
            if global_step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=global_step)

        val_map = evaluate(model, val_dl, device, world)
        wandb.log({"val/mAP": val_map, "epoch": epoch, "epoch_time": time.time() - tic}, step=global_step)
        if rank == 0:
            print(f"epoch {epoch} val mAP {val_map:.4f}", flush=True)
            if val_map > best_map:
                best_map = val_map
                torch.save({"model": model.module.state_dict(), "classes": classes, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
