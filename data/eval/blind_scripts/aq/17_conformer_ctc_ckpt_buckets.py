#!/usr/bin/env python
"""Large Conformer-CTC (BPE 1024) on a multi-corpus English mix.

Activation checkpointing per Conformer layer, duration-bucketed batches sharded over ranks,
non-finite batches skipped in lock-step across ranks.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        17_conformer_ctc_ckpt_buckets.py --manifest /shared/asr/train.tsv --dev /shared/asr/dev.tsv \
        --bpe /shared/asr/bpe1024.model --exp /shared/exp/conformer_l
"""
import argparse
import json
import math
import os
import random

import sentencepiece as spm
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torchaudio.models.conformer import ConformerLayer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--bpe", required=True)
    p.add_argument("--exp", required=True)
    p.add_argument("--max_batch_sec", type=float, default=400.0)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--peak_lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--grad_ckpt", action="store_true")
    return p.parse_args()


def read_durations(tsv, cache_path, rank):
    """Probing every file header is slow on network storage; rank 0 does it once and the rest wait."""
    if rank == 0 and not os.path.exists(cache_path):
        rows = []
        with open(tsv) as f:
            for line in f:
                path, text = line.rstrip("\n").split("\t", 1)
                rows.append([path, sf.info(path).duration, text])
        tmp = cache_path + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, cache_path)
    dist.barrier()
    with open(cache_path) as f:
        return json.load(f)


class AsrSet(Dataset):
    def __init__(self, rows, sp):
        self.rows, self.sp = rows, sp

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, _, text = self.rows[i]
        wav, sr = sf.read(path, dtype="float32")
        wav = torch.from_numpy(wav)
        if sr != 16000:
            wav = torchaudio.functional.resample(wav, sr, 16000)
        return wav, torch.tensor(self.sp.encode(text.lower()))


def collate(batch):
    w, t = zip(*batch)
    return (nn.utils.rnn.pad_sequence(w, batch_first=True), torch.tensor([x.numel() for x in w]),
            torch.cat(t), torch.tensor([x.numel() for x in t]))


class ShardedBucketBatches:
    """Same global batch list on every rank (seed + epoch), then every rank takes batches[rank::world]."""

    def __init__(self, durations, max_sec, rank, world, seed=0, shuffle=True, even=True):
        self.durs, self.max_sec = durations, max_sec
        self.rank, self.world, self.seed, self.shuffle = rank, world, seed, shuffle
        self.even = even
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _global_batches(self):
        rng = random.Random(self.seed + self.epoch)
        idx = sorted(range(len(self.durs)), key=lambda i: (self.durs[i], i))
        batches, cur, longest = [], [], 0.0
        for i in idx:
            longest_new = max(longest, self.durs[i])
            if cur and longest_new * (len(cur) + 1) > self.max_sec:
                batches.append(cur)
                cur, longest_new = [], self.durs[i]
            cur.append(i)
            longest = longest_new
        if cur:
            batches.append(cur)
        if self.shuffle:
            rng.shuffle(batches)
        if self.even:  # every rank must run the same number of DDP steps
            batches = batches[:len(batches) - len(batches) % self.world]
        return batches

    def __iter__(self):
        return iter(self._global_batches()[self.rank::self.world])

    def __len__(self):
        return len(self._global_batches()[self.rank::self.world])


class ConformerCTC(nn.Module):
    def __init__(self, vocab, d, layers, grad_ckpt):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160, n_mels=80)
        self.specaug = nn.Sequential(*[torchaudio.transforms.FrequencyMasking(27) for _ in range(2)],
                                     *[torchaudio.transforms.TimeMasking(40, p=0.05) for _ in range(10)])
        self.sub = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.SiLU(), nn.Conv2d(d, d, 3, 2), nn.SiLU())
        self.lin = nn.Linear(d * 19, d)
        self.layers = nn.ModuleList([ConformerLayer(d, 4 * d, 8, 31, dropout=0.1, use_group_norm=True)
                                     for _ in range(layers)])
        self.head = nn.Linear(d, vocab)
        self.grad_ckpt = grad_ckpt

    def forward(self, wav, wav_len):
        with torch.no_grad():
            x = (self.mel(wav) + 1e-6).log()
            x = (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5)
            if self.training:
                x = self.specaug(x)
        x = self.sub(x.transpose(1, 2).unsqueeze(1))
        b, c, t, f = x.shape
        x = self.lin(x.transpose(1, 2).reshape(b, t, c * f)).transpose(0, 1)  # T, B, D
        lens = (((wav_len // 160 + 1) - 1) // 2 - 1) // 2
        lens = lens.clamp(1, t)
        pad_mask = torch.arange(t, device=x.device)[None] >= lens[:, None]
        for layer in self.layers:
            if self.grad_ckpt and self.training:
                x = checkpoint(layer, x, pad_mask, use_reentrant=False)
            else:
                x = layer(x, pad_mask)
        return self.head(x).log_softmax(-1), lens  # T, B, V


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17)

    sp = spm.SentencePieceProcessor(model_file=args.bpe)
    blank = sp.get_piece_size()
    os.makedirs(args.exp, exist_ok=True)
    train_rows = read_durations(args.manifest, os.path.join(args.exp, "train_durations.json"), rank)
    dev_rows = read_durations(args.dev, os.path.join(args.exp, "dev_durations.json"), rank)
    train_rows = [r for r in train_rows if 0.5 <= r[1] <= 25.0]

    batcher = ShardedBucketBatches([r[1] for r in train_rows], args.max_batch_sec, rank, world, seed=17)
    train_dl = DataLoader(AsrSet(train_rows, sp), batch_sampler=batcher, collate_fn=collate, num_workers=8,
                          pin_memory=True, persistent_workers=True, prefetch_factor=4)
    dev_batcher = ShardedBucketBatches([r[1] for r in dev_rows], 200.0, rank, world, shuffle=False, even=False)
    dev_dl = DataLoader(AsrSet(dev_rows, sp), batch_sampler=dev_batcher, collate_fn=collate, num_workers=4)

    model = ConformerCTC(blank + 1, args.d_model, args.layers, args.grad_ckpt).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))
    start_epoch, step = 0, 0
    last = os.path.join(args.exp, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, step = ck["epoch"] + 1, ck["step"]
    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        batcher.set_epoch(epoch)
        model.train()
        skipped = 0
        for wav, wl, tgt, tl in train_dl:
            wav, wl, tgt, tl = wav.to(device), wl.to(device), tgt.to(device), tl.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lp, ol = model(wav, wl)
            loss = F.ctc_loss(lp.float(), tgt, ol, tl, blank=blank, reduction="sum") / wav.size(0)
            bad = (~torch.isfinite(loss)).float()
            dist.all_reduce(bad)
            if bad.item() > 0:
                skipped += 1
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.3f} gnorm {gn:.2f} "
                      f"lr {sched.get_last_lr()[0]:.2e} skipped {skipped}", flush=True)

        # ranks may hold different numbers of dev batches, so no DDP forward (buffer broadcast) here
        net = model.module
        net.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for wav, wl, tgt, tl in dev_dl:
                lp, ol = net(wav.to(device), wl.to(device))
                l = F.ctc_loss(lp.float(), tgt.to(device), ol, tl.to(device), blank=blank,
                               reduction="sum", zero_infinity=True)
                acc += torch.stack([l, tl.sum().to(device).float()])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} dev ctc/token {(acc[0] / acc[1]).item():.4f}", flush=True)
            tmp = last + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "step": step}, tmp)
            os.replace(tmp, last)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
