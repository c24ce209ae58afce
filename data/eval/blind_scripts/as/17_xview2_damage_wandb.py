"""
xView2 / xBD building damage assessment: siamese U-Net that predicts a
5-class map (background, no-damage, minor, major, destroyed) from
pre- and post-disaster images. Metric is the xView2 score:
0.3 * localization F1 + 0.7 * harmonic mean of per-class damage F1.

    torchrun --nproc_per_node=8 train_xbd.py --data /data/xbd --project xbd-damage
"""
import argparse
import glob
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--project", default="xbd-damage")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--encoder", default="resnet34")
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="checkpoints/xbd")
    return ap.parse_args()


class XBDPairs(Dataset):
    def __init__(self, root, split, crop, train):
        self.pre = sorted(glob.glob(os.path.join(root, split, "images", "*_pre_disaster.png")))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.pre)

    def __getitem__(self, i):
        pre_p = self.pre[i]
        post_p = pre_p.replace("_pre_", "_post_")
        tgt_p = post_p.replace("/images/", "/targets/").replace(".png", "_target.png")
        pre = np.asarray(Image.open(pre_p).convert("RGB"), np.float32) / 255.0
        post = np.asarray(Image.open(post_p).convert("RGB"), np.float32) / 255.0
        tgt = np.asarray(Image.open(tgt_p), np.int64)
        tgt = np.where(tgt > 4, 0, tgt)  # 5 = unclassified -> background
        if self.train:
            H, W = tgt.shape
            y, x = np.random.randint(0, H - self.crop + 1), np.random.randint(0, W - self.crop + 1)
            pre, post, tgt = (a[y:y + self.crop, x:x + self.crop] for a in (pre, post, tgt))
            if np.random.rand() < 0.5:
                pre, post, tgt = pre[:, ::-1], post[:, ::-1], tgt[:, ::-1]
        x = np.concatenate([pre, post], axis=2).transpose(2, 0, 1)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(tgt))


class SiameseDamageNet(nn.Module):
    """Shared U-Net decoder features for both dates; damage head sees the concatenation."""

    def __init__(self, encoder):
        super().__init__()
        self.unet = smp.Unet(encoder, encoder_weights="imagenet", in_channels=3, classes=16)
        self.head = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(True),
                                  nn.Conv2d(32, 5, 1))

    def forward(self, x):
        pre, post = x[:, :3], x[:, 3:]
        f = torch.cat([self.unet(pre), self.unet(post)], 1)
        return self.head(f)


def xview2_score(conf):
    """conf: 5x5 confusion (rows = gt, cols = pred)."""
    conf = conf.double()
    # localization: building (1..4) vs background (0)
    tp_loc = conf[1:, 1:].sum()
    fp_loc = conf[0, 1:].sum()
    fn_loc = conf[1:, 0].sum()
    f1_loc = 2 * tp_loc / (2 * tp_loc + fp_loc + fn_loc).clamp(min=1)
    # damage: only over gt building pixels
    d = conf[1:, 1:]
    tp = d.diag()
    f1_cls = 2 * tp / (d.sum(0) + d.sum(1)).clamp(min=1)
    f1_dmg = len(f1_cls) / (1.0 / f1_cls.clamp(min=1e-6)).sum()
    return (0.3 * f1_loc + 0.7 * f1_dmg).item(), f1_loc.item(), f1_dmg.item(), f1_cls.tolist()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.project, name=args.run_name, config=vars(args))

    train_ds = XBDPairs(args.data, "train", args.crop, train=True)
    val_ds = XBDPairs(args.data, "hold", args.crop, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 4, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=args.workers)

    model = SiameseDamageNet(args.encoder)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[15, 25], gamma=0.3)
    # damaged classes are rare; weights from the xView2 1st-place solution
    weights = torch.tensor([0.05, 0.2, 0.8, 0.7, 0.4], device=device)
    criterion = nn.CrossEntropyLoss(weight=weights)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best, step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = criterion(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 20 == 0:
                wandb.log({"train/loss": loss.item(), "lr": opt.param_groups[0]["lr"], "epoch": epoch}, step=step)
        sched.step()

        model.eval()
        conf = torch.zeros(5, 5, dtype=torch.long, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                pred = model(x).argmax(1)
                conf += torch.bincount(y.flatten() * 5 + pred.flatten(), minlength=25).view(5, 5)
        dist.all_reduce(conf)
        score, f1_loc, f1_dmg, f1_cls = xview2_score(conf)
        wandb.log({"val/score": score, "val/f1_loc": f1_loc, "val/f1_dmg": f1_dmg,
                   **{f"val/f1_{n}": v for n, v in zip(["none", "minor", "major", "destroyed"], f1_cls)}},
                  step=step)
        if rank == 0:
            print(f"epoch {epoch} score {score:.4f} loc {f1_loc:.4f} dmg {f1_dmg:.4f}", flush=True)
            if score > best:
                best = score
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
                wandb.run.summary["best_score"] = best

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
