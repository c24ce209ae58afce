"""FastSpeech2 with a Conformer encoder/decoder.

torchrun --standalone --nproc_per_node=8 07_fastspeech2_conformer.py --data_dir data/ljspeech_fs2 --exp exp/fs2_conformer
"""
import argparse
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Sampler
from torch.utils.tensorboard import SummaryWriter

from fs2_data import FS2Dataset, fs2_collate, compute_pitch_energy_stats


class ConformerBlock(nn.Module):
    def __init__(self, d, heads, ff_mult=4, kernel=31, dropout=0.1):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d * ff_mult), nn.SiLU(), nn.Dropout(dropout),
                                 nn.Linear(d * ff_mult, d))
        self.attn_norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.conv_norm = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.conv_ln = nn.GroupNorm(1, d)
        self.pw2 = nn.Conv1d(d, d, 1)
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d * ff_mult), nn.SiLU(), nn.Dropout(dropout),
                                 nn.Linear(d * ff_mult, d))
        self.out_norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        x = x + 0.5 * self.drop(self.ff1(x))
        h = self.attn_norm(x)
        h, _ = self.attn(h, h, h, key_padding_mask=pad_mask, need_weights=False)
        x = x + self.drop(h)
        h = self.conv_norm(x).masked_fill(pad_mask.unsqueeze(-1), 0.0).transpose(1, 2)
        h = F.glu(self.pw1(h), dim=1)
        h = self.pw2(F.silu(self.conv_ln(self.dw(h)))).transpose(1, 2)
        x = x + self.drop(h)
        x = x + 0.5 * self.drop(self.ff2(x))
        return self.out_norm(x)


class ConformerStack(nn.Module):
    def __init__(self, d, heads, layers, grad_ckpt=False):
        super().__init__()
        self.blocks = nn.ModuleList([ConformerBlock(d, heads) for _ in range(layers)])
        self.grad_ckpt = grad_ckpt

    def forward(self, x, pad_mask):
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, pad_mask, use_reentrant=False)
            else:
                x = blk(x, pad_mask)
        return x


class VariancePredictor(nn.Module):
    def __init__(self, d, k=3, dropout=0.5):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(d, d, k, padding=k // 2), nn.ReLU(), nn.BatchNorm1d(d), nn.Dropout(dropout),
                                 nn.Conv1d(d, d, k, padding=k // 2), nn.ReLU(), nn.BatchNorm1d(d), nn.Dropout(dropout))
        self.proj = nn.Linear(d, 1)

    def forward(self, x, pad_mask):
        y = self.proj(self.net(x.transpose(1, 2)).transpose(1, 2)).squeeze(-1)
        return y.masked_fill(pad_mask, 0.0)


class FastSpeech2(nn.Module):
    def __init__(self, n_vocab, n_mels=80, d=384, heads=2, enc_layers=4, dec_layers=4, n_bins=256, grad_ckpt=False):
        super().__init__()
        self.emb = nn.Embedding(n_vocab, d, padding_idx=0)
        self.encoder = ConformerStack(d, heads, enc_layers, grad_ckpt)
        self.decoder = ConformerStack(d, heads, dec_layers, grad_ckpt)
        self.dur = VariancePredictor(d)
        self.pitch = VariancePredictor(d)
        self.energy = VariancePredictor(d)
        self.pitch_emb = nn.Embedding(n_bins, d)
        self.energy_emb = nn.Embedding(n_bins, d)
        self.register_buffer("bins", torch.linspace(-4.0, 4.0, n_bins - 1))
        self.mel_out = nn.Linear(d, n_mels)

    def forward(self, tokens, src_mask, durations, pitch, energy, mel_mask):
        x = self.encoder(self.emb(tokens), src_mask)
        log_d = self.dur(x, src_mask)
        p_hat, e_hat = self.pitch(x, src_mask), self.energy(x, src_mask)
        x = x + self.pitch_emb(torch.bucketize(pitch, self.bins)) + self.energy_emb(torch.bucketize(energy, self.bins))
        T = mel_mask.size(1)
        x = torch.stack([F.pad(torch.repeat_interleave(xi, di, dim=0), (0, 0, 0, T - int(di.sum())))
                         for xi, di in zip(x, durations)])
        mel = self.mel_out(self.decoder(x, mel_mask))
        return mel, log_d, p_hat, e_hat


class DistributedBucketBatchSampler(Sampler):
    """Length-bucketed batches built identically on every rank, then dealt out round-robin.
    The batch list is padded so every rank gets the same number of batches."""

    def __init__(self, lengths, batch_size, rank, world_size, bucket_mult=50, seed=0):
        self.lengths, self.bs = np.asarray(lengths), batch_size
        self.rank, self.world = rank, world_size
        self.bucket = batch_size * bucket_mult
        self.seed, self.epoch = seed, 0
        n_batches = math.ceil(len(lengths) / batch_size)
        self.per_rank = math.ceil(n_batches / world_size)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        idx = rng.permutation(len(self.lengths))
        batches = []
        for s in range(0, len(idx), self.bucket):
            chunk = idx[s:s + self.bucket]
            chunk = chunk[np.argsort(self.lengths[chunk])]
            batches += [chunk[i:i + self.bs].tolist() for i in range(0, len(chunk), self.bs)]
        rng.shuffle(batches)
        total = self.per_rank * self.world
        batches += batches[:total - len(batches)]
        return iter(batches[self.rank:total:self.world])

    def __len__(self):
        return self.per_rank


def losses(out, batch):
    mel, log_d, p_hat, e_hat = out
    keep_mel, keep_src = ~batch["mel_mask"], ~batch["src_mask"]
    l_mel = F.l1_loss(mel[keep_mel], batch["mel"][keep_mel])
    l_dur = F.mse_loss(log_d[keep_src], torch.log1p(batch["durations"].float())[keep_src])
    l_pitch = F.mse_loss(p_hat[keep_src], batch["pitch"][keep_src])
    l_energy = F.mse_loss(e_hat[keep_src], batch["energy"][keep_src])
    return l_mel + l_dur + l_pitch + l_energy, torch.stack([l_mel, l_dur, l_pitch, l_energy]).detach()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--batch_size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--grad_ckpt", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    stats_path = os.path.join(args.data_dir, "stats.json")
    if rank == 0 and not os.path.exists(stats_path):
        stats = compute_pitch_energy_stats(args.data_dir)
        with open(stats_path + ".tmp", "w") as f:
            json.dump(stats, f)
        os.replace(stats_path + ".tmp", stats_path)
    dist.barrier()
    with open(stats_path) as f:
        stats = json.load(f)

    train_set = FS2Dataset(os.path.join(args.data_dir, "train.txt"), stats)
    val_set = FS2Dataset(os.path.join(args.data_dir, "val.txt"), stats)
    batch_sampler = DistributedBucketBatchSampler(train_set.mel_lengths, args.batch_size, rank, world, seed=1234)
    train_loader = DataLoader(train_set, batch_sampler=batch_sampler, collate_fn=fs2_collate, num_workers=6,
                              pin_memory=True, persistent_workers=True)
    val_shard = torch.utils.data.Subset(val_set, list(range(rank, len(val_set), world)))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, collate_fn=fs2_collate, num_workers=2)

    torch.manual_seed(1234)
    model = FastSpeech2(train_set.n_vocab, grad_ckpt=args.grad_ckpt).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, (args.warmup / (s + 1)) ** 0.5))

    os.makedirs(args.exp, exist_ok=True)
    ckpt_path = os.path.join(args.exp, "last.pt")
    step, epoch = 0, 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        step, epoch = ckpt["step"], ckpt["epoch"]
    writer = SummaryWriter(os.path.join(args.exp, "tb")) if rank == 0 else None

    while step < args.steps:
        batch_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(batch["tokens"], batch["src_mask"], batch["durations"], batch["pitch"], batch["energy"],
                        batch["mel_mask"])
            loss, parts = losses(out, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                for name, v in zip(["mel", "dur", "pitch", "energy"], parts.tolist()):
                    writer.add_scalar(f"train/{name}", v, step)
                writer.add_scalar("train/grad_norm", gnorm.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

            if step % 5000 == 0:
                model.eval()
                sums = torch.zeros(5, device=device)
                with torch.no_grad():
                    for vb in val_loader:
                        vb = {k: v.to(device) for k, v in vb.items()}
                        _, vparts = losses(model.module(vb["tokens"], vb["src_mask"], vb["durations"], vb["pitch"],
                                                        vb["energy"], vb["mel_mask"]), vb)
                        n = vb["tokens"].size(0)
                        sums[:4] += vparts * n
                        sums[4] += n
                dist.all_reduce(sums)
                model.train()
                if rank == 0:
                    for name, v in zip(["mel", "dur", "pitch", "energy"], (sums[:4] / sums[4]).tolist()):
                        writer.add_scalar(f"val/{name}", v, step)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step, "epoch": epoch}, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
