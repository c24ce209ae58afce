"""SimVP-style video prediction (encoder / temporal translator / decoder) on KTH, 10 -> 10 frames, 128x128 gray.

Test metrics are computed over whole test sequences with a sliding window (stride = --pred).

    torchrun --nproc_per_node=4 19_simvp_video_prediction.py --root /data/kth_frames --exp runs/simvp_kth
    torchrun --nproc_per_node=4 19_simvp_video_prediction.py --root /data/kth_frames --exp runs/simvp_kth --resume
"""
import argparse
import copy
import glob
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from skimage.metrics import structural_similarity
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TRAIN_PERSONS = list(range(1, 17))
TEST_PERSONS = list(range(17, 26))


def sequences(root, persons):
    out = []
    for d in sorted(glob.glob(os.path.join(root, "*"))):
        pid = int(os.path.basename(d).split("_")[0].replace("person", ""))
        if pid in persons:
            frames = sorted(glob.glob(os.path.join(d, "*.png")))
            if len(frames) >= 20:
                out.append(frames)
    return out


def load_gray(paths):
    return torch.from_numpy(np.stack([np.asarray(Image.open(p).convert("L").resize((128, 128))) for p in paths])
                            ).float().unsqueeze(1) / 255.0  # T 1 H W


class KTHWindows(Dataset):
    def __init__(self, seqs, length=20, stride=2):
        self.seqs, self.length, self.stride = seqs, length, stride

    def __len__(self):
        return len(self.seqs) * 8

    def __getitem__(self, i):
        frames = self.seqs[i % len(self.seqs)]
        span = (self.length - 1) * self.stride + 1
        stride = self.stride if len(frames) >= span else 1
        span = (self.length - 1) * stride + 1
        s = random.randint(0, len(frames) - span)
        x = load_gray(frames[s:s + span:stride])
        if random.random() < 0.5:
            x = x.flip(-1)
        return x


def conv_gn(cin, cout, stride=1, transpose=False):
    c = (nn.ConvTranspose2d(cin, cout, 3, stride, 1, output_padding=stride - 1) if transpose
         else nn.Conv2d(cin, cout, 3, stride, 1))
    return nn.Sequential(c, nn.GroupNorm(2, cout), nn.LeakyReLU(0.2, True))


class Inception(nn.Module):
    def __init__(self, cin, chid, cout, groups=8):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, chid, 1)
        self.branches = nn.ModuleList([nn.Sequential(nn.Conv2d(chid, cout, k, 1, k // 2, groups=groups),
                                                     nn.GroupNorm(groups, cout), nn.LeakyReLU(0.2, True))
                                       for k in (3, 5, 7, 11)])

    def forward(self, x):
        x = self.conv1(x)
        return sum(b(x) for b in self.branches)


class SimVP(nn.Module):
    def __init__(self, t_in=10, c_in=1, hid_s=64, hid_t=256, n_t=8):
        super().__init__()
        self.t_in = t_in
        self.enc = nn.ModuleList([conv_gn(c_in, hid_s), conv_gn(hid_s, hid_s, 2), conv_gn(hid_s, hid_s),
                                  conv_gn(hid_s, hid_s, 2)])
        ch = t_in * hid_s
        self.t_enc = nn.ModuleList([Inception(ch, hid_t // 2, hid_t)] +
                                   [Inception(hid_t, hid_t // 2, hid_t) for _ in range(n_t // 2 - 1)])
        self.t_dec = nn.ModuleList([Inception(hid_t, hid_t // 2, hid_t)] +
                                   [Inception(2 * hid_t, hid_t // 2, hid_t) for _ in range(n_t // 2 - 2)] +
                                   [Inception(2 * hid_t, hid_t // 2, ch)])
        self.dec = nn.ModuleList([conv_gn(hid_s, hid_s, 2, True), conv_gn(hid_s, hid_s), conv_gn(hid_s, hid_s, 2, True),
                                  conv_gn(2 * hid_s, hid_s)])
        self.readout = nn.Conv2d(hid_s, c_in, 1)

    def forward(self, x):
        b, t, c, h, w = x.shape
        z = x.reshape(b * t, c, h, w)
        skip = None
        for i, layer in enumerate(self.enc):
            z = layer(z)
            if i == 0:
                skip = z
        _, cs, hs, ws = z.shape
        z = z.view(b, t * cs, hs, ws)
        skips = []
        for layer in self.t_enc:
            z = layer(z)
            skips.append(z)
        z = self.t_dec[0](z)
        for i, layer in enumerate(self.t_dec[1:], 1):
            z = layer(torch.cat([z, skips[-i]], 1))
        z = z.view(b * t, cs, hs, ws)
        for layer in self.dec[:-1]:
            z = layer(z)
        z = self.dec[-1](torch.cat([z, skip], 1))
        return self.readout(z).view(b, t, c, h, w)


@torch.no_grad()
def evaluate(net, seqs, device, rank, world, pre=10, aft=10):
    net.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)  # psnr, ssim, frames
    for frames in seqs[rank::world]:
        video = load_gray(frames).to(device)
        for s in range(0, video.shape[0] - pre - aft + 1, aft):
            inp, gt = video[s:s + pre][None], video[s + pre:s + pre + aft]
            pred = net(inp)[0, :aft].clamp(0, 1)
            mse = (pred - gt).pow(2).mean((1, 2, 3))
            acc[0] += (-10 * torch.log10(mse.clamp_min(1e-10))).sum()
            p_np, g_np = pred[:, 0].cpu().numpy(), gt[:, 0].cpu().numpy()
            acc[1] += sum(structural_similarity(p_np[k], g_np[k], data_range=1.0) for k in range(aft))
            acc[2] += aft
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--exp", default="runs/simvp_kth")
    ap.add_argument("--batch_size", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2023)

    train_seqs, test_seqs = sequences(args.root, TRAIN_PERSONS), sequences(args.root, TEST_PERSONS)
    ds = KTHWindows(train_seqs)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    net = SimVP().to(device)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(loader))
    ckpt_path = os.path.join(args.exp, "checkpoint.pth")
    start_epoch, best = 0, -1.0
    if args.resume and os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
        if rank == 0:
            print(f"resumed from epoch {ck['epoch']}")
    model = DDP(net, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for it, x in enumerate(loader):
            x = x.to(device, non_blocking=True)
            pred = model(x[:, :10])
            loss = F.mse_loss(pred, x[:, 10:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.lerp_(p, 1 - args.ema)
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} it {it}/{len(loader)} mse {loss.item():.5f}", flush=True)

        psnr, ssim_v = evaluate(ema, test_seqs, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} test PSNR {psnr:.3f} SSIM {ssim_v:.4f}", flush=True)
            best = max(best, psnr)
            os.makedirs(args.exp, exist_ok=True)
            torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
