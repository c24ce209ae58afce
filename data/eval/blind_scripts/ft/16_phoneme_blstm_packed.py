"""BLSTM-CTC phone recogniser (TIMIT-style, 48 training phones folded to 39 for scoring).

Variable-length utterances go through the LSTM as PackedSequences; batches are
grouped by frame count.

    torchrun --nproc_per_node=4 16_phoneme_blstm_packed.py --data data/timit --cmvn data/timit/cmvn.pt \
        --exp exp/blstm_ctc
"""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset, Sampler

FOLD_39 = {"ao": "aa", "ax": "ah", "ax-h": "ah", "axr": "er", "hv": "hh", "ix": "ih", "el": "l", "em": "m",
           "en": "n", "nx": "n", "eng": "ng", "zh": "sh", "ux": "uw", "pcl": "sil", "tcl": "sil", "kcl": "sil",
           "bcl": "sil", "dcl": "sil", "gcl": "sil", "h#": "sil", "pau": "sil", "epi": "sil"}


class TimitSet(Dataset):
    def __init__(self, manifest, phone2id):
        with open(manifest) as f:
            self.utts = [json.loads(l) for l in f]
        self.phone2id = phone2id
        self.frames = [u["num_frames"] for u in self.utts]
        self.mfcc = torchaudio.transforms.MFCC(16000, n_mfcc=13, melkwargs={"n_fft": 400, "hop_length": 160,
                                                                            "n_mels": 40})
        self.deltas = torchaudio.transforms.ComputeDeltas()

    def __len__(self):
        return len(self.utts)

    def __getitem__(self, i):
        u = self.utts[i]
        wav, _ = torchaudio.load(u["wav"])
        m = self.mfcc(wav[0])
        d = self.deltas(m)
        feats = torch.cat([m, d, self.deltas(d)], 0).T  # (T, 39)
        phones = torch.tensor([self.phone2id[p] for p in u["phones"]])
        return feats, phones


def collate(batch):
    feats, phones = zip(*batch)
    return (pad_sequence(feats, batch_first=True), torch.tensor([len(f) for f in feats]),
            pad_sequence(phones, batch_first=True), torch.tensor([len(p) for p in phones]))


class FrameBucketSampler(Sampler):
    def __init__(self, frames, max_frames, replicas, rank, shuffle=True, seed=0, even=True):
        self.frames, self.max_frames = frames, max_frames
        self.replicas, self.rank = replicas, rank
        self.shuffle, self.seed, self.even, self.epoch = shuffle, seed, even, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        order = sorted(range(len(self.frames)), key=lambda i: self.frames[i])
        batches, cur = [], []
        for i in order:
            if cur and self.frames[i] * (len(cur) + 1) > self.max_frames:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(batches)
        if self.even and len(batches) % self.replicas:
            batches += batches[: self.replicas - len(batches) % self.replicas]
        return batches[self.rank::self.replicas]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class BLSTMCTC(nn.Module):
    def __init__(self, n_in, n_out, hidden=320, layers=4, dropout=0.3):
        super().__init__()
        self.lstm = nn.LSTM(n_in, hidden, num_layers=layers, bidirectional=True, batch_first=True, dropout=dropout)
        self.proj = nn.Sequential(nn.Dropout(dropout), nn.Linear(2 * hidden, n_out))

    def forward(self, feats, lens):
        packed = pack_padded_sequence(feats, lens.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, out_lens = pad_packed_sequence(out, batch_first=True, total_length=feats.size(1))
        return self.proj(out).log_softmax(-1), out_lens


def decode(logp, lens):
    res = []
    for row, n in zip(logp.argmax(-1).cpu(), lens.cpu()):
        res.append([t for t in torch.unique_consecutive(row[:n]).tolist() if t != 0])
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--cmvn", required=True, help="global mean/std computed over the training set")
    ap.add_argument("--exp", required=True)
    ap.add_argument("--max-frames", type=int, default=20000)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data, "phones48.txt")) as f:
        phones = [l.strip() for l in f if l.strip()]
    phone2id = {p: i + 1 for i, p in enumerate(phones)}  # 0 = blank
    id2fold = {i + 1: FOLD_39.get(p, p) for i, p in enumerate(phones)}

    train_ds = TimitSet(os.path.join(args.data, "train.jsonl"), phone2id)
    dev_ds = TimitSet(os.path.join(args.data, "dev.jsonl"), phone2id)
    train_sampler = FrameBucketSampler(train_ds.frames, args.max_frames, world, rank, seed=args.seed)
    dev_sampler = FrameBucketSampler(dev_ds.frames, args.max_frames, world, rank, shuffle=False, even=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate, num_workers=4)
    dev_loader = DataLoader(dev_ds, batch_sampler=dev_sampler, collate_fn=collate, num_workers=2)

    stats = torch.load(args.cmvn, map_location="cpu")
    cmvn_mean, cmvn_std = stats["mean"].cuda(), stats["std"].cuda()

    model = BLSTMCTC(39, len(phones) + 1).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=2)

    best_per = 1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for feats, lens, targets, tlens in train_loader:
            feats = (feats.to(device) - cmvn_mean) / cmvn_std
            targets = targets.to(device)
            logp, out_lens = model(feats, lens)
            loss = F.ctc_loss(logp.transpose(0, 1), targets, out_lens, tlens, zero_infinity=True)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 400.0)
            optimizer.step()

        model.eval()
        counts = torch.zeros(2, device=device)
        with torch.no_grad():
            for feats, lens, targets, tlens in dev_loader:
                feats = (feats.to(device) - cmvn_mean) / cmvn_std
                logp, out_lens = model.module(feats, lens)
                for hyp, ref, n in zip(decode(logp, out_lens), targets, tlens):
                    h = [id2fold[t] for t in hyp]
                    r = [id2fold[t] for t in ref[:n].tolist()]
                    counts[0] += torchaudio.functional.edit_distance(h, r)
                    counts[1] += len(r)
        dist.all_reduce(counts)
        per = (counts[0] / counts[1]).item()
        scheduler.step(per)
        if rank == 0:
            print(f"epoch {epoch}: dev PER {100 * per:.2f}%  lr {optimizer.param_groups[0]['lr']:.1e}", flush=True)
            if per < best_per:
                best_per = per
                os.makedirs(args.exp, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "phones": phones, "cmvn": stats},
                           os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
