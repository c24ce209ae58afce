#!/usr/bin/env python3
"""
U-Net for binary car segmentation (Carvana-style: imgs/*.jpg, masks/*_mask.gif).

DDP training, then the best checkpoint is re-loaded and scored on the held-out
test list and a few predicted masks are written out.

    torchrun --nproc_per_node=4 18_unet_carvana_ddp.py --data /data/carvana --epochs 40
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--scale", type=float, default=0.5)
    p.add_argument("--ckpt-dir", default="checkpoints/unet")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return local_rank


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# ------------------------------------------------------------------------- data
class CarvanaDataset(Dataset):
    def __init__(self, root, ids, scale, augment=False):
        self.root, self.ids, self.scale, self.augment = root, ids, scale, augment

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        name = self.ids[i]
        img = Image.open(os.path.join(self.root, "imgs", f"{name}.jpg")).convert("RGB")
        mask = Image.open(os.path.join(self.root, "masks", f"{name}_mask.gif")).convert("L")
        w, h = img.size
        size = (int(w * self.scale), int(h * self.scale))
        img, mask = img.resize(size, Image.BICUBIC), mask.resize(size, Image.NEAREST)
        img = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        mask = torch.from_numpy((np.asarray(mask) > 127).astype(np.float32))[None]
        if self.augment and random.random() < 0.5:
            img, mask = img.flip(-1), mask.flip(-1)
        return img, mask


def read_ids(path):
    with open(path) as f:
        return [l.strip() for l in f if l.strip()]


# ------------------------------------------------------------------------- model
class DoubleConv(nn.Sequential):
    def __init__(self, c_in, c_out):
        super().__init__(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    def __init__(self, in_ch=3, out_ch=1, base=64):
        super().__init__()
        chs = [base, base * 2, base * 4, base * 8, base * 16]
        self.inc = DoubleConv(in_ch, chs[0])
        self.downs = nn.ModuleList([DoubleConv(chs[i], chs[i + 1]) for i in range(4)])
        self.ups = nn.ModuleList([nn.ConvTranspose2d(chs[i + 1], chs[i], 2, stride=2) for i in reversed(range(4))])
        self.up_convs = nn.ModuleList([DoubleConv(chs[i] * 2, chs[i]) for i in reversed(range(4))])
        self.outc = nn.Conv2d(chs[0], out_ch, 1)

    def forward(self, x):
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(F.max_pool2d(skips[-1], 2)))
        x = skips.pop()
        for up, conv in zip(self.ups, self.up_convs):
            x = up(x)
            skip = skips.pop()
            x = F.pad(x, [0, skip.size(3) - x.size(3), 0, skip.size(2) - x.size(2)])
            x = conv(torch.cat([skip, x], dim=1))
        return self.outc(x)


def dice_coeff(logits, target, eps=1e-6):
    pred = (torch.sigmoid(logits) > 0.5).float()
    inter = (pred * target).sum(dim=(1, 2, 3))
    union = pred.sum(dim=(1, 2, 3)) + target.sum(dim=(1, 2, 3))
    return (2 * inter + eps) / (union + eps)


def dice_loss(logits, target, eps=1.0):
    prob = torch.sigmoid(logits)
    inter = (prob * target).sum(dim=(1, 2, 3))
    return 1 - ((2 * inter + eps) / (prob.sum(dim=(1, 2, 3)) + target.sum(dim=(1, 2, 3)) + eps)).mean()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        acc[0] += dice_coeff(model(img), mask).sum()
        acc[1] += img.size(0)
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


@torch.no_grad()
def test_best_model(ckpt_path, test_ids, args, device):
    """Single-process scoring of the saved best model on the test list."""
    model = UNet().to(device)
    model.load_state_dict(torch.load(ckpt_path, map_location=device))
    model.eval()
    loader = DataLoader(CarvanaDataset(args.data, test_ids, args.scale), batch_size=4, num_workers=4)
    scores = []
    os.makedirs(os.path.join(args.ckpt_dir, "preds"), exist_ok=True)
    for i, (img, mask) in enumerate(loader):
        logits = model(img.to(device))
        scores.append(dice_coeff(logits, mask.to(device)).cpu())
        if i < 5:
            pred = (torch.sigmoid(logits[0, 0]) > 0.5).byte().cpu().numpy() * 255
            Image.fromarray(pred).save(os.path.join(args.ckpt_dir, "preds", f"{test_ids[i * 4]}.png"))
    return torch.cat(scores).mean().item()


def main():
    args = parse_args()
    local_rank = setup()
    device = torch.device("cuda", local_rank)
    world_size = dist.get_world_size()
    seed_everything(args.seed)

    train_ids = read_ids(os.path.join(args.data, "train.txt"))
    val_ids = read_ids(os.path.join(args.data, "val.txt"))
    test_ids = read_ids(os.path.join(args.data, "test.txt"))
    train_ds = CarvanaDataset(args.data, train_ids, args.scale, augment=True)
    val_ds = CarvanaDataset(args.data, val_ids, args.scale)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=4)

    model = UNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=3, factor=0.5)
    bce = nn.BCEWithLogitsLoss()
    best_path = os.path.join(args.ckpt_dir, "best_unet.pth")
    if is_main_process():
        os.makedirs(args.ckpt_dir, exist_ok=True)

    best_dice = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(1, device=device)
        for img, mask in tqdm(train_loader, disable=not is_main_process(), desc=f"epoch {epoch + 1}"):
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img)
            loss = bce(logits.float(), mask) + dice_loss(logits.float(), mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += loss.detach()
        dist.all_reduce(running)

        val_dice = evaluate(model, val_loader, device)
        scheduler.step(val_dice)  # same value on every rank
        if is_main_process():
            print(f"epoch {epoch + 1}: loss {running.item() / (len(train_loader) * world_size):.4f} "
                  f"val dice {val_dice:.4f}", flush=True)
            if val_dice > best_dice:
                best_dice = val_dice
                torch.save(model.state_dict(), best_path)
                print(f"  saved best model ({best_dice:.4f})", flush=True)
        dist.barrier()

    if is_main_process():
        test_dice = test_best_model(best_path, test_ids, args, device)
        print(f"test dice of best model: {test_dice:.4f}")
    dist.barrier()
    cleanup()


if __name__ == "__main__":
    main()
