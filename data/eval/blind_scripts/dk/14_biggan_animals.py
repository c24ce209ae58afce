"""BigGAN + DiffAugment on AFHQ (cat / dog / wild), 128x128, class conditional.

    torchrun --nproc_per_node=4 train_biggan_afhq.py --data /data/afhq/train --out /nfs/gan/biggan_afhq
"""
import argparse
import copy
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image

from biggan import BigGANDiscriminator, BigGANGenerator
from DiffAugment_pytorch import DiffAugment
from fid_utils import InceptionPool3, fid_from_feats

logger = logging.getLogger("biggan")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fid_ref", default="fid_stats/afhq128_train.npz")
    p.add_argument("--bs", type=int, default=32, help="per-GPU batch")
    p.add_argument("--g_lr", type=float, default=2e-4)
    p.add_argument("--d_lr", type=float, default=2e-4)
    p.add_argument("--d_steps", type=int, default=4)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--policy", default="color,translation,cutout")
    p.add_argument("--iters", type=int, default=100_000)
    p.add_argument("--ckpt_every", type=int, default=1000)
    p.add_argument("--fid_every", type=int, default=5000)
    p.add_argument("--fid_n", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def init_dist():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def repeat(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        yield from loader
        ep += 1


@torch.no_grad()
def ema_update(target, source, beta):
    for t, s in zip(target.parameters(), source.parameters()):
        t.copy_(torch.lerp(s, t, beta))
    for t, s in zip(target.buffers(), source.buffers()):
        t.copy_(s)


def save_checkpoint(path, step, G, D, G_ema, opt_G, opt_D):
    state = {
        "step": step,
        "G": G.module.state_dict(),
        "D": D.module.state_dict(),
        "G_ema": G_ema.state_dict(),
        "opt_G": opt_G.state_dict(),
        "opt_D": opt_D.state_dict(),
    }
    torch.save(state, path)


@torch.no_grad()
def fid(G_ema, pool3, ref, n, n_classes, z_dim, device, world):
    per = n // world
    feats = []
    for i in range(0, per, 100):
        b = min(100, per - i)
        img = G_ema(torch.randn(b, z_dim, device=device), torch.randint(0, n_classes, (b,), device=device))
        feats.append(pool3((img + 1) / 2))
    feats = torch.cat(feats)
    out = [torch.zeros_like(feats) for _ in range(world)]
    dist.all_gather(out, feats)
    return fid_from_feats(torch.cat(out).cpu().numpy(), ref["mu"], ref["sigma"])


def main():
    args = parse()
    rank, world, local_rank = init_dist()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    tf = transforms.Compose([transforms.Resize(128), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    ds = datasets.ImageFolder(args.data, transform=tf)
    n_classes = len(ds.classes)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    data = repeat(DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                             drop_last=True), sampler)

    torch.manual_seed(args.seed)
    G = BigGANGenerator(n_classes=n_classes, resolution=128, z_dim=120).to(device)
    D = BigGANDiscriminator(n_classes=n_classes, resolution=128).to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)
    torch.manual_seed(args.seed + rank + 1)

    G = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(G), device_ids=[local_rank])
    D = DDP(D, device_ids=[local_rank])
    opt_G = torch.optim.Adam(G.parameters(), lr=args.g_lr, betas=(0.0, 0.999))
    opt_D = torch.optim.Adam(D.parameters(), lr=args.d_lr, betas=(0.0, 0.999))

    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt_path):
        st = torch.load(ckpt_path, map_location="cpu")
        G.module.load_state_dict(st["G"])
        D.module.load_state_dict(st["D"])
        G_ema.load_state_dict(st["G_ema"])
        opt_G.load_state_dict(st["opt_G"])
        opt_D.load_state_dict(st["opt_D"])
        step = st["step"]
        logger.info("resumed at step %d", step)

    pool3 = InceptionPool3().to(device).eval()
    ref = np.load(args.fid_ref)
    fixed_z = torch.randn(8 * n_classes, 120, device=device)
    fixed_y = torch.arange(n_classes, device=device).repeat_interleave(8)
    if rank == 0:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
    dist.barrier()

    while step < args.iters:
        G.train()
        D.requires_grad_(True)
        for _ in range(args.d_steps):
            x, y = next(data)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            y_fake = torch.randint(0, n_classes, (x.size(0),), device=device)
            with torch.no_grad():
                fake = G(torch.randn(x.size(0), 120, device=device), y_fake)
            scores = D(DiffAugment(torch.cat([x, fake]), policy=args.policy), torch.cat([y, y_fake]))
            s_real, s_fake = scores.split(x.size(0))
            loss_D = F.relu(1.0 - s_real).mean() + F.relu(1.0 + s_fake).mean()
            opt_D.zero_grad(set_to_none=True)
            loss_D.backward()
            opt_D.step()

        D.requires_grad_(False)
        y_fake = torch.randint(0, n_classes, (args.bs,), device=device)
        fake = G(torch.randn(args.bs, 120, device=device), y_fake)
        loss_G = -D(DiffAugment(fake, policy=args.policy), y_fake).mean()
        opt_G.zero_grad(set_to_none=True)
        loss_G.backward()
        opt_G.step()
        ema_update(G_ema, G.module, args.ema)
        step += 1

        if step % 100 == 0:
            t = torch.stack([loss_D.detach(), loss_G.detach(), s_real.mean().detach(), s_fake.mean().detach()])
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            logger.info("step %d | D %.4f | G %.4f | D(x) %.3f | D(G(z)) %.3f", step, *t.tolist())

        if step % args.ckpt_every == 0:
            save_checkpoint(ckpt_path, step, G, D, G_ema, opt_G, opt_D)
            if rank == 0:
                with torch.no_grad():
                    save_image(G_ema(fixed_z, fixed_y), os.path.join(args.out, "samples", f"{step:06d}.jpg"),
                               nrow=8, normalize=True, value_range=(-1, 1))

        if step % args.fid_every == 0:
            score = fid(G_ema, pool3, ref, args.fid_n, n_classes, 120, device, world)
            logger.info("step %d | FID %.3f", step, score)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
