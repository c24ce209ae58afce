"""DVS Gesture, convolutional LIF network trained with full BPTT over T=48 bins.

Memory is kept in check by checkpointing chunks of time steps (non-reentrant
checkpoint, recomputed in backward) and by bf16 autocast where the GPU has it.

    torchrun --nproc_per_node=4 17_gesture_bptt_chunked_ckpt.py --root /data/gesture_npz --wandb
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

try:
    import wandb
except ImportError:  # logging is optional
    wandb = None


class GestureVoxels(Dataset):
    """<root>/<split>/*.npz with x, y, t, p, label; full recording binned into T slices at 64x64."""

    def __init__(self, root, split, T):
        self.files = sorted(os.path.join(root, split, f) for f in os.listdir(os.path.join(root, split))
                            if f.endswith(".npz"))
        self.T = T

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        t = d["t"].astype(np.int64)
        vox = np.zeros((self.T, 2, 64, 64), dtype=np.float32)
        if t.size:
            b = (t - t[0]) * self.T // (t[-1] - t[0] + 1)
            np.add.at(vox, (b, d["p"].astype(np.int64), d["y"] // 2, d["x"] // 2), 1.0)
        return torch.from_numpy(np.minimum(vox, 6.0) / 6.0), int(d["label"])


class Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        return (u > 0).to(u.dtype)

    @staticmethod
    def backward(ctx, g):
        (u,) = ctx.saved_tensors
        return g * torch.exp(-2.0 * u.abs()).to(g.dtype)


class ChunkedLIFNet(nn.Module):
    def __init__(self, ch=64, num_classes=11, tau=2.0, chunk=8):
        super().__init__()
        self.chunk, self.decay = chunk, 1.0 - 1.0 / tau
        self.conv = nn.ModuleList([
            nn.Conv2d(2, ch, 3, padding=1, bias=False),
            nn.Conv2d(ch, ch * 2, 3, stride=2, padding=1, bias=False),
            nn.Conv2d(ch * 2, ch * 4, 3, stride=2, padding=1, bias=False),
        ])
        self.norm = nn.ModuleList([nn.GroupNorm(8, ch), nn.GroupNorm(8, ch * 2), nn.GroupNorm(8, ch * 4)])
        self.fc = nn.Linear(ch * 4, num_classes)

    def _chunk(self, x_chunk, v0, v1, v2):
        """Runs a few time steps; returns summed logits, spike count and the final membranes."""
        vs = [v0, v1, v2]
        logits, spikes = 0.0, 0.0
        for xt in x_chunk.unbind(1):
            h = xt
            for k in range(3):
                vs[k] = self.decay * vs[k] + self.norm[k](self.conv[k](h))
                h = Spike.apply(vs[k] - 1.0)
                vs[k] = vs[k] - h.detach()
                spikes = spikes + h.mean()
            logits = logits + self.fc(h.mean(dim=(2, 3)))
        return logits, spikes, vs[0], vs[1], vs[2]

    def forward(self, x):  # [B, T, 2, 64, 64]
        B, T = x.shape[:2]
        ch = self.conv[0].out_channels
        v0 = x.new_zeros(B, ch, 64, 64)
        v1 = x.new_zeros(B, ch * 2, 32, 32)
        v2 = x.new_zeros(B, ch * 4, 16, 16)
        logits, spikes = 0.0, 0.0
        for s in range(0, T, self.chunk):
            xc = x[:, s:s + self.chunk]
            if self.training:
                lo, sp, v0, v1, v2 = checkpoint(self._chunk, xc, v0, v1, v2, use_reentrant=False)
            else:
                lo, sp, v0, v1, v2 = self._chunk(xc, v0, v1, v2)
            logits, spikes = logits + lo, spikes + sp
        return logits / T, spikes / (3 * T)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--T", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4, help="per 32 samples")
    ap.add_argument("--rate-target", type=float, default=0.05)
    ap.add_argument("--ckpt", default="/shared/ckpt/gesture_bptt/last.pt")
    ap.add_argument("--wandb", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    use_bf16 = torch.cuda.is_bf16_supported()
    amp_dtype = torch.bfloat16 if use_bf16 else torch.float16
    scaler = torch.cuda.amp.GradScaler(enabled=not use_bf16)  # loss scaling only needed for fp16

    train_set = GestureVoxels(args.root, "train", args.T)
    test_set = GestureVoxels(args.root, "test", args.T)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), args.batch_size,
                             num_workers=8, pin_memory=True)

    model = DDP(ChunkedLIFNet(chunk=args.chunk).to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 32
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    start, best = 0, 0.0
    if os.path.exists(args.ckpt):
        ck = torch.load(args.ckpt, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start, best = ck["epoch"] + 1, ck["best"]

    run = None
    if rank == 0:
        os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
        if args.wandb and wandb is not None:
            run = wandb.init(project="snn-gesture", config=vars(args) | {"world_size": world, "lr": lr},
                             resume="allow")

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        m = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=amp_dtype):
                logits, rate = model(x)
                loss = F.cross_entropy(logits.float(), y) + (rate.float() - args.rate_target) ** 2
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(opt)
            scaler.update()
            m += torch.stack([loss.detach(), rate.detach().float(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(m)

        net = model.module.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=amp_dtype):
            for x, y in test_loader:
                logits, _ = net(x.to(device, non_blocking=True))
                hits += torch.stack([(logits.argmax(1) == y.to(device)).sum().float(),
                                     torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1]).item()
        best = max(best, acc)

        if rank == 0:
            stats = {"loss": (m[0] / m[2]).item(), "rate": (m[1] / m[2]).item(), "test_acc": acc,
                     "best_acc": best, "lr": sched.get_last_lr()[0], "epoch_time": time.time() - t0}
            print(f"epoch {epoch} " + " ".join(f"{k} {v:.4g}" for k, v in stats.items()), flush=True)
            if run is not None:
                run.log(stats, step=epoch)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "best": best}, args.ckpt + ".tmp")
            os.replace(args.ckpt + ".tmp", args.ckpt)

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
