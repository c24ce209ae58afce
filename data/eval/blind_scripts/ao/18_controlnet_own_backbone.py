"""
ControlNet on top of our own pretrained 64x64 pixel diffusion UNet (frozen).
The control branch is a trainable copy of the backbone encoder + middle block,
fed with the backbone input plus an encoded hint (edges / segmentation), and
connected back through zero-initialised 1x1 convs.

    torchrun --nproc_per_node=4 train_controlnet.py --backbone ckpt/unet64_ema.pt --pairs data/edges2shoes --out runs/cn_shoes
"""
import argparse
import copy
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.utils import save_image


def temb(t, d):
    h = d // 2
    f = torch.exp(-math.log(10000) * torch.arange(h, device=t.device) / h)
    a = t.float()[:, None] * f[None]
    return torch.cat([a.sin(), a.cos()], 1)


class RB(nn.Module):
    def __init__(self, ci, co, ed):
        super().__init__()
        self.f1 = nn.Sequential(nn.GroupNorm(32, ci), nn.SiLU(), nn.Conv2d(ci, co, 3, 1, 1))
        self.e = nn.Linear(ed, co)
        self.f2 = nn.Sequential(nn.GroupNorm(32, co), nn.SiLU(), nn.Conv2d(co, co, 3, 1, 1))
        self.sk = nn.Conv2d(ci, co, 1) if ci != co else nn.Identity()

    def forward(self, x, e):
        return self.sk(x) + self.f2(self.f1(x) + self.e(e)[:, :, None, None])


class Encoder(nn.Module):
    """input conv + down path + mid block; returns skip features and mid output"""

    def __init__(self, ch=128, mult=(1, 2, 2, 4)):
        super().__init__()
        ed = 4 * ch
        self.ch = ch
        self.t_mlp = nn.Sequential(nn.Linear(ch, ed), nn.SiLU(), nn.Linear(ed, ed))
        self.inp = nn.Conv2d(3, ch, 3, 1, 1)
        self.down = nn.ModuleList()
        self.skip_ch = [ch]
        c = ch
        for i, m in enumerate(mult):
            for _ in range(2):
                self.down.append(RB(c, ch * m, ed)); c = ch * m; self.skip_ch.append(c)
            if i < len(mult) - 1:
                self.down.append(nn.Conv2d(c, c, 3, 2, 1)); self.skip_ch.append(c)
        self.mid = nn.ModuleList([RB(c, c, ed), RB(c, c, ed)])
        self.out_ch = c

    def forward(self, x, t, hint=None):
        e = self.t_mlp(temb(t, self.ch))
        h = self.inp(x)
        if hint is not None:
            h = h + hint
        hs = [h]
        for m in self.down:
            h = m(h, e) if isinstance(m, RB) else m(h)
            hs.append(h)
        for m in self.mid:
            h = m(h, e)
        return hs, h, e


class UNet(nn.Module):
    def __init__(self, ch=128, mult=(1, 2, 2, 4)):
        super().__init__()
        self.enc = Encoder(ch, mult)
        ed, c, skips = 4 * ch, self.enc.out_ch, list(self.enc.skip_ch)
        self.up = nn.ModuleList()
        for i, m in reversed(list(enumerate(mult))):
            for _ in range(3):
                self.up.append(RB(c + skips.pop(), ch * m, ed)); c = ch * m
            if i > 0:
                self.up.append(nn.Upsample(scale_factor=2))
        self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, 1, 1))

    def forward(self, x, t, ctrl_skips=None, ctrl_mid=None):
        hs, h, e = self.enc(x, t)
        if ctrl_skips is not None:
            hs = [a + b for a, b in zip(hs, ctrl_skips)]
            h = h + ctrl_mid
        for m in self.up:
            h = m(torch.cat([h, hs.pop()], 1), e) if isinstance(m, RB) else m(h)
        return self.out(h)


def zero_module(m):
    for p in m.parameters():
        nn.init.zeros_(p)
    return m


class ControlNet(nn.Module):
    def __init__(self, backbone: UNet, hint_ch=3):
        super().__init__()
        ch = backbone.enc.ch
        self.enc = copy.deepcopy(backbone.enc)
        self.hint = nn.Sequential(nn.Conv2d(hint_ch, 32, 3, 1, 1), nn.SiLU(), nn.Conv2d(32, 64, 3, 1, 1), nn.SiLU(),
                                  zero_module(nn.Conv2d(64, ch, 3, 1, 1)))
        self.zero_skips = nn.ModuleList([zero_module(nn.Conv2d(c, c, 1)) for c in backbone.enc.skip_ch])
        self.zero_mid = zero_module(nn.Conv2d(backbone.enc.out_ch, backbone.enc.out_ch, 1))

    def forward(self, x, t, cond):
        hs, h, _ = self.enc(x, t, hint=self.hint(cond))
        return [z(s) for z, s in zip(self.zero_skips, hs)], self.zero_mid(h)


class PairFolder(Dataset):
    def __init__(self, root, size=64):
        self.a = sorted(os.listdir(os.path.join(root, "cond")))
        self.root = root
        self.tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor()])

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        name = self.a[i]
        cond = self.tf(Image.open(os.path.join(self.root, "cond", name)).convert("RGB"))
        img = self.tf(Image.open(os.path.join(self.root, "image", name)).convert("RGB")) * 2 - 1
        return img, cond


@torch.no_grad()
def sample(unet, cn, cond, abar, steps=50):
    x = torch.randn(cond.shape[0], 3, cond.shape[2], cond.shape[3], device=cond.device)
    ts = torch.linspace(len(abar) - 1, 0, steps, device=cond.device).long()
    for i, t in enumerate(ts):
        tt = t.repeat(len(x))
        sk, mid = cn(x, tt, cond)
        eps = unet(x, tt, sk, mid)
        a, an = abar[t], (abar[ts[i + 1]] if i + 1 < steps else torch.ones((), device=x.device))
        x0 = ((x - (1 - a).sqrt() * eps) / a.sqrt()).clamp(-1, 1)
        x = an.sqrt() * x0 + (1 - an).sqrt() * eps
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backbone", required=True)
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--out", default="runs/controlnet")
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    unet = UNet()
    unet.load_state_dict(torch.load(args.backbone, map_location="cpu"))
    controlnet = ControlNet(unet).to(dev)  # copy the encoder before freezing the backbone
    unet.to(dev).eval().requires_grad_(False)
    opt = torch.optim.AdamW(controlnet.parameters(), lr=args.lr)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        controlnet.load_state_dict(ck["controlnet"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1
    controlnet = DDP(controlnet, device_ids=[local_rank])

    ds = PairFolder(args.pairs)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, device=dev), 0)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        vis_img, vis_cond = next(iter(DataLoader(ds, batch_size=16, shuffle=False)))
        vis_cond = vis_cond.to(dev)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        controlnet.train()
        t0 = time.time()
        acc = torch.zeros(2, device=dev)
        for img, cond in dl:
            img, cond = img.to(dev, non_blocking=True), cond.to(dev, non_blocking=True)
            # drop the hint sometimes so the model keeps working without it
            cond = cond * (torch.rand(cond.size(0), 1, 1, 1, device=dev) > 0.05).float()
            t = torch.randint(0, 1000, (img.size(0),), device=dev)
            noise = torch.randn_like(img)
            a = abar[t].view(-1, 1, 1, 1)
            xt = a.sqrt() * img + (1 - a).sqrt() * noise
            skips, mid = controlnet(xt, t, cond)
            loss = F.mse_loss(unet(xt, t, skips, mid), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=dev)])

        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} {time.time() - t0:.0f}s", flush=True)
            out = sample(unet, controlnet.module, vis_cond, abar)
            save_image(torch.cat([vis_cond, out * 0.5 + 0.5]), os.path.join(args.out, f"ep{epoch:03d}.png"), nrow=8)
            torch.save({"controlnet": controlnet.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "controlnet_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
