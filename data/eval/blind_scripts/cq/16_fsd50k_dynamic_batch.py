"""FSD50K tagging on full-length, variable-duration clips (0.3 - 30 s) with duration-bucketed batches.

Instead of cropping everything to 10 s, clips of similar length are batched together so that a batch
holds at most --max-batch-seconds of audio. Model: Cnn14-style, length-agnostic (global pooling).

    torchrun --nproc_per_node=4 16_fsd50k_dynamic_batch.py --root /data/FSD50K --max-batch-seconds 400
"""
import argparse
import math
import os
import random
import time

import numpy as np
import pandas as pd
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchaudio.transforms import AmplitudeToDB, FrequencyMasking, MelSpectrogram, TimeMasking

SR = 22050


class FSDVarLen(Dataset):
    def __init__(self, root, split, vocab):
        gt = os.path.join(root, "FSD50K.ground_truth")
        if split == "eval":
            df, adir = pd.read_csv(os.path.join(gt, "eval.csv")), "FSD50K.eval_audio_22k"
        else:
            df = pd.read_csv(os.path.join(gt, "dev.csv"))
            df, adir = df[df.split == split].reset_index(drop=True), "FSD50K.dev_audio_22k"
        self.paths = [os.path.join(root, adir, f"{f}.wav") for f in df.fname]
        self.durations = np.array([sf.info(p).frames for p in self.paths])
        self.y = np.zeros((len(df), len(vocab)), np.float32)
        for i, labs in enumerate(df.labels):
            self.y[i, [vocab[l] for l in labs.split(",")]] = 1.0

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        wav, _ = sf.read(self.paths[i], dtype="float32")
        return torch.from_numpy(wav), torch.from_numpy(self.y[i]), i


def pad_collate(batch):
    wavs, ys, idx = zip(*batch)
    n = max(w.numel() for w in wavs)
    out = torch.zeros(len(wavs), n)
    for k, w in enumerate(wavs):
        # repeat short clips instead of zero padding
        reps = math.ceil(n / w.numel())
        out[k] = w.repeat(reps)[:n]
    return out, torch.stack(ys), torch.tensor(idx)


class DurationBucketSampler(Sampler):
    """Groups indices of similar duration so that max_len * batch_size <= max_samples."""

    def __init__(self, indices, durations, max_samples, shuffle=True, seed=0):
        self.indices = sorted(indices, key=lambda i: durations[i])
        self.durations, self.max_samples = durations, max_samples
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.batches = self._make_batches()

    def _make_batches(self):
        batches, cur, cur_max = [], [], 0
        for i in self.indices:
            d = self.durations[i]
            if cur and max(cur_max, d) * (len(cur) + 1) > self.max_samples:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(i)
            cur_max = max(cur_max, d)
        if cur:
            batches.append(cur)
        return batches

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = list(range(len(self.batches)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        for b in order:
            yield self.batches[b]

    def __len__(self):
        return len(self.batches)


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True),
                                  nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True))

    def forward(self, x):
        return F.avg_pool2d(self.body(x), 2)


class VarLenCnn(nn.Module):
    def __init__(self, n_classes, n_mels=96):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(n_mels)
        self.blocks = nn.Sequential(Block(1, 64), Block(64, 128), Block(128, 256), Block(256, 512), Block(512, 1024))
        self.fc = nn.Linear(1024, 1024)
        self.out = nn.Linear(1024, n_classes)

    def forward(self, x):                                      # (B, 1, T, M)
        x = self.bn0(x.transpose(1, 3)).transpose(1, 3)
        x = self.blocks(x).mean(3)                             # (B, C, T')
        x = x.amax(2) + x.mean(2)
        return self.out(F.dropout(F.relu(self.fc(F.dropout(x, 0.3, self.training))), 0.3, self.training))


class LogMel(nn.Module):
    def __init__(self, n_mels=96):
        super().__init__()
        self.spec = MelSpectrogram(SR, n_fft=1024, hop_length=256, n_mels=n_mels, f_min=30, f_max=11000)
        self.db = AmplitudeToDB(top_db=None)
        self.aug = nn.Sequential(FrequencyMasking(12, iid_masks=True), TimeMasking(40, iid_masks=True, p=0.2))

    @torch.no_grad()
    def forward(self, wav, augment):
        x = self.db(self.spec(wav)).unsqueeze(1)               # (B, 1, M, T)
        if x.size(-1) < 32:
            x = F.pad(x, (0, 32 - x.size(-1)), mode="replicate")
        if augment:
            x = self.aug(x)
        return x.transpose(2, 3)


@torch.no_grad()
def evaluate(net, frontend, loader, device):
    net.eval()
    P, Y = [], []
    for wav, y, _ in loader:
        P.append(torch.sigmoid(net(frontend(wav.to(device), augment=False))).cpu().numpy())
        Y.append(y.numpy())
    allp = [None] * dist.get_world_size()
    dist.all_gather_object(allp, (np.concatenate(P), np.concatenate(Y)))
    p = np.concatenate([a for a, _ in allp])
    y = np.concatenate([b for _, b in allp])
    return float(average_precision_score(y, p, average="macro"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--max-batch-seconds", type=float, default=400.0)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/fsd50k_varlen")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    vdf = pd.read_csv(os.path.join(args.root, "FSD50K.ground_truth", "vocabulary.csv"), header=None)
    vocab = {l: int(i) for i, l in zip(vdf[0], vdf[1])}
    train_set, val_set = FSDVarLen(args.root, "train", vocab), FSDVarLen(args.root, "val", vocab)
    max_samples = int(args.max_batch_seconds * SR)

    # each rank takes a strided shard of the clips and buckets its own shard by duration
    train_shard = list(range(rank, len(train_set), world))
    train_sampler = DurationBucketSampler(train_shard, train_set.durations, max_samples, shuffle=True, seed=17)
    val_sampler = DurationBucketSampler(list(range(rank, len(val_set), world)), val_set.durations,
                                        max_samples, shuffle=False)
    train_loader = DataLoader(train_set, batch_sampler=train_sampler, collate_fn=pad_collate,
                              num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_set, batch_sampler=val_sampler, collate_fn=pad_collate, num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(VarLenCnn(len(vocab))).to(device)
    model = DDP(model, device_ids=[local_rank])
    frontend = LogMel().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world / 4, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"rank0: {len(train_sampler)} train batches/epoch", flush=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, tot, n = time.time(), 0.0, 0
        for wav, y, _ in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(frontend(wav, augment=True))
            loss = F.binary_cross_entropy_with_logits(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            tot += loss.item()
            n += 1
        sched.step()
        stats = torch.tensor([tot, n], device=device, dtype=torch.float64)
        dist.all_reduce(stats)

        val_map = evaluate(model.module, frontend, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: loss {stats[0].item() / stats[1].item():.4f} val mAP {val_map:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "val_map": val_map}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_map > best:
                best = val_map
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
