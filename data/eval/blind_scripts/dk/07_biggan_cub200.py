"""Class-conditional BigGAN (128px) on CUB-200-2011 bird crops.

Per-GPU batches are small (16), so the generator's conditional BatchNorm layers are
converted to SyncBatchNorm (the "cross-replica BN" of the BigGAN paper).

    torchrun --nproc_per_node=8 train.py --data /data/cub200_crops/train --out runs/biggan_cub
"""
import argparse
import copy
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import spectral_norm
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from torchvision.utils import save_image

from fid import InceptionV3Features, frechet_distance


class CBN(nn.Module):
    def __init__(self, ch, cond_dim):
        super().__init__()
        self.bn = nn.BatchNorm2d(ch, affine=False)
        self.gamma = spectral_norm(nn.Linear(cond_dim, ch))
        self.beta = spectral_norm(nn.Linear(cond_dim, ch))

    def forward(self, x, c):
        return self.bn(x) * (1 + self.gamma(c))[:, :, None, None] + self.beta(c)[:, :, None, None]


class GBlock(nn.Module):
    def __init__(self, cin, cout, cond_dim):
        super().__init__()
        self.n1, self.n2 = CBN(cin, cond_dim), CBN(cout, cond_dim)
        self.c1 = spectral_norm(nn.Conv2d(cin, cout, 3, padding=1))
        self.c2 = spectral_norm(nn.Conv2d(cout, cout, 3, padding=1))
        self.sc = spectral_norm(nn.Conv2d(cin, cout, 1))

    def forward(self, x, c):
        h = F.interpolate(F.relu(self.n1(x, c)), scale_factor=2)
        h = self.c2(F.relu(self.n2(self.c1(h), c)))
        return h + self.sc(F.interpolate(x, scale_factor=2))


class Generator(nn.Module):
    def __init__(self, n_classes, z_dim=120, ch=64, emb=128):
        super().__init__()
        mult = [16, 16, 8, 4, 2, 1]
        self.z_dim, self.n_chunks = z_dim, len(mult)
        self.chunk = z_dim // self.n_chunks
        self.embed = nn.Embedding(n_classes, emb)
        self.fc = spectral_norm(nn.Linear(self.chunk, mult[0] * ch * 16))
        self.blocks = nn.ModuleList(GBlock(mult[i] * ch, mult[i + 1] * ch, emb + self.chunk) for i in range(5))
        self.out = nn.Sequential(nn.BatchNorm2d(ch), nn.ReLU(), spectral_norm(nn.Conv2d(ch, 3, 3, padding=1)), nn.Tanh())

    def forward(self, z, y):
        zs = z.split(self.chunk, dim=1)
        e = self.embed(y)
        h = self.fc(zs[0]).view(z.size(0), -1, 4, 4)
        for blk, zc in zip(self.blocks, zs[1:]):
            h = blk(h, torch.cat([e, zc], 1))
        return self.out(h)


class DBlock(nn.Module):
    def __init__(self, cin, cout, down=True, first=False):
        super().__init__()
        self.c1 = spectral_norm(nn.Conv2d(cin, cout, 3, padding=1))
        self.c2 = spectral_norm(nn.Conv2d(cout, cout, 3, padding=1))
        self.sc = spectral_norm(nn.Conv2d(cin, cout, 1))
        self.down, self.first = down, first

    def forward(self, x):
        h = x if self.first else F.relu(x)
        h = self.c2(F.relu(self.c1(h)))
        s = self.sc(x)
        if self.down:
            h, s = F.avg_pool2d(h, 2), F.avg_pool2d(s, 2)
        return h + s


class Discriminator(nn.Module):
    def __init__(self, n_classes, ch=64):
        super().__init__()
        mult = [1, 2, 4, 8, 16, 16]
        blocks = [DBlock(3, ch, first=True)]
        blocks += [DBlock(mult[i] * ch, mult[i + 1] * ch, down=i < 4) for i in range(5)]
        self.blocks = nn.Sequential(*blocks)
        self.fc = spectral_norm(nn.Linear(16 * ch, 1))
        self.proj = spectral_norm(nn.Embedding(n_classes, 16 * ch))

    def forward(self, x, y):
        h = F.relu(self.blocks(x)).sum(dim=(2, 3))
        return self.fc(h).squeeze(1) + (self.proj(y) * h).sum(1)


@torch.no_grad()
def update_ema(ema, model, decay):
    for pe, p in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(p.detach(), alpha=1 - decay)
    for be, b in zip(ema.buffers(), model.buffers()):
        be.copy_(b)


@torch.no_grad()
def evaluate(G_ema, feat_net, ref, n_classes, n_total, device, world_size, rank):
    G_ema.eval()
    n_local = -(-n_total // world_size)
    feats = []
    for s in range(0, n_local, 50):
        b = min(50, n_local - s)
        z = torch.randn(b, G_ema.z_dim, device=device)
        y = torch.randint(0, n_classes, (b,), device=device)
        feats.append(feat_net((G_ema(z, y) + 1) / 2))
    feats = torch.cat(feats)
    bucket = [torch.zeros_like(feats) for _ in range(world_size)]
    dist.all_gather(bucket, feats)
    if rank != 0:
        return None
    allf = torch.cat(bucket)[:n_total].double().cpu().numpy()
    return frechet_distance(allf.mean(0), np.cov(allf, rowvar=False), ref["mu"], ref["sigma"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/biggan_cub")
    ap.add_argument("--ref_stats", default="stats/cub200_128_train.npz")
    ap.add_argument("--batch_size", type=int, default=16, help="per GPU")
    ap.add_argument("--d_steps", type=int, default=2)
    ap.add_argument("--d_accum", type=int, default=2)
    ap.add_argument("--g_lr", type=float, default=1e-4)
    ap.add_argument("--d_lr", type=float, default=4e-4)
    ap.add_argument("--iters", type=int, default=150000)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--eval_every", type=int, default=5000)
    ap.add_argument("--n_fid", type=int, default=10000)
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tf = transforms.Compose([transforms.Resize(128), transforms.CenterCrop(128), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, tf)
    n_classes = len(ds.classes)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    torch.manual_seed(args.seed)
    G = Generator(n_classes).to(device)
    D = Discriminator(n_classes).to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)

    G = nn.SyncBatchNorm.convert_sync_batchnorm(G)
    G = DDP(G, device_ids=[local_rank], output_device=local_rank)
    D = DDP(D, device_ids=[local_rank], output_device=local_rank)
    opt_G = torch.optim.Adam(G.parameters(), lr=args.g_lr, betas=(0.0, 0.999), eps=1e-6)
    opt_D = torch.optim.Adam(D.parameters(), lr=args.d_lr, betas=(0.0, 0.999), eps=1e-6)

    it, epoch = 0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        G.module.load_state_dict(ck["G"])
        D.module.load_state_dict(ck["D"])
        G_ema.load_state_dict(ck["G_ema"])
        opt_G.load_state_dict(ck["opt_G"])
        opt_D.load_state_dict(ck["opt_D"])
        it, epoch = ck["it"], ck["epoch"]
    torch.manual_seed(args.seed + 1000 * rank + it)

    feat_net = InceptionV3Features().to(device).eval()
    ref = np.load(args.ref_stats)
    writer = SummaryWriter(args.out) if rank == 0 else None
    fixed_z = torch.randn(n_classes, G_ema.z_dim, device=device)
    fixed_y = torch.arange(n_classes, device=device)

    def batches():
        nonlocal epoch
        while True:
            sampler.set_epoch(epoch)
            for b in loader:
                yield b
            epoch += 1

    data = batches()
    while it < args.iters:
        G.train()
        for p in D.parameters():
            p.requires_grad_(True)
        for _ in range(args.d_steps):
            opt_D.zero_grad(set_to_none=True)
            for acc in range(args.d_accum):
                x, y = next(data)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                z = torch.randn(x.size(0), G_ema.z_dim, device=device)
                y_fake = torch.randint(0, n_classes, (x.size(0),), device=device)
                with torch.no_grad():
                    fake = G(z, y_fake)
                last = acc == args.d_accum - 1
                ctx = D.no_sync() if not last else torch.enable_grad()
                with ctx:
                    logits = D(torch.cat([x, fake]), torch.cat([y, y_fake]))
                    d_real, d_fake = logits.chunk(2)
                    loss_D = (F.relu(1 - d_real).mean() + F.relu(1 + d_fake).mean()) / args.d_accum
                    loss_D.backward()
            opt_D.step()

        for p in D.parameters():
            p.requires_grad_(False)
        opt_G.zero_grad(set_to_none=True)
        z = torch.randn(args.batch_size, G_ema.z_dim, device=device)
        y_fake = torch.randint(0, n_classes, (args.batch_size,), device=device)
        loss_G = -D(G(z, y_fake), y_fake).mean()
        loss_G.backward()
        opt_G.step()
        update_ema(G_ema, G.module, args.ema if it > 1000 else 0.0)
        it += 1

        if it % 200 == 0:
            l = torch.stack([loss_D.detach() * args.d_accum, loss_G.detach()])
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                writer.add_scalar("loss/D", l[0].item(), it)
                writer.add_scalar("loss/G", l[1].item(), it)

        if it % args.eval_every == 0:
            fid = evaluate(G_ema, feat_net, ref, n_classes, args.n_fid, device, world_size, rank)
            if rank == 0:
                writer.add_scalar("fid10k", fid, it)
                print(f"it {it} epoch {epoch} FID {fid:.2f}", flush=True)
                save_image(G_ema(fixed_z, fixed_y), os.path.join(args.out, f"grid_{it:06d}.png"),
                           nrow=20, normalize=True, value_range=(-1, 1))
                torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(), "G_ema": G_ema.state_dict(),
                            "opt_G": opt_G.state_dict(), "opt_D": opt_D.state_dict(), "it": it, "epoch": epoch},
                           os.path.join(args.out, "ckpt.pt"))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
