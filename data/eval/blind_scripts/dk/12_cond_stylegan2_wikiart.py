"""Class-conditional StyleGAN2 on WikiArt (genre labels), 256x256.

A small held-out split is used as the FID reference so that the metric is not computed
against images the discriminator has memorised.

    torchrun --nproc_per_node=8 train_cond.py --root /data/wikiart --csv /data/wikiart/genre.csv
"""
import argparse
import copy
import csv
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from scipy import linalg
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms

from networks import ConditionalDiscriminator, ConditionalGenerator
from pytorch_fid.inception import InceptionV3


class LabelledImages(Dataset):
    def __init__(self, root, records, class_to_idx, size, train=True):
        self.root, self.records, self.class_to_idx = root, records, class_to_idx
        ops = [transforms.Resize(size), transforms.CenterCrop(size)]
        if train:
            ops.append(transforms.RandomHorizontalFlip())
        ops += [transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)]
        self.tf = transforms.Compose(ops)

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        path, label = self.records[i]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        return self.tf(img), self.class_to_idx[label]


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def read_records(csv_path):
    with open(csv_path) as f:
        return [(row["filename"], row["genre"]) for row in csv.DictReader(f)]


@torch.no_grad()
def inception_feats(net, images):
    return net((images.clamp(-1, 1) + 1) / 2)[0].flatten(1)


def frechet(mu1, s1, mu2, s2):
    covmean, _ = linalg.sqrtm(s1.dot(s2), disp=False)
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean.real))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--out", default="runs/wikiart_cond")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--val_frac", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--total_steps", type=int, default=300_000)
    ap.add_argument("--lr", type=float, default=0.0025)
    ap.add_argument("--gamma", type=float, default=10.0)
    ap.add_argument("--r1_every", type=int, default=16)
    ap.add_argument("--pl_every", type=int, default=4)
    ap.add_argument("--ema_beta", type=float, default=0.999)
    ap.add_argument("--fid_every", type=int, default=10_000)
    ap.add_argument("--fid_fake_per_rank", type=int, default=1250)
    ap.add_argument("--seed", type=int, default=2024)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    records = read_records(args.csv)
    classes = sorted({label for _, label in records})
    class_to_idx = {c: i for i, c in enumerate(classes)}
    random.shuffle(records)
    n_val = int(len(records) * args.val_frac)
    val_records, train_records = records[:n_val], records[n_val:]

    train_set = LabelledImages(args.root, train_records, class_to_idx, args.size, train=True)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    label_freq = torch.bincount(torch.tensor([class_to_idx[l] for _, l in train_records]), minlength=len(classes))
    label_probs = (label_freq.float() / label_freq.sum()).to(device)

    G = ConditionalGenerator(z_dim=512, c_dim=len(classes), w_dim=512, img_resolution=args.size).to(device)
    D = ConditionalDiscriminator(c_dim=len(classes), img_resolution=args.size).to(device)
    G = DDP(G, device_ids=[local_rank], broadcast_buffers=False)
    D = DDP(D, device_ids=[local_rank], broadcast_buffers=False)
    G_ema = copy.deepcopy(G.module).eval().requires_grad_(False)

    g_ratio = args.pl_every / (args.pl_every + 1)
    d_ratio = args.r1_every / (args.r1_every + 1)
    opt_G = torch.optim.Adam(G.parameters(), lr=args.lr * g_ratio, betas=(0, 0.99 ** g_ratio), eps=1e-8)
    opt_D = torch.optim.Adam(D.parameters(), lr=args.lr * d_ratio, betas=(0, 0.99 ** d_ratio), eps=1e-8)

    inception = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).to(device).eval()
    writer = None
    mu_val = sigma_val = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out)
        val_loader = DataLoader(LabelledImages(args.root, val_records, class_to_idx, args.size, train=False),
                                batch_size=64, num_workers=6)
        feats = torch.cat([inception_feats(inception, x.to(device)) for x, _ in val_loader]).double().cpu().numpy()
        mu_val, sigma_val = feats.mean(0), np.cov(feats, rowvar=False)
    dist.barrier()

    def sample_c(n):
        y = torch.multinomial(label_probs, n, replacement=True)
        return F.one_hot(y, len(classes)).float()

    pl_mean = torch.zeros((), device=device)
    step, epoch = 0, 0
    while step < args.total_steps:
        sampler.set_epoch(epoch)
        for real, y in loader:
            real = real.to(device, non_blocking=True)
            c_real = F.one_hot(y.to(device), len(classes)).float()

            # --- D ---
            G.requires_grad_(False)
            D.requires_grad_(True)
            c_fake = sample_c(args.batch)
            with torch.no_grad():
                fake, _ = G(torch.randn(args.batch, 512, device=device), c_fake)
            do_r1 = step % args.r1_every == 0
            real.requires_grad_(do_r1)
            out_real = D(real, c_real)
            out_fake = D(fake, c_fake)
            loss_D = F.softplus(out_fake).mean() + F.softplus(-out_real).mean()
            if do_r1:
                (g,) = torch.autograd.grad(out_real.sum(), real, create_graph=True)
                loss_D = loss_D + g.pow(2).sum([1, 2, 3]).mean() * (args.gamma / 2) * args.r1_every
            opt_D.zero_grad(set_to_none=True)
            loss_D.backward()
            opt_D.step()

            # --- G ---
            G.requires_grad_(True)
            D.requires_grad_(False)
            c_fake = sample_c(args.batch)
            fake, _ = G(torch.randn(args.batch, 512, device=device), c_fake)
            loss_G = F.softplus(-D(fake, c_fake)).mean()
            opt_G.zero_grad(set_to_none=True)
            loss_G.backward()
            opt_G.step()

            if step % args.pl_every == 0:
                n = args.batch // 2
                img, ws = G(torch.randn(n, 512, device=device), sample_c(n))
                noise = torch.randn_like(img) / math.sqrt(img.shape[2] * img.shape[3])
                (jw,) = torch.autograd.grad((img * noise).sum(), ws, create_graph=True)
                lengths = jw.pow(2).sum(2).mean(1).sqrt()
                target = pl_mean.lerp(lengths.mean(), 0.01)
                pl_mean.copy_(target.detach())
                loss_pl = (lengths - target).pow(2).mean() * 2.0 * args.pl_every
                opt_G.zero_grad(set_to_none=True)
                (loss_pl + 0 * img[0, 0, 0, 0]).backward()
                opt_G.step()

            with torch.no_grad():
                for pe, p in zip(G_ema.parameters(), G.module.parameters()):
                    pe.lerp_(p, 1 - args.ema_beta)
                for be, b in zip(G_ema.buffers(), G.module.buffers()):
                    be.copy_(b)
            step += 1

            if step % 100 == 0:
                l = torch.stack([loss_D.detach(), loss_G.detach()])
                dist.all_reduce(l)
                if rank == 0:
                    writer.add_scalar("loss/D", l[0].item() / world, step)
                    writer.add_scalar("loss/G", l[1].item() / world, step)

            if step % args.fid_every == 0:
                with torch.no_grad():
                    feats = []
                    for _ in range(0, args.fid_fake_per_rank, 50):
                        img, _ = G_ema(torch.randn(50, 512, device=device), sample_c(50), noise_mode="const")
                        feats.append(inception_feats(inception, img))
                    feats = torch.cat(feats)
                    allf = [torch.empty_like(feats) for _ in range(world)]
                    dist.all_gather(allf, feats)
                if rank == 0:
                    f = torch.cat(allf).double().cpu().numpy()
                    fid = frechet(f.mean(0), np.cov(f, rowvar=False), mu_val, sigma_val)
                    writer.add_scalar("fid/val", fid, step)
                    torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(), "G_ema": G_ema.state_dict(),
                                "classes": classes, "step": step}, os.path.join(args.out, f"ckpt_{step:07d}.pt"))

            if step >= args.total_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
