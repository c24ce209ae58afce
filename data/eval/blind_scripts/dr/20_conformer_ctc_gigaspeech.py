"""Conformer-CTC (BPE-1000) on GigaSpeech-M with duration-bucketed batches.

    torchrun --nproc_per_node=8 20_conformer_ctc_gigaspeech.py conf/gigaspeech_m.yaml

Precomputed fbank (.npy, 80-dim, 10 ms) + jsonl manifests: {"feat": ..., "frames": ..., "text": ...}
"""
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
import editdistance


@dataclass
class Config:
    train_manifest: str
    dev_manifest: str
    bpe_model: str
    exp_dir: str
    batch_size: int = 32
    max_frames: int = 2000
    num_buckets: int = 30
    d_model: int = 512
    num_heads: int = 8
    num_layers: int = 16
    kernel: int = 31
    dropout: float = 0.1
    lr: float = 1.5e-3
    warmup: int = 20000
    epochs: int = 30
    workers: int = 8
    keep_last: int = 5
    seed: int = 42


def load_manifest(path, max_frames=None):
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if max_frames is None or r["frames"] <= max_frames:
                rows.append(r)
    return rows


class GigaDataset(Dataset):
    # GigaSpeech punctuation tags are removed from the targets
    TAGS = ("<COMMA>", "<PERIOD>", "<QUESTIONMARK>", "<EXCLAMATIONPOINT>")

    def __init__(self, rows, sp, augment):
        self.rows, self.sp, self.augment = rows, sp, augment
        self.fmask = torchaudio.transforms.FrequencyMasking(27)
        self.tmask = torchaudio.transforms.TimeMasking(100, p=0.05)

    def __len__(self):
        return len(self.rows)

    def clean(self, text):
        return " ".join(w for w in text.split() if w not in self.TAGS).lower()

    def __getitem__(self, i):
        r = self.rows[i]
        x = torch.from_numpy(np.load(r["feat"])).float()
        if self.augment:
            x = x.t()
            x = self.fmask(self.fmask(x))
            for _ in range(10):
                x = self.tmask(x)
            x = x.t()
        text = self.clean(r["text"])
        y = torch.tensor(self.sp.encode(text), dtype=torch.long) + 1
        return x, y, text


def collate(batch):
    xs, ys, texts = zip(*batch)
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor([x.shape[0] for x in xs]),
            nn.utils.rnn.pad_sequence(ys, batch_first=True), torch.tensor([y.shape[0] for y in ys]), texts)


class DistributedBucketSampler(Sampler):
    def __init__(self, frames, batch_size, num_buckets, num_replicas, rank, seed=0):
        self.frames = frames
        self.batch_size = batch_size
        self.num_buckets = num_buckets
        self.num_replicas, self.rank = num_replicas, rank
        self.seed, self.epoch = seed, 0
        order = sorted(range(len(frames)), key=lambda i: frames[i])
        size = math.ceil(len(order) / num_buckets)
        self.buckets = [order[i:i + size] for i in range(0, len(order), size)]
        n_batches = sum(len(b) // batch_size for b in self.buckets)
        self.num_batches = n_batches // num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = random.Random(self.seed + self.epoch)
        batches = []
        for bucket in self.buckets:
            bucket = bucket[:]
            g.shuffle(bucket)
            batches += [bucket[k:k + self.batch_size] for k in range(0, len(bucket) - self.batch_size + 1,
                                                                   self.batch_size)]
        g.shuffle(batches)
        batches = batches[: self.num_batches * self.num_replicas]
        return iter(batches[self.rank::self.num_replicas])

    def __len__(self):
        return self.num_batches


class Frontend(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.GELU(), nn.Conv2d(d, d, 3, 2), nn.GELU())
        self.proj = nn.Linear(d * 19, d)

    def forward(self, x, n):
        x = self.conv(x.unsqueeze(1)).permute(0, 2, 1, 3).flatten(2)
        return self.proj(x), ((n - 1) // 2 - 1) // 2


class CTCModel(nn.Module):
    def __init__(self, cfg, vocab):
        super().__init__()
        self.frontend = Frontend(cfg.d_model)
        self.encoder = torchaudio.models.Conformer(cfg.d_model, cfg.num_heads, 4 * cfg.d_model, cfg.num_layers,
                                                   cfg.kernel, dropout=cfg.dropout, use_group_norm=True)
        self.head = nn.Linear(cfg.d_model, vocab)

    def forward(self, x, n):
        x, n = self.frontend(x, n)
        x, n = self.encoder(x, n)
        return self.head(x), n


def ctc_greedy(logits, lens, sp):
    hyps = []
    for seq, n in zip(logits.argmax(-1), lens):
        ids = [int(t) - 1 for t in torch.unique_consecutive(seq[:n]) if t != 0]
        hyps.append(sp.decode(ids))
    return hyps


def main():
    with open(sys.argv[1]) as f:
        cfg = Config(**yaml.safe_load(f))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    sp = spm.SentencePieceProcessor(model_file=cfg.bpe_model)
    train_rows = load_manifest(cfg.train_manifest, cfg.max_frames)
    dev_rows = sorted(load_manifest(cfg.dev_manifest), key=lambda r: r["frames"])[rank::world]
    sampler = DistributedBucketSampler([r["frames"] for r in train_rows], cfg.batch_size, cfg.num_buckets,
                                       world, rank, seed=cfg.seed)
    train_loader = DataLoader(GigaDataset(train_rows, sp, augment=True), batch_sampler=sampler,
                              collate_fn=collate, num_workers=cfg.workers, pin_memory=True, persistent_workers=True)
    dev_loader = DataLoader(GigaDataset(dev_rows, sp, augment=False), batch_size=32, collate_fn=collate,
                            num_workers=2)

    model = CTCModel(cfg, sp.get_piece_size() + 1).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / cfg.warmup, math.sqrt(cfg.warmup / (s + 1))))
    criterion = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)

    start_epoch = 0
    last = os.path.join(cfg.exp_dir, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(cfg.exp_dir, exist_ok=True)
        print(f"{len(train_rows)} train utts, {len(train_loader)} batches/rank/epoch, world {world}", flush=True)

    for epoch in range(start_epoch, cfg.epochs):
        model.train()
        t0 = time.time()
        for it, (x, xn, y, yn, _) in enumerate(train_loader):
            x, xn, y, yn = x.to(device, non_blocking=True), xn.to(device), y.to(device), yn.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, on = model(x, xn)
            loss = criterion(logits.float().log_softmax(-1).transpose(0, 1), y, on, yn)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.3f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        model.eval()
        tally = torch.zeros(2, dtype=torch.float64, device=device)
        with torch.no_grad():
            for x, xn, _, _, texts in dev_loader:
                logits, on = model.module(x.to(device), xn.to(device))
                for ref, hyp in zip(texts, ctc_greedy(logits, on, sp)):
                    tally[0] += editdistance.eval(ref.split(), hyp.split())
                    tally[1] += len(ref.split())
        dist.all_reduce(tally)
        if rank == 0:
            print(f"epoch {epoch} dev WER {100 * (tally[0] / tally[1]).item():.2f}", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(cfg.exp_dir, f"epoch{epoch}.pt"))
            torch.save(state, last + ".tmp")
            os.replace(last + ".tmp", last)
            old = os.path.join(cfg.exp_dir, f"epoch{epoch - cfg.keep_last}.pt")
            if os.path.exists(old):
                os.remove(old)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
