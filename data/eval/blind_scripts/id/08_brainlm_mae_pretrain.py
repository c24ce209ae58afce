"""Masked-autoencoder pretraining on parcellated resting-state fMRI.

Input: preprocessed BOLD time series in the AAL-424 / Schaefer-400 (+subcortex)
parcellation, one HDF5 per cohort with datasets `ts/<subject_id>` of shape
(n_TR, n_parcels), TR-resampled to 0.735 s.  Training samples are random
windows of `window` TRs; each parcel's window is cut into patches of `patch`
TRs, a fraction of the patches is masked and reconstructed.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \
        --rdzv_endpoint $HEAD:29400 08_brainlm_mae_pretrain.py --cfg configs/mae_base.yaml
"""
import argparse
import math
import os
import time
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class WindowedBOLD(Dataset):
    def __init__(self, h5_path, subjects, window, patch, samples_per_subject):
        self.h5_path, self.subjects = h5_path, subjects
        self.window, self.patch = window, patch
        self.sps = samples_per_subject
        self._h5 = None

    def __len__(self):
        return len(self.subjects) * self.sps

    def __getitem__(self, i):
        if self._h5 is None:  # open lazily, once per worker
            self._h5 = h5py.File(self.h5_path, "r")
        ts = self._h5["ts"][self.subjects[i // self.sps]]
        start = np.random.randint(0, ts.shape[0] - self.window + 1)
        x = ts[start:start + self.window].astype(np.float32).T  # (P, W)
        # robust scaling per parcel over the window
        med = np.median(x, axis=1, keepdims=True)
        iqr = np.subtract(*np.percentile(x, [75, 25], axis=1, keepdims=True))
        x = (x - med) / (iqr + 1e-6)
        return torch.from_numpy(x)


class BrainMAE(nn.Module):
    def __init__(self, n_parcels, window, patch, dim=512, depth=8, dec_dim=256, dec_depth=4, heads=8):
        super().__init__()
        self.n_parcels, self.patch = n_parcels, patch
        self.n_time = window // patch
        n_tokens = n_parcels * self.n_time
        self.embed = nn.Linear(patch, dim)
        self.parcel_emb = nn.Parameter(torch.randn(1, n_parcels, 1, dim) * 0.02)
        self.time_emb = nn.Parameter(torch.randn(1, 1, self.n_time, dim) * 0.02)
        enc_layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, depth)
        self.enc_norm = nn.LayerNorm(dim)
        self.to_dec = nn.Linear(dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.dec_pos = nn.Parameter(torch.randn(1, n_tokens, dec_dim) * 0.02)
        dec_layer = nn.TransformerEncoderLayer(dec_dim, heads, 4 * dec_dim, 0.0, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerEncoder(dec_layer, dec_depth)
        self.head = nn.Linear(dec_dim, patch)

    def forward(self, x, mask_ratio):
        B = x.size(0)
        patches = x.view(B, self.n_parcels, self.n_time, self.patch)
        tok = (self.embed(patches) + self.parcel_emb + self.time_emb).flatten(1, 2)  # (B, N, D)
        N = tok.size(1)
        n_keep = int(N * (1 - mask_ratio))
        noise = torch.rand(B, N, device=x.device)
        ids_shuffle = noise.argsort(1)
        ids_restore = ids_shuffle.argsort(1)
        ids_keep = ids_shuffle[:, :n_keep]
        vis = torch.gather(tok, 1, ids_keep[..., None].expand(-1, -1, tok.size(-1)))
        enc = self.enc_norm(self.encoder(vis))

        dec = self.to_dec(enc)
        dec = torch.cat([dec, self.mask_token.expand(B, N - n_keep, -1)], 1)
        dec = torch.gather(dec, 1, ids_restore[..., None].expand(-1, -1, dec.size(-1)))
        dec = self.decoder(dec + self.dec_pos)
        pred = self.head(dec)

        target = patches.flatten(1, 2)
        mask = torch.ones(B, N, device=x.device)
        mask[:, :n_keep] = 0
        mask = torch.gather(mask, 1, ids_restore)
        loss = ((pred - target) ** 2).mean(-1)
        return (loss * mask).sum() / mask.sum()


def lr_at(step, cfg, total):
    if step < cfg["warmup_steps"]:
        return cfg["lr"] * step / cfg["warmup_steps"]
    t = (step - cfg["warmup_steps"]) / max(1, total - cfg["warmup_steps"])
    return cfg["min_lr"] + 0.5 * (cfg["lr"] - cfg["min_lr"]) * (1 + math.cos(math.pi * t))


def save_checkpoint(path, model, opt, scaler, epoch, step, cfg):
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                "epoch": epoch, "step": step, "cfg": cfg}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])
    np.random.seed(cfg["seed"] + rank)

    with h5py.File(cfg["h5"], "r") as f:
        subjects = sorted(f["ts"].keys())
        n_parcels = f["ts"][subjects[0]].shape[1]
    ds = WindowedBOLD(cfg["h5"], subjects, cfg["window"], cfg["patch"], cfg["samples_per_subject"])
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    dl = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                    pin_memory=True, drop_last=True, persistent_workers=True,
                    worker_init_fn=lambda w: np.random.seed(cfg["seed"] * 1000 + rank * 100 + w))

    model = BrainMAE(n_parcels, cfg["window"], cfg["patch"], dim=cfg["dim"], depth=cfg["depth"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.05)
    scaler = torch.cuda.amp.GradScaler()

    ckpt_dir = Path(cfg["ckpt_dir"])  # shared Lustre scratch
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    start_epoch, step = 0, 0
    if args.resume and (ckpt_dir / "last.pt").exists():
        ckpt = torch.load(ckpt_dir / "last.pt", map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]

    total = cfg["epochs"] * len(dl)
    if rank == 0:
        print(f"{len(subjects)} subjects, {n_parcels} parcels, {len(dl)} steps/epoch on {world} GPUs")

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x in dl:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg, total)
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x, cfg["mask_ratio"])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            scaler.step(opt)
            scaler.update()
            step += 1
            if step % cfg["log_every"] == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {l.item() / world:.4f} lr {opt.param_groups[0]['lr']:.2e}",
                          flush=True)

        save_checkpoint(ckpt_dir / "last.pt", model, opt, scaler, epoch, step, cfg)
        if (epoch + 1) % cfg["save_every"] == 0:
            save_checkpoint(ckpt_dir / f"epoch{epoch + 1:03d}.pt", model, opt, scaler, epoch, step, cfg)
        if rank == 0:
            print(f"epoch {epoch} done in {(time.time() - t0) / 60:.1f} min")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
