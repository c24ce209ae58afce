"""
VQ tokenizer for our image-gen experiments: conv encoder/decoder, EMA codebook
(k-means style updates, statistics all-reduced across GPUs), L1 + LPIPS + hinge GAN.

    torchrun --nproc_per_node=4 vq_tokenizer.py --data /data/celebahq256 --save_dir ckpts/vq_celebahq
"""
import argparse
import os
import time

import lpips
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from torchvision.utils import save_image


def block(ci, co):
    return nn.Sequential(nn.GroupNorm(32, ci), nn.SiLU(), nn.Conv2d(ci, co, 3, 1, 1),
                         nn.GroupNorm(32, co), nn.SiLU(), nn.Conv2d(co, co, 3, 1, 1))


class Res(nn.Module):
    def __init__(self, ci, co):
        super().__init__()
        self.b, self.s = block(ci, co), (nn.Conv2d(ci, co, 1) if ci != co else nn.Identity())

    def forward(self, x):
        return self.s(x) + self.b(x)


class EMAQuantizer(nn.Module):
    def __init__(self, K=8192, D=32, decay=0.99, eps=1e-5, beta=0.25):
        super().__init__()
        self.K, self.D, self.decay, self.eps, self.beta = K, D, decay, eps, beta
        embed = torch.randn(K, D)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.zeros(K))
        self.register_buffer("embed_avg", embed.clone())

    def forward(self, z):
        B, C, H, W = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, C)
        dist_ = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.embed.t() + self.embed.pow(2).sum(1)[None]
        idx = dist_.argmin(1)
        q = F.embedding(idx, self.embed).view(B, H, W, C).permute(0, 3, 1, 2)
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(idx, self.K).type(flat.dtype)
                n = onehot.sum(0)
                s = onehot.t() @ flat
                if dist.is_initialized():
                    dist.all_reduce(n)
                    dist.all_reduce(s)
                self.cluster_size.mul_(self.decay).add_(n, alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(s, alpha=1 - self.decay)
                total = self.cluster_size.sum()
                size = (self.cluster_size + self.eps) / (total + self.K * self.eps) * total
                self.embed.copy_(self.embed_avg / size[:, None])
        commit = self.beta * F.mse_loss(z, q.detach())
        q = z + (q - z).detach()
        return q, commit, idx


class VQModel(nn.Module):
    def __init__(self, ch=128, mult=(1, 2, 2, 4), zdim=32, K=8192):
        super().__init__()
        enc, c = [nn.Conv2d(3, ch, 3, 1, 1)], ch
        for i, m in enumerate(mult):
            enc += [Res(c, ch * m), Res(ch * m, ch * m)]
            c = ch * m
            if i < len(mult) - 1:
                enc.append(nn.Conv2d(c, c, 3, 2, 1))
        enc += [nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, zdim, 1)]
        self.enc = nn.Sequential(*enc)
        self.quant = EMAQuantizer(K, zdim)
        dec = [nn.Conv2d(zdim, c, 3, 1, 1)]
        for i, m in reversed(list(enumerate(mult))):
            dec += [Res(c, ch * m), Res(ch * m, ch * m)]
            c = ch * m
            if i > 0:
                dec += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(c, c, 3, 1, 1)]
        dec += [nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, 1, 1)]
        self.dec = nn.Sequential(*dec)

    def forward(self, x):
        z = F.normalize(self.enc(x), dim=1)
        q, commit, idx = self.quant(z)
        return self.dec(q), commit, idx


class PatchD(nn.Module):
    def __init__(self, ch=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, ch, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(ch, ch * 2, 4, 2, 1), nn.GroupNorm(32, ch * 2), nn.LeakyReLU(0.2),
            nn.Conv2d(ch * 2, ch * 4, 4, 2, 1), nn.GroupNorm(32, ch * 4), nn.LeakyReLU(0.2),
            nn.Conv2d(ch * 4, ch * 8, 4, 1, 1), nn.GroupNorm(32, ch * 8), nn.LeakyReLU(0.2),
            nn.Conv2d(ch * 8, 1, 4, 1, 1))

    def forward(self, x):
        return self.net(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save_dir", default="ckpts/vq")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--gan_start_epoch", type=int, default=5)
    ap.add_argument("--gan_weight", type=float, default=0.1)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tf = transforms.Compose([transforms.Resize(args.size), transforms.CenterCrop(args.size),
                             transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    train_set = datasets.ImageFolder(args.data, transform=tf)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    torch.manual_seed(0)  # same codebook init everywhere
    vq = VQModel().to(device)
    D = PatchD().to(device)
    perc = lpips.LPIPS(net="vgg").to(device).eval().requires_grad_(False)
    opt_g = torch.optim.AdamW(vq.parameters(), lr=args.lr, betas=(0.5, 0.9), weight_decay=1e-4)
    opt_d = torch.optim.AdamW(D.parameters(), lr=args.lr, betas=(0.5, 0.9), weight_decay=1e-4)
    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        vq.load_state_dict(ck["vq"]); D.load_state_dict(ck["D"])
        opt_g.load_state_dict(ck["opt_g"]); opt_d.load_state_dict(ck["opt_d"]); start = ck["epoch"] + 1
    # codebook buffers are kept in sync by the quantizer itself
    vq = DDP(vq, device_ids=[local_rank], broadcast_buffers=False)
    D = DDP(D, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{len(train_set)} images, {len(loader)} iters/epoch/GPU", flush=True)

    for epoch in range(start, args.epochs):
        vq.train(); D.train()
        use_gan = epoch >= args.gan_start_epoch
        t0 = time.time()
        meter = torch.zeros(4, device=device)
        usage = torch.zeros(vq.module.quant.K, device=device)
        for i, (x, _) in enumerate(loader):
            x = x.to(device, non_blocking=True)
            rec, commit, idx = vq(x)
            rec_loss = F.l1_loss(rec, x) + perc(rec, x).mean()
            g_adv = -D(rec).mean() if use_gan else torch.zeros((), device=device)
            loss = rec_loss + commit + args.gan_weight * g_adv
            opt_g.zero_grad(set_to_none=True)
            loss.backward()
            opt_g.step()

            d_loss = torch.zeros((), device=device)
            if use_gan:
                d_loss = F.relu(1 - D(x)).mean() + F.relu(1 + D(rec.detach())).mean()
                opt_d.zero_grad(set_to_none=True)
                d_loss.backward()
                opt_d.step()

            meter += torch.stack([rec_loss.detach(), commit.detach(), g_adv.detach(), d_loss.detach()])
            usage += torch.bincount(idx, minlength=usage.numel())

        dist.all_reduce(meter)
        dist.all_reduce(usage)
        meter /= (len(loader) * world)
        if rank == 0:
            used = (usage > 0).float().mean().item()
            print(f"epoch {epoch} rec {meter[0]:.4f} commit {meter[1]:.4f} g {meter[2]:.3f} d {meter[3]:.3f} "
                  f"codebook usage {used * 100:.1f}% ({time.time() - t0:.0f}s)", flush=True)
            save_image(torch.cat([x[:8], rec[:8].detach()]) * 0.5 + 0.5,
                       os.path.join(args.save_dir, f"rec_{epoch:03d}.png"), nrow=8)
            torch.save({"vq": vq.module.state_dict(), "D": D.module.state_dict(), "opt_g": opt_g.state_dict(),
                        "opt_d": opt_d.state_dict(), "epoch": epoch}, os.path.join(args.save_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
