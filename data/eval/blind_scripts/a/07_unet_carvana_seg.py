# -*- coding: utf-8 -*-
"""UNet 二值分割 (Carvana) 多卡训练脚本

    torchrun --nnodes=1 --nproc_per_node=4 train_unet.py --img-dir data/imgs --mask-dir data/masks
"""
import argparse
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler


class CarvanaDataset(Dataset):
    def __init__(self, img_dir, mask_dir, scale=0.5):
        self.img_dir, self.mask_dir, self.scale = Path(img_dir), Path(mask_dir), scale
        self.ids = sorted(p.stem for p in self.img_dir.glob("*.jpg"))

    def __len__(self):
        return len(self.ids)

    def _resize(self, im, is_mask):
        w, h = im.size
        nw, nh = int(w * self.scale), int(h * self.scale)
        return im.resize((nw, nh), Image.NEAREST if is_mask else Image.BICUBIC)

    def __getitem__(self, i):
        name = self.ids[i]
        img = self._resize(Image.open(self.img_dir / f"{name}.jpg").convert("RGB"), False)
        mask = self._resize(Image.open(self.mask_dir / f"{name}_mask.gif"), True)
        img = torch.from_numpy(np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0)
        mask = torch.from_numpy((np.asarray(mask) > 0).astype(np.float32))[None]
        return img, mask


def double_conv(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, n_channels=3, n_classes=1, base=64):
        super().__init__()
        chs = [base, base * 2, base * 4, base * 8, base * 16]
        self.inc = double_conv(n_channels, chs[0])
        self.downs = nn.ModuleList([double_conv(chs[i], chs[i + 1]) for i in range(4)])
        self.ups = nn.ModuleList([nn.ConvTranspose2d(chs[i + 1], chs[i], 2, stride=2) for i in reversed(range(4))])
        self.up_convs = nn.ModuleList([double_conv(chs[i + 1], chs[i]) for i in reversed(range(4))])
        self.outc = nn.Conv2d(chs[0], n_classes, 1)

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


def dice_loss(logits, target, eps=1e-6):
    prob = torch.sigmoid(logits)
    inter = (prob * target).sum(dim=(1, 2, 3))
    union = prob.sum(dim=(1, 2, 3)) + target.sum(dim=(1, 2, 3))
    return 1 - ((2 * inter + eps) / (union + eps)).mean()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)  # dice sum, n images
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        pred = (torch.sigmoid(model(img)) > 0.5).float()
        inter = (pred * mask).sum(dim=(1, 2, 3))
        union = pred.sum(dim=(1, 2, 3)) + mask.sum(dim=(1, 2, 3))
        stats[0] += ((2 * inter + 1e-6) / (union + 1e-6)).sum()
        stats[1] += img.size(0)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def get_args():
    parser = argparse.ArgumentParser(description="Train UNet on Carvana (DDP)")
    parser.add_argument("--img-dir", required=True)
    parser.add_argument("--mask-dir", required=True)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4, help="每张卡的 batch")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--val-percent", type=float, default=10.0)
    parser.add_argument("--ckpt-dir", default="checkpoints")
    parser.add_argument("--seed", type=int, default=-1, help="<0 表示随机种子")
    return parser.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # 所有进程使用同一个随机种子 (由 rank 0 决定), 保证 train/val 划分一致
    seed = torch.tensor([args.seed if args.seed >= 0 else random.randint(0, 2 ** 31 - 1)]).cuda()
    dist.broadcast(seed, src=0)
    seed = int(seed.item())
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    logging.info(f"world_size={world_size} seed={seed}")

    dataset = CarvanaDataset(args.img_dir, args.mask_dir, args.scale)
    n_val = int(len(dataset) * args.val_percent / 100)
    train_set, val_set = random_split(dataset, [len(dataset) - n_val, n_val],
                                      generator=torch.Generator().manual_seed(seed))
    val_set = torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size))
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=4, pin_memory=True)

    model = UNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, "max", patience=3)
    bce = nn.BCEWithLogitsLoss()

    best = 0.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(1, device=device)
        for step, (img, mask) in enumerate(train_loader):
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            logits = model(img)
            loss = bce(logits, mask) + dice_loss(logits, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (len(train_loader) * world_size)

        val_dice = evaluate(model, val_loader, device)
        scheduler.step(val_dice)  # val_dice 已经 all_reduce, 各卡一致
        logging.info(f"epoch {epoch} loss {train_loss:.4f} val dice {val_dice:.4f}")
        if rank == 0:
            Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
            torch.save(model.module.state_dict(), Path(args.ckpt_dir) / f"epoch{epoch}.pth")
            if val_dice > best:
                best = val_dice
                torch.save(model.module.state_dict(), Path(args.ckpt_dir) / "best.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
