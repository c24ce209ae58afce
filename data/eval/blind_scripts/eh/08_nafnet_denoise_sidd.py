"""NAFNet-SIDD-width32 real-noise denoising.

Single-node launcher based on torch.multiprocessing (our workstation queue does not have torchrun wrappers):

    python 08_nafnet_denoise_sidd.py --train-dir /data/SIDD/train_crops --val-mat /data/SIDD/val
"""
import argparse
import logging
import os
import random
import time
from glob import glob

import cv2
import numpy as np
import scipy.io as sio
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-dir", required=True, help="contains input/ and gt/ with 512x512 crops")
    ap.add_argument("--val-mat", required=True, help="folder with ValidationNoisyBlocksSrgb.mat / ValidationGtBlocksSrgb.mat")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--patch", type=int, default=256)
    ap.add_argument("--batch-per-gpu", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--iters", type=int, default=200000)
    ap.add_argument("--val-freq", type=int, default=20000)
    ap.add_argument("--work-dir", default="./work_dirs/nafnet_sidd_w32")
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


# ------------------------------------------------------------------------------------------ model
class LayerNorm2d(nn.Module):
    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c)), eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        return self.weight[:, None, None] * (x - u) / torch.sqrt(s + self.eps) + self.bias[:, None, None]


class NAFBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm1, self.norm2 = LayerNorm2d(c), LayerNorm2d(c)
        self.conv1 = nn.Conv2d(c, 2 * c, 1)
        self.conv2 = nn.Conv2d(2 * c, 2 * c, 3, padding=1, groups=2 * c)
        self.sca = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c, 1))
        self.conv3 = nn.Conv2d(c, c, 1)
        self.conv4 = nn.Conv2d(c, 2 * c, 1)
        self.conv5 = nn.Conv2d(c, c, 1)
        self.beta = nn.Parameter(torch.zeros(1, c, 1, 1))
        self.gamma = nn.Parameter(torch.zeros(1, c, 1, 1))

    @staticmethod
    def gate(x):
        a, b = x.chunk(2, dim=1)
        return a * b

    def forward(self, inp):
        x = self.gate(self.conv2(self.conv1(self.norm1(inp))))
        y = inp + self.conv3(x * self.sca(x)) * self.beta
        return y + self.conv5(self.gate(self.conv4(self.norm2(y)))) * self.gamma


class NAFNet(nn.Module):
    def __init__(self, width=32, enc=(2, 2, 4, 8), middle=12, dec=(2, 2, 2, 2)):
        super().__init__()
        self.intro = nn.Conv2d(3, width, 3, padding=1)
        self.ending = nn.Conv2d(width, 3, 3, padding=1)
        self.encoders, self.downs, self.ups, self.decoders = (nn.ModuleList() for _ in range(4))
        c = width
        for n in enc:
            self.encoders.append(nn.Sequential(*[NAFBlock(c) for _ in range(n)]))
            self.downs.append(nn.Conv2d(c, 2 * c, 2, 2))
            c *= 2
        self.middle = nn.Sequential(*[NAFBlock(c) for _ in range(middle)])
        for n in dec:
            self.ups.append(nn.Sequential(nn.Conv2d(c, 2 * c, 1, bias=False), nn.PixelShuffle(2)))
            c //= 2
            self.decoders.append(nn.Sequential(*[NAFBlock(c) for _ in range(n)]))

    def forward(self, inp):
        x = self.intro(inp)
        skips = []
        for enc, down in zip(self.encoders, self.downs):
            x = enc(x)
            skips.append(x)
            x = down(x)
        x = self.middle(x)
        for dec, up, s in zip(self.decoders, self.ups, reversed(skips)):
            x = dec(up(x) + s)
        return self.ending(x) + inp


# ------------------------------------------------------------------------------------------ data
class SIDDCrops(Dataset):
    def __init__(self, root, patch):
        self.noisy = sorted(glob(os.path.join(root, "input", "*.png")))
        self.clean = [p.replace(f"{os.sep}input{os.sep}", f"{os.sep}gt{os.sep}") for p in self.noisy]
        self.patch = patch

    def __len__(self):
        return len(self.noisy)

    def __getitem__(self, i):
        n = cv2.imread(self.noisy[i])[:, :, ::-1]
        c = cv2.imread(self.clean[i])[:, :, ::-1]
        y = random.randint(0, n.shape[0] - self.patch)
        x = random.randint(0, n.shape[1] - self.patch)
        n, c = n[y:y + self.patch, x:x + self.patch], c[y:y + self.patch, x:x + self.patch]
        k = random.randint(0, 3)
        n, c = np.rot90(n, k), np.rot90(c, k)
        if random.random() < 0.5:
            n, c = n[:, ::-1], c[:, ::-1]
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float() / 255.0
        return to_t(n), to_t(c)


def load_sidd_val(folder):
    noisy = sio.loadmat(os.path.join(folder, "ValidationNoisyBlocksSrgb.mat"))["ValidationNoisyBlocksSrgb"]
    gt = sio.loadmat(os.path.join(folder, "ValidationGtBlocksSrgb.mat"))["ValidationGtBlocksSrgb"]
    # (40, 32, 256, 256, 3) uint8 -> list of 1280 blocks
    return noisy.reshape(-1, 256, 256, 3), gt.reshape(-1, 256, 256, 3)


def seed_worker(_):
    seed = torch.initial_seed() % 2 ** 32
    random.seed(seed)
    np.random.seed(seed)


# ------------------------------------------------------------------------------------------ worker
def main_worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    log = logging.getLogger("nafnet")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                            handlers=[logging.FileHandler(os.path.join(args.work_dir, "train.log")),
                                      logging.StreamHandler()])
    else:
        log.setLevel(logging.ERROR)

    torch.manual_seed(0)
    train_set = SIDDCrops(args.train_dir, args.patch)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    g = torch.Generator()
    g.manual_seed(1000 + rank)
    loader = DataLoader(train_set, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True,
                        worker_init_fn=seed_worker, generator=g)
    val_noisy, val_gt = load_sidd_val(args.val_mat)

    net = NAFNet(width=args.width).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.9))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.iters, eta_min=1e-7)
    step = 0
    if args.resume:
        state = torch.load(args.resume, map_location=device)
        net.load_state_dict(state["net"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = state["step"]
    model = DDP(net, device_ids=[rank], output_device=rank)

    epoch = step // len(loader)
    tic = time.time()
    while step < args.iters:
        sampler.set_epoch(epoch)
        for noisy, clean in loader:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            pred = model(noisy)
            # PSNR loss (NAFNet), scaled as in the reference implementation
            loss = 10.0 * torch.log10(((pred - clean) ** 2).mean(dim=(1, 2, 3)) + 1e-8).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 200 == 0:
                log.info("step %d loss %.3f lr %.2e (%.2fs/200it)", step, loss.item(),
                         scheduler.get_last_lr()[0], time.time() - tic)
                tic = time.time()

            if step % args.val_freq == 0 or step == args.iters:
                net.eval()
                total = torch.zeros(2, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for i in range(rank, len(val_noisy), world_size):
                        n = torch.from_numpy(val_noisy[i].transpose(2, 0, 1).copy()).float().div(255)
                        out = net(n.unsqueeze(0).to(device)).clamp(0, 1)
                        out = (out * 255).round()
                        gt = torch.from_numpy(val_gt[i].transpose(2, 0, 1).copy()).float().to(device)
                        mse = torch.mean((out.double() - gt.double()) ** 2)
                        total[0] += 10 * torch.log10(255.0 ** 2 / mse)
                        total[1] += 1
                net.train()
                dist.all_reduce(total)
                log.info("[val] step %d SIDD-val PSNR %.3f dB (%d blocks)", step,
                         (total[0] / total[1]).item(), int(total[1].item()))
                if rank == 0:
                    torch.save({"net": net.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "step": step},
                               os.path.join(args.work_dir, f"ckpt_{step:06d}.pth"))
            if step >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    world_size = torch.cuda.device_count()
    mp.spawn(main_worker, args=(world_size, args), nprocs=world_size, join=True)
