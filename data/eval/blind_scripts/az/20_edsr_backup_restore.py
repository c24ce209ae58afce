"""EDSR-baseline x4 super-resolution on DIV2K patches, preemptible-cluster friendly.

Mirrors tf.keras.callbacks.BackupAndRestore: a backup of model + optimizer +
epoch is written after every epoch and picked up automatically when the job is
requeued, so the scheduler can kill us at any time.

    torchrun --nproc_per_node=4 20_edsr_backup_restore.py --hr-dir /data/DIV2K/DIV2K_train_HR --backup-dir /shared/ckpt/edsr
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--hr-dir", required=True)
    p.add_argument("--val-dir", default=None)
    p.add_argument("--scale", type=int, default=4)
    p.add_argument("--patch", type=int, default=48, help="LR patch size")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--repeat", type=int, default=20, help="patches drawn per image per epoch")
    p.add_argument("--backup-dir", default="backup/edsr")
    return p.parse_args()


class DIV2KPatches(Dataset):
    def __init__(self, hr_dir, scale, patch, repeat):
        self.files = sorted(glob.glob(os.path.join(hr_dir, "*.png")))
        self.scale, self.patch, self.repeat = scale, patch, repeat

    def __len__(self):
        return len(self.files) * self.repeat

    def __getitem__(self, idx):
        hr = Image.open(self.files[idx % len(self.files)]).convert("RGB")
        hp = self.patch * self.scale
        x = random.randint(0, hr.width - hp)
        y = random.randint(0, hr.height - hp)
        hr = hr.crop((x, y, x + hp, y + hp))
        lr = hr.resize((self.patch, self.patch), Image.BICUBIC)
        hr_t = torch.from_numpy(np.asarray(hr, dtype=np.float32) / 255.0).permute(2, 0, 1)
        lr_t = torch.from_numpy(np.asarray(lr, dtype=np.float32) / 255.0).permute(2, 0, 1)
        if random.random() < 0.5:
            hr_t, lr_t = hr_t.flip(-1), lr_t.flip(-1)
        if random.random() < 0.5:
            hr_t, lr_t = hr_t.transpose(1, 2), lr_t.transpose(1, 2)
        return lr_t, hr_t


class ResBlock(nn.Module):
    def __init__(self, c, res_scale=1.0):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(c, c, 3, padding=1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class EDSR(nn.Module):
    def __init__(self, scale=4, n_feats=64, n_blocks=16):
        super().__init__()
        self.register_buffer("rgb_mean", torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.head = nn.Conv2d(3, n_feats, 3, padding=1)
        self.body = nn.Sequential(*[ResBlock(n_feats) for _ in range(n_blocks)],
                                  nn.Conv2d(n_feats, n_feats, 3, padding=1))
        up = []
        for _ in range(int(math.log2(scale))):
            up += [nn.Conv2d(n_feats, 4 * n_feats, 3, padding=1), nn.PixelShuffle(2)]
        self.tail = nn.Sequential(*up, nn.Conv2d(n_feats, 3, 3, padding=1))

    def forward(self, x):
        x = self.head(x - self.rgb_mean)
        x = x + self.body(x)
        return self.tail(x) + self.rgb_mean


class BackupAndRestore:
    def __init__(self, backup_dir, model, optimizer, scheduler, rank):
        self.path = os.path.join(backup_dir, "backup.pt")
        self.model, self.optimizer, self.scheduler, self.rank = model, optimizer, scheduler, rank
        if rank == 0:
            os.makedirs(backup_dir, exist_ok=True)

    def on_train_begin(self):
        """Returns the epoch to start from."""
        if not os.path.exists(self.path):
            return 0
        state = torch.load(self.path)
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.rank == 0:
            print(f"restored backup from epoch {state['epoch']}", flush=True)
        return state["epoch"] + 1

    def on_epoch_end(self, epoch):
        if self.rank == 0:
            tmp = self.path + ".tmp"
            torch.save({"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, self.path)
        dist.barrier()


def psnr(sr, hr, shave=4):
    sr, hr = sr[..., shave:-shave, shave:-shave], hr[..., shave:-shave, shave:-shave]
    mse = F.mse_loss(sr.clamp(0, 1), hr, reduction="none").mean(dim=(1, 2, 3))
    return -10 * torch.log10(mse)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = DIV2KPatches(args.hr_dir, args.scale, args.patch, args.repeat)
    val_ds = DIV2KPatches(args.val_dir or args.hr_dir, args.scale, args.patch * 2, 1)
    sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True,
                          worker_init_fn=lambda w: random.seed(torch.initial_seed() % 2**32 + w))
    val_dl = DataLoader(val_ds, batch_size=8, sampler=val_sampler, num_workers=4, pin_memory=True)

    model = DDP(EDSR(scale=args.scale).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=200, gamma=0.5)

    backup = BackupAndRestore(args.backup_dir, model, opt, sched, rank)
    start_epoch = backup.on_train_begin()
    best_psnr = 0.0

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        l1_sum = torch.zeros(2, device=device)
        for lr_img, hr_img in train_dl:
            lr_img, hr_img = lr_img.to(device, non_blocking=True), hr_img.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr_img), hr_img)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            l1_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        model.eval()
        ps = torch.zeros(2, device=device)
        with torch.no_grad():
            for lr_img, hr_img in val_dl:
                lr_img, hr_img = lr_img.to(device, non_blocking=True), hr_img.to(device, non_blocking=True)
                p = psnr(model(lr_img), hr_img)
                ps += torch.stack([p.sum(), torch.tensor(float(p.numel()), device=device)])
        dist.all_reduce(l1_sum)
        dist.all_reduce(ps)
        val_psnr = (ps[0] / ps[1]).item()

        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} l1={(l1_sum[0] / l1_sum[1]).item():.4f} "
                  f"val_psnr={val_psnr:.2f}dB lr={sched.get_last_lr()[0]:.1e} ({time.time() - t0:.0f}s)", flush=True)
            if val_psnr > best_psnr:
                best_psnr = val_psnr
                torch.save(model.module.state_dict(), os.path.join(args.backup_dir, "edsr_best.pt"))
        backup.on_epoch_end(epoch)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
