"""Video VQGAN (factorised 2D+1D convs) with an EMA codebook and a SyncBatchNorm PatchGAN discriminator.

The EMA codebook statistics are all-reduced inside the quantizer, so DDP does not need to broadcast buffers.
The clip index (path, number of frames) is built once by rank 0 and cached next to the data.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        16_vqgan_ema_codebook_syncbn.py --video_root /shared/datasets/sky_timelapse --out /shared/exp/vqgan_sky
"""
import argparse
import glob
import json
import os
import random

import decord
import lpips
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

decord.bridge.set_bridge("torch")


def build_or_load_index(root, split, rank):
    cache = os.path.join(root, f".index_{split}.json")
    if rank == 0 and not os.path.exists(cache):
        entries = []
        for p in sorted(glob.glob(os.path.join(root, split, "**", "*.mp4"), recursive=True)):
            try:
                entries.append({"path": p, "frames": len(decord.VideoReader(p))})
            except Exception:
                continue
        tmp = f"{cache}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, cache)
    dist.barrier()
    with open(cache) as f:
        return json.load(f)


class Clips(Dataset):
    def __init__(self, index, frames=16, size=128, min_frames=16):
        self.items = [e for e in index if e["frames"] >= min_frames]
        self.frames, self.size = frames, size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        e = self.items[i]
        vr = decord.VideoReader(e["path"], width=self.size, height=self.size, num_threads=1)
        s = random.randint(0, len(vr) - self.frames)
        x = vr.get_batch(list(range(s, s + self.frames))).float() / 127.5 - 1  # T H W C
        if random.random() < 0.5:
            x = x.flip(2)
        return x.permute(3, 0, 1, 2)  # C T H W


class Conv2Plus1d(nn.Module):
    def __init__(self, cin, cout, stride_t=1, stride_s=1):
        super().__init__()
        self.s = nn.Conv3d(cin, cout, (1, 3, 3), (1, stride_s, stride_s), (0, 1, 1))
        self.t = nn.Conv3d(cout, cout, (3, 1, 1), (stride_t, 1, 1), (1, 0, 0))

    def forward(self, x):
        return self.t(F.silu(self.s(x)))


class Res(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), Conv2Plus1d(c, c), nn.GroupNorm(32, c), nn.SiLU(),
                                  Conv2Plus1d(c, c))

    def forward(self, x):
        return x + self.body(x)


class Up(nn.Module):
    def __init__(self, cin, cout, t=True):
        super().__init__()
        self.scale = (2 if t else 1, 2, 2)
        self.conv = Conv2Plus1d(cin, cout)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=self.scale, mode="nearest"))


class EMAQuantizer(nn.Module):
    def __init__(self, num_codes=4096, dim=256, decay=0.99, eps=1e-5, beta=0.25):
        super().__init__()
        self.decay, self.eps, self.beta = decay, eps, beta
        embed = torch.randn(num_codes, dim) * 0.02
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.zeros(num_codes))
        self.register_buffer("embed_avg", embed.clone())

    def forward(self, z):
        b, c, t, h, w = z.shape
        flat = z.permute(0, 2, 3, 4, 1).reshape(-1, c).float()
        dist_ = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.embed.t() + self.embed.pow(2).sum(1)[None]
        idx = dist_.argmin(1)
        q = F.embedding(idx, self.embed)
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(idx, self.embed.shape[0]).type(flat.dtype)
                counts = onehot.sum(0)
                sums = onehot.t() @ flat
                if dist.is_initialized():
                    dist.all_reduce(counts)
                    dist.all_reduce(sums)
                self.cluster_size.mul_(self.decay).add_(counts, alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(sums, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                size = (self.cluster_size + self.eps) / (n + self.embed.shape[0] * self.eps) * n
                self.embed.copy_(self.embed_avg / size[:, None])
        commit = self.beta * F.mse_loss(flat, q.detach())
        q = flat + (q - flat).detach()
        return q.view(b, t, h, w, c).permute(0, 4, 1, 2, 3).to(z.dtype), commit, idx


class VideoVQGAN(nn.Module):
    def __init__(self, ch=128, dim=256):
        super().__init__()
        self.enc = nn.Sequential(Conv2Plus1d(3, ch), Res(ch), Conv2Plus1d(ch, ch * 2, 2, 2), Res(ch * 2),
                                 Conv2Plus1d(ch * 2, ch * 2, 1, 2), Res(ch * 2), Conv2Plus1d(ch * 2, ch * 4, 2, 2),
                                 Res(ch * 4), nn.GroupNorm(32, ch * 4), nn.SiLU(), nn.Conv3d(ch * 4, dim, 1))
        self.quant = EMAQuantizer(dim=dim)
        self.dec = nn.Sequential(nn.Conv3d(dim, ch * 4, 1), Res(ch * 4), Up(ch * 4, ch * 2), Res(ch * 2),
                                 Up(ch * 2, ch * 2, t=False), Res(ch * 2), Up(ch * 2, ch), Res(ch),
                                 nn.GroupNorm(32, ch), nn.SiLU())
        self.out = nn.Conv3d(ch, 3, 3, 1, 1)

    def forward(self, x):
        q, commit, idx = self.quant(self.enc(x))
        return self.out(self.dec(q)), commit, idx

    def last_layer(self):
        return self.out.weight


class Disc3D(nn.Module):
    def __init__(self, ch=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv3d(3, ch, 4, 2, 1), nn.LeakyReLU(0.2, True),
            nn.Conv3d(ch, ch * 2, 4, 2, 1, bias=False), nn.BatchNorm3d(ch * 2), nn.LeakyReLU(0.2, True),
            nn.Conv3d(ch * 2, ch * 4, 4, 2, 1, bias=False), nn.BatchNorm3d(ch * 4), nn.LeakyReLU(0.2, True),
            nn.Conv3d(ch * 4, 1, 3, 1, 1))

    def forward(self, x):
        return self.net(x)


@torch.no_grad()
def evaluate(g, lp, items, device, rank, world, frames=16):
    g.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for e in items[rank::world]:
        vr = decord.VideoReader(e["path"], width=128, height=128)
        n = len(vr) // frames * frames
        if n == 0:
            continue
        v = vr.get_batch(list(range(n))).float().to(device) / 127.5 - 1  # N H W C
        clips = v.view(n // frames, frames, 128, 128, 3).permute(0, 4, 1, 2, 3)
        rec = torch.cat([g(c[None])[0] for c in clips]).clamp(-1, 1)
        fr, fg = rec.transpose(1, 2).flatten(0, 1), clips.transpose(1, 2).flatten(0, 1)
        mse = ((fr - fg) / 2).pow(2).mean((1, 2, 3))
        acc += torch.stack([(-10 * mse.log10()).sum().double(), lp(fr, fg).sum().double(),
                            torch.tensor(float(fr.shape[0]), device=device, dtype=torch.float64)])
    dist.all_reduce(acc)
    g.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--video_root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=300000)
    ap.add_argument("--disc_start", type=int, default=30000)
    ap.add_argument("--eval_every", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_items, test_items = build_or_load_index(args.video_root, "train", rank), build_or_load_index(
        args.video_root, "test", rank)
    g_net = VideoVQGAN().to(device)
    d_net = nn.SyncBatchNorm.convert_sync_batchnorm(Disc3D()).to(device)
    lp = lpips.LPIPS(net="vgg").to(device).eval().requires_grad_(False)
    opt_g = torch.optim.Adam(g_net.parameters(), lr=args.lr, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(d_net.parameters(), lr=args.lr, betas=(0.5, 0.9))
    step = 0
    ck = os.path.join(args.out, "last.pt")
    if os.path.exists(ck):
        s = torch.load(ck, map_location="cpu")
        g_net.load_state_dict(s["g"])
        d_net.load_state_dict(s["d"])
        opt_g.load_state_dict(s["opt_g"])
        opt_d.load_state_dict(s["opt_d"])
        step = s["step"]
    gen = DDP(g_net, device_ids=[local_rank], broadcast_buffers=False)
    disc = DDP(d_net, device_ids=[local_rank])
    torch.manual_seed(1 + rank)

    ds = Clips(train_items)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    epoch = step // len(loader)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x in loader:
            x = x.to(device, non_blocking=True)
            use_gan = step >= args.disc_start
            rec, commit, idx = gen(x)
            nll = (rec - x).abs().mean() + lp(rec.transpose(1, 2).flatten(0, 1), x.transpose(1, 2).flatten(0, 1)).mean()
            loss = nll + commit
            if use_gan:
                g_adv = -disc(rec).mean()
                last = g_net.last_layer()
                gn = torch.autograd.grad(nll, last, retain_graph=True)[0].norm()
                ga = torch.autograd.grad(g_adv, last, retain_graph=True)[0].norm()
                loss = loss + 0.1 * (gn / (ga + 1e-4)).clamp(max=1e4).detach() * g_adv
            opt_g.zero_grad(set_to_none=True)
            loss.backward()
            opt_g.step()
            if use_gan:
                logits = disc(torch.cat([x, rec.detach()]))
                lr_, lf_ = logits.chunk(2)
                d_loss = 0.5 * (F.relu(1 - lr_).mean() + F.relu(1 + lf_).mean())
                opt_d.zero_grad(set_to_none=True)
                d_loss.backward()
                opt_d.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                used = torch.unique(idx).numel()
                print(f"step {step} nll {nll.item():.4f} commit {commit.item():.4f} codes/batch {used}", flush=True)
            if step % args.eval_every == 0:
                psnr, lpv = evaluate(g_net, lp, test_items, device, rank, world)
                if rank == 0:
                    print(f"step {step} test PSNR {psnr:.2f} LPIPS {lpv:.4f}", flush=True)
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"g": g_net.state_dict(), "d": d_net.state_dict(), "opt_g": opt_g.state_dict(),
                                "opt_d": opt_d.state_dict(), "step": step}, ck + ".tmp")
                    os.replace(ck + ".tmp", ck)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
