#!/usr/bin/env python3
# Transformer-CTC ASR with BPE targets (sentencepiece), gradient accumulation and native AMP.
# ported from our apex.amp recipe (opt_level O1) -> torch.cuda.amp
#
#   torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
#       04_transformer_ctc_accum.py --config conf/tfm_ctc.yaml
import argparse
import contextlib
import math
import os
import random
import time

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = dict(
    train="data/train_960/feats.tsv", dev="data/dev_clean/feats.tsv", bpe="data/lang/bpe5000.model",
    exp="exp/tfm_ctc", d_model=256, heads=4, layers=12, ff=2048, dropout=0.1,
    batch_frames=30000, accum_grad=4, lr=2e-3, warmup=25000, epochs=60, patience=6, fp16=True,
)


class FeatDataset(Dataset):
    def __init__(self, tsv, sp, specaug=False):
        self.rows = []
        with open(tsv) as f:
            for line in f:
                uid, path, nfr, text = line.rstrip("\n").split("\t", 3)
                self.rows.append((path, int(nfr), text))
        self.sp = sp
        self.specaug = specaug

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, _, text = self.rows[i]
        x = torch.from_numpy(np.load(path)).float()
        if self.specaug:
            x = spec_augment(x)
        return x, torch.tensor(self.sp.encode(text), dtype=torch.long)


def spec_augment(x, F_=27, nF=2, T_=40, nT=2):
    x = x.clone()
    t, d = x.shape
    for _ in range(nF):
        f = random.randint(0, F_)
        f0 = random.randint(0, max(0, d - f))
        x[:, f0:f0 + f] = 0
    for _ in range(nT):
        w = random.randint(0, min(T_, t // 5))
        t0 = random.randint(0, max(0, t - w))
        x[t0:t0 + w, :] = 0
    return x


def collate(batch):
    xs, ys = zip(*batch)
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor([len(x) for x in xs]),
            nn.utils.rnn.pad_sequence(ys, batch_first=True), torch.tensor([len(y) for y in ys]))


class LengthGroupedBatches:
    """Same global list of batches on every rank (seeded by epoch), each rank takes every world-th."""

    def __init__(self, lengths, batch_frames, rank, world, shuffle, seed=0):
        self.lengths, self.batch_frames = lengths, batch_frames
        self.rank, self.world, self.shuffle, self.seed = rank, world, shuffle, seed
        self.epoch = 0

    def set_epoch(self, e):
        self.epoch = e

    def _batches(self):
        g = random.Random(self.seed + self.epoch)
        idx = list(range(len(self.lengths)))
        if self.shuffle:
            g.shuffle(idx)
        # sort within chunks of 100 batches' worth to keep some randomness
        chunk = 100 * max(1, self.batch_frames // 1000)
        out = []
        for s in range(0, len(idx), chunk):
            part = sorted(idx[s:s + chunk], key=lambda i: self.lengths[i])
            cur = []
            for i in part:
                if cur and (len(cur) + 1) * self.lengths[i] > self.batch_frames:
                    out.append(cur)
                    cur = []
                cur.append(i)
            if cur:
                out.append(cur)
        if self.shuffle:
            g.shuffle(out)
        return out

    def __iter__(self):
        b = self._batches()
        if self.shuffle:
            n = len(b) // self.world * self.world  # equal number of batches per rank
            b = b[:n]
        return iter(b[self.rank::self.world])

    def __len__(self):
        b = self._batches()
        return len(b) // self.world if self.shuffle else len(b[self.rank::self.world])


class Conv2dSubsampling(nn.Module):
    def __init__(self, idim, d):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.out = nn.Linear(d * (((idim - 1) // 2 - 1) // 2), d)

    def forward(self, x, lens):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        return x, lens


class TransformerCTC(nn.Module):
    def __init__(self, odim, d_model, heads, layers, ff, dropout, idim=80):
        super().__init__()
        self.embed = Conv2dSubsampling(idim, d_model)
        enc_layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.after_norm = nn.LayerNorm(d_model)
        self.ctc_lo = nn.Linear(d_model, odim)
        self.d_model = d_model

    def forward(self, x, lens):
        x, lens = self.embed(x, lens)
        pos = torch.arange(x.size(1), device=x.device).float()[:, None]
        div = torch.exp(torch.arange(0, self.d_model, 2, device=x.device).float() * (-math.log(1e4) / self.d_model))
        pe = torch.zeros(x.size(1), self.d_model, device=x.device)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        x = x * math.sqrt(self.d_model) + pe
        mask = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        x = self.after_norm(self.encoder(x, src_key_padding_mask=mask))
        return self.ctc_lo(x), lens


def noam(step, d_model, warmup, peak):
    step = max(1, step)
    return peak * min(step / warmup, (warmup / step) ** 0.5)


@torch.no_grad()
def dev_loss(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for x, xl, y, yl in loader:
        x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
        logits, ol = model(x, xl)
        lp = logits.float().log_softmax(-1).transpose(0, 1)
        acc[0] += F.ctc_loss(lp, y, ol, yl, reduction="sum", zero_infinity=True).double()
        acc[1] += x.size(0)
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    sp = spm.SentencePieceProcessor(model_file=cfg["bpe"])
    odim = sp.get_piece_size() + 1  # last id = blank
    blank = odim - 1
    tr = FeatDataset(cfg["train"], sp, specaug=True)
    dv = FeatDataset(cfg["dev"], sp)
    tr_bs = LengthGroupedBatches([r[1] for r in tr.rows], cfg["batch_frames"], rank, world, shuffle=True)
    dv_bs = LengthGroupedBatches([r[1] for r in dv.rows], cfg["batch_frames"], rank, world, shuffle=False)
    tr_dl = DataLoader(tr, batch_sampler=tr_bs, collate_fn=collate, num_workers=4, pin_memory=True)
    dv_dl = DataLoader(dv, batch_sampler=dv_bs, collate_fn=collate, num_workers=2)

    model = TransformerCTC(odim, cfg["d_model"], cfg["heads"], cfg["layers"], cfg["ff"], cfg["dropout"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-9)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg["fp16"])

    start_epoch, step, best, bad = 1, 0, float("inf"), 0
    ckpt_path = os.path.join(cfg["exp"], "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, step, best, bad = ck["epoch"] + 1, ck["step"], ck["best"], ck["bad"]
        del ck

    tb = None
    if rank == 0:
        os.makedirs(cfg["exp"], exist_ok=True)
        tb = SummaryWriter(os.path.join(cfg["exp"], "tensorboard"))
        with open(os.path.join(cfg["exp"], "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    accum = cfg["accum_grad"]
    for epoch in range(start_epoch, cfg["epochs"] + 1):
        tr_bs.set_epoch(epoch)
        model.train()
        n_batches = len(tr_bs)
        t0 = time.time()
        for i, (x, xl, y, yl) in enumerate(tr_dl):
            x, xl, y, yl = (t.to(device, non_blocking=True) for t in (x, xl, y, yl))
            boundary = (i + 1) % accum == 0 or (i + 1) == n_batches
            ctx = contextlib.nullcontext() if boundary else model.no_sync()
            with ctx:
                with torch.cuda.amp.autocast(enabled=cfg["fp16"]):
                    logits, ol = model(x, xl)
                lp = logits.float().log_softmax(-1).transpose(0, 1)
                loss = F.ctc_loss(lp, y, ol, yl, blank=blank, reduction="sum", zero_infinity=True) / x.size(0)
                scaler.scale(loss / accum).backward()
            if not boundary:
                continue
            step += 1
            for g in opt.param_groups:
                g["lr"] = noam(step, cfg["d_model"], cfg["warmup"], cfg["lr"])
            scaler.unscale_(opt)
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if tb is not None and step % 50 == 0:
                tb.add_scalar("train/ctc_loss", loss.item(), step)
                tb.add_scalar("train/grad_norm", gnorm.item(), step)
                tb.add_scalar("train/lr", opt.param_groups[0]["lr"], step)

        loss_dev = dev_loss(model.module, dv_dl, device)
        improved = loss_dev < best
        if improved:
            best, bad = loss_dev, 0
        else:
            bad += 1
        if rank == 0:
            print(f"epoch {epoch} step {step} dev_ctc {loss_dev:.3f} best {best:.3f} ({time.time() - t0:.0f}s)", flush=True)
            tb.add_scalar("dev/ctc_loss", loss_dev, epoch)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "step": step, "best": best, "bad": bad}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if improved:
                torch.save(model.module.state_dict(), os.path.join(cfg["exp"], "valid.loss.best.pth"))
        dist.barrier()
        if bad >= cfg["patience"]:
            break

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
