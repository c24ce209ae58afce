"""Multi-scale patch transformer (MUSIQ-like) for KonIQ-10k / SPAQ.

The full-resolution image plus two aspect-preserving resized versions (longer
side 224 and 384) are cut into 32x32 patches. Each patch gets a hashed 2-D
spatial embedding (10x10 grid) and a scale embedding; a [CLS] token regresses
MOS. Padding patches are masked out.

    torchrun --nproc_per_node=4 12_musiq_multiscale_koniq.py --root /data/koniq10k --split splits/koniq_0.json
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
from PIL import Image
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import functional as TF

PATCH = 32
GRID = 10
SCALES = (224, 384, None)           # None = full resolution
MAX_PATCHES = (64, 160, 600)        # per scale, after padding


def patchify(img, longer, max_patches, scale_id, train):
    """img: PIL -> (max_patches, 3*P*P) patches, (max_patches, 3) [row_hash, col_hash, scale], mask."""
    w, h = img.size
    if longer is not None:
        r = longer / max(w, h)
        img = img.resize((max(PATCH, round(w * r)), max(PATCH, round(h * r))), Image.BICUBIC)
    x = TF.normalize(TF.to_tensor(img), [0.5] * 3, [0.5] * 3)
    c, H, W = x.shape
    nh, nw = H // PATCH, W // PATCH
    x = x[:, :nh * PATCH, :nw * PATCH]
    p = x.unfold(1, PATCH, PATCH).unfold(2, PATCH, PATCH)          # c, nh, nw, P, P
    p = p.permute(1, 2, 0, 3, 4).reshape(nh * nw, -1)
    rows = torch.arange(nh).repeat_interleave(nw)
    cols = torch.arange(nw).repeat(nh)
    pos = torch.stack([rows * GRID // nh, cols * GRID // nw, torch.full_like(rows, scale_id)], 1)
    if len(p) > max_patches:
        sel = torch.randperm(len(p))[:max_patches] if train else torch.linspace(0, len(p) - 1, max_patches).long()
        p, pos = p[sel], pos[sel]
    n = len(p)
    out = torch.zeros(max_patches, p.shape[1])
    out_pos = torch.zeros(max_patches, 3, dtype=torch.long)
    mask = torch.zeros(max_patches, dtype=torch.bool)
    out[:n], out_pos[:n], mask[:n] = p, pos, True
    return out, out_pos, mask


class MultiScaleIQA(Dataset):
    def __init__(self, root, names, mos, train):
        self.root, self.names, self.mos, self.train = root, names, np.asarray(mos, np.float32), train

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, "1024x768", self.names[i])).convert("RGB")
        if self.train and torch.rand(1).item() < 0.5:
            img = TF.hflip(img)
        parts = [patchify(img, s, m, k, self.train) for k, (s, m) in enumerate(zip(SCALES, MAX_PATCHES))]
        patches = torch.cat([p[0] for p in parts])
        pos = torch.cat([p[1] for p in parts])
        mask = torch.cat([p[2] for p in parts])
        return patches, pos, mask, self.mos[i], i


class MUSIQ(nn.Module):
    def __init__(self, dim=384, depth=8, heads=6):
        super().__init__()
        self.embed = nn.Linear(3 * PATCH * PATCH, dim)
        self.row_emb = nn.Embedding(GRID, dim)
        self.col_emb = nn.Embedding(GRID, dim)
        self.scale_emb = nn.Embedding(len(SCALES), dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 1)
        nn.init.trunc_normal_(self.cls, std=0.02)

    def forward(self, patches, pos, mask):
        x = self.embed(patches) + self.row_emb(pos[..., 0]) + self.col_emb(pos[..., 1]) + self.scale_emb(pos[..., 2])
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1)
        key_pad = torch.cat([torch.zeros_like(mask[:, :1]), ~mask], 1)
        x = self.encoder(x, src_key_padding_mask=key_pad)
        return self.head(self.norm(x[:, 0])).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    acc = []
    for patches, pos, mask, mos, idx in loader:
        pred = model(patches.to(device), pos.to(device), mask.to(device))
        acc.append(torch.stack([pred.float(), mos.to(device), idx.to(device).float()], 1))
    acc = torch.cat(acc)
    out = [torch.empty_like(acc) for _ in range(dist.get_world_size())]
    dist.all_gather(out, acc)
    out = torch.cat(out).cpu().numpy()
    _, u = np.unique(out[:, 2].astype(np.int64), return_index=True)
    out = out[u]
    assert len(out) == n
    model.train()
    return spearmanr(out[:, 0], out[:, 1])[0], pearsonr(out[:, 0], out[:, 1])[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--split", required=True, help="json with train/test lists of [name, mos]")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=5, help="epochs")
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--out", default="exp/musiq_koniq")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    split = json.load(open(args.split))
    train_set = MultiScaleIQA(args.root, [n for n, _ in split["train"]], [m for _, m in split["train"]], True)
    test_set = MultiScaleIQA(args.root, [n for n, _ in split["test"]], [m for _, m in split["test"]], False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = DDP(MUSIQ().to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.98))
    steps_per_epoch = len(train_loader)
    total, warm = args.epochs * steps_per_epoch, args.warmup * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        model.train()
        run = torch.zeros(2, device=device)
        for patches, pos, mask, mos, _ in train_loader:
            patches = patches.to(device, non_blocking=True)
            pos, mask = pos.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            mos = mos.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(patches, pos, mask)
            loss = F.mse_loss(pred.float(), mos)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        if epoch % 2 == 1 or epoch == args.epochs - 1:
            srcc, plcc = evaluate(model, test_loader, device, len(test_set))
            if rank == 0:
                print(f"epoch {epoch} mse {run[0] / run[1]:.4f} SRCC {srcc:.4f} PLCC {plcc:.4f}", flush=True)
                if srcc > best:
                    best = srcc
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "srcc": srcc,
                                "plcc": plcc}, os.path.join(args.out, "best.pth"))
            dist.barrier()
        elif rank == 0:
            print(f"epoch {epoch} mse {run[0] / run[1]:.4f}", flush=True)

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "epoch": args.epochs - 1},
                   os.path.join(args.out, "last.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
