"""Conditional StyleGAN2-ADA on CIFAR-10 (paper's `cifar` config), DDP + gradient accumulation.

    torchrun --nproc_per_node=4 train_cifar_ada.py --data_dir /data/cifar10 --batch 64 --batch_gpu 8
"""
import argparse
import contextlib
import copy
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy import linalg
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from training.augment import AugmentPipe
from training.networks import Discriminator, Generator

CIFAR_AUG = dict(xflip=1, rotate90=1, xint=1, scale=1, rotate=1, aniso=1, xfrac=1,
                 brightness=1, contrast=1, lumaflip=1, hue=1, saturation=1)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--outdir", default="runs/cifar10-ada")
    p.add_argument("--batch", type=int, default=64, help="total batch over all GPUs")
    p.add_argument("--batch_gpu", type=int, default=8, help="samples per GPU per accumulation round")
    p.add_argument("--kimg", type=int, default=100000)
    p.add_argument("--lr", type=float, default=0.0025)
    p.add_argument("--gamma", type=float, default=0.01)
    p.add_argument("--r1_every", type=int, default=16)
    p.add_argument("--ema_kimg", type=float, default=500)
    p.add_argument("--ema_rampup", type=float, default=0.05)
    p.add_argument("--ada_target", type=float, default=0.6)
    p.add_argument("--ada_interval", type=int, default=4)
    p.add_argument("--ada_kimg", type=float, default=500)
    p.add_argument("--eval_every_kimg", type=int, default=2000)
    p.add_argument("--fid_ref", default="stats/cifar10_train_inception.npz")
    p.add_argument("--detector", default="inception-2015-12-05.pt")
    p.add_argument("--resume", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def fid_full(G_ema, detector, ref, num, c_dim, device, rank, world):
    # exact split: the first (num % world) ranks make one extra image
    n_local = num // world + (1 if rank < num % world else 0)
    feats = []
    for s in range(0, n_local, 250):
        b = min(250, n_local - s)
        z = torch.randn(b, G_ema.z_dim, device=device)
        c = F.one_hot(torch.randint(0, c_dim, (b,), device=device), c_dim).float()
        img = G_ema(z, c, noise_mode="const")[0]
        feats.append(detector((img * 127.5 + 128).clamp(0, 255).to(torch.uint8), return_features=True))
    feats = torch.cat(feats)
    # all_gather needs equal shapes: pad to the largest shard and drop the padding afterwards
    counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([feats.shape[0]], device=device))
    max_n = max(int(c.item()) for c in counts)
    padded = torch.zeros(max_n, feats.shape[1], device=device, dtype=feats.dtype)
    padded[: feats.shape[0]] = feats
    bucket = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bucket, padded)
    if rank != 0:
        return None
    x = torch.cat([b[: int(c.item())] for b, c in zip(bucket, counts)]).double().cpu().numpy()
    mu, sigma = x.mean(0), np.cov(x, rowvar=False)
    covmean, _ = linalg.sqrtm(sigma.dot(ref["sigma"]), disp=False)
    return float(np.square(mu - ref["mu"]).sum() + np.trace(sigma + ref["sigma"] - 2 * covmean.real))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    per_gpu = args.batch // world
    assert args.batch % world == 0 and per_gpu % args.batch_gpu == 0
    rounds = per_gpu // args.batch_gpu

    # only rank 0 touches the network / disk for the download, the others wait for it
    if rank == 0:
        datasets.CIFAR10(args.data_dir, train=True, download=True)
    dist.barrier()
    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.CIFAR10(args.data_dir, train=True, download=False, transform=tf)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=per_gpu, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    torch.manual_seed(args.seed)
    G = Generator(z_dim=512, c_dim=10, w_dim=512, img_resolution=32, mapping_layers=2).to(device)
    D = Discriminator(c_dim=10, img_resolution=32, mbstd_group_size=min(args.batch_gpu, 4)).to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)
    augment_pipe = AugmentPipe(**CIFAR_AUG).to(device)
    augment_pipe.p.zero_()

    ratio = args.r1_every / (args.r1_every + 1)
    opt_G = torch.optim.Adam(G.parameters(), lr=args.lr, betas=(0, 0.99), eps=1e-8)
    opt_D = torch.optim.Adam(D.parameters(), lr=args.lr * ratio, betas=(0, 0.99 ** ratio), eps=1e-8)

    cur_nimg = 0
    if args.resume:
        st = torch.load(args.resume, map_location="cpu")
        G.load_state_dict(st["G"])
        D.load_state_dict(st["D"])
        G_ema.load_state_dict(st["G_ema"])
        opt_G.load_state_dict(st["opt_G"])
        opt_D.load_state_dict(st["opt_D"])
        augment_pipe.p.fill_(st["augment_p"])
        cur_nimg = st["cur_nimg"]

    G_ddp = DDP(G, device_ids=[local_rank], broadcast_buffers=False)
    D_ddp = DDP(D, device_ids=[local_rank], broadcast_buffers=False)
    torch.manual_seed(args.seed * world + rank)

    detector = torch.jit.load(args.detector, map_location=device).eval()
    ref = dict(np.load(args.fid_ref))
    if rank == 0:
        os.makedirs(args.outdir, exist_ok=True)

    ada_stat = torch.zeros(2, device=device)
    step, epoch, best_fid = 0, 0, float("inf")
    next_eval = cur_nimg + args.eval_every_kimg * 1000
    while cur_nimg < args.kimg * 1000:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            c = F.one_hot(y, 10).float()
            do_r1 = step % args.r1_every == 0

            # ---- G: accumulate over rounds, all-reduce only on the last one ----
            G_ddp.requires_grad_(True)
            D_ddp.requires_grad_(False)
            opt_G.zero_grad(set_to_none=True)
            for r in range(rounds):
                ctx = G_ddp.no_sync() if r < rounds - 1 else contextlib.nullcontext()
                with ctx:
                    cz = c[torch.randperm(per_gpu, device=device)[: args.batch_gpu]]
                    img, _ = G_ddp(torch.randn(args.batch_gpu, 512, device=device), cz)
                    loss_G = F.softplus(-D_ddp(augment_pipe(img), cz)).mean() / rounds
                    loss_G.backward()
            opt_G.step()

            # ---- D: main loss + lazy R1 in the same pass ----
            G_ddp.requires_grad_(False)
            D_ddp.requires_grad_(True)
            opt_D.zero_grad(set_to_none=True)
            for r in range(rounds):
                sl = slice(r * args.batch_gpu, (r + 1) * args.batch_gpu)
                ctx = D_ddp.no_sync() if r < rounds - 1 else contextlib.nullcontext()
                with ctx:
                    with torch.no_grad():
                        fake, _ = G_ddp(torch.randn(args.batch_gpu, 512, device=device), c[sl])
                    real = x[sl].detach().requires_grad_(do_r1)
                    logits_real = D_ddp(augment_pipe(real), c[sl])
                    logits_fake = D_ddp(augment_pipe(fake), c[sl])
                    loss = F.softplus(logits_fake).mean() + F.softplus(-logits_real).mean()
                    if do_r1:
                        (g,) = torch.autograd.grad(logits_real.sum(), real, create_graph=True)
                        loss = loss + g.square().sum([1, 2, 3]).mean() * (args.gamma / 2) * args.r1_every
                    (loss / rounds).backward()
                ada_stat += torch.stack([logits_real.detach().sign().sum(), logits_real.new_tensor(logits_real.numel())])
            opt_D.step()

            # ---- EMA with ramp-up ----
            ema_nimg = min(args.ema_kimg * 1000, cur_nimg * args.ema_rampup)
            beta = 0.5 ** (args.batch / max(ema_nimg, 1e-8))
            with torch.no_grad():
                for pe, p in zip(G_ema.parameters(), G.parameters()):
                    pe.copy_(p.lerp(pe, beta))
                for be, b in zip(G_ema.buffers(), G.buffers()):
                    be.copy_(b)

            step += 1
            cur_nimg += args.batch

            # ---- ADA: rank 0 decides, everyone receives the same p ----
            if step % args.ada_interval == 0:
                dist.reduce(ada_stat, dst=0)
                if rank == 0:
                    rt = (ada_stat[0] / ada_stat[1]).item()
                    adjust = np.sign(rt - args.ada_target) * args.batch * args.ada_interval / (args.ada_kimg * 1000)
                    augment_pipe.p.copy_((augment_pipe.p + adjust).clamp(min=0))
                dist.broadcast(augment_pipe.p, src=0)
                ada_stat.zero_()

            if cur_nimg >= next_eval or cur_nimg >= args.kimg * 1000:
                next_eval += args.eval_every_kimg * 1000
                fid = fid_full(G_ema, detector, ref, 50000, 10, device, rank, world)
                if rank == 0:
                    print(f"kimg {cur_nimg / 1000:.0f} p {augment_pipe.p.item():.3f} fid50k_full {fid:.2f}", flush=True)
                    state = {"G": G.state_dict(), "D": D.state_dict(), "G_ema": G_ema.state_dict(),
                             "opt_G": opt_G.state_dict(), "opt_D": opt_D.state_dict(),
                             "augment_p": augment_pipe.p.item(), "cur_nimg": cur_nimg}
                    torch.save(state, os.path.join(args.outdir, "last.pt"))
                    if fid < best_fid:
                        best_fid = fid
                        torch.save(state, os.path.join(args.outdir, "best.pt"))
                if cur_nimg >= args.kimg * 1000:
                    break
        epoch += 1

    # final sanity pass on the best snapshot; every rank reads it only after rank 0 has written it
    dist.barrier()
    st = torch.load(os.path.join(args.outdir, "best.pt"), map_location="cpu")
    G_ema.load_state_dict(st["G_ema"])
    fid = fid_full(G_ema, detector, ref, 50000, 10, device, rank, world)
    if rank == 0:
        print(f"best snapshot fid50k_full {fid:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
