"""FastSpeech2-style acoustic model (phonemes -> 80-bin mel) with a length-bucketed distributed sampler.

Data is preprocessed into <root>/{mel,duration,pitch,energy}/<utt>.npy and <root>/train.txt
("utt|speaker|phoneme ids separated by spaces|raw text").

torchrun --nproc_per_node=4 13_fastspeech2_bucket.py --root preprocessed/LJSpeech --out runs/fs2_lj
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class TTSDataset(Dataset):
    def __init__(self, root, split):
        self.root = root
        with open(os.path.join(root, f"{split}.txt"), encoding="utf-8") as f:
            self.meta = [l.rstrip("\n").split("|") for l in f if l.strip()]
        self.lengths = [os.path.getsize(os.path.join(root, "mel", f"{m[0]}.npy")) // (4 * 80) for m in self.meta]

    def __len__(self):
        return len(self.meta)

    def _load(self, kind, utt):
        return torch.from_numpy(np.load(os.path.join(self.root, kind, f"{utt}.npy")))

    def __getitem__(self, i):
        utt, spk, phones, _ = self.meta[i]
        return {"phones": torch.tensor([int(p) for p in phones.split()]), "mel": self._load("mel", utt).float(),
                "dur": self._load("duration", utt).long(), "pitch": self._load("pitch", utt).float(),
                "energy": self._load("energy", utt).float()}


def collate(batch):
    out = {}
    for k in batch[0]:
        out[k] = nn.utils.rnn.pad_sequence([b[k] for b in batch], batch_first=True)
    out["src_len"] = torch.tensor([len(b["phones"]) for b in batch])
    out["mel_len"] = torch.tensor([len(b["mel"]) for b in batch])
    return out


class DistributedBucketSampler(DistributedSampler):
    """Batches of similar mel length; each rank gets the same number of batches."""

    def __init__(self, dataset, batch_size, boundaries, num_replicas=None, rank=None, shuffle=True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle)
        self.lengths = dataset.lengths
        self.batch_size = batch_size
        self.boundaries = list(boundaries)
        self.buckets = [[] for _ in range(len(self.boundaries) - 1)]
        for i, L in enumerate(self.lengths):
            for b in range(len(self.boundaries) - 1):
                if self.boundaries[b] < L <= self.boundaries[b + 1]:
                    self.buckets[b].append(i)
                    break
        self.buckets = [b for b in self.buckets if b]
        per_step = self.num_replicas * self.batch_size
        self.num_samples_per_bucket = [len(b) + (per_step - len(b) % per_step) % per_step for b in self.buckets]
        self.total_size = sum(self.num_samples_per_bucket)
        self.num_samples = self.total_size // self.num_replicas

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        batches = []
        for bucket, n in zip(self.buckets, self.num_samples_per_bucket):
            ids = torch.randperm(len(bucket), generator=g).tolist() if self.shuffle else list(range(len(bucket)))
            rem = n - len(bucket)
            ids = ids + ids * (rem // len(bucket)) + ids[: rem % len(bucket)]
            ids = ids[self.rank::self.num_replicas]
            for j in range(len(ids) // self.batch_size):
                batches.append([bucket[k] for k in ids[j * self.batch_size:(j + 1) * self.batch_size]])
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        return iter(batches)

    def __len__(self):
        return self.num_samples // self.batch_size


class FFTBlock(nn.Module):
    def __init__(self, d, heads, conv_dim, k=9, p=0.1):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.conv = nn.Sequential(nn.Conv1d(d, conv_dim, k, padding=k // 2), nn.ReLU(), nn.Conv1d(conv_dim, d, 1))
        self.drop = nn.Dropout(p)

    def forward(self, x, pad_mask):
        x = self.ln1(x + self.drop(self.attn(x, x, x, key_padding_mask=pad_mask, need_weights=False)[0]))
        x = x.masked_fill(pad_mask[..., None], 0)
        x = self.ln2(x + self.drop(self.conv(x.transpose(1, 2)).transpose(1, 2)))
        return x.masked_fill(pad_mask[..., None], 0)


class VariancePredictor(nn.Module):
    def __init__(self, d, hid=256, k=3, p=0.5):
        super().__init__()
        self.c1, self.c2 = nn.Conv1d(d, hid, k, padding=1), nn.Conv1d(hid, hid, k, padding=1)
        self.ln1, self.ln2 = nn.LayerNorm(hid), nn.LayerNorm(hid)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(hid, 1)

    def forward(self, x, mask):
        x = self.drop(self.ln1(F.relu(self.c1(x.transpose(1, 2))).transpose(1, 2)))
        x = self.drop(self.ln2(F.relu(self.c2(x.transpose(1, 2))).transpose(1, 2)))
        return self.out(x).squeeze(-1).masked_fill(mask, 0.0)


def length_regulate(x, dur, max_len):
    out = [torch.repeat_interleave(xi, di, dim=0) for xi, di in zip(x, dur)]
    out = nn.utils.rnn.pad_sequence(out, batch_first=True)
    return out[:, :max_len] if out.size(1) >= max_len else F.pad(out, (0, 0, 0, max_len - out.size(1)))


class FastSpeech2(nn.Module):
    def __init__(self, n_phones=100, d=256, layers=4, heads=2, n_mels=80, n_bins=256):
        super().__init__()
        self.emb = nn.Embedding(n_phones, d, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(1, 2000, d) * 0.02)
        self.encoder = nn.ModuleList([FFTBlock(d, heads, 1024) for _ in range(layers)])
        self.decoder = nn.ModuleList([FFTBlock(d, heads, 1024) for _ in range(layers + 2)])
        self.dur_pred, self.pitch_pred, self.energy_pred = (VariancePredictor(d) for _ in range(3))
        self.register_buffer("bins", torch.linspace(-3.0, 5.0, n_bins - 1))
        self.pitch_emb, self.energy_emb = nn.Embedding(n_bins, d), nn.Embedding(n_bins, d)
        self.mel_out = nn.Linear(d, n_mels)

    def forward(self, phones, src_len, dur, pitch, energy, mel_len):
        src_mask = torch.arange(phones.size(1), device=phones.device)[None] >= src_len[:, None]
        x = self.emb(phones) + self.pos[:, : phones.size(1)]
        for blk in self.encoder:
            x = blk(x, src_mask)
        log_dur = self.dur_pred(x, src_mask)
        p_hat, e_hat = self.pitch_pred(x, src_mask), self.energy_pred(x, src_mask)
        x = x + self.pitch_emb(torch.bucketize(pitch, self.bins)) + self.energy_emb(torch.bucketize(energy, self.bins))
        T = int(mel_len.max())
        x = length_regulate(x, dur, T)
        mel_mask = torch.arange(T, device=x.device)[None] >= mel_len[:, None]
        x = x + self.pos[:, :T]
        for blk in self.decoder:
            x = blk(x, mel_mask)
        return self.mel_out(x), log_dur, p_hat, e_hat, src_mask, mel_mask


def fs2_loss(out, batch):
    mel_hat, log_dur, p_hat, e_hat, src_mask, mel_mask = out
    keep_m, keep_s = ~mel_mask, ~src_mask
    mel_l = F.l1_loss(mel_hat[keep_m], batch["mel"][keep_m])
    dur_l = F.mse_loss(log_dur[keep_s], torch.log(batch["dur"].float() + 1)[keep_s])
    p_l = F.mse_loss(p_hat[keep_s], batch["pitch"][keep_s])
    e_l = F.mse_loss(e_hat[keep_s], batch["energy"][keep_s])
    return mel_l + dur_l + p_l + e_l, (mel_l, dur_l, p_l, e_l)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--max_steps", type=int, default=300000)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--val_every", type=int, default=2000)
    ap.add_argument("--save_every", type=int, default=10000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_set, val_set = TTSDataset(args.root, "train"), TTSDataset(args.root, "val")
    sampler = DistributedBucketSampler(train_set, args.batch_size, [32, 300, 400, 500, 600, 700, 800, 900, 1000, 1200],
                                       num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_sampler=sampler, collate_fn=collate, num_workers=8, pin_memory=True)

    model = DDP(FastSpeech2().to(device), device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: 256 ** -0.5 * min((s + 1) ** -0.5, (s + 1) * args.warmup ** -1.5))

    step, epoch = 0, 0
    ckpt_path = os.path.join(args.out, "latest.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optim.load_state_dict(ck["optim"])
        sched.load_state_dict(ck["sched"])
        step, epoch = ck["step"], ck["epoch"]

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "logs"))
        val_loader = DataLoader(val_set, batch_size=8, collate_fn=collate, num_workers=2)

    model.train()
    while step < args.max_steps:
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(batch["phones"], batch["src_len"], batch["dur"], batch["pitch"], batch["energy"],
                        batch["mel_len"])
            loss, parts = fs2_loss(out, batch)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                for name, v in zip(("mel", "dur", "pitch", "energy"), parts):
                    writer.add_scalar(f"train/{name}", v.item(), step)
                writer.add_scalar("train/grad_norm", grad_norm.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
            if rank == 0 and step % args.val_every == 0:
                net = model.module
                net.eval()
                tot, n = 0.0, 0
                with torch.no_grad():
                    for vb in val_loader:
                        vb = {k: v.to(device) for k, v in vb.items()}
                        vl, _ = fs2_loss(net(vb["phones"], vb["src_len"], vb["dur"], vb["pitch"], vb["energy"],
                                             vb["mel_len"]), vb)
                        tot += vl.item() * vb["phones"].size(0)
                        n += vb["phones"].size(0)
                writer.add_scalar("val/loss", tot / n, step)
                print(f"step {step} epoch {epoch} train {loss.item():.4f} val {tot / n:.4f}", flush=True)
                net.train()
            if rank == 0 and step % args.save_every == 0:
                torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                            "sched": sched.state_dict(), "step": step, "epoch": epoch}, ckpt_path)
            if step >= args.max_steps:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
