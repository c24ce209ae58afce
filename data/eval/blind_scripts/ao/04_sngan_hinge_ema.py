"""SNGAN / hinge loss on LSUN-church 64 or CIFAR-10, with an EMA generator.

torchrun --nproc_per_node=4 sngan.py --dataset lsun_church --data_root /datasets/lsun --out runs/sngan_church
"""
import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import spectral_norm as SN
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image


class GBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.bn1 = nn.GroupNorm(8, cin)
        self.c1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.bn2 = nn.GroupNorm(8, cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.sc = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = F.interpolate(F.relu(self.bn1(x)), scale_factor=2)
        h = self.c2(F.relu(self.bn2(self.c1(h))))
        return h + self.sc(F.interpolate(x, scale_factor=2))


class Generator(nn.Module):
    def __init__(self, zdim=128, ch=512, res=64):
        super().__init__()
        self.zdim = zdim
        self.fc = nn.Linear(zdim, 4 * 4 * ch)
        n_up = {32: 3, 64: 4}[res]
        blocks, c = [], ch
        for _ in range(n_up):
            blocks.append(GBlock(c, c // 2))
            c //= 2
        self.blocks = nn.Sequential(*blocks)
        self.out = nn.Sequential(nn.GroupNorm(8, c), nn.ReLU(), nn.Conv2d(c, 3, 3, 1, 1), nn.Tanh())
        self.ch = ch

    def forward(self, z):
        return self.out(self.blocks(self.fc(z).view(-1, self.ch, 4, 4)))


class DBlock(nn.Module):
    def __init__(self, cin, cout, down=True, first=False):
        super().__init__()
        self.c1 = SN(nn.Conv2d(cin, cout, 3, 1, 1))
        self.c2 = SN(nn.Conv2d(cout, cout, 3, 1, 1))
        self.sc = SN(nn.Conv2d(cin, cout, 1))
        self.down, self.first = down, first

    def forward(self, x):
        h = x if self.first else F.relu(x)
        h = self.c2(F.relu(self.c1(h)))
        s = self.sc(x)
        if self.down:
            h, s = F.avg_pool2d(h, 2), F.avg_pool2d(s, 2)
        return h + s


class Discriminator(nn.Module):
    def __init__(self, ch=64, res=64):
        super().__init__()
        mults = [1, 2, 4, 8] if res == 64 else [2, 4, 4]
        layers, c = [], 3
        for i, m in enumerate(mults):
            layers.append(DBlock(c, ch * m, down=True, first=(i == 0)))
            c = ch * m
        layers.append(DBlock(c, c, down=False))
        self.blocks = nn.Sequential(*layers)
        self.fc = SN(nn.Linear(c, 1))

    def forward(self, x):
        h = F.relu(self.blocks(x)).sum(dim=[2, 3])
        return self.fc(h).squeeze(1)


def make_dataset(name, root, res):
    tf = transforms.Compose([
        transforms.Resize(res),
        transforms.CenterCrop(res),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    if name == "cifar10":
        return datasets.CIFAR10(root, train=True, transform=tf)
    if name == "lsun_church":
        return datasets.LSUN(root, classes=["church_outdoor_train"], transform=tf)
    return datasets.ImageFolder(root, transform=tf)


@torch.no_grad()
def accumulate(ema, model, decay=0.999):
    for pe, p in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(p.detach(), alpha=1 - decay)
    for be, b in zip(ema.buffers(), model.buffers()):
        be.copy_(b)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default="cifar10")
    parser.add_argument("--data_root", default="data")
    parser.add_argument("--res", type=int, default=64)
    parser.add_argument("--out", default="runs/sngan")
    parser.add_argument("--batch_size", type=int, default=64, help="per gpu")
    parser.add_argument("--n_dis", type=int, default=2)
    parser.add_argument("--lr_g", type=float, default=2e-4)
    parser.add_argument("--lr_d", type=float, default=2e-4)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--ema_start", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", default="")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    dataset = make_dataset(args.dataset, args.data_root, args.res)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    G = Generator(res=args.res).to(device)
    D = Discriminator(res=args.res).to(device)
    G_ema = copy.deepcopy(G).eval()
    opt_g = torch.optim.Adam(G.parameters(), lr=args.lr_g, betas=(0.0, 0.9))
    opt_d = torch.optim.Adam(D.parameters(), lr=args.lr_d, betas=(0.0, 0.9))

    start_epoch, it = 0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        G.load_state_dict(ck["G"]); D.load_state_dict(ck["D"]); G_ema.load_state_dict(ck["G_ema"])
        opt_g.load_state_dict(ck["opt_g"]); opt_d.load_state_dict(ck["opt_d"])
        start_epoch, it = ck["epoch"] + 1, ck["it"]

    G = DDP(G, device_ids=[local_rank])
    D = DDP(D, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        fixed_z = torch.randn(64, G.module.zdim, device=device)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        G.train(); D.train()
        d_sum, g_sum, n_batches = 0.0, 0.0, 0
        t0 = time.time()
        data_iter = iter(loader)
        steps = len(loader) // args.n_dis
        for _ in range(steps):
            # --- D updates
            for _ in range(args.n_dis):
                real, _ = next(data_iter)
                real = real.to(device, non_blocking=True)
                z = torch.randn(real.size(0), G.module.zdim, device=device)
                with torch.no_grad():
                    fake = G(z)
                logits = D(torch.cat([real, fake]))
                d_real, d_fake = logits.chunk(2)
                loss_d = F.relu(1 - d_real).mean() + F.relu(1 + d_fake).mean()
                opt_d.zero_grad(set_to_none=True)
                loss_d.backward()
                opt_d.step()
                d_sum += loss_d.item()

            # --- G update
            z = torch.randn(args.batch_size * 2, G.module.zdim, device=device)
            loss_g = -D(G(z)).mean()
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()
            g_sum += loss_g.item()
            n_batches += 1
            it += 1

            if it < args.ema_start:
                G_ema.load_state_dict(G.module.state_dict())
            else:
                accumulate(G_ema, G.module)

        stats = torch.tensor([d_sum / args.n_dis, g_sum, float(n_batches)])
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        if rank == 0:
            d_avg, g_avg = stats[0] / stats[2], stats[1] / stats[2]
            print(f"[{epoch:03d}] it {it} loss_d {d_avg:.4f} loss_g {g_avg:.4f} {time.time() - t0:.0f}s", flush=True)
            with torch.no_grad():
                imgs = G_ema(fixed_z)
            save_image(imgs, os.path.join(args.out, f"ema_{epoch:04d}.png"), nrow=8, normalize=True,
                       value_range=(-1, 1))
            torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(), "G_ema": G_ema.state_dict(),
                        "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(), "epoch": epoch, "it": it},
                       os.path.join(args.out, "latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
