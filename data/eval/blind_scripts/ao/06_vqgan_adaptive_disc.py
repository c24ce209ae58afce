"""
VQGAN (Esser et al.) first stage, re-written without lightning.
 - L1 + LPIPS reconstruction, commitment/codebook loss
 - PatchGAN discriminator switched on at `disc_start`, adaptive weight from the
   gradient norms at the decoder's last layer
 - dead-code restart every `restart_every` steps

torchrun --nnodes=1 --nproc_per_node=8 train_vqgan.py --data /data/ffhq256 --out ckpt/vqgan_ffhq
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
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms as T
from torchvision.utils import save_image


class Res(nn.Module):
    def __init__(self, ci, co):
        super().__init__()
        self.f = nn.Sequential(nn.GroupNorm(32, ci), nn.SiLU(), nn.Conv2d(ci, co, 3, 1, 1),
                               nn.GroupNorm(32, co), nn.SiLU(), nn.Conv2d(co, co, 3, 1, 1))
        self.s = nn.Conv2d(ci, co, 1) if ci != co else nn.Identity()

    def forward(self, x):
        return self.s(x) + self.f(x)


def encoder(ch=128, mult=(1, 1, 2, 2, 4), zc=256):
    L, c = [nn.Conv2d(3, ch, 3, 1, 1)], ch
    for i, m in enumerate(mult):
        L += [Res(c, ch * m), Res(ch * m, ch * m)]
        c = ch * m
        if i < len(mult) - 1:
            L.append(nn.Conv2d(c, c, 4, 2, 1))
    L += [Res(c, c), nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, zc, 3, 1, 1)]
    return nn.Sequential(*L)


class Decoder(nn.Module):
    def __init__(self, ch=128, mult=(1, 1, 2, 2, 4), zc=256):
        super().__init__()
        c = ch * mult[-1]
        L = [nn.Conv2d(zc, c, 3, 1, 1), Res(c, c)]
        for i, m in reversed(list(enumerate(mult))):
            L += [Res(c, ch * m), Res(ch * m, ch * m)]
            c = ch * m
            if i > 0:
                L += [nn.Upsample(scale_factor=2.0), nn.Conv2d(c, c, 3, 1, 1)]
        L += [nn.GroupNorm(32, c), nn.SiLU()]
        self.body = nn.Sequential(*L)
        self.conv_out = nn.Conv2d(c, 3, 3, 1, 1)

    def forward(self, z):
        return self.conv_out(self.body(z))


class Quantizer(nn.Module):
    def __init__(self, n_codes=1024, dim=256, beta=0.25):
        super().__init__()
        self.embedding = nn.Embedding(n_codes, dim)
        self.embedding.weight.data.uniform_(-1 / n_codes, 1 / n_codes)
        self.beta = beta

    def forward(self, z):
        B, C, H, W = z.shape
        zf = z.permute(0, 2, 3, 1).reshape(-1, C)
        d = zf.pow(2).sum(1, keepdim=True) - 2 * zf @ self.embedding.weight.t() + self.embedding.weight.pow(2).sum(1)
        idx = d.argmin(1)
        zq = self.embedding(idx).view(B, H, W, C).permute(0, 3, 1, 2)
        loss = self.beta * F.mse_loss(zq.detach(), z) + F.mse_loss(zq, z.detach())
        zq = z + (zq - z).detach()
        return zq, loss, idx


class VQModel(nn.Module):
    def __init__(self, n_codes=1024, zc=256):
        super().__init__()
        self.encoder = encoder(zc=zc)
        self.quant_conv = nn.Conv2d(zc, zc, 1)
        self.quantize = Quantizer(n_codes, zc)
        self.post_quant_conv = nn.Conv2d(zc, zc, 1)
        self.decoder = Decoder(zc=zc)

    def forward(self, x):
        h = self.quant_conv(self.encoder(x))
        zq, qloss, idx = self.quantize(h)
        return self.decoder(self.post_quant_conv(zq)), qloss, idx, h


class NLayerDiscriminator(nn.Module):
    def __init__(self, ndf=64, n_layers=3):
        super().__init__()
        L = [nn.Conv2d(3, ndf, 4, 2, 1), nn.LeakyReLU(0.2, True)]
        c = ndf
        for n in range(1, n_layers + 1):
            nc = ndf * min(2 ** n, 8)
            L += [nn.Conv2d(c, nc, 4, 2 if n < n_layers else 1, 1, bias=False), nn.BatchNorm2d(nc),
                  nn.LeakyReLU(0.2, True)]
            c = nc
        L.append(nn.Conv2d(c, 1, 4, 1, 1))
        self.main = nn.Sequential(*L)

    def forward(self, x):
        return self.main(x)


def adaptive_weight(nll, g_loss, last_layer, max_w=1e4):
    nll_g = torch.autograd.grad(nll, last_layer, retain_graph=True)[0]
    g_g = torch.autograd.grad(g_loss, last_layer, retain_graph=True)[0]
    w = torch.norm(nll_g) / (torch.norm(g_g) + 1e-4)
    return w.clamp(0.0, max_w).detach()


@torch.no_grad()
def restart_dead_codes(quantizer, usage, enc_out, rank):
    """usage is already summed over ranks; rank 0 picks the new codes and broadcasts them."""
    dead = (usage == 0).nonzero().squeeze(1)
    n_dead = torch.tensor([dead.numel()], device=usage.device)
    if dead.numel() > 0:
        pool = enc_out.permute(0, 2, 3, 1).reshape(-1, enc_out.shape[1])
        new = pool[torch.randint(0, pool.shape[0], (dead.numel(),), device=pool.device)]
        dist.broadcast(new, src=0)
        quantizer.embedding.weight.data[dead] = new
    return int(n_dead.item())


def main():
    pa = argparse.ArgumentParser()
    pa.add_argument("--data", required=True)
    pa.add_argument("--out", default="ckpt/vqgan")
    pa.add_argument("--res", type=int, default=256)
    pa.add_argument("--bs", type=int, default=8, help="per-GPU batch")
    pa.add_argument("--base_lr", type=float, default=4.5e-6, help="per-sample lr as in taming")
    pa.add_argument("--steps", type=int, default=400_000)
    pa.add_argument("--disc_start", type=int, default=30_000)
    pa.add_argument("--disc_weight", type=float, default=0.8)
    pa.add_argument("--perceptual_weight", type=float, default=1.0)
    pa.add_argument("--restart_every", type=int, default=2000)
    pa.add_argument("--log_every", type=int, default=50)
    pa.add_argument("--save_every", type=int, default=5000)
    pa.add_argument("--resume", default=None)
    a = pa.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    # taming scales lr by the total batch
    lr = a.base_lr * a.bs * world

    model = VQModel().to(dev)
    disc = nn.SyncBatchNorm.convert_sync_batchnorm(NLayerDiscriminator()).to(dev)
    lp = lpips.LPIPS(net="vgg").to(dev).eval().requires_grad_(False)
    opt_ae = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(disc.parameters(), lr=lr, betas=(0.5, 0.9))

    step = 0
    if a.resume:
        sd = torch.load(a.resume, map_location="cpu")
        model.load_state_dict(sd["model"]); disc.load_state_dict(sd["disc"])
        opt_ae.load_state_dict(sd["opt_ae"]); opt_d.load_state_dict(sd["opt_d"])
        step = sd["step"]

    model = DDP(model, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank], broadcast_buffers=False)
    last_layer = model.module.decoder.conv_out.weight
    n_codes = model.module.quantize.embedding.num_embeddings

    ds = datasets.ImageFolder(a.data, T.Compose([T.Resize(a.res), T.RandomCrop(a.res), T.RandomHorizontalFlip(),
                                                 T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)]))
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=a.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        print(f"{len(ds)} images | world {world} | lr {lr:.2e}", flush=True)

    usage = torch.zeros(n_codes, device=dev)
    epoch = step // len(dl)
    tic = time.time()
    while step < a.steps:
        sampler.set_epoch(epoch)
        for x, _ in dl:
            x = x.to(dev, non_blocking=True)
            rec, qloss, idx, h = model(x)
            usage += torch.bincount(idx, minlength=n_codes).float()

            nll = (x - rec).abs().mean() + a.perceptual_weight * lp(x, rec).mean()
            gan_on = step >= a.disc_start
            if gan_on:
                g_loss = -disc(rec).mean()
                d_w = adaptive_weight(nll, g_loss, last_layer) * a.disc_weight
                loss = nll + qloss + d_w * g_loss
            else:
                g_loss = d_w = torch.zeros((), device=dev)
                loss = nll + qloss
            opt_ae.zero_grad(set_to_none=True)
            loss.backward()
            opt_ae.step()

            d_loss = torch.zeros((), device=dev)
            if gan_on:
                lr_real = disc(x.detach())
                lr_fake = disc(rec.detach())
                d_loss = 0.5 * (F.relu(1 - lr_real).mean() + F.relu(1 + lr_fake).mean())
                opt_d.zero_grad(set_to_none=True)
                d_loss.backward()
                opt_d.step()

            step += 1
            if step % a.restart_every == 0:
                dist.all_reduce(usage)
                n_dead = restart_dead_codes(model.module.quantize, usage, h.detach(), rank)
                usage.zero_()
                if rank == 0 and n_dead:
                    print(f"step {step}: restarted {n_dead} dead codes", flush=True)

            if step % a.log_every == 0:
                s = torch.stack([nll.detach(), qloss.detach(), g_loss.detach(), d_loss.detach()])
                dist.all_reduce(s)
                s = (s / world).tolist()
                if rank == 0:
                    print(f"step {step} nll {s[0]:.4f} q {s[1]:.4f} g {s[2]:.4f} d {s[3]:.4f} "
                          f"dw {float(d_w):.3f} {(time.time() - tic) / a.log_every:.2f}s/it", flush=True)
                    tic = time.time()

            if step % a.save_every == 0:
                if rank == 0:
                    save_image(torch.cat([x[:4], rec[:4].detach()]) * 0.5 + 0.5,
                               os.path.join(a.out, f"rec_{step:07d}.png"), nrow=4)
                    torch.save({"model": model.module.state_dict(), "disc": disc.module.state_dict(),
                                "opt_ae": opt_ae.state_dict(), "opt_d": opt_d.state_dict(), "step": step},
                               os.path.join(a.out, "last.ckpt"))
                dist.barrier()
            if step >= a.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
