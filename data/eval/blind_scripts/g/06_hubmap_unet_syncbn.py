"""HuBMAP tile segmentation - smp Unet, DDP + SyncBN.

    torchrun --standalone --nproc_per_node=4 06_hubmap_unet_syncbn.py --config configs/unet_r34.yaml
    # resume:
    torchrun --standalone --nproc_per_node=4 06_hubmap_unet_syncbn.py --config configs/unet_r34.yaml --resume out/last.pth
"""
import argparse
import os

import cv2
import numpy as np
import pandas as pd
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class TileDataset(Dataset):
    def __init__(self, df, tile_dir, train):
        self.ids = df.tile_id.values
        self.tile_dir = tile_dir
        self.train = train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        tid = self.ids[i]
        img = cv2.imread(os.path.join(self.tile_dir, "images", f"{tid}.png"))[:, :, ::-1]
        mask = cv2.imread(os.path.join(self.tile_dir, "masks", f"{tid}.png"), cv2.IMREAD_GRAYSCALE)
        if self.train:
            if np.random.rand() < 0.5:
                img, mask = img[:, ::-1], mask[:, ::-1]
            if np.random.rand() < 0.5:
                img, mask = img[::-1], mask[::-1]
            k = np.random.randint(4)
            img, mask = np.rot90(img, k), np.rot90(mask, k)
        img = (img.astype(np.float32) / 255.0 - 0.5) / 0.25
        img = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        mask = torch.from_numpy(np.ascontiguousarray(mask > 127)).float().unsqueeze(0)
        return img, mask, i


def dice_loss(logits, target, eps=1.0):
    p = torch.sigmoid(logits)
    inter = (p * target).sum((2, 3))
    return 1 - ((2 * inter + eps) / (p.sum((2, 3)) + target.sum((2, 3)) + eps)).mean()


def build_model(cfg):
    return smp.Unet(cfg["encoder"], encoder_weights=cfg.get("encoder_weights", "imagenet"),
                    classes=1, decoder_attention_type="scse")


def gather_variable(t, world):
    """all_gather for 1-D tensors whose length differs between ranks: pad to the max length."""
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros(max_n, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    dices, idxs = [], []
    for img, mask, idx in loader:
        img, mask = img.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = (torch.sigmoid(net(img)) > 0.5).float()
        inter = (pred * mask).sum((1, 2, 3))
        denom = pred.sum((1, 2, 3)) + mask.sum((1, 2, 3))
        dices.append(torch.where(denom > 0, 2 * inter / denom.clamp(min=1), torch.ones_like(denom)))
        idxs.append(idx.to(device))
    return torch.cat(dices), torch.cat(idxs)


def save_overlay(net, ds, device, path, n=4):
    """Rank-0 only debug picture; pure local inference, no communication."""
    net.eval()
    rows = []
    with torch.no_grad():
        for i in range(min(n, len(ds))):
            img, mask, _ = ds[i]
            pred = torch.sigmoid(net(img[None].to(device)))[0, 0].cpu().numpy()
            vis = np.concatenate([mask[0].numpy(), pred], axis=1)
            rows.append((vis * 255).astype(np.uint8))
    cv2.imwrite(path, np.concatenate(rows, axis=0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    df = pd.read_csv(cfg["folds_csv"])
    trn_df, val_df = df[df.fold != cfg["fold"]], df[df.fold == cfg["fold"]]
    train_ds = TileDataset(trn_df, cfg["tile_dir"], train=True)
    val_ds = TileDataset(val_df, cfg["tile_dir"], train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                          num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler, num_workers=4)

    # encoder weights are fetched once by rank 0, the others then read the cache
    if rank == 0:
        model = build_model(cfg)
    dist.barrier()
    if rank != 0:
        model = build_model(cfg)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"] * world / 4, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"] * world / 4,
                                                total_steps=cfg["epochs"] * len(train_dl), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
    model = DDP(model, device_ids=[local_rank])
    bce = nn.BCEWithLogitsLoss()

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        run_loss = torch.zeros(2, device=device)
        for img, mask, _ in train_dl:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(img)
                loss = bce(logits, mask) + dice_loss(logits.float(), mask)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            run_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(run_loss)

        # padded sampler -> drop duplicate indices after the gather
        dices, idxs = validate(model, val_dl, device)
        all_d, all_i = gather_variable(dices, world), gather_variable(idxs, world)
        uniq, first = np.unique(all_i.cpu().numpy(), return_index=True)
        mean_dice = all_d.cpu().numpy()[first].mean()

        if rank == 0:
            print(f"epoch {epoch} train loss {(run_loss[0] / run_loss[1]).item():.4f} "
                  f"val dice {mean_dice:.4f} ({len(uniq)} tiles)", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best": max(best, mean_dice)}
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save(state, os.path.join(cfg["out_dir"], "last.pth"))
            if mean_dice > best:
                torch.save(model.module.state_dict(), os.path.join(cfg["out_dir"], "best.pth"))
            save_overlay(model.module, val_ds, device, os.path.join(cfg["out_dir"], f"ep{epoch}.png"))
        best = max(best, mean_dice)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
