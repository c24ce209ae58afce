"""Utterance-level speech emotion classifier (conv front-end + transformer + attention pooling).

Batches are built from utterance durations so each one holds about --max-seconds of audio.

    torchrun --nproc_per_node=4 05_speech_emotion_dynbatch.py --train-csv meta/train.csv \
        --val-csv meta/val.csv --exp-dir exp/ser_v3
"""
import argparse
import csv
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter

SR = 16000


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def get_durations(rows, cache_path):
    """Durations in seconds. Calling torchaudio.info on ~400k files takes a while, so cache it."""
    if os.path.exists(cache_path):
        return np.load(cache_path)
    durs = []
    for r in rows:
        info = torchaudio.info(r["path"])
        durs.append(info.num_frames / info.sample_rate)
    durs = np.asarray(durs, dtype=np.float32)
    np.save(cache_path, durs)
    return durs


class EmotionDataset(Dataset):
    def __init__(self, rows, label2id, max_seconds):
        self.rows = rows
        self.label2id = label2id
        self.max_samples = int(max_seconds * SR)
        self.fbank = torchaudio.transforms.MelSpectrogram(SR, n_fft=512, win_length=400, hop_length=160, n_mels=80)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(self.rows[i]["path"])
        wav = wav.mean(0)
        if sr != SR:
            wav = torchaudio.functional.resample(wav, sr, SR)
        wav = wav[: self.max_samples]
        feats = torch.log(self.fbank(wav) + 1e-6).T
        return feats - feats.mean(0, keepdim=True), self.label2id[self.rows[i]["emotion"]]


def collate(batch):
    feats, labels = zip(*batch)
    lens = torch.tensor([f.size(0) for f in feats])
    return nn.utils.rnn.pad_sequence(feats, batch_first=True), lens, torch.tensor(labels)


class DynamicBatchSampler(Sampler):
    def __init__(self, durations, max_seconds, num_replicas, rank, shuffle=True, seed=0, num_buckets=20,
                 even=True):
        self.durations = np.asarray(durations)
        self.max_seconds = max_seconds
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.even = even
        # quantile bucket boundaries so every bucket holds a similar number of utterances
        self.boundaries = np.quantile(self.durations, np.linspace(0, 1, num_buckets + 1)[1:-1])

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _make_batches(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        bucket_ids = np.digitize(self.durations, self.boundaries)
        batches = []
        for b in np.unique(bucket_ids):
            idx = np.flatnonzero(bucket_ids == b)
            if self.shuffle:
                idx = rng.permutation(idx)
            max_dur = self.durations[idx].max()
            per_batch = max(1, int(self.max_seconds // max_dur))
            batches.extend(idx[s:s + per_batch].tolist() for s in range(0, len(idx), per_batch))
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        if self.even and len(batches) % self.num_replicas:
            batches += batches[: self.num_replicas - len(batches) % self.num_replicas]
        return batches[self.rank::self.num_replicas]

    def __iter__(self):
        yield from self._make_batches()

    def __len__(self):
        return len(self._make_batches())


class SERModel(nn.Module):
    def __init__(self, n_classes, n_mels=80, dim=256, layers=6, heads=4):
        super().__init__()
        self.front = nn.Sequential(
            nn.Conv1d(n_mels, dim, 5, stride=2, padding=2), nn.GELU(),
            nn.Conv1d(dim, dim, 5, stride=2, padding=2), nn.GELU())
        self.ln = nn.LayerNorm(dim)
        enc_layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.attn_pool = nn.Linear(dim, 1)
        self.classifier = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Dropout(0.2), nn.Linear(dim, n_classes))

    def forward(self, feats, lens):
        x = self.front(feats.transpose(1, 2)).transpose(1, 2)
        lens = (lens + 3) // 4
        x = self.ln(x)
        pad = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        x = self.encoder(x, src_key_padding_mask=pad)
        w = self.attn_pool(x).squeeze(-1).masked_fill(pad, float("-inf")).softmax(-1)
        return self.classifier(torch.einsum("bt,btd->bd", w, x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", required=True)
    ap.add_argument("--exp-dir", required=True)
    ap.add_argument("--max-seconds", type=float, default=240.0, help="audio seconds per GPU batch")
    ap.add_argument("--max-utt-seconds", type=float, default=15.0)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_rows, val_rows = read_csv(args.train_csv), read_csv(args.val_csv)
    emotions = sorted({r["emotion"] for r in train_rows})
    label2id = {e: i for i, e in enumerate(emotions)}
    train_durs = np.minimum(get_durations(train_rows, args.train_csv + ".dur.npy"), args.max_utt_seconds)
    val_durs = np.minimum(get_durations(val_rows, args.val_csv + ".dur.npy"), args.max_utt_seconds)

    train_ds = EmotionDataset(train_rows, label2id, args.max_utt_seconds)
    val_ds = EmotionDataset(val_rows, label2id, args.max_utt_seconds)
    train_sampler = DynamicBatchSampler(train_durs, args.max_seconds, world, rank, seed=args.seed)
    val_sampler = DynamicBatchSampler(val_durs, args.max_seconds, world, rank, shuffle=False, even=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate, num_workers=8,
                              pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_sampler=val_sampler, collate_fn=collate, num_workers=4)

    # class-balanced loss weights, computed identically on every rank
    counts = np.bincount([label2id[r["emotion"]] for r in train_rows], minlength=len(emotions))
    class_weights = torch.tensor(counts.sum() / (len(emotions) * counts), dtype=torch.float32, device=device)

    model = DDP(SERModel(len(emotions)).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps = args.epochs * len(train_sampler)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps, pct_start=0.1)
    writer = SummaryWriter(args.exp_dir) if rank == 0 else None

    best_uar, step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for feats, lens, labels in train_loader:
            feats, lens, labels = feats.to(device), lens.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(feats, lens)
            loss = F.cross_entropy(logits.float(), labels, weight=class_weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)

        # unweighted average recall over the whole validation set
        model.eval()
        confusion = torch.zeros(len(emotions), len(emotions), device=device, dtype=torch.long)
        with torch.no_grad():
            for feats, lens, labels in val_loader:
                feats, lens, labels = feats.to(device), lens.to(device), labels.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(feats, lens).argmax(-1)
                confusion.index_put_((labels, pred), torch.ones_like(labels), accumulate=True)
        dist.all_reduce(confusion)
        recall = confusion.diag().float() / confusion.sum(1).clamp(min=1).float()
        uar = recall.mean().item()
        if rank == 0:
            print(f"epoch {epoch}: UAR {uar:.4f} per-class {[round(r, 3) for r in recall.tolist()]}", flush=True)
            writer.add_scalar("val/uar", uar, step)
            if uar > best_uar:
                best_uar = uar
                torch.save({"model": model.module.state_dict(), "emotions": emotions, "epoch": epoch},
                           os.path.join(args.exp_dir, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
