# BigGAN (128x128, class-conditional) on ImageNet with DistributedDataParallel.
# Launch: torchrun --nproc_per_node=8 train_biggan.py --data_root /datasets/imagenet/train
import argparse
import copy
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import spectral_norm as SN
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms, utils as vutils
from pytorch_fid.fid_score import calculate_frechet_distance
from pytorch_fid.inception import InceptionV3


class ConditionalBN(nn.Module):
    def __init__(self, num_features, cond_dim):
        super().__init__()
        self.bn = nn.BatchNorm2d(num_features, affine=False, eps=1e-4, momentum=0.1)
        self.gain = SN(nn.Linear(cond_dim, num_features, bias=False))
        self.bias = SN(nn.Linear(cond_dim, num_features, bias=False))

    def forward(self, x, y):
        gain = (1 + self.gain(y)).view(y.size(0), -1, 1, 1)
        bias = self.bias(y).view(y.size(0), -1, 1, 1)
        return self.bn(x) * gain + bias


class GBlock(nn.Module):
    def __init__(self, in_ch, out_ch, cond_dim):
        super().__init__()
        self.bn1 = ConditionalBN(in_ch, cond_dim)
        self.conv1 = SN(nn.Conv2d(in_ch, out_ch, 3, 1, 1))
        self.bn2 = ConditionalBN(out_ch, cond_dim)
        self.conv2 = SN(nn.Conv2d(out_ch, out_ch, 3, 1, 1))
        self.conv_sc = SN(nn.Conv2d(in_ch, out_ch, 1))

    def forward(self, x, y):
        h = F.relu(self.bn1(x, y))
        h = F.interpolate(h, scale_factor=2)
        x = F.interpolate(x, scale_factor=2)
        h = self.conv1(h)
        h = self.conv2(F.relu(self.bn2(h, y)))
        return h + self.conv_sc(x)


class Generator(nn.Module):
    def __init__(self, z_dim=120, shared_dim=128, ch=64, n_classes=1000):
        super().__init__()
        in_ch = [16, 16, 8, 4, 2]
        out_ch = [16, 8, 4, 2, 1]
        self.num_slots = len(in_ch) + 1
        self.z_chunk = z_dim // self.num_slots
        self.z_dim = self.z_chunk * self.num_slots
        self.shared = nn.Embedding(n_classes, shared_dim)
        self.linear = SN(nn.Linear(self.z_chunk, in_ch[0] * ch * 4 * 4))
        cond_dim = shared_dim + self.z_chunk
        self.blocks = nn.ModuleList([GBlock(i * ch, o * ch, cond_dim) for i, o in zip(in_ch, out_ch)])
        self.out_bn = nn.BatchNorm2d(ch, eps=1e-4)
        self.out_conv = SN(nn.Conv2d(ch, 3, 3, 1, 1))

    def forward(self, z, y):
        zs = torch.split(z, self.z_chunk, dim=1)
        shared = self.shared(y)
        h = self.linear(zs[0]).view(z.size(0), -1, 4, 4)
        for block, zc in zip(self.blocks, zs[1:]):
            h = block(h, torch.cat([shared, zc], dim=1))
        return torch.tanh(self.out_conv(F.relu(self.out_bn(h))))


class DBlock(nn.Module):
    def __init__(self, in_ch, out_ch, downsample=True, preactivation=True):
        super().__init__()
        self.conv1 = SN(nn.Conv2d(in_ch, out_ch, 3, 1, 1))
        self.conv2 = SN(nn.Conv2d(out_ch, out_ch, 3, 1, 1))
        self.learnable_sc = in_ch != out_ch or downsample
        if self.learnable_sc:
            self.conv_sc = SN(nn.Conv2d(in_ch, out_ch, 1))
        self.downsample = downsample
        self.preactivation = preactivation

    def shortcut(self, x):
        if self.preactivation:
            if self.learnable_sc:
                x = self.conv_sc(x)
            if self.downsample:
                x = F.avg_pool2d(x, 2)
        else:
            if self.downsample:
                x = F.avg_pool2d(x, 2)
            if self.learnable_sc:
                x = self.conv_sc(x)
        return x

    def forward(self, x):
        h = F.relu(x) if self.preactivation else x
        h = self.conv2(F.relu(self.conv1(h)))
        if self.downsample:
            h = F.avg_pool2d(h, 2)
        return h + self.shortcut(x)


class Discriminator(nn.Module):
    def __init__(self, ch=64, n_classes=1000):
        super().__init__()
        in_ch = [3, 1, 2, 4, 8, 16]
        out_ch = [1, 2, 4, 8, 16, 16]
        down = [True, True, True, True, True, False]
        blocks = []
        for idx, (i, o, d) in enumerate(zip(in_ch, out_ch, down)):
            blocks.append(DBlock(i if idx == 0 else i * ch, o * ch, downsample=d, preactivation=idx > 0))
        self.blocks = nn.ModuleList(blocks)
        self.linear = SN(nn.Linear(16 * ch, 1))
        self.embed = SN(nn.Embedding(n_classes, 16 * ch))

    def forward(self, x, y):
        h = x
        for block in self.blocks:
            h = block(h)
        h = torch.sum(F.relu(h), dim=[2, 3])
        out = self.linear(h)
        return out + torch.sum(self.embed(y) * h, dim=1, keepdim=True)


def toggle_grad(model, on):
    for p in model.parameters():
        p.requires_grad_(on)


@torch.no_grad()
def ema_update(ema_model, model, decay):
    for p_ema, p in zip(ema_model.parameters(), model.parameters()):
        p_ema.lerp_(p, 1.0 - decay)
    for b_ema, b in zip(ema_model.buffers(), model.buffers()):
        b_ema.copy_(b)


@torch.no_grad()
def evaluate_fid(G_ema, inception, mu_real, sigma_real, args, device, rank, world_size):
    G_ema.eval()
    n_per_rank = args.fid_samples // world_size
    feats = []
    for start in range(0, n_per_rank, args.eval_batch):
        b = min(args.eval_batch, n_per_rank - start)
        z = torch.randn(b, G_ema.z_dim, device=device)
        y = torch.randint(0, args.n_classes, (b,), device=device)
        img = (G_ema(z, y).clamp(-1, 1) + 1) / 2
        feats.append(inception(img)[0].flatten(1))
    feats = torch.cat(feats)
    gathered = [torch.empty_like(feats) for _ in range(world_size)]
    dist.all_gather(gathered, feats)
    if rank != 0:
        return None
    feats = torch.cat(gathered).double().cpu().numpy()
    mu, sigma = np.mean(feats, axis=0), np.cov(feats, rowvar=False)
    return float(calculate_frechet_distance(mu, sigma, mu_real, sigma_real))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--fid_stats", default="stats/imagenet128_train.npz")
    parser.add_argument("--out", default="experiments/biggan128")
    parser.add_argument("--batch_size", type=int, default=32, help="per GPU, per D step")
    parser.add_argument("--num_D_steps", type=int, default=2)
    parser.add_argument("--G_lr", type=float, default=1e-4)
    parser.add_argument("--D_lr", type=float, default=4e-4)
    parser.add_argument("--n_classes", type=int, default=1000)
    parser.add_argument("--ch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--ema_decay", type=float, default=0.9999)
    parser.add_argument("--ema_start", type=int, default=20000)
    parser.add_argument("--eval_every", type=int, default=5000)
    parser.add_argument("--save_every", type=int, default=2000)
    parser.add_argument("--fid_samples", type=int, default=50000)
    parser.add_argument("--eval_batch", type=int, default=100)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.backends.cudnn.benchmark = True

    torch.manual_seed(args.seed)
    G = Generator(ch=args.ch, n_classes=args.n_classes).to(device)
    D = Discriminator(ch=args.ch, n_classes=args.n_classes).to(device)
    G_ema = copy.deepcopy(G).eval()
    toggle_grad(G_ema, False)
    torch.manual_seed(args.seed + rank)

    G_opt = torch.optim.Adam(G.parameters(), lr=args.G_lr, betas=(0.0, 0.999), eps=1e-6)
    D_opt = torch.optim.Adam(D.parameters(), lr=args.D_lr, betas=(0.0, 0.999), eps=1e-6)

    G = DDP(G, device_ids=[local_rank])
    D = DDP(D, device_ids=[local_rank])

    tfm = transforms.Compose([
        transforms.Resize(128),
        transforms.CenterCrop(128),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    dataset = datasets.ImageFolder(args.data_root, transform=tfm)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size * args.num_D_steps, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)

    inception = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).to(device).eval()
    stats = np.load(args.fid_stats)
    mu_real, sigma_real = stats["mu"], stats["sigma"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    fixed_z = torch.randn(64, G.module.z_dim, device=device)
    fixed_y = torch.arange(64, device=device) % args.n_classes

    step = 0
    best_fid = float("inf")
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        G.train()
        D.train()
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            xs, ys = torch.split(x, args.batch_size), torch.split(y, args.batch_size)

            # D steps
            toggle_grad(D, True)
            toggle_grad(G, False)
            for real, real_y in zip(xs, ys):
                z = torch.randn(real.size(0), G.module.z_dim, device=device)
                fake_y = torch.randint(0, args.n_classes, (real.size(0),), device=device)
                with torch.no_grad():
                    fake = G(z, fake_y)
                out = D(torch.cat([real, fake]), torch.cat([real_y, fake_y]))
                d_real, d_fake = torch.split(out, real.size(0))
                d_loss = F.relu(1.0 - d_real).mean() + F.relu(1.0 + d_fake).mean()
                D_opt.zero_grad(set_to_none=True)
                d_loss.backward()
                D_opt.step()

            # G step
            toggle_grad(D, False)
            toggle_grad(G, True)
            z = torch.randn(args.batch_size, G.module.z_dim, device=device)
            fake_y = torch.randint(0, args.n_classes, (args.batch_size,), device=device)
            g_loss = -D(G(z, fake_y), fake_y).mean()
            G_opt.zero_grad(set_to_none=True)
            g_loss.backward()
            G_opt.step()

            ema_update(G_ema, G.module, args.ema_decay if step >= args.ema_start else 0.0)
            step += 1

            if step % 100 == 0:
                logs = torch.stack([d_loss.detach(), g_loss.detach()])
                dist.all_reduce(logs)
                logs /= world_size
                if rank == 0:
                    print(f"ep {epoch} it {step} D {logs[0].item():.3f} G {logs[1].item():.3f} "
                          f"({(time.time() - t0) / 100:.3f}s/it)", flush=True)
                    t0 = time.time()

            if step % args.save_every == 0 and rank == 0:
                torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(), "G_ema": G_ema.state_dict(),
                            "G_opt": G_opt.state_dict(), "D_opt": D_opt.state_dict(), "step": step, "epoch": epoch},
                           os.path.join(args.out, "latest.pth"))
                with torch.no_grad():
                    vutils.save_image(G_ema(fixed_z, fixed_y), os.path.join(args.out, f"samples_{step:07d}.png"),
                                      nrow=8, normalize=True, value_range=(-1, 1))

            if step % args.eval_every == 0:
                fid = evaluate_fid(G_ema, inception, mu_real, sigma_real, args, device, rank, world_size)
                if rank == 0:
                    print(f"[eval] step {step} FID {fid:.2f}", flush=True)
                    if fid < best_fid:
                        best_fid = fid
                        torch.save({"G_ema": G_ema.state_dict(), "step": step, "fid": fid},
                                   os.path.join(args.out, "best_G_ema.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
