"""SepFormer (speechbrain building blocks) on Libri2Mix clean, fp16 autocast, DDP.

torchrun --standalone --nproc_per_node=8 09_sepformer_libri2mix_amp.py \
    --train_csv /data/Libri2Mix/wav8k/min/metadata/mixture_train-360_mix_clean.csv \
    --valid_csv /data/Libri2Mix/wav8k/min/metadata/mixture_dev_mix_clean.csv \
    --resume exp/sepformer_l2m/last.pt
"""
import argparse
import csv
import itertools
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from speechbrain.lobes.models.dual_path import Decoder, Dual_Path_Model, Encoder, SBTransformerBlock
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class Libri2Mix(Dataset):
    def __init__(self, csv_file, max_len=None):
        with open(csv_file) as f:
            self.rows = list(csv.DictReader(f))
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        r = self.rows[idx]
        n = int(r["length"])
        a, b = 0, n
        if self.max_len and n > self.max_len:
            a = random.randint(0, n - self.max_len)
            b = a + self.max_len
        mix = sf.read(r["mixture_path"], start=a, stop=b, dtype="float32")[0]
        src = np.stack([sf.read(r[f"source_{i}_path"], start=a, stop=b, dtype="float32")[0] for i in (1, 2)])
        return torch.from_numpy(mix), torch.from_numpy(src)


def collate_pad(batch):
    n = max(m.shape[-1] for m, _ in batch)
    mix = torch.stack([F.pad(m, (0, n - m.shape[-1])) for m, _ in batch])
    src = torch.stack([F.pad(s, (0, n - s.shape[-1])) for _, s in batch])
    return mix, src


class SepFormer(nn.Module):
    def __init__(self, n_src=2, N=256, kernel=16, K=250, layers=8, nhead=8, d_ffn=1024):
        super().__init__()
        self.n_src = n_src

        def tf_block():
            return SBTransformerBlock(num_layers=layers, d_model=N, nhead=nhead, d_ffn=d_ffn, dropout=0.0,
                                      use_positional_encoding=True, norm_before=True)

        self.encoder = Encoder(kernel_size=kernel, out_channels=N)
        self.masknet = Dual_Path_Model(in_channels=N, out_channels=N, intra_model=tf_block(), inter_model=tf_block(),
                                       num_layers=2, norm="ln", K=K, num_spks=n_src, skip_around_intra=True,
                                       linear_layer_after_inter_intra=False)
        self.decoder = Decoder(in_channels=N, out_channels=1, kernel_size=kernel, stride=kernel // 2, bias=False)

    def forward(self, mix):
        w = self.encoder(mix)
        masks = self.masknet(w)
        est = torch.stack([self.decoder(w * masks[i]) for i in range(self.n_src)], dim=1)
        T = mix.size(-1)
        return F.pad(est, (0, max(0, T - est.size(-1))))[..., :T]


def si_snr(est, ref, eps=1e-8):
    est, ref = est - est.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    proj = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True) + eps)
    return 10 * torch.log10(proj.pow(2).sum(-1) / ((est - proj).pow(2).sum(-1) + eps) + eps)


def pit_si_snr(est, ref):
    pair = si_snr(est.unsqueeze(2), ref.unsqueeze(1))
    r = torch.arange(est.size(1), device=est.device)
    return torch.stack([pair[:, r, list(p)].mean(-1) for p in itertools.permutations(range(est.size(1)))]).max(0).values


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train_csv", required=True)
    p.add_argument("--valid_csv", required=True)
    p.add_argument("--exp", default="exp/sepformer_l2m")
    p.add_argument("--resume", default=None)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--max_len_s", type=float, default=4.0)
    p.add_argument("--loss_floor", type=float, default=-30.0)
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)

    train_set = Libri2Mix(args.train_csv, max_len=int(args.max_len_s * 8000))
    valid_set = Libri2Mix(args.valid_csv)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True,
                              drop_last=True, collate_fn=collate_pad)
    valid_loader = DataLoader(Subset(valid_set, list(range(rank, len(valid_set), world))), batch_size=1,
                              num_workers=2)

    model = SepFormer().to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.cuda.amp.GradScaler()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2)
    start_epoch, best = 0, -float("inf")
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        plateau.load_state_dict(ckpt["plateau"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed {args.resume} at epoch {start_epoch}", flush=True)
    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stat = torch.zeros(2, device=dev)
        for mix, src in train_loader:
            mix, src = mix.to(dev, non_blocking=True), src.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                est = model(mix)
            per_example = -pit_si_snr(est.float(), src)
            keep = per_example[per_example > args.loss_floor]
            loss = keep.mean() if keep.numel() > 0 else per_example.mean()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            stat += torch.stack([loss.detach(), torch.ones((), device=dev)])

        model.eval()
        val = torch.zeros(2, device=dev, dtype=torch.float64)
        with torch.no_grad():
            for mix, src in valid_loader:
                mix, src = mix.to(dev), src.to(dev)
                with torch.autocast("cuda", dtype=torch.float16):
                    est = model.module(mix)
                gain = pit_si_snr(est.float(), src) - pit_si_snr(mix.unsqueeze(1).expand_as(src), src)
                val += torch.stack([gain.sum().double(), torch.tensor(1.0, device=dev, dtype=torch.float64)])
        dist.all_reduce(stat)
        dist.all_reduce(val)
        sisnri = (val[0] / val[1]).item()
        plateau.step(sisnri)

        if rank == 0:
            print(f"epoch {epoch} train {(stat[0] / stat[1]).item():.3f} valid SI-SNRi {sisnri:.2f} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} ({time.time() - t0:.0f}s)", flush=True)
            best = max(best, sisnri)
            ck = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                  "scaler": scaler.state_dict(), "plateau": plateau.state_dict(), "epoch": epoch, "best": best}
            torch.save(ck, os.path.join(args.exp, "last.pt"))
            if best == sisnri:
                torch.save(ck, os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
