"""
LOUPE: jointly learning a 2D k-space undersampling pattern and a U-Net reconstructor
(Bahadir et al.), on single-coil brain slices simulated from the Calgary-Campinas T1 volumes.

The probability mask is parameterised by logits, rescaled to the target sampling ratio and
binarised with a straight-through sigmoid; the reconstruction network sees the zero-filled image.

    torchrun --nproc_per_node=4 19_loupe_learned_mask_wandb.py --data /data/cc359/slices --ratio 0.1
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class CCSlices(Dataset):
    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        x = np.load(self.files[i]).astype(np.float32)  # 256x256 magnitude, [0, 1]
        return torch.from_numpy(x)[None]


class LoupeMask(nn.Module):
    def __init__(self, shape, ratio, slope=5.0, sample_slope=12.0):
        super().__init__()
        self.ratio, self.slope, self.sample_slope = ratio, slope, sample_slope
        init = torch.rand(shape) * 0.9 + 0.05
        self.logits = nn.Parameter(-torch.log(1.0 / init - 1.0) / slope)

    def prob(self):
        p = torch.sigmoid(self.slope * self.logits)
        xbar = p.mean()
        r = self.ratio / xbar
        beta = (1 - self.ratio) / (1 - xbar)
        le = (r <= 1).float()
        return le * p * r + (1 - le) * (1 - (1 - p) * beta)

    def forward(self, batch):
        p = self.prob()
        u = torch.rand((batch, *p.shape), device=p.device)
        soft = torch.sigmoid(self.sample_slope * (p - u))
        hard = (soft > 0.5).float()
        return hard + soft - soft.detach() if self.training else (p > torch.quantile(p, 1 - self.ratio)).float().expand(batch, -1, -1)


def down(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(True),
                         nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(True))


class ReconUNet(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.d1, self.d2, self.d3, self.d4 = down(2, c), down(c, 2 * c), down(2 * c, 4 * c), down(4 * c, 8 * c)
        self.u3, self.u2, self.u1 = down(12 * c, 4 * c), down(6 * c, 2 * c), down(3 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        c = self.d3(F.max_pool2d(b, 2))
        d = self.d4(F.max_pool2d(c, 2))
        up = lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=False)
        y = self.u3(torch.cat([up(d), c], 1))
        y = self.u2(torch.cat([up(y), b], 1))
        y = self.u1(torch.cat([up(y), a], 1))
        return self.out(y)


class Loupe(nn.Module):
    def __init__(self, shape, ratio):
        super().__init__()
        self.mask = LoupeMask(shape, ratio)
        self.recon = ReconUNet()

    def forward(self, img):
        k = torch.fft.fftshift(torch.fft.fft2(img[:, 0].to(torch.complex64), norm="ortho"), dim=(-2, -1))
        m = self.mask(img.shape[0])
        zf = torch.fft.ifft2(torch.fft.ifftshift(k * m, dim=(-2, -1)), norm="ortho")
        inp = torch.stack([zf.real, zf.imag], 1)
        return zf.abs()[:, None] + self.recon(inp), m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--project", default="loupe-cc359")
    ap.add_argument("--out", default="ckpt/loupe")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    wandb.init(project=args.project, config=vars(args), name=f"loupe_r{args.ratio}")

    subjects = sorted(glob.glob(os.path.join(args.data, "*")))
    train = [f for s in subjects[:-7] for f in sorted(glob.glob(os.path.join(s, "*.npy")))]
    val = [f for s in subjects[-7:] for f in sorted(glob.glob(os.path.join(s, "*.npy")))]
    tds, vds = CCSlices(train), CCSlices(val)
    ts = DistributedSampler(tds, shuffle=True, drop_last=True)
    vs = DistributedSampler(vds, shuffle=False, drop_last=True)
    tl = DataLoader(tds, args.bs, sampler=ts, num_workers=8, pin_memory=True, drop_last=True)
    vl = DataLoader(vds, args.bs, sampler=vs, num_workers=4)

    model = Loupe((256, 256), args.ratio)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        ts.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x in tl:
            x = x.to(dev, non_blocking=True)
            rec, m = model(x)
            loss = F.l1_loss(rec, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/l1": loss.item(), "train/sampled_frac": m.mean().item()}, step=step)

        net = model.module
        net.eval()
        acc = torch.zeros(3, device=dev)
        with torch.no_grad():
            for x in vl:
                x = x.to(dev)
                rec, _ = net(x)
                mse = F.mse_loss(rec, x, reduction="none").flatten(1).mean(1)
                psnr = 10 * torch.log10(x.flatten(1).amax(1) ** 2 / mse)
                acc += torch.stack([psnr.sum(), F.l1_loss(rec, x, reduction="sum") / x[0].numel(),
                                    torch.tensor(float(x.shape[0]), device=dev)])
        dist.all_reduce(acc)
        if rank == 0:
            prob = net.mask.prob().detach().cpu().numpy()
            wandb.log({"val/psnr": (acc[0] / acc[2]).item(), "val/l1": (acc[1] / acc[2]).item(),
                       "mask/prob": wandb.Image(prob / prob.max()), "epoch": epoch}, step=step)
            print(f"epoch {epoch}: val PSNR {(acc[0] / acc[2]).item():.2f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
