"""
Small F5-TTS-style model: DiT over mel frames, char-level text padded to mel length,
conditional flow matching with random span infilling. Mels precomputed (24 kHz, 100 bins, hop 256).

accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 19_flow_matching_tts_accelerate.py \
    --metadata data/emilia_en_subset.jsonl --exp_name f5_small_en
"""
import argparse
import copy
import json
import math
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

N_MELS = 100


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--exp_name", default="f5_small")
    ap.add_argument("--ckpt_root", default="ckpts")
    ap.add_argument("--batch_size", type=int, default=24)
    ap.add_argument("--max_frames", type=int, default=1200)
    ap.add_argument("--lr", type=float, default=7.5e-5)
    ap.add_argument("--warmup", type=int, default=20000)
    ap.add_argument("--total_updates", type=int, default=400000)
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--save_every", type=int, default=10000)
    ap.add_argument("--ema_decay", type=float, default=0.9999)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--depth", type=int, default=18)
    ap.add_argument("--wandb", action="store_true")
    return ap.parse_args()


class MelText(Dataset):
    def __init__(self, meta, max_frames):
        rows = [json.loads(l) for l in open(meta, encoding="utf-8")]
        self.rows = [r for r in rows if 50 <= r["frames"] <= max_frames]
        self.vocab = {c: i + 1 for i, c in enumerate(sorted({c for r in self.rows for c in r["text"]}))}

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        mel = torch.from_numpy(np.load(r["mel"])).float()  # (T, 100)
        text = torch.tensor([self.vocab.get(c, 0) for c in r["text"]], dtype=torch.long)
        return mel, text


def collate(batch):
    mels, texts = zip(*batch)
    T = max(m.shape[0] for m in mels)
    mel = torch.zeros(len(batch), T, N_MELS)
    txt = torch.zeros(len(batch), T, dtype=torch.long)
    lens = torch.tensor([m.shape[0] for m in mels])
    for i, (m, t) in enumerate(zip(mels, texts)):
        mel[i, : m.shape[0]] = m
        txt[i, : min(len(t), T)] = t[:T]
    return mel, txt, lens


class TimeEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t):
        half = 128
        f = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
        e = t[:, None] * 1000 * f[None]
        return self.mlp(torch.cat([e.sin(), e.cos()], -1))


class DiTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.ff = nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(approximate="tanh"), nn.Linear(dim * 2, dim))
        self.ada = nn.Linear(dim, dim * 6)

    def forward(self, x, c, pad_mask):
        s1, b1, g1, s2, b2, g2 = self.ada(F.silu(c)).unsqueeze(1).chunk(6, -1)
        h = self.n1(x) * (1 + s1) + b1
        x = x + g1 * self.attn(h, h, h, key_padding_mask=pad_mask, need_weights=False)[0]
        h = self.n2(x) * (1 + s2) + b2
        return x + g2 * self.ff(h)


class DiT(nn.Module):
    def __init__(self, vocab, dim, depth, heads=12):
        super().__init__()
        self.text_emb = nn.Embedding(vocab + 1, 512)
        self.in_proj = nn.Linear(N_MELS * 2 + 512, dim)
        self.time = TimeEmb(dim)
        self.blocks = nn.ModuleList([DiTBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.out = nn.Linear(dim, N_MELS)

    def forward(self, x, cond, text, t, pad_mask):
        h = self.in_proj(torch.cat([x, cond, self.text_emb(text)], -1))
        c = self.time(t)
        for b in self.blocks:
            h = b(h, c, pad_mask)
        return self.out(self.norm(h))


def cfm_loss(model, mel, text, lens):
    B, T, _ = mel.shape
    pad = torch.arange(T, device=mel.device)[None] >= lens[:, None]
    # random span (70-100% of the utterance) to infill, rest given as audio prompt
    frac = torch.empty(B, device=mel.device).uniform_(0.7, 1.0)
    span = (frac * lens).long()
    start = (torch.rand(B, device=mel.device) * (lens - span + 1)).long()
    idx = torch.arange(T, device=mel.device)[None]
    infill = (idx >= start[:, None]) & (idx < (start + span)[:, None]) & ~pad
    cond = mel.masked_fill(infill.unsqueeze(-1), 0.0)
    drop_audio = torch.rand(B, device=mel.device) < 0.3
    cond = cond.masked_fill(drop_audio[:, None, None], 0.0)
    text = text.masked_fill((torch.rand(B, device=mel.device) < 0.2)[:, None], 0)
    x0 = torch.randn_like(mel)
    t = torch.rand(B, device=mel.device)
    xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * mel
    pred = model(xt, cond, text, t, pad)
    err = F.mse_loss(pred, mel - x0, reduction="none").mean(-1)
    return (err * infill).sum() / infill.sum().clamp(min=1)


@torch.no_grad()
def sample(model, cond, text, lens, steps=32):
    T = cond.shape[1]
    pad = torch.arange(T, device=cond.device)[None] >= lens[:, None]
    x = torch.randn_like(cond)
    ts = torch.linspace(0, 1, steps + 1, device=cond.device)
    for i in range(steps):
        t = ts[i].expand(x.shape[0])
        x = x + (ts[i + 1] - ts[i]) * model(x, cond, text, t, pad)
    return x


def main():
    args = parse()
    acc = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="wandb" if args.wandb else None)
    set_seed(666)  # same init on every rank
    out_dir = os.path.join(args.ckpt_root, args.exp_name)

    ds = MelText(args.metadata, args.max_frames)
    dl = DataLoader(ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate, num_workers=8,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    model = DiT(len(ds.vocab), args.dim, args.depth)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = torch.optim.lr_scheduler.LinearLR(opt, 1e-8, 1.0, total_iters=args.warmup * acc.num_processes)
    decay = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 1e-8,
                                              total_iters=(args.total_updates - args.warmup) * acc.num_processes)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[args.warmup * acc.num_processes])

    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    ema.to(acc.device)
    set_seed(666, device_specific=True)  # different noise / t / masks per rank from here on

    update, start_epoch = 0, 0
    last = os.path.join(out_dir, "model_last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu", weights_only=True)
        acc.unwrap_model(model).load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        update = ck["update"]
        start_epoch = ck.get("epoch", 0)
        acc.print(f"resumed at update {update}")

    if acc.is_main_process:
        os.makedirs(out_dir, exist_ok=True)
        acc.init_trackers("f5-small", config=vars(args), init_kwargs={"wandb": {"name": args.exp_name}})

    epoch = start_epoch
    bar = tqdm(total=args.total_updates, initial=update, disable=not acc.is_local_main_process)
    while update < args.total_updates:
        model.train()
        for mel, text, lens in dl:
            with acc.accumulate(model):
                loss = cfm_loss(model, mel, text, lens)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if not acc.sync_gradients:
                continue
            update += 1
            bar.update(1)
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), acc.unwrap_model(model).parameters()):
                    pe.lerp_(pm.detach(), 1 - args.ema_decay)
            if update % 100 == 0:
                acc.log({"loss": acc.gather(loss.detach()).mean().item(), "lr": sched.get_last_lr()[0]}, step=update)
            if update % args.save_every == 0 or update == args.total_updates:
                acc.wait_for_everyone()
                if acc.is_main_process:
                    state = {"model": acc.unwrap_model(model).state_dict(), "ema": ema.state_dict(),
                             "opt": opt.state_dict(), "sched": sched.state_dict(), "update": update, "epoch": epoch}
                    torch.save(state, last + ".tmp")
                    os.replace(last + ".tmp", last)
                    torch.save({"ema": ema.state_dict(), "vocab": ds.vocab}, os.path.join(out_dir, f"ema_{update}.pt"))
                    # quick qualitative check: infill the second half of the first utterance with the EMA model
                    ema.eval()
                    n = int(lens[0])
                    cond = mel[:1].clone()
                    cond[:, n // 2:] = 0
                    gen = sample(ema, cond, text[:1], lens[:1])
                    np.save(os.path.join(out_dir, f"sample_{update}.npy"), gen[0, :n].float().cpu().numpy())
                acc.wait_for_everyone()
            if update >= args.total_updates:
                break
        epoch += 1

    acc.end_training()


if __name__ == "__main__":
    main()
