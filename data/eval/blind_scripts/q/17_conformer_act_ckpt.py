#!/usr/bin/env python3
"""Conformer-CTC (large) with activation checkpointing to fit 30 s utterances on 40GB cards.

    torchrun --nproc_per_node=8 17_conformer_act_ckpt.py --train-list data/train.lst \
        --dev-list data/dev.lst --units data/units.txt --outdir exp/conformer_l --grad-ckpt
"""
import argparse
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Conf:
    idim: int = 80
    d_model: int = 512
    heads: int = 8
    ffn: int = 2048
    layers: int = 17
    kernel: int = 31
    dropout: float = 0.1
    interctc_layer: int = 8
    interctc_weight: float = 0.0


class ListDataset(Dataset):
    def __init__(self, lst, units):
        self.rows = [l.rstrip("\n").split("\t") for l in open(lst, encoding="utf-8")]
        self.u2i = units

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i][0], self.rows[i][-1]
        feats = torch.from_numpy(np.load(path)).float()
        return feats, torch.tensor([self.u2i.get(t, 1) for t in text.split()])


def collate(b):
    xs, ys = zip(*b)
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor([x.size(0) for x in xs]),
            nn.utils.rnn.pad_sequence(ys, batch_first=True), torch.tensor([y.size(0) for y in ys]))


class FeedForward(nn.Module):
    def __init__(self, d, ff, p):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, ff), nn.SiLU(), nn.Dropout(p), nn.Linear(ff, d), nn.Dropout(p))

    def forward(self, x):
        return self.net(x)


class ConvModule(nn.Module):
    def __init__(self, d, k, p):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, k, padding=k // 2, groups=d)
        self.norm = nn.GroupNorm(1, d)
        self.pw2 = nn.Conv1d(d, d, 1)
        self.drop = nn.Dropout(p)

    def forward(self, x, pad_mask):
        x = self.ln(x).masked_fill(pad_mask[..., None], 0.0).transpose(1, 2)
        x = F.glu(self.pw1(x), dim=1)
        x = self.pw2(F.silu(self.norm(self.dw(x))))
        return self.drop(x.transpose(1, 2))


class ConformerBlock(nn.Module):
    def __init__(self, c: Conf):
        super().__init__()
        self.ff1 = FeedForward(c.d_model, c.ffn, c.dropout)
        self.ln_att = nn.LayerNorm(c.d_model)
        self.att = nn.MultiheadAttention(c.d_model, c.heads, dropout=c.dropout, batch_first=True)
        self.conv = ConvModule(c.d_model, c.kernel, c.dropout)
        self.ff2 = FeedForward(c.d_model, c.ffn, c.dropout)
        self.ln_out = nn.LayerNorm(c.d_model)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, pad_mask):
        x = x + 0.5 * self.ff1(x)
        h = self.ln_att(x)
        x = x + self.drop(self.att(h, h, h, key_padding_mask=pad_mask, need_weights=False)[0])
        x = x + self.conv(x, pad_mask)
        x = x + 0.5 * self.ff2(x)
        return self.ln_out(x)


class ConformerCTC(nn.Module):
    def __init__(self, c: Conf, odim, grad_ckpt=False):
        super().__init__()
        self.c = c
        self.grad_ckpt = grad_ckpt
        self.subsample = nn.Sequential(nn.Conv2d(1, c.d_model, 3, 2), nn.ReLU(), nn.Conv2d(c.d_model, c.d_model, 3, 2), nn.ReLU())
        self.sub_proj = nn.Linear(c.d_model * (((c.idim - 1) // 2 - 1) // 2), c.d_model)
        self.blocks = nn.ModuleList([ConformerBlock(c) for _ in range(c.layers)])
        self.ctc_out = nn.Linear(c.d_model, odim)
        self.interctc_out = nn.Linear(c.d_model, odim)

    def forward(self, x, lens):
        x = self.subsample(x.unsqueeze(1))
        B, C, T, Fq = x.shape
        x = self.sub_proj(x.transpose(1, 2).reshape(B, T, C * Fq))
        lens = ((lens - 1) // 2 - 1) // 2
        pad_mask = torch.arange(T, device=x.device)[None] >= lens[:, None]
        inter = None
        for i, blk in enumerate(self.blocks):
            if self.grad_ckpt and self.training:
                x = ckpt.checkpoint(blk, x, pad_mask)
            else:
                x = blk(x, pad_mask)
            if i + 1 == self.c.interctc_layer and self.c.interctc_weight > 0:
                inter = self.interctc_out(x)
        return self.ctc_out(x), inter, lens


def ctc(logits, ys, olens, ylens):
    return F.ctc_loss(logits.float().log_softmax(-1).transpose(0, 1), ys, olens, ylens, zero_infinity=True)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, xl, y, yl in loader:
        x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
        logits, _, ol = model(x, xl)
        s[0] += ctc(logits, y, ol, yl) * x.size(0)
        s[1] += x.size(0)
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--dev-list", required=True)
    ap.add_argument("--units", required=True)
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--peak-lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=15000)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--interctc-weight", type=float, default=0.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(777)

    units = {u.split()[0]: i + 1 for i, u in enumerate(open(args.units, encoding="utf-8"))}  # 0 = blank
    tr = ListDataset(args.train_list, units)
    dv = ListDataset(args.dev_list, units)
    sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr, batch_size=args.batch_size, sampler=sampler, collate_fn=collate, num_workers=6,
                       pin_memory=True, drop_last=True)
    dv_dl = DataLoader(torch.utils.data.Subset(dv, range(rank, len(dv), world)), batch_size=16,
                       collate_fn=collate, num_workers=2)

    conf = Conf(interctc_weight=args.interctc_weight)
    model = ConformerCTC(conf, len(units) + 1, grad_ckpt=args.grad_ckpt).to(device)
    # interctc head is optional -> some params may not receive grads
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))

    tb = None
    if rank == 0:
        os.makedirs(args.outdir, exist_ok=True)
        tb = SummaryWriter(os.path.join(args.outdir, "tb"))
        n_params = sum(p.numel() for p in model.parameters())
        print(f"Conformer params: {n_params / 1e6:.1f}M, world={world}, grad_ckpt={args.grad_ckpt}")

    best, step = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, xl, y, yl in tr_dl:
            x, xl, y, yl = (t.to(device, non_blocking=True) for t in (x, xl, y, yl))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, inter, ol = model(x, xl)
            loss = ctc(logits, y, ol, yl)
            if inter is not None:
                loss = (1 - conf.interctc_weight) * loss + conf.interctc_weight * ctc(inter, y, ol, yl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if tb is not None and step % 50 == 0:
                tb.add_scalar("train/loss", loss.item(), step)
                tb.add_scalar("train/gn", gn.item(), step)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], step)

        vloss = validate(model.module, dv_dl, device)
        if rank == 0:
            print(f"epoch {epoch} step {step} dev ctc {vloss:.3f} ({time.time() - t0:.0f}s)", flush=True)
            tb.add_scalar("dev/ctc", vloss, epoch)
            torch.save({"model": model.module.state_dict(), "conf": conf.__dict__, "epoch": epoch},
                       os.path.join(args.outdir, "last.pth"))
            if vloss < best:
                best = vloss
                torch.save({"model": model.module.state_dict(), "conf": conf.__dict__, "epoch": epoch},
                           os.path.join(args.outdir, "best.pth"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
