"""Sound event classifier for an in-house dataset laid out as <root>/<class_name>/*.wav.

EfficientNet-B0 (timm) on GPU log-mel spectrograms, mixup + SpecAugment, DDP.

    torchrun --nproc_per_node=8 07_folder_effnet_classifier.py --root /mnt/datasets/factory_sounds_v3
"""
import argparse
import json
import os
import random
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--sr", type=int, default=22050)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--bs", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-3, help="for the full 8-GPU batch")
    p.add_argument("--mixup", type=float, default=0.4)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--save-dir", type=Path, default=Path("outputs/effnet_b0"))
    return p.parse_args()


def index_dataset(root: Path):
    files = sorted(root.rglob("*.wav"))
    classes = list(set(f.parent.name for f in files))
    class_to_idx = {c: i for i, c in enumerate(classes)}
    labels = [class_to_idx[f.parent.name] for f in files]
    return files, labels, classes


class ClipDataset(Dataset):
    def __init__(self, files, labels, sr, seconds, train):
        self.files, self.labels = files, labels
        self.sr, self.n = sr, int(sr * seconds)
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(str(self.files[i]))
        wav = wav.mean(0)
        if sr != self.sr:
            wav = torchaudio.functional.resample(wav, sr, self.sr)
        if wav.numel() > self.n:
            off = random.randint(0, wav.numel() - self.n) if self.train else (wav.numel() - self.n) // 2
            wav = wav[off:off + self.n]
        else:
            wav = F.pad(wav, (0, self.n - wav.numel()))
        return wav, self.labels[i]


class Frontend(nn.Module):
    def __init__(self, sr):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(sr, n_fft=1024, hop_length=256, n_mels=128)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.aug = nn.Sequential(torchaudio.transforms.FrequencyMasking(20, iid_masks=True),
                                 torchaudio.transforms.TimeMasking(40, iid_masks=True))

    @torch.no_grad()
    def forward(self, wav, train):
        x = self.db(self.mel(wav)).unsqueeze(1)
        x = (x + 40.0) / 40.0
        return self.aug(x) if train else x


@torch.no_grad()
def evaluate(model, frontend, loader, num_classes, device):
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, device=device, dtype=torch.long)
    for wav, y in loader:
        pred = model(frontend(wav.to(device), train=False)).argmax(1)
        y = y.to(device)
        confusion.index_put_((y, pred), torch.ones_like(y), accumulate=True)
    dist.all_reduce(confusion)
    per_class = confusion.diag().float() / confusion.sum(1).clamp(min=1).float()
    acc = confusion.diag().sum().item() / max(1, confusion.sum().item())
    return acc, per_class.mean().item()


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    files, labels, classes = index_dataset(args.root)
    tr_f, va_f, tr_y, va_y = train_test_split(files, labels, test_size=args.val_frac,
                                              random_state=args.seed, stratify=labels)
    train_ds = ClipDataset(tr_f, tr_y, args.sr, args.seconds, train=True)
    val_ds = ClipDataset(va_f, va_y, args.sr, args.seconds, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=128, sampler=range(rank, len(val_ds), world),
                        num_workers=args.workers, pin_memory=True)
    if rank == 0:
        print(f"{len(classes)} classes, {len(train_ds)} train / {len(val_ds)} val clips", flush=True)

    model = timm.create_model("efficientnet_b0", pretrained=False, in_chans=1, num_classes=len(classes),
                              drop_rate=0.3, drop_path_rate=0.1)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    frontend = Frontend(args.sr).to(device)

    lr = args.lr * world / 8
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()

    args.save_dir.mkdir(parents=True, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        seen, loss_acc = 0, torch.zeros((), device=device)
        for wav, y in train_dl:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = frontend(wav, train=True)
            target = F.one_hot(y, len(classes)).float()
            if args.mixup > 0:
                lam = float(np.random.beta(args.mixup, args.mixup))
                perm = torch.randperm(x.size(0), device=device)
                x = lam * x + (1 - lam) * x[perm]
                target = lam * target + (1 - lam) * target[perm]
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            loss = torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            loss_acc += loss.detach() * y.size(0)
            seen += y.size(0)
        sched.step()
        dist.all_reduce(loss_acc)
        acc, bal_acc = evaluate(model.module, frontend, val_dl, len(classes), device)
        if rank == 0:
            print(f"epoch {epoch:03d} loss {loss_acc.item() / (seen * world):.4f} "
                  f"val acc {acc:.4f} balanced {bal_acc:.4f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "classes": classes, "epoch": epoch,
                    "val_acc": acc, "args": {k: str(v) for k, v in vars(args).items()}}
            torch.save(ckpt, args.save_dir / "last.pt")
            if bal_acc > best:
                best = bal_acc
                torch.save(ckpt, args.save_dir / "best.pt")
                with open(args.save_dir / "classes.json", "w") as f:
                    json.dump(classes, f)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
