"""VQ-VAE-2 style two-level tokenizer (top 32x32 / bottom 64x64) with dead-code restarts.

Codes whose usage over the last `restart_every` steps falls below `dead_threshold` are
re-initialised from encoder outputs of the current batch (chosen on rank 0 and broadcast).

    torchrun --nproc_per_node=4 07_vqvae2_celebahq.py --root /data/celebahq_256 --save_dir exp/vqvae2_celebahq
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms, utils


class Quantize(nn.Module):
    def __init__(self, dim, n_embed):
        super().__init__()
        self.dim, self.n_embed = dim, n_embed
        self.embed = nn.Parameter(torch.randn(n_embed, dim) * 0.1)

    def forward(self, x):
        # x: (B, H, W, C)
        flat = x.reshape(-1, self.dim)
        d = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.embed.t() + self.embed.pow(2).sum(1)
        ind = d.argmin(1)
        q = F.embedding(ind, self.embed).view_as(x)
        diff = (q.detach() - x).pow(2).mean() * 0.25 + (q - x.detach()).pow(2).mean()
        q = x + (q - x).detach()
        return q, diff, ind.view(x.shape[:-1]), flat.detach()


class CodebookMonitor:
    """Tracks per-code usage between restarts."""

    def __init__(self, n_embed):
        self.counts = torch.zeros(n_embed, dtype=torch.long)

    def update(self, ind):
        self.counts += torch.bincount(ind.flatten().cpu(), minlength=self.counts.numel())

    def reset(self):
        self.counts.zero_()


def down(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 4, 2, 1), nn.ReLU(True))


def up(cin, cout):
    return nn.Sequential(nn.ConvTranspose2d(cin, cout, 4, 2, 1), nn.ReLU(True))


class VQVAE2(nn.Module):
    def __init__(self, ch=128, dim=64, n_embed=512):
        super().__init__()
        self.enc_b = nn.Sequential(down(3, ch // 2), down(ch // 2, ch), nn.Conv2d(ch, ch, 3, 1, 1))
        self.enc_t = nn.Sequential(down(ch, ch), nn.Conv2d(ch, ch, 3, 1, 1))
        self.qconv_t = nn.Conv2d(ch, dim, 1)
        self.q_t = Quantize(dim, n_embed)
        self.dec_t = up(dim, dim)
        self.qconv_b = nn.Conv2d(ch + dim, dim, 1)
        self.q_b = Quantize(dim, n_embed)
        self.up_t = nn.ConvTranspose2d(dim, dim, 4, 2, 1)
        self.dec = nn.Sequential(nn.Conv2d(2 * dim, ch, 3, 1, 1), nn.ReLU(True), up(ch, ch // 2),
                                 nn.ConvTranspose2d(ch // 2, 3, 4, 2, 1))

    def forward(self, x):
        hb = self.enc_b(x)
        ht = self.enc_t(hb)
        qt, dt, it, ft = self.q_t(self.qconv_t(ht).permute(0, 2, 3, 1))
        qt = qt.permute(0, 3, 1, 2)
        hb = torch.cat([self.dec_t(qt), hb], 1)
        qb, db, ib, fb = self.q_b(self.qconv_b(hb).permute(0, 2, 3, 1))
        qb = qb.permute(0, 3, 1, 2)
        out = self.dec(torch.cat([self.up_t(qt), qb], 1))
        return out, dt + db, (it, ib), (ft, fb)


@torch.no_grad()
def restart_dead_codes(quant, counts, feats, threshold):
    dead = counts < threshold
    n_dead = int(dead.sum())
    if n_dead == 0:
        return 0
    new = torch.empty(n_dead, quant.dim, device=quant.embed.device)
    if dist.get_rank() == 0:
        pick = torch.randint(0, feats.shape[0], (n_dead,), device=feats.device)
        new.copy_(feats[pick] + 0.01 * torch.randn_like(feats[pick]))
    dist.broadcast(new, src=0)
    quant.embed.data[dead.to(quant.embed.device)] = new
    return n_dead


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--n_embed", type=int, default=512)
    ap.add_argument("--restart_every", type=int, default=500)
    ap.add_argument("--dead_threshold", type=int, default=2)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tf = transforms.Compose([transforms.Resize(args.size), transforms.CenterCrop(args.size),
                             transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.root, transform=tf)
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    model = VQVAE2(n_embed=args.n_embed).to(device)
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    mon_t, mon_b = CodebookMonitor(args.n_embed), CodebookMonitor(args.n_embed)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        with open(os.path.join(args.save_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for img, _ in loader:
            img = img.to(device, non_blocking=True)
            out, latent_loss, (it, ib), (ft, fb) = model(img)
            recon = F.mse_loss(out, img)
            loss = recon + latent_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1

            mon_t.update(it)
            mon_b.update(ib)
            if step % args.restart_every == 0:
                dist.all_reduce(mon_t.counts)
                dist.all_reduce(mon_b.counts)
                used_t = int((mon_t.counts > 0).sum())
                used_b = int((mon_b.counts > 0).sum())
                nt = restart_dead_codes(model.module.q_t, mon_t.counts, ft, args.dead_threshold)
                nb = restart_dead_codes(model.module.q_b, mon_b.counts, fb, args.dead_threshold)
                mon_t.reset()
                mon_b.reset()
                r = torch.stack([recon.detach(), latent_loss.detach()])
                dist.all_reduce(r, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} mse {r[0]:.5f} latent {r[1]:.5f} used top {used_t} bot {used_b} "
                          f"restarted {nt}/{nb} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - tic) / args.restart_every:.3f}s/it", flush=True)
                tic = time.time()

        if rank == 0:
            model.eval()
            with torch.no_grad():
                sample = img[:16]
                rec, _, _, _ = model.module(sample)
            utils.save_image(torch.cat([sample, rec]), os.path.join(args.save_dir, f"rec_{epoch:03d}.png"),
                             nrow=16, normalize=True, value_range=(-1, 1))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.save_dir, "vqvae2_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
