"""Real-noise sRGB denoising with a small Restormer on our own phone captures.

Data layout: <root>/<scene_id>/{NOISY_*.png, GT_*.png}; 10% of the scenes are held out for validation.

    torchrun --nproc_per_node=4 17_restormer_real_denoise.py --root /data/phone_denoise --out runs/restormer_s
"""
import argparse
import os
import random
import time
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------ model
class ChannelLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class MDTA(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.temperature = nn.Parameter(torch.ones(heads, 1, 1))
        self.qkv = nn.Conv2d(dim, dim * 3, 1, bias=False)
        self.qkv_dw = nn.Conv2d(dim * 3, dim * 3, 3, 1, 1, groups=dim * 3, bias=False)
        self.proj = nn.Conv2d(dim, dim, 1, bias=False)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv_dw(self.qkv(x)).chunk(3, dim=1)
        q, k, v = (t.reshape(b, self.heads, c // self.heads, h * w) for t in (q, k, v))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        attn = ((q @ k.transpose(-2, -1)) * self.temperature).softmax(dim=-1)
        return self.proj((attn @ v).reshape(b, c, h, w))


class GDFN(nn.Module):
    def __init__(self, dim, expansion=2.66):
        super().__init__()
        hidden = int(dim * expansion)
        self.project_in = nn.Conv2d(dim, hidden * 2, 1, bias=False)
        self.dw = nn.Conv2d(hidden * 2, hidden * 2, 3, 1, 1, groups=hidden * 2, bias=False)
        self.project_out = nn.Conv2d(hidden, dim, 1, bias=False)

    def forward(self, x):
        x1, x2 = self.dw(self.project_in(x)).chunk(2, dim=1)
        return self.project_out(F.gelu(x1) * x2)


class TransformerBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2 = ChannelLayerNorm(dim), ChannelLayerNorm(dim)
        self.attn, self.ffn = MDTA(dim, heads), GDFN(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class RestormerS(nn.Module):
    def __init__(self, dim=32, blocks=(2, 3, 4), heads=(1, 2, 4), refine=2):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 3, 1, 1, bias=False)
        self.enc1 = nn.Sequential(*[TransformerBlock(dim, heads[0]) for _ in range(blocks[0])])
        self.down1 = nn.Sequential(nn.Conv2d(dim, dim // 2, 3, 1, 1, bias=False), nn.PixelUnshuffle(2))
        self.enc2 = nn.Sequential(*[TransformerBlock(dim * 2, heads[1]) for _ in range(blocks[1])])
        self.down2 = nn.Sequential(nn.Conv2d(dim * 2, dim, 3, 1, 1, bias=False), nn.PixelUnshuffle(2))
        self.latent = nn.Sequential(*[TransformerBlock(dim * 4, heads[2]) for _ in range(blocks[2])])
        self.up2 = nn.Sequential(nn.Conv2d(dim * 4, dim * 8, 3, 1, 1, bias=False), nn.PixelShuffle(2))
        self.reduce2 = nn.Conv2d(dim * 4, dim * 2, 1, bias=False)
        self.dec2 = nn.Sequential(*[TransformerBlock(dim * 2, heads[1]) for _ in range(blocks[1])])
        self.up1 = nn.Sequential(nn.Conv2d(dim * 2, dim * 4, 3, 1, 1, bias=False), nn.PixelShuffle(2))
        self.dec1 = nn.Sequential(*[TransformerBlock(dim * 2, heads[0]) for _ in range(blocks[0])])
        self.refine = nn.Sequential(*[TransformerBlock(dim * 2, heads[0]) for _ in range(refine)])
        self.out = nn.Conv2d(dim * 2, 3, 3, 1, 1, bias=False)

    def forward(self, inp):
        h, w = inp.shape[-2:]
        x = F.pad(inp, (0, (-w) % 4, 0, (-h) % 4), mode="reflect")
        e1 = self.enc1(self.embed(x))
        e2 = self.enc2(self.down1(e1))
        lat = self.latent(self.down2(e2))
        d2 = self.dec2(self.reduce2(torch.cat([self.up2(lat), e2], 1)))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return self.out(self.refine(d1))[..., :h, :w] + inp


# ------------------------------------------------------------------------------------ data
def load_rgb(path):
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0


class ScenePairs(Dataset):
    def __init__(self, root, scenes, patch=128, train=True):
        self.pairs = []
        for s in scenes:
            for noisy in sorted(glob(os.path.join(root, s, "NOISY_*.png"))):
                self.pairs.append((noisy, noisy.replace("NOISY_", "GT_")))
        self.patch, self.train = patch, train

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        noisy, gt = (load_rgb(p) for p in self.pairs[i])
        if self.train:
            y, x = random.randint(0, noisy.shape[0] - self.patch), random.randint(0, noisy.shape[1] - self.patch)
            noisy, gt = noisy[y:y + self.patch, x:x + self.patch], gt[y:y + self.patch, x:x + self.patch]
            k = random.randint(0, 3)
            noisy, gt = np.rot90(noisy, k), np.rot90(gt, k)
        else:  # centre 512x512 crop, as for the SIDD validation blocks
            cy, cx = noisy.shape[0] // 2, noisy.shape[1] // 2
            noisy, gt = noisy[cy - 256:cy + 256, cx - 256:cx + 256], gt[cy - 256:cy + 256, cx - 256:cx + 256]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return t(noisy), t(gt)


def batch_psnr(out, gt):
    mse = ((out.clamp(0, 1) - gt) ** 2).mean(dim=(1, 2, 3))
    return 10 * torch.log10(1.0 / mse)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--val_frac", type=float, default=0.1)
    ap.add_argument("--batch_size", type=int, default=8, help="per GPU")
    ap.add_argument("--iters", type=int, default=150000)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=100)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    net = RestormerS().to(device)  # DDP broadcasts rank 0's initial weights
    model = DDP(net, device_ids=[local_rank])
    seed_everything(args.seed + rank)  # different crops / flips on every GPU

    scenes = sorted(d for d in os.listdir(args.root) if os.path.isdir(os.path.join(args.root, d)))
    random.shuffle(scenes)
    n_val = max(1, int(len(scenes) * args.val_frac))
    val_scenes, train_scenes = scenes[:n_val], scenes[n_val:]
    train_set = ScenePairs(args.root, train_scenes, train=True)
    val_set = ScenePairs(args.root, val_scenes, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_idx = list(range(rank, len(val_set), world))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.iters, pct_start=0.02,
                                                anneal_strategy="cos")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "split.txt"), "w") as f:
            f.write("\n".join(f"val {s}" for s in val_scenes) + "\n" + "\n".join(f"train {s}" for s in train_scenes))

    it, epoch, best, tic = 0, 0, 0.0, time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for noisy, gt in loader:
            noisy, gt = noisy.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            loss = F.l1_loss(model(noisy), gt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
            sched.step()
            it += 1
            if rank == 0 and it % 200 == 0:
                print(f"it {it} l1 {loss.item():.5f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - tic) / 200:.3f}s/it", flush=True)
                tic = time.time()
            if it % 5000 == 0 or it == args.iters:
                net.eval()
                acc = torch.zeros(2, device=device)
                with torch.no_grad():
                    for i in val_idx:
                        n, g = val_set[i]
                        acc[0] += batch_psnr(net(n.unsqueeze(0).to(device)), g.unsqueeze(0).to(device)).sum()
                        acc[1] += 1
                dist.all_reduce(acc)
                net.train()
                psnr = (acc[0] / acc[1].clamp(min=1)).item()
                if rank == 0:
                    print(f"[val] it {it}: PSNR {psnr:.3f} on {int(acc[1].item())} crops", flush=True)
                    torch.save({"it": it, "model": net.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict()}, os.path.join(args.out, "latest.pth"))
                    if psnr > best:
                        best = psnr
                        torch.save(net.state_dict(), os.path.join(args.out, "best.pth"))
            if it >= args.iters:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
