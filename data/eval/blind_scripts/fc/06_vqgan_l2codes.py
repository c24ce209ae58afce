"""Factorized / l2-normalized codebook VQGAN (ViT-VQGAN style lookup, conv backbone).

Run on one 8xA100 node:
    torchrun --nproc_per_node=8 06_vqgan_l2codes.py --data /data/laion_art_256 --out ckpt/vq_l2_f8
"""
import argparse
import glob
import os
from dataclasses import dataclass, asdict

import lpips
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from lab_models.convnets import ConvDecoder, ConvEncoder


@dataclass
class Config:
    data: str = ""
    out: str = "ckpt/vq"
    res: int = 256
    batch: int = 16
    lr: float = 1e-4
    steps: int = 500_000
    codes: int = 8192
    code_dim: int = 32
    z_ch: int = 256
    beta: float = 0.25
    disc_start: int = 50_000
    disc_weight: float = 0.1
    lpips_weight: float = 1.0
    log_every: int = 100
    ckpt_every: int = 10_000


class FolderImages(Dataset):
    def __init__(self, root, res):
        self.files = sorted(glob.glob(os.path.join(root, "**", "*.jpg"), recursive=True))
        self.tf = transforms.Compose([
            transforms.Resize(res, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.RandomCrop(res), transforms.RandomHorizontalFlip(),
            transforms.ToTensor(), transforms.Normalize(0.5, 0.5)])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB"))


class L2Quantizer(nn.Module):
    def __init__(self, n, z_ch, dim, beta):
        super().__init__()
        self.proj_in = nn.Conv2d(z_ch, dim, 1)
        self.proj_out = nn.Conv2d(dim, z_ch, 1)
        self.codebook = nn.Embedding(n, dim)
        nn.init.normal_(self.codebook.weight)
        self.beta = beta

    def forward(self, z):
        z = F.normalize(self.proj_in(z), dim=1)
        b, c, h, w = z.shape
        zf = z.permute(0, 2, 3, 1).reshape(-1, c)
        cb = F.normalize(self.codebook.weight, dim=1)
        idx = (zf @ cb.t()).argmax(1)
        zq = cb[idx].view(b, h, w, c).permute(0, 3, 1, 2)
        loss = F.mse_loss(zq, z.detach()) + self.beta * F.mse_loss(z, zq.detach())
        zq = z + (zq - z).detach()
        return self.proj_out(zq), loss, idx


class Tokenizer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.enc = ConvEncoder(out_ch=cfg.z_ch, ch_mult=(1, 2, 2, 4))
        self.quant = L2Quantizer(cfg.codes, cfg.z_ch, cfg.code_dim, cfg.beta)
        self.dec = ConvDecoder(in_ch=cfg.z_ch, ch_mult=(1, 2, 2, 4))

    def forward(self, x):
        zq, qloss, idx = self.quant(self.enc(x))
        return self.dec(zq), qloss, idx

    def last_layer(self):
        return self.dec.conv_out.weight


class PatchDiscriminator(nn.Module):
    def __init__(self, ch=64, n_layers=3):
        super().__init__()
        layers = [nn.Conv2d(3, ch, 4, 2, 1), nn.LeakyReLU(0.2, True)]
        mult = 1
        for i in range(1, n_layers + 1):
            prev, mult = mult, min(2 ** i, 8)
            stride = 2 if i < n_layers else 1
            layers += [nn.Conv2d(ch * prev, ch * mult, 4, stride, 1, bias=False),
                       nn.BatchNorm2d(ch * mult), nn.LeakyReLU(0.2, True)]
        layers += [nn.Conv2d(ch * mult, 1, 4, 1, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def main():
    ap = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    cfg = Config(**vars(ap.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    ds = FolderImages(cfg.data, cfg.res)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg.batch, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    G = DDP(Tokenizer(cfg).to(dev), device_ids=[local_rank])
    D = DDP(PatchDiscriminator().to(dev), device_ids=[local_rank])
    perc = lpips.LPIPS(net="vgg").to(dev).eval().requires_grad_(False)
    opt_g = torch.optim.AdamW(G.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=1e-4)
    opt_d = torch.optim.AdamW(D.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=1e-4)

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)

    step, epoch = 0, 0
    while step < cfg.steps:
        sampler.set_epoch(epoch)
        for x in dl:
            x = x.to(dev, non_blocking=True)
            use_gan = step >= cfg.disc_start

            # ---- generator / tokenizer ----
            xr, qloss, idx = G(x)
            l1 = (xr - x).abs().mean()
            lp = perc(xr, x).mean()
            nll = l1 + cfg.lpips_weight * lp
            if use_gan:
                g_adv = -D(xr).mean()
                last = G.module.last_layer()
                gn = torch.autograd.grad(nll, last, retain_graph=True)[0].norm()
                ga = torch.autograd.grad(g_adv, last, retain_graph=True)[0].norm()
                w = (gn / (ga + 1e-4)).clamp(0, 1e4).detach() * cfg.disc_weight
            else:
                g_adv, w = torch.zeros((), device=dev), 0.0
            loss_g = nll + qloss + w * g_adv
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()

            # ---- discriminator ----
            if use_gan:
                real = D(x)
                fake = D(xr.detach())
                loss_d = 0.5 * (F.relu(1 - real).mean() + F.relu(1 + fake).mean())
                opt_d.zero_grad(set_to_none=True)
                loss_d.backward()
                opt_d.step()
            else:
                loss_d = torch.zeros((), device=dev)

            step += 1
            if step % cfg.log_every == 0:
                m = torch.stack([l1.detach(), lp.detach(), qloss.detach(), g_adv.detach(), loss_d.detach()])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                hist = torch.bincount(idx, minlength=cfg.codes).float()
                dist.all_reduce(hist)
                pr = hist / hist.sum()
                ppl = torch.exp(-(pr * (pr + 1e-10).log()).sum())
                if rank == 0:
                    print(f"step {step} l1 {m[0]:.4f} lpips {m[1]:.4f} q {m[2]:.4f} g {m[3]:.3f} d {m[4]:.3f} "
                          f"ppl {ppl:.0f} used {(hist > 0).sum().item()}", flush=True)

            if step % cfg.ckpt_every == 0 and rank == 0:
                torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(), "opt_g": opt_g.state_dict(),
                            "opt_d": opt_d.state_dict(), "step": step, "cfg": asdict(cfg)},
                           os.path.join(cfg.out, f"step_{step:07d}.pt"))
            if step >= cfg.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
