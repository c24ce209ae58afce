"""Multi-frame VFI on Vimeo-90K septuplets: frames (1, 3, 5, 7) -> frame 4.

The official septuplet test list is kept for the final numbers; a held-out part of sep_trainlist is used
for model selection.

    torchrun --standalone --nproc_per_node=8 06_septuplet_multiframe_vfi.py --root /data/vimeo_septuplet
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from pytorch_msssim import ssim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

INPUT_IDS = (1, 3, 5, 7)
TARGET_ID = 4


def read_list(path):
    with open(path) as f:
        return [l.strip() for l in f if l.strip()]


def split_train_val(seqs, val_frac):
    seqs = list(seqs)
    random.shuffle(seqs)
    n_val = int(len(seqs) * val_frac)
    return seqs[n_val:], seqs[:n_val]


class Septuplets(Dataset):
    def __init__(self, root, seqs, crop=None):
        self.dir = os.path.join(root, "sequences")
        self.seqs, self.crop = seqs, crop

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        d = os.path.join(self.dir, self.seqs[i])
        ims = [np.asarray(Image.open(os.path.join(d, f"im{k}.png")).convert("RGB")) for k in INPUT_IDS + (TARGET_ID,)]
        x = torch.from_numpy(np.stack(ims)).permute(0, 3, 1, 2).float() / 255.0  # 5 x 3 x H x W
        if self.crop:
            _, _, h, w = x.shape
            top, left = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            x = x[:, :, top:top + self.crop, left:left + self.crop]
            if random.random() < 0.5:
                x = x.flip(-1)
            if random.random() < 0.5:
                x = torch.cat([x[:4].flip(0), x[4:]], 0)  # time reversal keeps frame 4 in the middle
        return x[:4], x[4]


def backward_warp(img, flow):
    n, _, h, w = flow.shape
    yy, xx = torch.meshgrid(torch.arange(h, device=flow.device, dtype=flow.dtype),
                            torch.arange(w, device=flow.device, dtype=flow.dtype), indexing="ij")
    x = 2.0 * (xx + flow[:, 0]) / max(w - 1, 1) - 1.0
    y = 2.0 * (yy + flow[:, 1]) / max(h - 1, 1) - 1.0
    return F.grid_sample(img, torch.stack([x, y], -1), align_corners=True, padding_mode="border")


def block(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.LeakyReLU(0.1, inplace=True),
                         nn.Conv2d(cout, cout, 3, 1, 1), nn.LeakyReLU(0.1, inplace=True))


class FlowLevel(nn.Module):
    """Predicts residual flows t->3 and t->5 at one pyramid level."""

    def __init__(self, cin, c):
        super().__init__()
        self.body = nn.Sequential(block(cin, c, 2), block(c, c), nn.ConvTranspose2d(c, 4, 4, 2, 1))

    def forward(self, x):
        return self.body(x)


class MultiFrameVFI(nn.Module):
    def __init__(self, c=64):
        super().__init__()
        self.levels = nn.ModuleList([FlowLevel(12, 128), FlowLevel(12 + 6 + 4, 96), FlowLevel(12 + 6 + 4, 64)])
        self.enc1 = block(12 + 6 + 4, c)
        self.enc2 = block(c, c * 2, 2)
        self.enc3 = block(c * 2, c * 4, 2)
        self.dec2 = block(c * 4 + c * 2, c * 2)
        self.dec1 = block(c * 2 + c, c)
        self.head = nn.Conv2d(c, 4, 3, 1, 1)

    def forward(self, frames):
        b, n, _, h, w = frames.shape
        stack = frames.reshape(b, n * 3, h, w)
        f3, f5 = frames[:, 1], frames[:, 2]
        flow = None
        for lvl, scale in zip(self.levels, (4, 2, 1)):
            if flow is None:
                inp = stack
            else:
                w3, w5 = backward_warp(f3, flow[:, :2]), backward_warp(f5, flow[:, 2:])
                inp = torch.cat([stack, w3, w5, flow], 1)
            if scale != 1:
                inp = F.interpolate(inp, scale_factor=1 / scale, mode="bilinear", align_corners=False)
            delta = F.interpolate(lvl(inp), size=(h, w), mode="bilinear", align_corners=False) * scale
            flow = delta if flow is None else flow + delta
        w3, w5 = backward_warp(f3, flow[:, :2]), backward_warp(f5, flow[:, 2:])
        e1 = self.enc1(torch.cat([stack, w3, w5, flow], 1))
        e2 = self.enc2(e1)
        e3 = self.enc3(e2)
        d2 = self.dec2(torch.cat([F.interpolate(e3, size=e2.shape[-2:], mode="bilinear", align_corners=False), e2], 1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, size=e1.shape[-2:], mode="bilinear", align_corners=False), e1], 1))
        out = self.head(d1)
        m = torch.sigmoid(out[:, :1])
        res = out[:, 1:]
        return (m * w3 + (1 - m) * w5 + res).clamp(0, 1)


@torch.no_grad()
def run_eval(net, dataset, device, rank, world, bs=8):
    net.eval()
    loader = DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=bs, num_workers=4)
    acc = torch.zeros(3, device=device)
    for frames, gt in loader:
        frames, gt = frames.to(device), gt.to(device)
        pred = net(frames)
        mse = F.mse_loss(pred, gt, reduction="none").mean((1, 2, 3))
        acc[0] += (10 * torch.log10(1.0 / mse)).sum()
        acc[1] += ssim(pred, gt, data_range=1.0, size_average=False).sum()
        acc[2] += gt.shape[0]
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="checkpoints/sep_vfi")
    ap.add_argument("--val_frac", type=float, default=0.05)
    ap.add_argument("--crop", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=8, help="per GPU")
    ap.add_argument("--base_lr", type=float, default=2e-4, help="for a global batch of 64")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--project", default="sep-vfi")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation stream per rank, identical weight init
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_seqs, val_seqs = split_train_val(read_list(os.path.join(args.root, "sep_trainlist.txt")), args.val_frac)
    test_seqs = read_list(os.path.join(args.root, "sep_testlist.txt"))
    train_set = Septuplets(args.root, train_seqs, crop=args.crop)
    val_set = Septuplets(args.root, val_seqs)
    test_set = Septuplets(args.root, test_seqs)

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DDP(MultiFrameVFI().to(device), device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world / 64
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(loader), pct_start=0.02)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.project, config=vars(args))
        print(f"train {len(train_set)}  val {len(val_set)}  test {len(test_set)}  lr {lr:.2e}")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (frames, gt) in enumerate(loader):
            frames, gt = frames.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            pred = model(frames)
            l1 = (pred - gt).abs().mean()
            loss = l1 + 0.2 * (1 - ssim(pred, gt, data_range=1.0))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                wandb.log({"loss": loss.item(), "l1": l1.item(), "lr": sched.get_last_lr()[0]})

        val_psnr, val_ssim = run_eval(model.module, val_set, device, rank, world)
        if rank == 0:
            wandb.log({"epoch": epoch, "val/psnr": val_psnr, "val/ssim": val_ssim, "epoch_time": time.time() - t0})
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "epoch": epoch, "val_psnr": val_psnr}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if val_psnr > best:
                best = val_psnr
                torch.save(ckpt, os.path.join(args.out, "best.pth"))
        dist.barrier()

    ckpt = torch.load(os.path.join(args.out, "best.pth"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test_psnr, test_ssim = run_eval(model.module, test_set, device, rank, world)
    if rank == 0:
        print(f"sep test: PSNR {test_psnr:.3f} SSIM {test_ssim:.4f} (best epoch {ckpt['epoch']})")
        wandb.log({"test/psnr": test_psnr, "test/ssim": test_ssim})
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
