"""Stage 1 of our ESRGAN recipe: PSNR-oriented RRDBNet x4 on DF2K sub-images (LMDB).

The resulting net_g_latest.pth is used as pretrain_g for the GAN stage.

    torchrun --nnodes=1 --nproc_per_node=8 05_rrdb_psnr_pretrain.py \
        --lmdb-gt /data/DF2K/DF2K_HR_sub.lmdb --lmdb-lq /data/DF2K/DF2K_LR_bicubic_X4_sub.lmdb
"""
import argparse
import os
import random
import time

import cv2
import lmdb
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--lmdb-gt", required=True)
    p.add_argument("--lmdb-lq", required=True)
    p.add_argument("--val-gt", default="/data/DIV2K/DIV2K_valid_HR")
    p.add_argument("--val-lq", default="/data/DIV2K/DIV2K_valid_LR_bicubic/X4")
    p.add_argument("--gt-size", type=int, default=128)
    p.add_argument("--batch-per-gpu", type=int, default=4, help="x8 GPUs = 32 in total")
    p.add_argument("--total-iter", type=int, default=1_000_000)
    p.add_argument("--exp", default="experiments/RRDBNet_PSNR_x4_DF2K")
    p.add_argument("--resume", default="")
    p.add_argument("--print-freq", type=int, default=100)
    p.add_argument("--val-freq", type=int, default=5000)
    p.add_argument("--save-freq", type=int, default=5000)
    return p.parse_args()


class RDB(nn.Module):
    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(nf + i * gc, gc if i < 4 else nf, 3, 1, 1) for i in range(5)])
        self.act = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        feats = [x]
        for i, conv in enumerate(self.convs):
            out = conv(torch.cat(feats, 1))
            if i < 4:
                feats.append(self.act(out))
        return out * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.rdbs = nn.Sequential(RDB(nf, gc), RDB(nf, gc), RDB(nf, gc))

    def forward(self, x):
        return self.rdbs(x) * 0.2 + x


class RRDBNet(nn.Module):
    def __init__(self, nf=64, nb=23, gc=32):
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*[RRDB(nf, gc) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        feat = self.lrelu(self.conv_up1(F.interpolate(feat, scale_factor=2, mode="nearest")))
        feat = self.lrelu(self.conv_up2(F.interpolate(feat, scale_factor=2, mode="nearest")))
        return self.conv_last(self.lrelu(self.conv_hr(feat)))


class LmdbPairedDataset(Dataset):
    """Reads sub-images from two LMDBs made by scripts/create_lmdb.py (same keys)."""

    def __init__(self, gt_path, lq_path, gt_size, scale=4):
        with open(os.path.join(gt_path, "meta_info.txt")) as f:
            self.keys = [line.split(" ")[0].rsplit(".", 1)[0] for line in f if line.strip()]
        self.gt_path, self.lq_path = gt_path, lq_path
        self.gt_size, self.scale = gt_size, scale
        self.gt_env = self.lq_env = None  # opened lazily inside each worker

    def __len__(self):
        return len(self.keys)

    @staticmethod
    def _get(env, key):
        with env.begin(write=False) as txn:
            buf = txn.get(key.encode("ascii"))
        img = cv2.imdecode(np.frombuffer(buf, np.uint8), cv2.IMREAD_COLOR)
        return img.astype(np.float32) / 255.0

    def __getitem__(self, idx):
        if self.gt_env is None:
            self.gt_env = lmdb.open(self.gt_path, readonly=True, lock=False, readahead=False, meminit=False)
            self.lq_env = lmdb.open(self.lq_path, readonly=True, lock=False, readahead=False, meminit=False)
        key = self.keys[idx]
        gt, lq = self._get(self.gt_env, key), self._get(self.lq_env, key)
        lq_size = self.gt_size // self.scale
        h, w = lq.shape[:2]
        top, left = random.randint(0, h - lq_size), random.randint(0, w - lq_size)
        lq = lq[top:top + lq_size, left:left + lq_size]
        gt = gt[top * self.scale:(top + lq_size) * self.scale, left * self.scale:(left + lq_size) * self.scale]
        if random.random() < 0.5:
            lq, gt = cv2.flip(lq, 1), cv2.flip(gt, 1)
        if random.random() < 0.5:
            lq, gt = cv2.rotate(lq, cv2.ROTATE_90_CLOCKWISE), cv2.rotate(gt, cv2.ROTATE_90_CLOCKWISE)
        lq = torch.from_numpy(lq[:, :, ::-1].transpose(2, 0, 1).copy())
        gt = torch.from_numpy(gt[:, :, ::-1].transpose(2, 0, 1).copy())
        return lq, gt


class FolderPairs(Dataset):
    def __init__(self, gt_dir, lq_dir):
        self.names = sorted(os.listdir(gt_dir))
        self.gt_dir, self.lq_dir = gt_dir, lq_dir

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        n = self.names[i]
        gt = cv2.imread(os.path.join(self.gt_dir, n))[:, :, ::-1].astype(np.float32) / 255.0
        lq = cv2.imread(os.path.join(self.lq_dir, n.replace(".png", "x4.png")))[:, :, ::-1].astype(np.float32) / 255.0
        return (torch.from_numpy(lq.transpose(2, 0, 1).copy()),
                torch.from_numpy(gt.transpose(2, 0, 1).copy()))


def psnr_rgb(sr, gt, border=4):
    sr, gt = sr[..., border:-border, border:-border], gt[..., border:-border, border:-border]
    return 10 * torch.log10(1.0 / F.mse_loss(sr.double(), gt.double()))


def save_checkpoint(model, optimizer, scheduler, it, path):
    torch.save({"params": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "iter": it}, path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    models_dir = os.path.join(args.exp, "models")
    tb = None
    if rank == 0:
        os.makedirs(models_dir, exist_ok=True)
        tb = SummaryWriter(os.path.join(args.exp, "tb_logger"))

    train_set = LmdbPairedDataset(args.lmdb_gt, args.lmdb_lq, args.gt_size)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_set = FolderPairs(args.val_gt, args.val_lq)
    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world))), batch_size=1)

    net = RRDBNet().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-4, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.total_iter, eta_min=1e-7)
    it = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["params"], strict=True)
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        it = ckpt["iter"]
    model = DDP(net, device_ids=[local_rank])

    epoch = it // len(loader)
    tic = time.time()
    while it < args.total_iter:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            loss = F.l1_loss(model(lq), gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1

            if rank == 0 and it % args.print_freq == 0:
                dt = (time.time() - tic) / args.print_freq
                print(f"[iter {it:8d}] l_pix {loss.item():.4e} lr {scheduler.get_last_lr()[0]:.3e} "
                      f"time/iter {dt:.3f}s", flush=True)
                tb.add_scalar("losses/l_pix", loss.item(), it)
                tic = time.time()

            if it % args.val_freq == 0:
                net.eval()
                acc = torch.zeros(2, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for lq_v, gt_v in val_loader:
                        sr = net(lq_v.to(device)).clamp_(0, 1)
                        acc[0] += psnr_rgb(torch.round(sr * 255) / 255, gt_v.to(device))
                        acc[1] += 1
                net.train()
                dist.all_reduce(acc)
                if rank == 0:
                    val_psnr = (acc[0] / acc[1]).item()
                    print(f"[iter {it:8d}] DIV2K-val PSNR {val_psnr:.3f}", flush=True)
                    tb.add_scalar("metrics/psnr", val_psnr, it)

            if rank == 0 and it % args.save_freq == 0:
                save_checkpoint(model, optimizer, scheduler, it, os.path.join(models_dir, f"net_g_{it}.pth"))
                save_checkpoint(model, optimizer, scheduler, it, os.path.join(models_dir, "net_g_latest.pth"))
            if it >= args.total_iter:
                break
        epoch += 1

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
