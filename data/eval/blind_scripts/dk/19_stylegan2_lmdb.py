"""StyleGAN2 on a raw image folder (LSUN-cat style). On first run the images are resized
and packed into an LMDB next to the data so that later runs start immediately.

    torchrun --nproc_per_node=8 train.py --images /data/lsun_cat/images --size 256
"""
import argparse
import copy
import io
import math
import os
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms
from torchvision.transforms import functional as TF

from metrics import fid_from_feats, load_inception
from stylegan2 import Discriminator, Generator


def resize_and_encode(path, size):
    img = Image.open(path).convert("RGB")
    img = TF.center_crop(TF.resize(img, size, interpolation=transforms.InterpolationMode.LANCZOS), size)
    buf = io.BytesIO()
    img.save(buf, format="png")
    return buf.getvalue()


def build_lmdb(image_dir, out_path, size, workers=16):
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(image_dir) for f in fs
                   if f.lower().endswith((".jpg", ".jpeg", ".png", ".webp")))
    env = lmdb.open(out_path, map_size=1024 ** 4, readahead=False)
    with ThreadPoolExecutor(workers) as pool, env.begin(write=True) as txn:
        for i, png in enumerate(pool.map(lambda p: resize_and_encode(p, size), files)):
            txn.put(f"{size}-{str(i).zfill(7)}".encode("utf-8"), png)
        txn.put(b"length", str(len(files)).encode("utf-8"))
    env.close()


class LMDBImages(Dataset):
    def __init__(self, path, size, transform):
        self.path, self.size, self.transform = path, size, transform
        self.env = None
        with lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False) as env:
            with env.begin(write=False) as txn:
                self.length = int(txn.get(b"length").decode("utf-8"))

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if self.env is None:  # opened lazily inside each worker
            self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False, meminit=False)
        with self.env.begin(write=False) as txn:
            png = txn.get(f"{self.size}-{str(i).zfill(7)}".encode("utf-8"))
        return self.transform(Image.open(io.BytesIO(png)))


@torch.no_grad()
def eval_fid(G_ema, inception, ref, n, device, world):
    per = math.ceil(n / world)
    feats = []
    for s in range(0, per, 64):
        b = min(64, per - s)
        img = G_ema(torch.randn(b, 512, device=device))[0]
        feats.append(inception((img.clamp(-1, 1) + 1) / 2))
    feats = torch.cat(feats)
    out = [torch.empty_like(feats) for _ in range(world)]
    dist.all_gather(out, feats)
    return torch.cat(out)[:n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--out", default="runs/lsun_cat256")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=500_000)
    ap.add_argument("--lr", type=float, default=0.002)
    ap.add_argument("--gamma", type=float, default=10.0)
    ap.add_argument("--r1_every", type=int, default=16)
    ap.add_argument("--pl_every", type=int, default=4)
    ap.add_argument("--fid_every", type=int, default=25_000)
    ap.add_argument("--ref_stats", default="stats/lsun_cat256.npz")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    lmdb_path = os.path.join(os.path.dirname(args.images.rstrip("/")), f"lmdb_{args.size}")
    if not os.path.exists(os.path.join(lmdb_path, "data.mdb")):
        print(f"[rank {rank}] packing {args.images} -> {lmdb_path}", flush=True)
        build_lmdb(args.images, lmdb_path, args.size)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    dataset = LMDBImages(lmdb_path, args.size, tf)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    torch.manual_seed(0)
    G = Generator(size=args.size, z_dim=512, n_mlp=8).to(device)
    D = Discriminator(size=args.size).to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)
    torch.manual_seed(rank + 1)
    G_ddp = DDP(G, device_ids=[local_rank], broadcast_buffers=False)
    D_ddp = DDP(D, device_ids=[local_rank], broadcast_buffers=False)
    gr, dr = args.pl_every / (args.pl_every + 1), args.r1_every / (args.r1_every + 1)
    opt_G = torch.optim.Adam(G.parameters(), lr=args.lr * gr, betas=(0, 0.99 ** gr))
    opt_D = torch.optim.Adam(D.parameters(), lr=args.lr * dr, betas=(0, 0.99 ** dr))

    inception = load_inception().to(device).eval()
    ref = np.load(args.ref_stats)
    writer = SummaryWriter(args.out) if rank == 0 else None
    pl_mean = torch.zeros((), device=device)
    beta = 0.5 ** (args.batch * world / 10000)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for real in loader:
            real = real.to(device, non_blocking=True)

            G_ddp.requires_grad_(False)
            D_ddp.requires_grad_(True)
            do_r1 = step % args.r1_every == 0
            with torch.no_grad():
                fake = G_ddp(torch.randn(args.batch, 512, device=device))[0]
            real.requires_grad_(do_r1)
            lr_, lf = D_ddp(real), D_ddp(fake)
            loss_D = F.softplus(lf).mean() + F.softplus(-lr_).mean()
            if do_r1:
                (g,) = torch.autograd.grad(lr_.sum(), real, create_graph=True)
                loss_D = loss_D + g.square().sum([1, 2, 3]).mean() * args.gamma / 2 * args.r1_every
            opt_D.zero_grad(set_to_none=True)
            loss_D.backward()
            opt_D.step()

            G_ddp.requires_grad_(True)
            D_ddp.requires_grad_(False)
            fake = G_ddp(torch.randn(args.batch, 512, device=device))[0]
            loss_G = F.softplus(-D_ddp(fake)).mean()
            opt_G.zero_grad(set_to_none=True)
            loss_G.backward()
            opt_G.step()

            if step % args.pl_every == 0:
                img, ws = G_ddp(torch.randn(args.batch // 2, 512, device=device), return_latents=True)
                noise = torch.randn_like(img) / math.sqrt(img.shape[2] * img.shape[3])
                (jw,) = torch.autograd.grad((img * noise).sum(), ws, create_graph=True)
                lengths = jw.square().sum(2).mean(1).sqrt()
                target = pl_mean.lerp(lengths.mean(), 0.01)
                pl_mean.copy_(target.detach())
                loss_pl = (lengths - target).square().mean() * 2.0 * args.pl_every
                opt_G.zero_grad(set_to_none=True)
                (loss_pl + 0 * img[0, 0, 0, 0]).backward()
                opt_G.step()

            with torch.no_grad():
                for pe, p in zip(G_ema.parameters(), G.parameters()):
                    pe.copy_(p.lerp(pe, beta))
            step += 1

            if step % 100 == 0:
                t = torch.stack([loss_D.detach(), loss_G.detach()])
                dist.all_reduce(t)
                if rank == 0:
                    writer.add_scalar("loss/D", t[0].item() / world, step)
                    writer.add_scalar("loss/G", t[1].item() / world, step)

            if step % args.fid_every == 0:
                feats = eval_fid(G_ema, inception, ref, 50000, device, world)
                if rank == 0:
                    fid = fid_from_feats(feats.double().cpu().numpy(), ref["mu"], ref["sigma"])
                    writer.add_scalar("fid50k", fid, step)
                    torch.save({"G": G.state_dict(), "D": D.state_dict(), "G_ema": G_ema.state_dict(),
                                "opt_G": opt_G.state_dict(), "opt_D": opt_D.state_dict(), "step": step},
                               os.path.join(args.out, f"ckpt_{step:07d}.pt"))
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
