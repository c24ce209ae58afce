# -*- coding: utf-8 -*-
"""Character-level Conformer CTC for AISHELL-1 (Kaldi-style data dirs).

    torchrun --standalone --nproc_per_node=4 09_aishell_conformer_char.py \
        --train_dir data/train --dev_dir data/dev --exp exp/conformer_char
"""
import argparse
import contextlib
import json
import os
import time

import editdistance
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import torchaudio.compliance.kaldi as kaldi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.models import Conformer


def read_kaldi_dir(d):
    wav, text = {}, {}
    with open(os.path.join(d, "wav.scp"), encoding="utf-8") as f:
        for line in f:
            k, v = line.strip().split(maxsplit=1)
            wav[k] = v
    with open(os.path.join(d, "text"), encoding="utf-8") as f:
        for line in f:
            parts = line.strip().split(maxsplit=1)
            if len(parts) == 2:
                text[parts[0]] = parts[1].replace(" ", "")
    keys = sorted(k for k in wav if k in text)
    return [(k, wav[k], text[k]) for k in keys]


def build_vocab(texts):
    chars = set()
    for t in texts:
        chars.update(t)
    vocab = ["<blank>", "<unk>"] + list(chars)
    return {c: i for i, c in enumerate(vocab)}


class AishellDataset(Dataset):
    def __init__(self, utts, char2id, speed_perturb=False):
        self.utts = utts
        self.char2id = char2id
        self.speed_perturb = speed_perturb

    def __len__(self):
        return len(self.utts)

    def __getitem__(self, i):
        key, path, txt = self.utts[i]
        wav, sr = torchaudio.load(path)
        if self.speed_perturb:
            speed = float(torch.empty(1).uniform_(0.9, 1.1))
            wav, _ = torchaudio.sox_effects.apply_effects_tensor(
                wav, sr, [["speed", f"{speed:.3f}"], ["rate", str(sr)]])
        feat = kaldi.fbank(wav * (1 << 15), num_mel_bins=80, frame_length=25, frame_shift=10,
                           dither=1.0 if self.speed_perturb else 0.0, sample_frequency=sr)
        ids = [self.char2id.get(c, 1) for c in txt]
        return feat, torch.tensor(ids, dtype=torch.long)


def collate(batch):
    feats, ids = zip(*batch)
    flen = torch.tensor([f.size(0) for f in feats])
    ilen = torch.tensor([len(x) for x in ids])
    return (nn.utils.rnn.pad_sequence(feats, batch_first=True), flen,
            nn.utils.rnn.pad_sequence(ids, batch_first=True), ilen)


class GlobalCMVN(nn.Module):
    def __init__(self, dim=80):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)

    def forward(self, x):
        return self.norm(x)


class Model(nn.Module):
    def __init__(self, vocab_size, d=256, layers=12, heads=4):
        super().__init__()
        self.cmvn = GlobalCMVN()
        self.embed = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.out_proj = nn.Linear(d * 19, d)
        self.encoder = Conformer(d, heads, 2048, layers, 15, dropout=0.1)
        self.ctc = nn.Linear(d, vocab_size)

    def forward(self, x, xlen):
        x = self.embed(self.cmvn(x).unsqueeze(1))
        b, c, t, f = x.shape
        x = self.out_proj(x.transpose(1, 2).reshape(b, t, c * f))
        xlen = ((xlen - 1) // 2 - 1) // 2
        x, xlen = self.encoder(x, xlen.clamp(1, t))
        return self.ctc(x).log_softmax(-1), xlen


def specaug(x):
    b, t, f = x.shape
    for i in range(b):
        for _ in range(2):
            w = int(torch.randint(0, 11, ()))
            s = int(torch.randint(0, max(1, f - w), ()))
            x[i, :, s:s + w] = 0
        for _ in range(2):
            w = int(torch.randint(0, 51, ()))
            s = int(torch.randint(0, max(1, t - w), ()))
            x[i, s:s + w, :] = 0
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--dev_dir", required=True)
    ap.add_argument("--exp", default="exp/conformer_char")
    ap.add_argument("--batch_size", type=int, default=24)
    ap.add_argument("--accum_grad", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=25000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)

    train_utts = read_kaldi_dir(args.train_dir)
    dev_utts = read_kaldi_dir(args.dev_dir)
    char2id = build_vocab([u[2] for u in train_utts])
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        with open(os.path.join(args.exp, "units.json"), "w", encoding="utf-8") as f:
            json.dump(char2id, f, ensure_ascii=False, indent=0)
        print(f"vocab size {len(char2id)}; {len(train_utts)} train / {len(dev_utts)} dev utts")

    train_ds = AishellDataset(train_utts, char2id, speed_perturb=True)
    dev_ds = AishellDataset(dev_utts, char2id)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True, prefetch_factor=4)
    dev_dl = DataLoader(dev_ds, args.batch_size, sampler=DistributedSampler(dev_ds, shuffle=False),
                        collate_fn=collate, num_workers=4)

    model = DDP(Model(len(char2id)).to(dev), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, (args.warmup / (s + 1)) ** 0.5))
    ctc = nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)

    best_cer = 1e9
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, xl, y, yl) in enumerate(train_dl):
            x, xl, y, yl = x.to(dev), xl.to(dev), y.to(dev), yl.to(dev)
            x = specaug(x)
            sync_now = (it + 1) % args.accum_grad == 0
            with model.no_sync() if not sync_now else contextlib.nullcontext():
                lp, ol = model(x, xl)
                loss = ctc(lp.transpose(0, 1), y, ol, yl) / x.size(0)
                (loss / args.accum_grad).backward()
            if sync_now:
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{time.time() - t0:.0f}s", flush=True)

        model.eval()
        stats = torch.zeros(2, device=dev)
        with torch.no_grad():
            for x, xl, y, yl in dev_dl:
                lp, ol = model(x.to(dev), xl.to(dev))
                pred = lp.argmax(-1).cpu()
                for p, n, ref, rl in zip(pred, ol.cpu(), y, yl):
                    hyp = [int(c) for c in torch.unique_consecutive(p[:n]) if c != 0]
                    ref = ref[:rl].tolist()
                    stats[0] += editdistance.eval(hyp, ref)
                    stats[1] += len(ref)
        dist.all_reduce(stats)
        cer = (stats[0] / stats[1]).item()
        if rank == 0:
            print(f"epoch {epoch} dev CER {cer * 100:.2f}%", flush=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.exp, f"{epoch}.pt"))
            if cer < best_cer:
                best_cer = cer
                torch.save(ckpt, os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
