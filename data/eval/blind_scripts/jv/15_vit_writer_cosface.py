"""Writer identification with a ViT-S encoder on handwriting strips + CosFace over training writers.

pages.csv columns: path, writer, split   (split in {train, val}; writers never cross splits)
Validation: each val page is cut into strips, strip embeddings are averaged per page, and
page-level leave-one-out retrieval (mAP, top-1) is reported.

    torchrun --nproc_per_node=8 15_vit_writer_cosface.py --csv data/pages.csv --out runs/vit_cosface
"""
import argparse
import csv
import math
import os
import random

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

STRIP_H, STRIP_W = 128, 512


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--out", default="runs/vit_cosface")
    ap.add_argument("--strips-per-page", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32, help="pages per GPU")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=5e-4, help="per 256 strips")
    ap.add_argument("--s", type=float, default=32.0)
    ap.add_argument("--m", type=float, default=0.35)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def random_strips(img, n, train):
    """cut n STRIP_H x STRIP_W windows from a page resized to a fixed width"""
    scale = 1600 / img.width
    img = img.resize((1600, max(STRIP_H, int(img.height * scale))), Image.BILINEAR)
    a = 1.0 - np.asarray(img, dtype=np.float32) / 255.0
    H, W = a.shape
    out = []
    for k in range(n):
        if train:
            y, x = random.randint(0, H - STRIP_H), random.randint(0, W - STRIP_W)
        else:
            y = int((H - STRIP_H) * (k + 0.5) / n)
            x = (W - STRIP_W) // 2
        out.append(torch.from_numpy(a[y:y + STRIP_H, x:x + STRIP_W].copy()))
    return torch.stack(out)[:, None]


class Pages(Dataset):
    def __init__(self, rows, w2i, n_strips, train):
        self.rows, self.w2i, self.n, self.train = rows, w2i, n_strips, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, writer = self.rows[i]
        img = Image.open(path).convert("L")
        return random_strips(img, self.n, self.train), self.w2i[writer], i


class WriterViT(nn.Module):
    def __init__(self, n_writers, dim=384):
        super().__init__()
        self.vit = timm.create_model("vit_small_patch16_224", pretrained=False, in_chans=1,
                                     img_size=(STRIP_H, STRIP_W), num_classes=0, drop_path_rate=0.1)
        self.neck = nn.Sequential(nn.Linear(self.vit.num_features, dim), nn.LayerNorm(dim))
        self.W = nn.Parameter(torch.randn(n_writers, dim) * 0.01)

    def embed(self, x):
        return F.normalize(self.neck(self.vit(x)), dim=-1)

    def forward(self, x):
        return F.linear(self.embed(x), F.normalize(self.W, dim=-1))


def cosface_loss(cos, y, s, m):
    margin = torch.zeros_like(cos).scatter_(1, y[:, None], m)
    return F.cross_entropy(s * (cos - margin), y)


@torch.no_grad()
def page_embeddings(model, loader, device):
    model.eval()
    E, Y, I = [], [], []
    for strips, y, idx in loader:
        b, n = strips.shape[:2]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            e = model.embed(strips.flatten(0, 1).to(device, non_blocking=True))
        E.append(F.normalize(e.float().view(b, n, -1).mean(1), dim=-1))
        Y.append(y.to(device))
        I.append(idx.to(device))
    model.train()
    return torch.cat(E), torch.cat(Y), torch.cat(I)


def all_gather_cat(t, world):
    buf = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(buf, t)
    return torch.cat(buf)


def retrieval(E, Y):
    sim = E @ E.t()
    sim.fill_diagonal_(-2)
    order = sim.argsort(1, descending=True)[:, :-1]
    rel = (Y[order] == Y[:, None]).float()
    prec = rel.cumsum(1) / torch.arange(1, rel.shape[1] + 1, device=E.device)
    n = rel.sum(1)
    ok = n > 0
    return ((prec * rel).sum(1)[ok] / n[ok]).mean().item(), rel[ok, 0].mean().item()


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(1000)

    with open(args.csv) as f:
        rows = list(csv.DictReader(f))
    train_rows = [(r["path"], r["writer"]) for r in rows if r["split"] == "train"]
    val_rows = [(r["path"], r["writer"]) for r in rows if r["split"] == "val"]
    train_w2i = {w: i for i, w in enumerate(sorted({w for _, w in train_rows}))}
    val_w2i = {w: i for i, w in enumerate(sorted({w for _, w in val_rows}))}

    train_ds = Pages(train_rows, train_w2i, args.strips_per_page, train=True)
    val_ds = Pages(val_rows, val_w2i, args.strips_per_page, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=16, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers)

    model = DDP(WriterViT(len(train_w2i)).to(device), device_ids=[local_rank])
    strips_per_step = args.batch * args.strips_per_page * world
    lr = args.lr * strips_per_step / 256
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "pos_embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    total = args.epochs * len(loader)
    warm = 5 * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, (strips, y, _) in enumerate(loader):
            n = strips.shape[1]
            x = strips.flatten(0, 1).to(device, non_blocking=True)
            y = y.to(device).repeat_interleave(n)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                cos = model(x)
            loss = cosface_loss(cos.float(), y, args.s, args.m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(loader)} loss {loss.item():.3f}", flush=True)

        E, Y, I = page_embeddings(model, val_loader, device)
        E, Y, I = all_gather_cat(E, world), all_gather_cat(Y, world), all_gather_cat(I, world)
        keep = torch.from_numpy(np.unique(I.cpu().numpy(), return_index=True)[1]).to(device)
        m_ap, top1 = retrieval(E[keep], Y[keep])
        if rank == 0:
            print(f"epoch {epoch}: val mAP {m_ap:.4f} top-1 {top1:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            ck = {"model": model.module.state_dict(), "epoch": epoch, "mAP": m_ap, "writers": train_w2i}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if m_ap > best:
                best = m_ap
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
