"""Chunk-wise streaming training for a causal conv KWS model (single node, all GPUs).

The deployed model sees 160 ms feature chunks and keeps a left-context cache
per layer, so training feeds each utterance chunk by chunk in the same way
(the cache is detached between chunks, i.e. truncated BPTT).

    CUDA_VISIBLE_DEVICES=0,1,2,3 python 17_streaming_chunk_dataparallel.py --train data/train.tsv --dev data/dev.tsv
"""
import argparse
import csv
import os
import random
import time

import soundfile as sf
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.utils.data import DataLoader, Dataset

SR = 16000
CHUNK = 16  # frames (10 ms hop) per streaming step


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--n-classes", type=int, default=12)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--clip-s", type=float, default=1.5)
    p.add_argument("--save-dir", default="exp/stream_chunk")
    return p.parse_args()


class TsvClips(Dataset):
    def __init__(self, tsv, clip_s, train):
        with open(tsv) as f:
            self.rows = [(r[0], int(r[1])) for r in csv.reader(f, delimiter="\t")]
        self.n = int(clip_s * SR)
        self.train = train
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=400, hop_length=160, n_mels=40, center=False)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, y = self.rows[i]
        wav, _ = sf.read(path, dtype="float32")
        wav = torch.from_numpy(wav[: self.n])
        lead = random.randint(0, self.n - wav.numel()) if self.train else (self.n - wav.numel()) // 2
        wav = F.pad(wav, (lead, self.n - wav.numel() - lead))
        if self.train:
            wav = wav * random.uniform(0.3, 1.5) + torch.randn_like(wav) * random.uniform(0, 3e-3)
        return (self.mel(wav) + 1e-6).log(), y  # (40, T)


class CachedCausalConv(nn.Module):
    def __init__(self, cin, cout, k, dilation=1):
        super().__init__()
        self.pad = (k - 1) * dilation
        self.conv = nn.Conv1d(cin, cout, k, dilation=dilation)
        self.norm = nn.BatchNorm1d(cout)
        self.cache = None

    def reset(self):
        self.cache = None

    def forward(self, x):
        if self.cache is None or self.cache.size(0) != x.size(0):
            ctx = x.new_zeros(x.size(0), x.size(1), self.pad)
        else:
            ctx = self.cache
        x = torch.cat([ctx, x], dim=-1)
        self.cache = x[..., -self.pad:].detach()
        return F.relu(self.norm(self.conv(x)))


class StreamingKWS(nn.Module):
    def __init__(self, n_classes, n_mels=40, ch=64):
        super().__init__()
        self.layers = nn.ModuleList([
            CachedCausalConv(n_mels, ch, 3), CachedCausalConv(ch, ch, 3, 2), CachedCausalConv(ch, ch, 3, 4),
            CachedCausalConv(ch, ch, 3, 8), CachedCausalConv(ch, ch, 3, 16)])
        self.out = nn.Conv1d(ch, n_classes, 1)

    def reset_streaming_state(self):
        for layer in self.layers:
            layer.reset()

    def forward(self, chunk):
        x = chunk
        for layer in self.layers:
            x = layer(x)
        return self.out(x)  # (B, C, T_chunk)


def chunked_forward(model, feats):
    """Run feats (B, F, T) through the model CHUNK frames at a time; returns (B, C, T) logits."""
    outs = []
    for s in range(0, feats.size(-1), CHUNK):
        outs.append(model(feats[..., s:s + CHUNK]))
    return torch.cat(outs, dim=-1)


def max_pool_loss(logits, y, filler=0):
    logp = logits.log_softmax(1)
    kw = y != filler
    loss = logits.new_zeros(())
    if kw.any():
        loss = loss - logp[kw].gather(1, y[kw, None, None].expand(-1, 1, logp.size(-1))).amax(-1).mean()
    if (~kw).any():
        loss = loss - logp[~kw, filler].mean()
    return loss


def main():
    args = parse_args()
    n_gpus = torch.cuda.device_count()
    device = torch.device("cuda")
    torch.manual_seed(0)

    train_loader = DataLoader(TsvClips(args.train, args.clip_s, True), batch_size=args.batch_size, shuffle=True,
                              num_workers=4 * n_gpus, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(TsvClips(args.dev, args.clip_s, False), batch_size=args.batch_size,
                            num_workers=8, pin_memory=True)

    net = StreamingKWS(args.n_classes).to(device)
    model = nn.DataParallel(net) if n_gpus > 1 else net
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))
    print(f"training on {n_gpus} GPU(s), {sum(p.numel() for p in net.parameters())} params")

    os.makedirs(args.save_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0, tot, n = time.time(), 0.0, 0
        for feats, y in train_loader:
            feats, y = feats.to(device, non_blocking=True), y.to(device, non_blocking=True)
            net.reset_streaming_state()
            logits = chunked_forward(model, feats)
            loss = max_pool_loss(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            sched.step()
            tot, n = tot + loss.item(), n + 1

        model.eval()
        correct = total = 0
        with torch.no_grad():
            for feats, y in dev_loader:
                feats, y = feats.to(device), y.to(device)
                net.reset_streaming_state()
                post = chunked_forward(model, feats).softmax(1)
                kw_peak = post[:, 1:].amax(-1)                  # (B, C-1)
                pred = torch.where(kw_peak.amax(1) > 0.5, kw_peak.argmax(1) + 1, torch.zeros_like(y))
                correct += (pred == y).sum().item()
                total += y.numel()
        acc = correct / total
        print(f"epoch {epoch:02d} loss {tot / n:.4f} dev acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
        torch.save(net.state_dict(), os.path.join(args.save_dir, "last.pt"))
        if acc > best:
            best = acc
            torch.save(net.state_dict(), os.path.join(args.save_dir, "best.pt"))


if __name__ == "__main__":
    main()
