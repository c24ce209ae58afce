"""Blind JPEG artifact removal (colour, QF 10-70) for the gallery re-encode path.

RDN-style backbone trained on DIV2K+Flickr2K with on-the-fly JPEG compression; evaluated on LIVE1 at
QF 10/20/30/40.

    torchrun --nproc_per_node=8 11_jpeg_artifact_removal.py --train /data/DF2K_HR --live1 /data/LIVE1
"""
import argparse
import os
import random
import time
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

EVAL_QFS = (10, 20, 30, 40)


def jpeg_compress(img_rgb_u8, qf):
    bgr = np.ascontiguousarray(img_rgb_u8[:, :, ::-1])
    ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, int(qf)])
    assert ok
    return cv2.imdecode(buf, cv2.IMREAD_COLOR)[:, :, ::-1]


class JPEGTrainSet(Dataset):
    def __init__(self, root, patch=128, qf_range=(10, 70)):
        self.files = sorted(glob(os.path.join(root, "*.png")))
        self.patch, self.qf_range = patch, qf_range

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = cv2.imread(self.files[i])[:, :, ::-1]
        h, w = img.shape[:2]
        # crop on the 8x8 grid so block boundaries line up with the real encoder's
        y = random.randrange(0, (h - self.patch) // 8 + 1) * 8
        x = random.randrange(0, (w - self.patch) // 8 + 1) * 8
        gt = np.ascontiguousarray(img[y:y + self.patch, x:x + self.patch])
        if random.random() < 0.5:
            gt = np.ascontiguousarray(gt[:, ::-1])
        lq = jpeg_compress(gt, random.randint(*self.qf_range))
        to_t = lambda a: torch.from_numpy(a.transpose(2, 0, 1).copy()).float() / 255.0
        return to_t(lq), to_t(gt)


class RDB(nn.Module):
    def __init__(self, c, g, n_layers):
        super().__init__()
        self.layers = nn.ModuleList(nn.Conv2d(c + i * g, g, 3, padding=1) for i in range(n_layers))
        self.lff = nn.Conv2d(c + n_layers * g, c, 1)

    def forward(self, x):
        feats = [x]
        for conv in self.layers:
            feats.append(F.relu(conv(torch.cat(feats, 1)), inplace=True))
        return x + self.lff(torch.cat(feats, 1))


class RDNDeblock(nn.Module):
    def __init__(self, c=64, g=32, n_blocks=12, n_layers=6):
        super().__init__()
        self.sfe1 = nn.Conv2d(3, c, 3, padding=1)
        self.sfe2 = nn.Conv2d(c, c, 3, padding=1)
        self.rdbs = nn.ModuleList(RDB(c, g, n_layers) for _ in range(n_blocks))
        self.gff = nn.Sequential(nn.Conv2d(c * n_blocks, c, 1), nn.Conv2d(c, c, 3, padding=1))
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x):
        f1 = self.sfe1(x)
        y = self.sfe2(f1)
        outs = []
        for rdb in self.rdbs:
            y = rdb(y)
            outs.append(y)
        y = self.gff(torch.cat(outs, 1)) + f1
        return x + self.out(y)


def psnr(a, b):
    return 10 * np.log10(1.0 / np.mean((a - b) ** 2))


def ssim(a, b):
    """SSIM on a single-channel float64 image in [0, 1] (Wang et al., gaussian 11x11)."""
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    k = cv2.getGaussianKernel(11, 1.5)
    win = np.outer(k, k.transpose())
    mu1, mu2 = cv2.filter2D(a, -1, win)[5:-5, 5:-5], cv2.filter2D(b, -1, win)[5:-5, 5:-5]
    s11 = cv2.filter2D(a * a, -1, win)[5:-5, 5:-5] - mu1 ** 2
    s22 = cv2.filter2D(b * b, -1, win)[5:-5, 5:-5] - mu2 ** 2
    s12 = cv2.filter2D(a * b, -1, win)[5:-5, 5:-5] - mu1 * mu2
    return float(np.mean(((2 * mu1 * mu2 + c1) * (2 * s12 + c2)) / ((mu1 ** 2 + mu2 ** 2 + c1) * (s11 + s22 + c2))))


def to_y(rgb):
    return (16.0 + 65.481 * rgb[..., 0] + 128.553 * rgb[..., 1] + 24.966 * rgb[..., 2]) / 255.0


@torch.no_grad()
def evaluate_live1(net, files, device, rank, world):
    net.eval()
    results = {}
    for qf in EVAL_QFS:
        psnr_sum, ssim_sum, count = 0.0, 0.0, 0
        for path in files[rank::world]:
            gt = cv2.imread(path)[:, :, ::-1]
            lq = jpeg_compress(gt, qf)
            inp = torch.from_numpy(lq.transpose(2, 0, 1).copy()).float().div(255).unsqueeze(0).to(device)
            out = net(inp).clamp(0, 1).squeeze(0).permute(1, 2, 0).cpu().numpy()
            out = np.round(out * 255.0) / 255.0
            gt_f = gt.astype(np.float64) / 255.0
            psnr_sum += psnr(to_y(out), to_y(gt_f))
            ssim_sum += ssim(to_y(out), to_y(gt_f))
            count += 1
        stats = torch.tensor([psnr_sum, ssim_sum, count], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        results[qf] = ((stats[0] / stats[2]).item(), (stats[1] / stats[2]).item())
    net.train()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--live1", required=True)
    ap.add_argument("--out", default="runs/jpeg_rdn")
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--iters", type=int, default=300000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-every", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)
    random.seed(7 + rank)

    ds = JPEGTrainSet(args.train)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch // world, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    live1 = sorted(glob(os.path.join(args.live1, "*.bmp")))

    net = RDNDeblock().to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [100000, 200000, 250000], 0.5)
    tb = SummaryWriter(args.out) if rank == 0 else None

    step, epoch, t = 0, 0, time.time()
    while step < args.iters:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            loss = F.l1_loss(model(lq), gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if tb is not None and step % 100 == 0:
                tb.add_scalar("train/l1", loss.item(), step)
                print(f"step {step} l1 {loss.item():.5f} ({time.time() - t:.1f}s)", flush=True)
                t = time.time()
            if step % args.eval_every == 0:
                res = evaluate_live1(net, live1, device, rank, world)
                if tb is not None:
                    for qf, (p, s) in res.items():
                        tb.add_scalar(f"live1/psnr_q{qf}", p, step)
                        tb.add_scalar(f"live1/ssim_q{qf}", s, step)
                    print("LIVE1 " + "  ".join(f"q{qf}: {p:.2f}/{s:.4f}" for qf, (p, s) in res.items()), flush=True)
                    torch.save({"model": net.state_dict(), "step": step}, os.path.join(args.out, f"rdn_{step}.pth"))
            if step >= args.iters:
                break
        epoch += 1

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
