"""Class-conditional SNGAN (hinge loss, projection discriminator) on CIFAR-10.

Generator and discriminator are each wrapped in DDP and have their own Adam
(TTUR). An EMA copy of the generator is kept for sampling.

    torchrun --standalone --nproc_per_node=4 sngan_cifar.py --data ./data --out runs/sngan
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import spectral_norm as SN
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.utils import save_image


class GBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm2d(cin), nn.BatchNorm2d(cout)
        self.c1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.sc = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = F.interpolate(F.relu(self.bn1(x)), scale_factor=2)
        h = self.c2(F.relu(self.bn2(self.c1(h))))
        return h + self.sc(F.interpolate(x, scale_factor=2))


class Generator(nn.Module):
    def __init__(self, nz=128, ch=256, n_classes=10):
        super().__init__()
        self.ch = ch
        self.embed = nn.Embedding(n_classes, nz)
        self.fc = nn.Linear(2 * nz, 4 * 4 * ch)
        self.blocks = nn.Sequential(GBlock(ch, ch), GBlock(ch, ch), GBlock(ch, ch))
        self.out = nn.Sequential(nn.BatchNorm2d(ch), nn.ReLU(), nn.Conv2d(ch, 3, 3, 1, 1), nn.Tanh())

    def forward(self, z, y):
        h = self.fc(torch.cat([z, self.embed(y)], 1)).view(-1, self.ch, 4, 4)
        return self.out(self.blocks(h))


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
    def __init__(self, ch=128, n_classes=10):
        super().__init__()
        self.blocks = nn.Sequential(DBlock(3, ch, first=True), DBlock(ch, ch),
                                    DBlock(ch, ch, down=False), DBlock(ch, ch, down=False))
        self.fc = SN(nn.Linear(ch, 1))
        self.embed = SN(nn.Embedding(n_classes, ch))

    def forward(self, x, y):
        h = F.relu(self.blocks(x)).sum(dim=(2, 3))
        return self.fc(h).squeeze(1) + (self.embed(y) * h).sum(1)


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, p in zip(ema.parameters(), model.parameters()):
        pe.lerp_(p, 1 - decay)
    for be, b in zip(ema.buffers(), model.buffers()):
        be.copy_(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="runs/sngan")
    ap.add_argument("--global_batch", type=int, default=64, help="summed over all GPUs")
    ap.add_argument("--iters", type=int, default=100000)
    ap.add_argument("--n_dis", type=int, default=5)
    ap.add_argument("--lr_g", type=float, default=2e-4)
    ap.add_argument("--lr_d", type=float, default=2e-4)
    ap.add_argument("--nz", type=int, default=128)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1 + rank)
    assert args.global_batch % world == 0
    batch = args.global_batch // world

    tf = T.Compose([T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])
    if rank == 0:
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
    dist.barrier()
    ds = torchvision.datasets.CIFAR10(args.data, train=True, download=False, transform=tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    # BN statistics over the global batch; G_ema runs in eval mode, so it never syncs
    G = nn.SyncBatchNorm.convert_sync_batchnorm(Generator(args.nz)).to(device)
    D = Discriminator().to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)
    opt_g = torch.optim.Adam(G.parameters(), args.lr_g, betas=(0.0, 0.9))
    opt_d = torch.optim.Adam(D.parameters(), args.lr_d, betas=(0.0, 0.9))

    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        G.load_state_dict(ck["G"])
        D.load_state_dict(ck["D"])
        G_ema.load_state_dict(ck["G_ema"])
        opt_g.load_state_dict(ck["opt_g"])
        opt_d.load_state_dict(ck["opt_d"])
        start = ck["step"]

    G = DDP(G, device_ids=[local_rank])
    # spectral norm updates its u/v buffers in every forward, and D runs twice per step
    D = DDP(D, device_ids=[local_rank], broadcast_buffers=False)

    fixed_z = torch.randn(100, args.nz, generator=torch.Generator().manual_seed(0)).to(device)
    fixed_y = torch.arange(10).repeat_interleave(10).to(device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    epoch = start * args.n_dis // len(loader)
    sampler.set_epoch(epoch)
    data_iter = iter(loader)

    def next_batch():
        nonlocal data_iter, epoch
        try:
            return next(data_iter)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            data_iter = iter(loader)
            return next(data_iter)

    for step in range(start, args.iters):
        for _ in range(args.n_dis):
            x, y = next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            z = torch.randn(x.size(0), args.nz, device=device)
            with torch.no_grad():
                fake = G(z, y)
            logits = D(torch.cat([x, fake]), torch.cat([y, y]))
            d_real, d_fake = logits.chunk(2)
            loss_d = F.relu(1 - d_real).mean() + F.relu(1 + d_fake).mean()
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()

        z = torch.randn(batch * 2, args.nz, device=device)
        yg = torch.randint(0, 10, (batch * 2,), device=device)
        loss_g = -D(G(z, yg), yg).mean()
        opt_g.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_g.step()
        ema_update(G_ema, G.module, args.ema if step > 1000 else 0.0)

        if step % 100 == 0:
            logs = torch.stack([loss_d.detach(), loss_g.detach()])
            dist.all_reduce(logs, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss_d {logs[0]:.4f} loss_g {logs[1]:.4f}", flush=True)

        if step % 5000 == 0 or step == args.iters - 1:
            if rank == 0:
                with torch.no_grad():
                    imgs = G_ema(fixed_z, fixed_y)
                save_image(imgs, os.path.join(args.out, f"samples_{step:06d}.png"), nrow=10, normalize=True)
                torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(),
                            "G_ema": G_ema.state_dict(), "opt_g": opt_g.state_dict(),
                            "opt_d": opt_d.state_dict(), "step": step + 1},
                           os.path.join(args.out, "ckpt.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
