"""Stage-1 tokenizer for the two-stage pipeline (VQ-VAE f4 for 128px video frames, per-frame).

Writes <out>/tokenizer_last.pt (resumable) and <out>/tokenizer_export.pt which stage2_gpt.py loads
with `VQVAE(**cfg).load_state_dict(torch.load(...)["model"])`.

    torchrun --nproc_per_node=8 13_vqvae_kinetics_frames.py --frames /data/kinetics600_frames128 --out /ckpt/kin_vq_f4
"""
import argparse
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


class FrameDataset(Dataset):
    def __init__(self, root, list_file, size=128):
        with open(list_file) as f:
            self.items = [os.path.join(root, l.strip()) for l in f if l.strip()]
        self.tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor()])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.tf(Image.open(self.items[i]).convert("RGB")) * 2 - 1


class Res(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.f = nn.Sequential(nn.ReLU(), nn.Conv2d(c, c // 2, 3, 1, 1), nn.ReLU(), nn.Conv2d(c // 2, c, 1))

    def forward(self, x):
        return x + self.f(x)


class VQ(nn.Module):
    def __init__(self, k, d, beta=0.25):
        super().__init__()
        self.k, self.d, self.beta = k, d, beta
        self.emb = nn.Embedding(k, d)
        self.emb.weight.data.uniform_(-1 / k, 1 / k)

    def forward(self, z):
        zp = z.permute(0, 2, 3, 1)
        flat = zp.reshape(-1, self.d)
        idx = torch.cdist(flat, self.emb.weight).argmin(1)
        q = self.emb(idx).view_as(zp)
        loss = F.mse_loss(q, zp.detach()) + self.beta * F.mse_loss(zp, q.detach())
        q = zp + (q - zp).detach()
        return q.permute(0, 3, 1, 2), loss, idx.view(zp.shape[:3])


class VQVAE(nn.Module):
    def __init__(self, ch=256, k=2048, d=64):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, ch // 2, 4, 2, 1), nn.ReLU(), nn.Conv2d(ch // 2, ch, 4, 2, 1),
                                 nn.ReLU(), nn.Conv2d(ch, ch, 3, 1, 1), Res(ch), Res(ch), nn.Conv2d(ch, d, 1))
        self.vq = VQ(k, d)
        self.dec = nn.Sequential(nn.Conv2d(d, ch, 3, 1, 1), Res(ch), Res(ch), nn.ReLU(),
                                 nn.ConvTranspose2d(ch, ch // 2, 4, 2, 1), nn.ReLU(),
                                 nn.ConvTranspose2d(ch // 2, 3, 4, 2, 1))

    def forward(self, x):
        q, l, idx = self.vq(self.enc(x))
        return self.dec(q), l, idx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--iters", type=int, default=200_000)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--ckpt_every", type=int, default=2000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    ds = FrameDataset(args.frames, os.path.join(args.frames, "train_frames.txt"))
    sampler = DistributedSampler(ds, shuffle=True, seed=17)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=12, pin_memory=True, drop_last=True,
                    persistent_workers=True, prefetch_factor=4)

    net = VQVAE(k=args.k).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    last = os.path.join(args.out, "tokenizer_last.pt")
    it = 0
    if os.path.isfile(last):
        ck = torch.load(last, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        it = ck["it"]
    model = DDP(net, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(ds)} frames, {world} gpus, starting at iter {it}", flush=True)

    epoch = it // len(dl)
    t0 = time.time()
    counts = torch.zeros(args.k, device=device, dtype=torch.long)
    while it < args.iters:
        sampler.set_epoch(epoch)
        for x in dl:
            x = x.to(device, non_blocking=True)
            xr, vq_loss, idx = model(x)
            rec = F.mse_loss(xr, x)
            loss = rec + vq_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            it += 1
            counts += torch.bincount(idx.flatten(), minlength=args.k)

            if it % 500 == 0:
                stats = torch.stack([rec.detach(), vq_loss.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                dist.all_reduce(counts)
                if rank == 0:
                    p = counts.float() / counts.sum()
                    ppl = torch.exp(-(p[p > 0] * p[p > 0].log()).sum()).item()
                    print(f"it {it} mse {stats[0]:.5f} vq {stats[1]:.5f} ppl {ppl:.1f} "
                          f"dead {(counts == 0).sum().item()} {(time.time() - t0) / 500:.3f}s/it", flush=True)
                    t0 = time.time()
                counts.zero_()

            if it % args.ckpt_every == 0 or it == args.iters:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "it": it}, last + ".tmp")
                    os.replace(last + ".tmp", last)
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    if rank == 0:
        torch.save({"model": model.state_dict(), "config": {"ch": 256, "k": args.k, "d": 64}},
                   os.path.join(args.out, "tokenizer_export.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
