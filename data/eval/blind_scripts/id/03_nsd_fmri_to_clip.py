"""Map NSD single-trial betas (nsdgeneral ROI) to CLIP image embeddings.

A residual MLP regresses the CLIP ViT-L/14 image embedding of the seen image
from the voxel pattern; loss = MSE + symmetric InfoNCE.  Evaluation reports
top-1 two-way identification on the shared 1000 test images.

Inputs (per subject):
    betas/subj0X/betas_session{01..40}.nii.gz   (NSD release, 1.8 mm func)
    rois/subj0X/nsdgeneral.nii.gz
    stim/subj0X_trials.csv                       session, trial, nsd_id, split
    clip/nsd_clip_vitl14.npy                     (73000, 768)
"""
import argparse
import logging
import os
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("nsd2clip")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--nsd_root", default="/datasets/nsd")
    p.add_argument("--cache", default="/datasets/nsd/cache")
    p.add_argument("--subject", type=int, default=1)
    p.add_argument("--sessions", type=int, default=40)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--n_blocks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--tau", type=float, default=0.05)
    p.add_argument("--mse_w", type=float, default=1.0)
    p.add_argument("--save_dir", default="ckpt/nsd2clip")
    return p.parse_args()


def load_session_betas(root, subj, ses, mask):
    img = nib.load(f"{root}/betas/subj{subj:02d}/betas_session{ses:02d}.nii.gz")
    data = np.asanyarray(img.dataobj)  # (X, Y, Z, 750) int16, scaled by 300
    betas = data[mask].T.astype(np.float32) / 300.0
    # z-score every voxel within the session, as recommended for NSD betas
    betas = (betas - betas.mean(0)) / (betas.std(0) + 1e-6)
    return betas


def prepare_cache(args):
    """Mask and z-score all sessions once; store as a float16 memmap."""
    cache = Path(args.cache) / f"subj{args.subject:02d}_nsdgeneral_{args.sessions}ses.npy"
    if cache.exists():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    roi = nib.load(f"{args.nsd_root}/rois/subj{args.subject:02d}/nsdgeneral.nii.gz").get_fdata()
    mask = roi > 0
    n_vox = int(mask.sum())
    out = np.lib.format.open_memmap(cache, mode="w+", dtype=np.float16,
                                    shape=(args.sessions * 750, n_vox))
    for ses in range(1, args.sessions + 1):
        out[(ses - 1) * 750: ses * 750] = load_session_betas(args.nsd_root, args.subject, ses, mask)
        log.info("cached session %d / %d", ses, args.sessions)
    out.flush()
    del out
    return cache


class NSDTrials(Dataset):
    def __init__(self, beta_path, trials, clip_emb):
        self.betas = np.load(beta_path, mmap_mode="r")
        self.rows = trials["row"].to_numpy()
        self.nsd_ids = trials["nsd_id"].to_numpy()
        self.clip = clip_emb

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        x = torch.from_numpy(np.asarray(self.betas[self.rows[i]], dtype=np.float32))
        y = torch.from_numpy(self.clip[self.nsd_ids[i]].astype(np.float32))
        return x, y


class ResMLP(nn.Module):
    def __init__(self, n_in, hidden, n_out, n_blocks, p=0.15):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(n_in, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(0.5))
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(p))
            for _ in range(n_blocks)
        ])
        self.out = nn.Linear(hidden, n_out)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = h + blk(h)
        return self.out(h)


def clip_loss(pred, target, tau):
    pred = F.normalize(pred, dim=-1)
    target = F.normalize(target, dim=-1)
    logits = pred @ target.t() / tau
    labels = torch.arange(len(pred), device=pred.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


@torch.no_grad()
def two_way_identification(model, loader, device):
    model.eval()
    preds, targets = [], []
    for x, y in loader:
        preds.append(model(x.to(device)).float())
        targets.append(y.to(device))
    p = F.normalize(torch.cat(preds), dim=-1)
    t = F.normalize(torch.cat(targets), dim=-1)
    sim = p @ t.t()
    correct = (sim.diag()[:, None] > sim).float().sum(1) / (len(sim) - 1)
    return correct.mean().item()


def main():
    args = parse()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    if rank != 0:
        log.setLevel(logging.WARNING)

    beta_path = prepare_cache(args)

    trials = pd.read_csv(f"{args.nsd_root}/stim/subj{args.subject:02d}_trials.csv")
    trials = trials[trials.session <= args.sessions].copy()
    trials["row"] = (trials.session - 1) * 750 + (trials.trial - 1)
    clip_emb = np.load(f"{args.nsd_root}/clip/nsd_clip_vitl14.npy", mmap_mode="r")

    train_ds = NSDTrials(beta_path, trials[trials.split == "train"], clip_emb)
    # test: first presentation of each shared image
    test_trials = trials[trials.split == "test"].groupby("nsd_id").head(1)
    test_ds = NSDTrials(beta_path, test_trials, clip_emb)

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=300, shuffle=False, num_workers=4)

    n_vox = train_ds[0][0].numel()
    model = ResMLP(n_vox, args.hidden, clip_emb.shape[1], args.n_blocks).to(device)
    model = DDP(model, device_ids=[local_rank])
    log.info("voxels=%d train=%d test=%d", n_vox, len(train_ds), len(test_ds))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=2 / args.epochs)

    Path(args.save_dir).mkdir(parents=True, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            pred = pred.float()
            loss = clip_loss(pred, y, args.tau) + args.mse_w * F.mse_loss(pred, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        if rank == 0:
            acc = two_way_identification(model.module, test_dl, device)
            log.info("epoch %d loss %.4f 2-way id %.4f", epoch, loss.item(), acc)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc,
                            "args": vars(args)}, f"{args.save_dir}/subj{args.subject:02d}_best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
