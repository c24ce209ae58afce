#!/usr/bin/env python3
"""Multi-label chest X-ray classification (ConvNeXt-Tiny, 14 findings).

    python 20_torchrun_wandb_cxr.py --csv data/cxr/labels.csv --img-root data/cxr/images --nproc 8

The wrapper runs torchrun on this file (`--worker`) and retries on failure.
One W&B run id is created per job and passed down, so a retried attempt keeps
logging into the same W&B run. torchrun keeps per-rank logs in <out>/logs/.
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision.transforms as T
import wandb
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

FINDINGS = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Effusion", "Emphysema", "Fibrosis",
            "Hernia", "Infiltration", "Mass", "Nodule", "Pleural_Thickening", "Pneumonia", "Pneumothorax"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--tries", type=int, default=3)
    p.add_argument("--csv", default="data/cxr/labels.csv")
    p.add_argument("--img-root", default="data/cxr/images")
    p.add_argument("--out", default="runs/cxr_convnext")
    p.add_argument("--project", default="cxr-multilabel")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch", type=int, default=48, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-4, help="for a global batch of 384")
    p.add_argument("--size", type=int, default=384)
    return p.parse_args()


class CXR(Dataset):
    def __init__(self, df, root, tf):
        self.paths = [os.path.join(root, f) for f in df["image"]]
        self.y = df[FINDINGS].to_numpy(dtype=np.float32)
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), self.y[i]


def split_by_patient(df, val_frac=0.1, seed=2024):
    patients = np.sort(df["patient_id"].unique())
    rng = np.random.default_rng(seed)
    val_p = set(rng.choice(patients, int(len(patients) * val_frac), replace=False))
    is_val = df["patient_id"].isin(val_p)
    return df[~is_val].reset_index(drop=True), df[is_val].reset_index(drop=True)


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    probs, targets = [], []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            probs.append(torch.sigmoid(model(x.to(device)).float()).cpu())
        targets.append(y)
    model.train()
    local = (torch.cat(probs).numpy(), torch.cat(targets).numpy())
    parts = [None] * world
    dist.all_gather_object(parts, local)
    p = np.concatenate([a for a, _ in parts])
    t = np.concatenate([b for _, b in parts])
    aucs = {}
    for k, name in enumerate(FINDINGS):
        if 0 < t[:, k].sum() < len(t):
            aucs[name] = roc_auc_score(t[:, k], p[:, k])
    return float(np.mean(list(aucs.values()))), aucs


def worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=args.project, id=os.environ["CXR_WANDB_ID"], resume="allow",
                     config=vars(args), dir=args.out, name=os.path.basename(args.out))

    df = pd.read_csv(args.csv)
    train_df, val_df = split_by_patient(df)
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = T.Compose([T.RandomResizedCrop(args.size, scale=(0.7, 1.0)), T.RandomRotation(7),
                          T.ToTensor(), norm])
    val_tf = T.Compose([T.Resize(args.size), T.CenterCrop(args.size), T.ToTensor(), norm])
    train_ds, val_ds = CXR(train_df, args.img_root, train_tf), CXR(val_df, args.img_root, val_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=96, num_workers=8)

    model = timm.create_model("convnext_tiny.fb_in22k", pretrained=True, num_classes=len(FINDINGS),
                              drop_path_rate=0.1).to(device)
    lr = args.lr * args.batch * world / 384
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl), pct_start=0.1)
    pos = train_df[FINDINGS].to_numpy().mean(0)
    pos_weight = torch.tensor((1 - pos) / np.clip(pos, 1e-3, None), device=device).clamp(max=20).float()

    start, best = 0, 0.0
    ck_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]
    ddp = DDP(model, device_ids=[local_rank])

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(x)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0],
                           "epoch": epoch + i / len(train_dl)})

        mean_auc, aucs = evaluate(model, val_dl, device, world)
        if rank == 0:
            print(f"epoch {epoch} mean AUROC {mean_auc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            wandb.log({"val/mean_auc": mean_auc, **{f"val/auc_{k}": v for k, v in aucs.items()}, "epoch": epoch + 1})
            if mean_auc > best:
                best = mean_auc
                torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))
                run.summary["best_mean_auc"] = best
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, ck_path + ".tmp")
            os.replace(ck_path + ".tmp", ck_path)
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


def wrapper(args):
    os.makedirs(args.out, exist_ok=True)
    id_file = os.path.join(args.out, "wandb_id")
    if os.path.exists(id_file):
        run_id = open(id_file).read().strip()
    else:
        run_id = wandb.util.generate_id()
        with open(id_file, "w") as f:
            f.write(run_id)
    timm.create_model("convnext_tiny.fb_in22k", pretrained=True)  # warm the weights cache
    env = dict(os.environ, CXR_WANDB_ID=run_id, OMP_NUM_THREADS="8")
    for attempt in range(1, args.tries + 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               f"--log-dir={os.path.join(args.out, 'logs', f'try{attempt}')}", "--redirects=3", "--tee=1",
               os.path.abspath(__file__), "--worker", *sys.argv[1:]]
        rc = subprocess.run(cmd, env=env).returncode
        if rc == 0:
            return 0
        print(f"[wrapper] try {attempt} failed ({rc})", flush=True)
        time.sleep(30)
    return 1


if __name__ == "__main__":
    a = get_args()
    sys.exit(worker(a) if a.worker else wrapper(a))
