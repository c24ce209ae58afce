"""
Rectified-flow DiT ("SiT"-ish) on pre-encoded latents, class conditional with CFG.

launch:
    torchrun --nproc_per_node=4 train_rf_dit.py --latents data/cub_latents.npz --run rf_dit_cub
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.utils import save_image
from diffusers.models import AutoencoderKL


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.n1 = nn.LayerNorm(d, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.n2 = nn.LayerNorm(d, elementwise_affine=False)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.mod = nn.Linear(d, 6 * d)
        nn.init.zeros_(self.mod.weight)
        nn.init.zeros_(self.mod.bias)

    def forward(self, x, c):
        a1, b1, g1, a2, b2, g2 = self.mod(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        h = self.n1(x) * (1 + a1) + b1
        x = x + g1 * self.attn(h, h, h, need_weights=False)[0]
        h = self.n2(x) * (1 + a2) + b2
        return x + g2 * self.ff(h)


class FlowDiT(nn.Module):
    def __init__(self, in_ch=4, size=32, patch=2, dim=768, depth=12, heads=12, num_classes=200):
        super().__init__()
        self.p, self.in_ch, self.num_classes = patch, in_ch, num_classes
        self.embed = nn.Conv2d(in_ch, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2, dim) * 0.02)
        self.t_mlp = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.y_emb = nn.Embedding(num_classes + 1, dim)  # +1 = null class
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.final_mod = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, patch * patch * in_ch)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    @staticmethod
    def t_freq(t, dim=256):
        half = dim // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
        a = (t * 1000)[:, None] * f[None]
        return torch.cat([a.cos(), a.sin()], -1)

    def forward(self, x, t, y):
        B, C, H, W = x.shape
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        c = self.t_mlp(self.t_freq(t)) + self.y_emb(y)
        for blk in self.blocks:
            h = blk(h, c)
        s, b = self.final_mod(F.silu(c)).unsqueeze(1).chunk(2, -1)
        h = self.out(self.norm(h) * (1 + s) + b)
        gh, gw = H // self.p, W // self.p
        h = h.view(B, gh, gw, self.p, self.p, C).permute(0, 5, 1, 3, 2, 4)
        return h.reshape(B, C, H, W)

    def forward_with_cfg(self, x, t, y, scale):
        y_null = torch.full_like(y, self.num_classes)
        v = self.forward(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, y_null]))
        v_c, v_u = v.chunk(2)
        return v_u + scale * (v_c - v_u)


class NpzLatents(Dataset):
    def __init__(self, path):
        d = np.load(path)
        self.z = torch.from_numpy(d["latents"]).float()
        self.y = torch.from_numpy(d["labels"]).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.z[i], self.y[i]


@torch.no_grad()
def euler_sample(model, y, shape, steps, cfg, device):
    x = torch.randn(shape, device=device)
    ts = torch.linspace(1.0, 0.0, steps + 1, device=device)
    for i in range(steps):
        t = ts[i].expand(shape[0])
        v = model.forward_with_cfg(x, t, y, cfg)
        x = x + (ts[i + 1] - ts[i]) * v
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--latents", required=True)
    ap.add_argument("--run", default="rf_dit")
    ap.add_argument("--bs", type=int, default=64, help="per gpu")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--p_drop", type=float, default=0.1)
    ap.add_argument("--cfg", type=float, default=3.0)
    ap.add_argument("--sample_every", type=int, default=5)
    ap.add_argument("--vae", default="stabilityai/sd-vae-ft-mse")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(rank)

    ds = NpzLatents(args.latents)
    num_classes = int(ds.y.max()) + 1
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=2, drop_last=True)

    model = FlowDiT(num_classes=num_classes).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    run_dir = os.path.join("runs", args.run)
    ckpt_path = os.path.join(run_dir, "model.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=dev)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1

    writer, vae = None, None
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        writer = SummaryWriter(run_dir)
        vae = AutoencoderKL.from_pretrained(args.vae).to(dev).eval()

    gstep = start_epoch * len(dl)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for z, y in dl:
            z, y = z.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            drop = torch.rand(y.shape, device=dev) < args.p_drop
            y = torch.where(drop, torch.full_like(y, num_classes), y)
            # logit-normal t, x_t = (1 - t) x0 + t eps, target v = eps - x0
            t = torch.sigmoid(torch.randn(z.size(0), device=dev))
            eps = torch.randn_like(z)
            xt = (1 - t.view(-1, 1, 1, 1)) * z + t.view(-1, 1, 1, 1) * eps
            loss = F.mse_loss(model(xt, t, y), eps - z)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            gstep += 1
            if gstep % 100 == 0:
                lt = loss.detach().clone()
                dist.all_reduce(lt, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("loss", lt.item(), gstep)

        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s", flush=True)
            if epoch % args.sample_every == 0:
                model.eval()
                y = torch.arange(16, device=dev) % num_classes
                lat = euler_sample(model, y, (16, 4, 32, 32), 50, args.cfg, dev)
                with torch.no_grad():
                    img = vae.decode(lat / 0.18215).sample
                save_image(img * 0.5 + 0.5, os.path.join(run_dir, f"ep{epoch:04d}.png"), nrow=4)
                writer.add_images("samples", (img * 0.5 + 0.5).clamp(0, 1), epoch)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
