"""ViTSTR: a single-stage ViT scene text recognizer (Atienza, ICDAR 2021) fine-tuned on real data.

    torchrun --nproc_per_node=4 12_vitstr_scene_text.py --train-dir data/real/train --val-dir data/real/val
"""
import argparse
import os
import random
import string
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageFilter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CHARSET = string.digits + string.ascii_lowercase + string.ascii_uppercase + string.punctuation
GO, EOS = "[GO]", "[s]"


class TokenLabelConverter:
    def __init__(self, charset, max_len=25):
        self.itos = [GO, EOS] + list(charset)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.max_len = max_len + 2

    def encode(self, texts):
        out = torch.full((len(texts), self.max_len), self.stoi[GO], dtype=torch.long)
        for i, t in enumerate(texts):
            ids = [self.stoi[c] for c in t if c in self.stoi][: self.max_len - 2] + [self.stoi[EOS]]
            out[i, 1: 1 + len(ids)] = torch.tensor(ids)
        return out

    def decode(self, ids):
        res = []
        for row in ids.tolist():
            s = []
            for i in row[1:]:
                if i == self.stoi[EOS]:
                    break
                s.append(self.itos[i])
            res.append("".join(s))
        return res


class FolderTextDataset(Dataset):
    """<dir>/labels.txt with lines: relative/path.jpg<TAB>text"""

    def __init__(self, root, img_size=224, train=True):
        self.root = root
        with open(os.path.join(root, "labels.txt"), encoding="utf-8") as f:
            self.samples = [l.rstrip("\n").split("\t", 1) for l in f if "\t" in l]
        self.size, self.train = img_size, train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, text = self.samples[i]
        img = Image.open(os.path.join(self.root, path)).convert("L")
        if self.train:
            if random.random() < 0.3:
                img = img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.3, 1.2)))
            if random.random() < 0.3:
                img = img.rotate(random.uniform(-8, 8), resample=Image.BILINEAR, expand=True, fillcolor=128)
        img = img.resize((self.size, self.size), Image.BICUBIC)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).unsqueeze(0)
        return (x - 0.5) / 0.5, text


class ViTSTR(nn.Module):
    def __init__(self, num_classes, max_len, backbone="vit_small_patch16_224"):
        super().__init__()
        self.vit = timm.create_model(backbone, pretrained=True, in_chans=1, num_classes=0, global_pool="")
        self.head = nn.Linear(self.vit.num_features, num_classes)
        self.max_len = max_len

    def forward(self, x):
        tokens = self.vit.forward_features(x)  # B, 1 + N, C
        return self.head(tokens[:, : self.max_len])


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-dir", required=True)
    p.add_argument("--val-dir", required=True)
    p.add_argument("--backbone", default="vit_small_patch16_224")
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--save", default="saved_models/vitstr_small")
    p.add_argument("--seed", type=int, default=1111)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def validate(model, loader, conv, device):
    model.eval()
    totals = torch.zeros(4, device=device)  # correct words, total words, char edits (norm), -
    for x, texts in loader:
        logits = model(x.to(device, non_blocking=True))
        preds = conv.decode(logits.argmax(-1).cpu())
        for p, g in zip(preds, texts):
            totals[0] += float(p == g)
            totals[1] += 1
            # normalised edit distance, ICDAR-2019 style
            d = np.zeros((len(p) + 1, len(g) + 1), dtype=np.int32)
            d[:, 0], d[0, :] = np.arange(len(p) + 1), np.arange(len(g) + 1)
            for i in range(1, len(p) + 1):
                for j in range(1, len(g) + 1):
                    d[i, j] = min(d[i - 1, j] + 1, d[i, j - 1] + 1, d[i - 1, j - 1] + (p[i - 1] != g[j - 1]))
            totals[2] += 1 - d[-1, -1] / max(len(p), len(g), 1)
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item(), (totals[2] / totals[1]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    conv = TokenLabelConverter(CHARSET)
    train_ds = FolderTextDataset(args.train_dir, train=True)
    val_ds = FolderTextDataset(args.val_dir, train=False)
    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=256, num_workers=4, pin_memory=True)

    model = ViTSTR(len(conv.itos), conv.max_len, args.backbone).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0, rho=0.95, eps=1e-8) if args.lr >= 1 else \
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    criterion = nn.CrossEntropyLoss(ignore_index=0)  # [GO] is also used as padding

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start = time.time()
        for it, (x, texts) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            target = conv.encode(texts).to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = criterion(logits.float()[:, 1:].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}/{args.epochs}] it {it} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        acc, ned = validate(model, val_loader, conv, device)
        if rank == 0:
            print(f"epoch {epoch}: word acc {acc:.4f} 1-NED {ned:.4f} time {time.time() - start:.0f}s", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.save, "last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), os.path.join(args.save, "best_accuracy.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
