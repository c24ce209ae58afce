"""StyleGAN2 on LSUN Horse 256 (DDP), with style-mixing grids from the EMA generator.

    torchrun --nproc_per_node=8 train_horse.py --data /data/lsun/horse_256 --out runs/horse256
    # continue a run:
    torchrun --nproc_per_node=8 train_horse.py --data /data/lsun/horse_256 --out runs/horse256 --resume runs/horse256/last.pt
"""
import argparse
import copy
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from torchvision.utils import save_image

from networks.stylegan2 import Discriminator, Generator


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/horse256")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--res", type=int, default=256)
    ap.add_argument("--batch_gpu", type=int, default=8)
    ap.add_argument("--kimg", type=int, default=30000)
    ap.add_argument("--lr", type=float, default=0.002)
    ap.add_argument("--gamma", type=float, default=10.0)
    ap.add_argument("--d_reg_every", type=int, default=16)
    ap.add_argument("--g_reg_every", type=int, default=4)
    ap.add_argument("--pl_weight", type=float, default=2.0)
    ap.add_argument("--mixing", type=float, default=0.9)
    ap.add_argument("--ema_kimg", type=float, default=10.0)
    ap.add_argument("--snapshot_kimg", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


@torch.no_grad()
def style_mixing_grid(G_ema, path, n_src=6, n_dst=6, mix_layers=range(0, 6), psi=0.7, device="cuda"):
    """Rows: destination latents, columns: source latents whose coarse styles are copied in."""
    src_w = G_ema.mapping(torch.randn(n_src, G_ema.z_dim, device=device), truncation_psi=psi)
    dst_w = G_ema.mapping(torch.randn(n_dst, G_ema.z_dim, device=device), truncation_psi=psi)
    src_img = G_ema.synthesis(src_w, noise_mode="const")
    dst_img = G_ema.synthesis(dst_w, noise_mode="const")
    rows = [torch.cat([torch.ones_like(src_img[:1]), src_img])]
    for i in range(n_dst):
        w = dst_w[i:i + 1].repeat(n_src, 1, 1).clone()
        w[:, list(mix_layers)] = src_w[:, list(mix_layers)]
        rows.append(torch.cat([dst_img[i:i + 1], G_ema.synthesis(w, noise_mode="const")]))
    save_image(torch.cat(rows), path, nrow=n_src + 1, normalize=True, value_range=(-1, 1))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    batch = args.batch_gpu * world

    torch.manual_seed(args.seed)
    G = Generator(z_dim=512, w_dim=512, img_resolution=args.res).to(device)
    D = Discriminator(img_resolution=args.res).to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)

    g_ratio = args.g_reg_every / (args.g_reg_every + 1)
    d_ratio = args.d_reg_every / (args.d_reg_every + 1)
    opt_G = torch.optim.Adam(G.parameters(), lr=args.lr * g_ratio, betas=(0, 0.99 ** g_ratio), eps=1e-8)
    opt_D = torch.optim.Adam(D.parameters(), lr=args.lr * d_ratio, betas=(0, 0.99 ** d_ratio), eps=1e-8)

    cur_nimg = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        G.load_state_dict(ckpt["G"])
        D.load_state_dict(ckpt["D"])
        G_ema.load_state_dict(ckpt["G_ema"])
        opt_G.load_state_dict(ckpt["opt_G"])
        opt_D.load_state_dict(ckpt["opt_D"])
        cur_nimg = ckpt["cur_nimg"]
        del ckpt

    G_ddp = DDP(G, device_ids=[local_rank], broadcast_buffers=False)
    D_ddp = DDP(D, device_ids=[local_rank], broadcast_buffers=False)
    torch.manual_seed(args.seed * world + rank + cur_nimg)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, tf)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_gpu, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    writer = SummaryWriter(args.out) if rank == 0 else None
    ema_beta = 0.5 ** (batch / (args.ema_kimg * 1000))
    pl_mean = torch.zeros((), device=device)
    step = cur_nimg // batch
    next_snap = cur_nimg + args.snapshot_kimg * 1000
    epoch = step // len(loader)

    while cur_nimg < args.kimg * 1000:
        sampler.set_epoch(epoch)
        for real, _ in loader:
            real = real.to(device, non_blocking=True)

            # D main + lazy R1 (same backward)
            G_ddp.requires_grad_(False)
            D_ddp.requires_grad_(True)
            with torch.no_grad():
                fake, _ = G_ddp(torch.randn(args.batch_gpu, 512, device=device), mixing_prob=args.mixing)
            do_r1 = step % args.d_reg_every == 0
            real.requires_grad_(do_r1)
            logit_r, logit_f = D_ddp(real), D_ddp(fake)
            loss_D = F.softplus(logit_f).mean() + F.softplus(-logit_r).mean()
            if do_r1:
                (g,) = torch.autograd.grad(logit_r.sum(), real, create_graph=True)
                loss_D = loss_D + g.square().sum([1, 2, 3]).mean() * (args.gamma / 2) * args.d_reg_every
            opt_D.zero_grad(set_to_none=True)
            loss_D.backward()
            opt_D.step()

            # G main
            G_ddp.requires_grad_(True)
            D_ddp.requires_grad_(False)
            fake, _ = G_ddp(torch.randn(args.batch_gpu, 512, device=device), mixing_prob=args.mixing)
            loss_G = F.softplus(-D_ddp(fake)).mean()
            opt_G.zero_grad(set_to_none=True)
            loss_G.backward()
            opt_G.step()

            # G path length
            if step % args.g_reg_every == 0:
                img, ws = G_ddp(torch.randn(args.batch_gpu // 2, 512, device=device), mixing_prob=args.mixing)
                noise = torch.randn_like(img) / math.sqrt(img.shape[2] * img.shape[3])
                (jw,) = torch.autograd.grad((img * noise).sum(), ws, create_graph=True)
                lengths = jw.square().sum(2).mean(1).sqrt()
                target = pl_mean.lerp(lengths.mean(), 0.01)
                pl_mean.copy_(target.detach())
                loss_pl = (lengths - target).square().mean() * args.pl_weight * args.g_reg_every
                opt_G.zero_grad(set_to_none=True)
                (loss_pl + img[:, 0, 0, 0].sum() * 0).backward()
                opt_G.step()

            with torch.no_grad():
                for pe, p in zip(G_ema.parameters(), G.parameters()):
                    pe.copy_(p.lerp(pe, ema_beta))
                for be, b in zip(G_ema.buffers(), G.buffers()):
                    be.copy_(b)

            step += 1
            cur_nimg += batch

            if step % 100 == 0:
                t = torch.stack([loss_D.detach(), loss_G.detach(), pl_mean])
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("Loss/D", t[0].item(), cur_nimg // 1000)
                    writer.add_scalar("Loss/G", t[1].item(), cur_nimg // 1000)
                    writer.add_scalar("Loss/pl_mean", t[2].item(), cur_nimg // 1000)

            if cur_nimg >= next_snap or cur_nimg >= args.kimg * 1000:
                next_snap += args.snapshot_kimg * 1000
                if rank == 0:
                    style_mixing_grid(G_ema, os.path.join(args.out, f"mix_{cur_nimg // 1000:06d}.png"), device=device)
                    state = {"G": G_ddp.state_dict(), "D": D_ddp.state_dict(), "G_ema": G_ema.state_dict(),
                             "opt_G": opt_G.state_dict(), "opt_D": opt_D.state_dict(), "cur_nimg": cur_nimg}
                    torch.save(state, os.path.join(args.out, f"snapshot_{cur_nimg // 1000:06d}.pt"))
                    torch.save(state, os.path.join(args.out, "last.pt"))
                if cur_nimg >= args.kimg * 1000:
                    break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
