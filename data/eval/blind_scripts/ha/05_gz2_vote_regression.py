"""Galaxy Zoo 2: regress the 37 decision-tree vote fractions from SDSS gri cutouts.

EfficientNet-B0 (timm) backbone, MSE on the vote fractions (Kaggle GZ challenge
metric is RMSE over all 37 answers). DDP over the GPUs of one node:

    torchrun --nproc_per_node=4 05_gz2_vote_regression.py --cfg cfg/gz2_effb0.yaml
"""
import argparse
import os
from pathlib import Path

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

ANSWER_COLS = [f"Class{q}.{a}" for q, n in
               [(1, 3), (2, 2), (3, 2), (4, 2), (5, 4), (6, 2), (7, 3), (8, 7), (9, 3),
                (10, 3), (11, 6)] for a in range(1, n + 1)]
assert len(ANSWER_COLS) == 37


class GZ2Cutouts(Dataset):
    def __init__(self, table, image_dir, transform):
        self.ids = table["GalaxyID"].values
        self.targets = table[ANSWER_COLS].values.astype(np.float32)
        self.image_dir = Path(image_dir)
        self.transform = transform

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = Image.open(self.image_dir / f"{self.ids[i]}.jpg").convert("RGB")
        return self.transform(img), torch.from_numpy(self.targets[i])


def make_transforms(size):
    train = transforms.Compose([
        transforms.CenterCrop(256),
        transforms.RandomRotation(180, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.RandomResizedCrop(size, scale=(0.7, 1.0), ratio=(0.9, 1.1)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.1, 0.1),
        transforms.ToTensor(),
    ])
    test = transforms.Compose([
        transforms.CenterCrop(256),
        transforms.Resize(size),
        transforms.ToTensor(),
    ])
    return train, test


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--run-name", default=None)
    a = ap.parse_args()
    with open(a.cfg) as f:
        cfg = yaml.safe_load(f)
    cfg["run_name"] = a.run_name
    return cfg


def init_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    sse = torch.zeros((), device=device, dtype=torch.float64)
    n = torch.zeros((), device=device, dtype=torch.float64)
    for img, tgt in loader:
        img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = torch.sigmoid(net(img)).float()
        sse += ((pred - tgt) ** 2).sum().double()
        n += tgt.numel()
    dist.all_reduce(sse)
    dist.all_reduce(n)
    return torch.sqrt(sse / n).item()


def main():
    cfg = load_cfg()
    rank, world_size, local_rank = init_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    run = wandb.init(project="gz2-morphology", name=cfg["run_name"], config=cfg,
                     dir=cfg["out_dir"])

    table = pd.read_csv(cfg["solutions_csv"])
    split = np.load(cfg["split_npz"])  # fixed GalaxyID lists shared by all our runs
    train_tab = table[table.GalaxyID.isin(split["train"])].reset_index(drop=True)
    val_tab = table[table.GalaxyID.isin(split["val"])].reset_index(drop=True)
    val_tab = val_tab.iloc[rank::world_size].reset_index(drop=True)

    tf_train, tf_test = make_transforms(cfg["img_size"])
    train_ds = GZ2Cutouts(train_tab, cfg["image_dir"], tf_train)
    val_ds = GZ2Cutouts(val_tab, cfg["image_dir"], tf_test)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler,
                          num_workers=cfg["workers"], pin_memory=True, drop_last=True,
                          persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=cfg["batch_size"] * 2, shuffle=False,
                        num_workers=cfg["workers"], pin_memory=True)

    net = timm.create_model(cfg["arch"], pretrained=cfg.get("pretrained", True), num_classes=37,
                            drop_rate=0.2, drop_path_rate=0.1)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    total_steps = cfg["epochs"] * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=total_steps,
                                                pct_start=0.05, anneal_strategy="cos")

    out_dir = Path(cfg["out_dir"])
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    best_rmse, global_step = 1e9, 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for img, tgt in train_dl:
            img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = torch.sigmoid(model(img))
            loss = F.mse_loss(pred.float(), tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            global_step += 1
            if global_step % cfg["log_every"] == 0:
                wandb.log({"train/mse": loss.item(), "lr": sched.get_last_lr()[0],
                           "epoch": epoch}, step=global_step)

        val_rmse = evaluate(model.module, val_dl, device)
        wandb.log({"val/rmse": val_rmse, "epoch": epoch}, step=global_step)

        if rank == 0:
            print(f"epoch {epoch}: val RMSE {val_rmse:.5f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch, "val_rmse": val_rmse, "cfg": cfg}
            torch.save(ckpt, out_dir / "last.pt")
            if val_rmse < best_rmse:
                best_rmse = val_rmse
                torch.save(ckpt, out_dir / "best.pt")
                run.summary["best_val_rmse"] = best_rmse
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
