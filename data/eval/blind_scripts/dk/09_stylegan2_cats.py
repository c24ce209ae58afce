# StyleGAN2 + ADA on AFHQ-cat (5k images, 512px). Reports KID and FID against the full training set.
#
#   torchrun --nproc_per_node=8 train_cats.py --data /data/afhq/train/cat --outdir runs/afhq-cat
import argparse
import copy
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from scipy import linalg
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from augment import AugmentPipe
from networks import Discriminator, Generator


class FolderDataset(Dataset):
    def __init__(self, root, flip=True):
        self.paths = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith((".jpg", ".png")))
        self.flip = flip

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        x = torch.from_numpy(np.asarray(Image.open(self.paths[i]).convert("RGB"), dtype=np.uint8).copy())
        x = x.permute(2, 0, 1)
        if self.flip and torch.rand(()) < 0.5:
            x = x.flip(2)
        return x


def kid_from_features(real, fake, num_subsets=100, max_subset_size=1000):
    n = real.shape[1]
    m = min(min(len(real), len(fake)), max_subset_size)
    t = 0
    for _ in range(num_subsets):
        x = fake[np.random.choice(len(fake), m, replace=False)]
        y = real[np.random.choice(len(real), m, replace=False)]
        a = (x @ x.T / n + 1) ** 3 + (y @ y.T / n + 1) ** 3
        b = (x @ y.T / n + 1) ** 3
        t += (a.sum() - np.diag(a).sum()) / (m - 1) - b.sum() * 2 / m
    return float(t / num_subsets / m)


def fid_from_features(real, fake):
    mu1, s1 = real.mean(0), np.cov(real, rowvar=False)
    mu2, s2 = fake.mean(0), np.cov(fake, rowvar=False)
    covmean, _ = linalg.sqrtm(s1.dot(s2), disp=False)
    return float(np.square(mu1 - mu2).sum() + np.trace(s1 + s2 - 2 * np.real(covmean)))


def gather_features(local, world_size):
    out = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(out, local)
    return torch.cat(out).double().cpu().numpy()


@torch.no_grad()
def real_features(dataset, detector, device, rank, world_size, batch=64):
    # each real image exactly once: rank r takes images r, r+W, r+2W, ...
    shard = Subset(dataset, list(range(rank, len(dataset), world_size)))
    feats = []
    for x in DataLoader(shard, batch_size=batch, num_workers=4):
        feats.append(detector(x.to(device), return_features=True))
    return gather_features(torch.cat(feats), world_size)


@torch.no_grad()
def fake_features(G_ema, detector, num, device, world_size, batch=64):
    per_rank = math.ceil(num / world_size)
    feats = []
    for s in range(0, per_rank, batch):
        z = torch.randn(min(batch, per_rank - s), G_ema.z_dim, device=device)
        img = G_ema(z, None, truncation_psi=1.0, noise_mode="const")[0]
        feats.append(detector((img * 127.5 + 128).clamp(0, 255).to(torch.uint8), return_features=True))
    return gather_features(torch.cat(feats), world_size)[:num]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--outdir", default="runs/afhq-cat")
    ap.add_argument("--batch_gpu", type=int, default=4)
    ap.add_argument("--kimg", type=int, default=10000)
    ap.add_argument("--lr", type=float, default=0.0025)
    ap.add_argument("--gamma", type=float, default=0.5)
    ap.add_argument("--r1_every", type=int, default=16)
    ap.add_argument("--pl_every", type=int, default=4)
    ap.add_argument("--pl_weight", type=float, default=2.0)
    ap.add_argument("--mixing", type=float, default=0.9)
    ap.add_argument("--ada_target", type=float, default=0.6)
    ap.add_argument("--ada_interval", type=int, default=4)
    ap.add_argument("--ada_kimg", type=float, default=100)
    ap.add_argument("--metric_every_kimg", type=int, default=200)
    ap.add_argument("--detector", default="inception-2015-12-05.pt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    batch_total = args.batch_gpu * world_size

    torch.manual_seed(args.seed)
    G = Generator(z_dim=512, w_dim=512, img_resolution=512, img_channels=3).to(device)
    D = Discriminator(img_resolution=512, img_channels=3).to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)
    aug = AugmentPipe(xflip=1, rotate90=1, xint=1, scale=1, rotate=1, aniso=1, xfrac=1,
                      brightness=1, contrast=1, lumaflip=1, hue=1, saturation=1).to(device)
    aug.p.zero_()
    torch.manual_seed(args.seed * world_size + rank)
    np.random.seed(args.seed * world_size + rank)

    G_ddp = DDP(G, device_ids=[local_rank], broadcast_buffers=False)
    D_ddp = DDP(D, device_ids=[local_rank], broadcast_buffers=False)
    g_r = args.pl_every / (args.pl_every + 1)
    d_r = args.r1_every / (args.r1_every + 1)
    opt_G = torch.optim.Adam(G.parameters(), lr=args.lr * g_r, betas=(0, 0.99 ** g_r), eps=1e-8)
    opt_D = torch.optim.Adam(D.parameters(), lr=args.lr * d_r, betas=(0, 0.99 ** d_r), eps=1e-8)

    dataset = FolderDataset(args.data)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_gpu, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    detector = torch.jit.load(args.detector, map_location=device).eval()
    eval_set = FolderDataset(args.data, flip=False)
    feats_real = real_features(eval_set, detector, device, rank, world_size)
    if rank == 0:
        os.makedirs(args.outdir, exist_ok=True)
        log = open(os.path.join(args.outdir, "metrics.jsonl"), "a")

    ada_acc = torch.zeros(2, device=device)
    pl_mean = torch.zeros((), device=device)
    ema_beta = 0.5 ** (batch_total / 10000.0)
    cur_nimg, step, epoch, next_metric = 0, 0, 0, 0

    while cur_nimg < args.kimg * 1000:
        sampler.set_epoch(epoch)
        for real in loader:
            real = real.to(device).float() / 127.5 - 1

            # D
            G_ddp.requires_grad_(False)
            D_ddp.requires_grad_(True)
            z = torch.randn(args.batch_gpu, 512, device=device)
            with torch.no_grad():
                fake, _ = G_ddp(z, None, mixing_prob=args.mixing)
            do_r1 = step % args.r1_every == 0
            real_in = real.detach().requires_grad_(do_r1)
            real_logits = D_ddp(aug(real_in), None)
            fake_logits = D_ddp(aug(fake), None)
            loss_D = F.softplus(-real_logits).mean() + F.softplus(fake_logits).mean()
            if do_r1:
                (g,) = torch.autograd.grad(real_logits.sum(), real_in, create_graph=True)
                loss_D = loss_D + g.square().sum([1, 2, 3]).mean() * (args.gamma / 2) * args.r1_every
            opt_D.zero_grad(set_to_none=True)
            loss_D.backward()
            opt_D.step()
            ada_acc += torch.stack([real_logits.detach().sign().sum(), torch.tensor(float(real_logits.numel()), device=device)])

            # G
            G_ddp.requires_grad_(True)
            D_ddp.requires_grad_(False)
            z = torch.randn(args.batch_gpu, 512, device=device)
            fake, _ = G_ddp(z, None, mixing_prob=args.mixing)
            loss_G = F.softplus(-D_ddp(aug(fake), None)).mean()
            opt_G.zero_grad(set_to_none=True)
            loss_G.backward()
            opt_G.step()

            if step % args.pl_every == 0:
                z = torch.randn(max(1, args.batch_gpu // 2), 512, device=device)
                img, ws = G_ddp(z, None, mixing_prob=args.mixing)
                noise = torch.randn_like(img) / math.sqrt(img.shape[2] * img.shape[3])
                (pg,) = torch.autograd.grad((img * noise).sum(), ws, create_graph=True)
                lengths = pg.square().sum(2).mean(1).sqrt()
                pl_new = pl_mean.lerp(lengths.mean(), 0.01)
                pl_mean.copy_(pl_new.detach())
                loss_pl = ((lengths - pl_new).square() * args.pl_weight).mean() * args.pl_every
                opt_G.zero_grad(set_to_none=True)
                (loss_pl + img[:, 0, 0, 0].mean() * 0).backward()
                opt_G.step()

            with torch.no_grad():
                for pe, p in zip(G_ema.parameters(), G.parameters()):
                    pe.copy_(p.lerp(pe, ema_beta))
                for be, b in zip(G_ema.buffers(), G.buffers()):
                    be.copy_(b)

            step += 1
            cur_nimg += batch_total

            if step % args.ada_interval == 0:
                dist.all_reduce(ada_acc)
                r_t = (ada_acc[0] / ada_acc[1]).item()
                delta = np.sign(r_t - args.ada_target) * batch_total * args.ada_interval / (args.ada_kimg * 1000)
                aug.p.copy_((aug.p + delta).clamp(min=0.0))
                ada_acc.zero_()

            if cur_nimg >= next_metric:
                next_metric += args.metric_every_kimg * 1000
                feats_fake = fake_features(G_ema, detector, 50000, device, world_size)
                if rank == 0:
                    rec = {"kimg": cur_nimg / 1000, "augment_p": aug.p.item(),
                           "fid50k_full": fid_from_features(feats_real, feats_fake),
                           "kid50k_full": kid_from_features(feats_real, feats_fake)}
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    print(rec, flush=True)
                    torch.save({"G": G.state_dict(), "D": D.state_dict(), "G_ema": G_ema.state_dict(),
                                "augment_p": aug.p.item(), "cur_nimg": cur_nimg},
                               os.path.join(args.outdir, f"snapshot-{cur_nimg // 1000:06d}.pt"))

            if cur_nimg >= args.kimg * 1000:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
