#!/usr/bin/env python
"""Conformer-lite CTC acoustic model on LibriSpeech, DDP + fp16 AMP + grad accumulation.

    torchrun --nproc_per_node=8 08_ddp_ctc_asr.py --manifest data/train_960.tsv --dev data/dev_clean.tsv
"""
import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VOCAB = list("_ abcdefghijklmnopqrstuvwxyz'")  # index 0 = CTC blank
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True, help="tsv: path<TAB>num_samples<TAB>transcript")
    p.add_argument("--dev", required=True)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--max_sec", type=float, default=16.7)
    p.add_argument("--exp", default="exp/ctc_conformer")
    return p.parse_args()


class AudioDataset(Dataset):
    def __init__(self, manifest, max_sec=None):
        self.rows = []
        with open(manifest) as f:
            for line in f:
                path, n, text = line.rstrip("\n").split("\t")
                if max_sec and int(n) / 16000 > max_sec:
                    continue
                self.rows.append((path, text.lower()))
        self.fbank = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i]
        wav, sr = torchaudio.load(path)
        feats = (self.fbank(wav[0]) + 1e-6).log().t()  # [T, 80]
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
        target = torch.tensor([CHAR2ID[c] for c in text if c in CHAR2ID], dtype=torch.long)
        return feats, target


def collate(batch):
    feats, targets = zip(*batch)
    flen = torch.tensor([f.size(0) for f in feats])
    tlen = torch.tensor([t.size(0) for t in targets])
    x = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    y = nn.utils.rnn.pad_sequence(targets, batch_first=True)
    return x, flen, y, tlen


class ConvSubsample(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.out = nn.Linear(d * 19, d)

    def forward(self, x, lens):
        x = self.conv(x.unsqueeze(1))  # [B, d, T/4, 19]
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        return x, lens


class CTCModel(nn.Module):
    def __init__(self, d, layers, vocab):
        super().__init__()
        self.sub = ConvSubsample(d)
        enc_layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.out = nn.Linear(d, vocab)

    def forward(self, x, lens):
        x, lens = self.sub(x, lens)
        mask = torch.arange(x.size(1), device=x.device)[None, :] >= lens[:, None]
        x = self.encoder(x, src_key_padding_mask=mask)
        return self.out(x).log_softmax(-1), lens


def greedy_decode(logp, lens):
    hyps = []
    for seq, n in zip(logp.argmax(-1), lens):
        prev, out = -1, []
        for t in seq[:n].tolist():
            if t != prev and t != 0:
                out.append(VOCAB[t])
            prev = t
        hyps.append("".join(out))
    return hyps


def edit_distance(a, b):
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(b) + 1):
            cur = min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
            prev, d[j] = d[j], cur
    return d[len(b)]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = AudioDataset(args.manifest, args.max_sec)
    dev_ds = AudioDataset(args.dev)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, collate_fn=collate,
                        num_workers=8, pin_memory=True, drop_last=True)
    dev_idx = list(range(rank, len(dev_ds), world))
    dev_loader = DataLoader(torch.utils.data.Subset(dev_ds, dev_idx), batch_size=32,
                            collate_fn=collate, num_workers=4)

    model = CTCModel(args.d_model, args.layers, len(VOCAB)).to(device)
    model = DDP(model, device_ids=[local_rank])
    ctc = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, pct_start=0.1,
                                                total_steps=args.epochs * (len(loader) // args.accum))
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, flen, y, tlen) in enumerate(loader):
            x, flen = x.to(device, non_blocking=True), flen.to(device)
            y, tlen = y.to(device, non_blocking=True), tlen.to(device)
            do_step = (i + 1) % args.accum == 0
            with (model.no_sync() if not do_step else contextlib.nullcontext()):
                with torch.autocast("cuda", dtype=torch.float16):
                    logp, olen = model(x, flen)
                loss = ctc(logp.float().transpose(0, 1), y, olen, tlen)
                if not torch.isfinite(loss):
                    print(f"[rank {rank}] non-finite CTC loss at iter {i}, skipping batch", flush=True)
                    continue
                scaler.scale(loss / args.accum).backward()
            if not do_step:
                continue
            scaler.unscale_(optimizer)
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            sched.step()
            if rank == 0 and (i // args.accum) % 100 == 0:
                print(f"epoch {epoch} it {i} loss {loss.item():.3f} gnorm {gnorm:.2f} "
                      f"scale {scaler.get_scale():.0f} {time.time() - t0:.0f}s", flush=True)

        model.eval()
        errs = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, flen, y, tlen in dev_loader:
                with torch.autocast("cuda", dtype=torch.float16):
                    logp, olen = model.module(x.to(device), flen.to(device))
                hyps = greedy_decode(logp.float(), olen)
                for h, ref, n in zip(hyps, y, tlen):
                    ref_s = "".join(VOCAB[t] for t in ref[:n].tolist())
                    errs[0] += edit_distance(h.split(), ref_s.split())
                    errs[1] += len(ref_s.split())
        dist.all_reduce(errs)
        if rank == 0:
            print(f"epoch {epoch} dev WER {100 * errs[0] / errs[1]:.2f}", flush=True)
            os.makedirs(args.exp, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.exp, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
