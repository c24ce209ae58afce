#!/usr/bin/env python3
# CSL-Daily continuous SLR on pre-extracted frame features.
#
# Features come from a frozen 2D backbone (one float16 .npy of shape (T, 1024) per video,
# see tools/extract_features.py). Temporal model: conv subsampling + transformer encoder + CTC.
#
#   torchrun --nproc_per_node=8 10_csl_daily_feature_ctc.py --config configs/csl_daily_tf.yaml
import argparse
import gzip
import math
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def levenshtein(a, b):
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


class FeatureGlossDataset(Dataset):
    def __init__(self, ann_file, feat_dir, vocab, max_len=400, train=True):
        with gzip.open(ann_file, "rb") as f:
            self.anns = pickle.load(f)  # list of {"name", "gloss": "G1 G2 ...", "num_frames"}
        self.feat_dir = feat_dir
        self.vocab = vocab
        self.max_len = max_len
        self.train = train

    def __len__(self):
        return len(self.anns)

    def __getitem__(self, i):
        ann = self.anns[i]
        feats = np.load(os.path.join(self.feat_dir, ann["name"] + ".npy")).astype(np.float32)
        if self.train:
            # temporal jitter: drop ~10% of the frames at random
            keep = np.sort(np.random.choice(len(feats), int(len(feats) * 0.9), replace=False))
            feats = feats[keep]
            feats = feats + np.random.normal(0, 0.01, feats.shape).astype(np.float32)
        feats = feats[: self.max_len]
        labels = [self.vocab[g] for g in ann["gloss"].split() if g in self.vocab]
        return torch.from_numpy(feats), torch.tensor(labels, dtype=torch.long)


def collate(batch):
    feats, labels = zip(*batch)
    lens = torch.tensor([f.shape[0] for f in feats])
    x = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    return x, lens, torch.cat(labels), torch.tensor([len(l) for l in labels])


class ConvSubsample(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(dim, dim, 5, padding=2), nn.BatchNorm1d(dim), nn.ReLU(inplace=True), nn.MaxPool1d(2, ceil_mode=True),
            nn.Conv1d(dim, dim, 5, padding=2), nn.BatchNorm1d(dim), nn.ReLU(inplace=True), nn.MaxPool1d(2, ceil_mode=True))

    def forward(self, x, lens):
        x = self.net(x.transpose(1, 2)).transpose(1, 2)
        lens = torch.div(lens + 1, 2, rounding_mode="floor")
        lens = torch.div(lens + 1, 2, rounding_mode="floor")
        return x, lens


class CTCTransformer(nn.Module):
    def __init__(self, in_dim, vocab_size, d_model=512, layers=4, heads=8, dropout=0.1):
        super().__init__()
        self.proj = nn.Linear(in_dim, d_model)
        self.sub = ConvSubsample(d_model)
        enc = nn.TransformerEncoderLayer(d_model, heads, 2048, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers)
        self.out = nn.Linear(d_model, vocab_size)

    def forward(self, x, lens):
        x, lens = self.sub(self.proj(x), lens)
        pad = torch.arange(x.shape[1], device=x.device)[None] >= lens[:, None]
        x = self.encoder(x, src_key_padding_mask=pad)
        return self.out(x).log_softmax(-1), lens


def decode(log_probs, lens, blank=0):
    best = log_probs.argmax(-1).cpu().numpy()
    out = []
    for seq, n in zip(best, lens.cpu().numpy()):
        prev, hyp = blank, []
        for s in seq[:n]:
            if s != prev and s != blank:
                hyp.append(int(s))
            prev = s
        out.append(hyp)
    return out


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    for x, lens, labels, label_lens in loader:
        log_probs, out_lens = model(x.to(device), lens.to(device))
        refs = torch.split(labels, label_lens.tolist())
        for hyp, ref in zip(decode(log_probs, out_lens), refs):
            stats[0] += levenshtein(hyp, ref.tolist())
            stats[1] += len(ref)
    dist.all_reduce(stats)
    return (100 * stats[0] / stats[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("opts", nargs="*", help="key=value overrides")
    cfg = OmegaConf.merge(OmegaConf.load(parser.parse_args().config),
                          OmegaConf.from_dotlist(parser.parse_args().opts))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    with open(cfg.data.vocab) as f:
        glosses = [line.strip() for line in f if line.strip()]
    vocab = {g: i + 1 for i, g in enumerate(glosses)}  # 0 = blank

    train_set = FeatureGlossDataset(cfg.data.train_ann, cfg.data.feat_dir, vocab, train=True)
    dev_set = FeatureGlossDataset(cfg.data.dev_ann, cfg.data.feat_dir, vocab, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_set, cfg.train.batch_per_gpu, sampler=train_sampler, collate_fn=collate,
                              num_workers=cfg.train.workers, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(torch.utils.data.Subset(dev_set, range(rank, len(dev_set), world)),
                            batch_size=16, collate_fn=collate, num_workers=4)

    model = CTCTransformer(cfg.model.in_dim, len(vocab) + 1, cfg.model.d_model, cfg.model.layers).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    ctc = nn.CTCLoss(blank=0, reduction="mean")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.wd)
    total_steps = cfg.train.epochs * len(train_loader)
    warmup = cfg.train.warmup_epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / total_steps))))

    writer = SummaryWriter(cfg.out_dir) if rank == 0 else None
    best_wer, global_step = 1e9, 0
    for epoch in range(cfg.train.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        skipped, t0 = 0, time.time()
        for x, lens, labels, label_lens in train_loader:
            x, lens = x.to(device, non_blocking=True), lens.to(device)
            log_probs, out_lens = model(x, lens)
            loss = ctc(log_probs.transpose(0, 1), labels.to(device), out_lens, label_lens.to(device))
            if not torch.isfinite(loss):
                # target longer than the subsampled input -> inf; ignore this batch
                skipped += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip)
            optimizer.step()
            scheduler.step()
            global_step += 1
            if rank == 0 and global_step % 50 == 0:
                writer.add_scalar("train/ctc", loss.item(), global_step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], global_step)

        wer = evaluate(model, dev_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: dev WER {wer:.2f} skipped {skipped} batches ({time.time() - t0:.0f}s)")
            writer.add_scalar("dev/wer", wer, epoch)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "cfg": OmegaConf.to_container(cfg)}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
