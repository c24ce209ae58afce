"""
EfficientNetV2-S multi-label classifier on VinDr-CXR (global labels), with W&B tracking.

    torchrun --nproc_per_node=4 14_effnetv2_cxr_wandb.py --cfg configs/vindr_effv2s.yaml
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import pydicom
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
import yaml
from pydicom.pixel_data_handlers.util import apply_voi_lut
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models
from torchvision.transforms import v2 as T

GLOBAL_LABELS = ["Lung tumor", "Pneumonia", "Tuberculosis", "Other diseases", "COPD", "No finding"]

DEFAULT_CFG = dict(
    data_root="/data/vindr-cxr/1.0.0",
    out_dir="runs/vindr_effv2s",
    img_size=512,
    batch_size=16,
    epochs=30,
    lr=3e-4,
    weight_decay=1e-5,
    num_workers=8,
    wandb_project="cxr-global-labels",
    run_name="effv2s_512",
)


class VinDrDicom(Dataset):
    def __init__(self, root, split, size, train):
        lab = pd.read_csv(os.path.join(root, "annotations", f"image_labels_{split}.csv"))
        # train has three readers per image: majority vote
        lab = lab.groupby("image_id")[GLOBAL_LABELS].mean().reset_index()
        self.ids = lab["image_id"].tolist()
        self.y = (lab[GLOBAL_LABELS].values >= 0.5).astype(np.float32)
        self.dir = os.path.join(root, split)
        ops = [T.Resize((size, size), antialias=True)]
        if train:
            ops += [T.RandomAffine(degrees=7, translate=(0.04, 0.04), scale=(0.92, 1.08)),
                    T.RandomAutocontrast(p=0.3)]
        self.tf = T.Compose(ops + [T.Normalize([0.5], [0.25])])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ds = pydicom.dcmread(os.path.join(self.dir, self.ids[i] + ".dicom"))
        px = apply_voi_lut(ds.pixel_array, ds).astype(np.float32)
        if ds.PhotometricInterpretation == "MONOCHROME1":
            px = px.max() - px
        px = (px - px.min()) / max(px.max() - px.min(), 1e-6)
        x = torch.from_numpy(px)[None]
        return self.tf(x), torch.from_numpy(self.y[i])


def build_model(n_classes):
    m = models.efficientnet_v2_s(weights=models.EfficientNet_V2_S_Weights.IMAGENET1K_V1)
    # single-channel input: sum the RGB filters of the stem
    stem = m.features[0][0]
    new_stem = nn.Conv2d(1, stem.out_channels, stem.kernel_size, stem.stride, stem.padding, bias=False)
    new_stem.weight.data = stem.weight.data.sum(dim=1, keepdim=True)
    m.features[0][0] = new_stem
    m.classifier[1] = nn.Linear(m.classifier[1].in_features, n_classes)
    return m


@torch.no_grad()
def gather_predictions(model, loader, device, n_total):
    model.eval()
    ps, ys = [], []
    for x, y in loader:
        ps.append(torch.sigmoid(model(x.to(device, non_blocking=True))).float())
        ys.append(y.to(device))
    p, y = torch.cat(ps), torch.cat(ys)
    world = dist.get_world_size()
    pl = [torch.zeros_like(p) for _ in range(world)]
    yl = [torch.zeros_like(y) for _ in range(world)]
    dist.all_gather(pl, p)
    dist.all_gather(yl, y)
    # DistributedSampler(shuffle=False) hands out indices round-robin: interleave back to dataset order
    p = torch.stack(pl, dim=1).reshape(-1, p.size(1))[:n_total].cpu().numpy()
    y = torch.stack(yl, dim=1).reshape(-1, y.size(1))[:n_total].cpu().numpy()
    model.train()
    return p, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if cli.cfg:
        with open(cli.cfg) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    run = wandb.init(project=cfg["wandb_project"], name=cfg["run_name"], config=cfg)

    train_ds = VinDrDicom(cfg["data_root"], "train", cfg["img_size"], True)
    test_ds = VinDrDicom(cfg["data_root"], "test", cfg["img_size"], False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                          num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=cfg["batch_size"], sampler=test_sampler,
                         num_workers=cfg["num_workers"], pin_memory=True)

    model = build_model(len(GLOBAL_LABELS))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    pos = train_ds.y.mean(0)
    pos_weight = torch.tensor(np.clip((1 - pos) / np.maximum(pos, 1e-3), 1, 50), device=device)
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg["epochs"])
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
    best_map = 0.0
    step = 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if step % 25 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": optimizer.param_groups[0]["lr"],
                           "epoch": epoch}, step=step)
        scheduler.step()

        p, y = gather_predictions(model, test_dl, device, len(test_ds))
        aucs = [roc_auc_score(y[:, k], p[:, k]) for k in range(len(GLOBAL_LABELS))]
        aps = [average_precision_score(y[:, k], p[:, k]) for k in range(len(GLOBAL_LABELS))]
        wandb.log({"val/mAUC": float(np.mean(aucs)), "val/mAP": float(np.mean(aps)),
                   **{f"val/auc_{n}": a for n, a in zip(GLOBAL_LABELS, aucs)},
                   "epoch_time": time.time() - t0}, step=step)

        if rank == 0:
            print(f"epoch {epoch} mAUC {np.mean(aucs):.4f} mAP {np.mean(aps):.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "cfg": cfg},
                       os.path.join(cfg["out_dir"], "last.pt"))
            if np.mean(aps) > best_map:
                best_map = float(np.mean(aps))
                torch.save(model.module.state_dict(), os.path.join(cfg["out_dir"], "best_map.pt"))
                run.summary["best_mAP"] = best_map
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
