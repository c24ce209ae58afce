"""Coarse transformer matcher trained from scene-level tar shards (MegaDepth + BlendedMVS).

Every scene is packed into one or more tar shards (``<scene>-<k>.tar``) of pre-resized pairs:
``<key>.im0.png``, ``<key>.im1.png`` and ``<key>.corr.npy`` (N x 4 pixel correspondences).

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 \
        12_coarse_matcher_scene_shards.py --shards "/lustre/md_bmvs_shards/train/*.tar" \
        --val_shards "/lustre/md_bmvs_shards/val/*.tar" --out /lustre/runs/cm_shards
"""
import argparse
import contextlib
import glob
import io
import math
import os
import random
import tarfile

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

RES = 512
STRIDE = 8


class SceneShardStream(IterableDataset):
    """Endless stream over this rank's shards; shard sizes differ, so the caller bounds the epoch by steps."""

    def __init__(self, shards, rank, world, seed=0, max_corr=2048):
        self.shards = shards[rank::world]
        self.rank, self.seed, self.max_corr = rank, seed, max_corr
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _samples(self, path):
        with tarfile.open(path) as tf:
            group = {}
            for m in tf:
                key, kind = m.name.split(".", 1)
                group.setdefault(key, {})[kind] = tf.extractfile(m).read()
                if len(group[key]) == 3:
                    yield group.pop(key)

    def _decode(self, s):
        im0 = np.asarray(Image.open(io.BytesIO(s["im0.png"])).convert("L"), np.float32) / 255.0
        im1 = np.asarray(Image.open(io.BytesIO(s["im1.png"])).convert("L"), np.float32) / 255.0
        corr = np.load(io.BytesIO(s["corr.npy"])).astype(np.float32)
        np.random.shuffle(corr)
        out = np.full((self.max_corr, 4), -1.0, np.float32)
        out[: min(len(corr), self.max_corr)] = corr[: self.max_corr]
        return torch.from_numpy(im0)[None], torch.from_numpy(im1)[None], torch.from_numpy(out)

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        my = self.shards[wid::nw]
        rng = random.Random(hash((self.seed, self.epoch, self.rank, wid)))
        np.random.seed(rng.randrange(2 ** 31))
        while True:
            rng.shuffle(my)
            buf = []
            for path in my:
                for s in self._samples(path):
                    buf.append(s)
                    if len(buf) >= 64:
                        yield self._decode(buf.pop(rng.randrange(len(buf))))
            while buf:
                yield self._decode(buf.pop(rng.randrange(len(buf))))


class Attn(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, src):
        b, n, d = x.shape
        q = self.q(self.n1(x)).view(b, n, self.h, -1).transpose(1, 2)
        k, v = self.kv(self.n1(src)).view(b, src.size(1), 2, self.h, -1).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.n2(x))


class CoarseMatcher(nn.Module):
    def __init__(self, d=256, heads=8, depth=6, grad_ckpt=True):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, 64, 7, 2, 3), nn.GroupNorm(8, 64), nn.GELU(),
            nn.Conv2d(64, 128, 3, 2, 1), nn.GroupNorm(16, 128), nn.GELU(),
            nn.Conv2d(128, d, 3, 2, 1), nn.GroupNorm(32, d), nn.GELU(), nn.Conv2d(d, d, 3, 1, 1))
        n = (RES // STRIDE) ** 2
        self.pos = nn.Parameter(torch.zeros(1, n, d))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.self_blocks = nn.ModuleList([Attn(d, heads) for _ in range(depth)])
        self.cross_blocks = nn.ModuleList([Attn(d, heads) for _ in range(depth)])
        self.grad_ckpt = grad_ckpt
        self.log_temp = nn.Parameter(torch.tensor(math.log(10.0)))

    def _run(self, blk, x, src):
        if self.grad_ckpt and self.training:
            return checkpoint(blk, x, src, use_reentrant=False)
        return blk(x, src)

    def forward(self, im0, im1):
        b = im0.size(0)
        f = self.stem(torch.cat([im0, im1])).flatten(2).transpose(1, 2) + self.pos
        x0, x1 = f[:b], f[b:]
        for sb, cb in zip(self.self_blocks, self.cross_blocks):
            x0, x1 = self._run(sb, x0, x0), self._run(sb, x1, x1)
            x0, x1 = self._run(cb, x0, x1), self._run(cb, x1, x0)
        x0, x1 = F.normalize(x0, dim=-1), F.normalize(x1, dim=-1)
        sim = x0 @ x1.transpose(1, 2) * self.log_temp.exp()
        return sim.log_softmax(1) + sim.log_softmax(2)  # log dual-softmax


def cells(pts):
    w = RES // STRIDE
    c = (pts / STRIDE).floor().long().clamp(0, w - 1)
    return c[..., 1] * w + c[..., 0]


def coarse_nll(logp, corr):
    valid = corr[..., 0] >= 0
    i, j = cells(corr[..., :2]), cells(corr[..., 2:])
    ll = logp.gather(1, i[..., None].expand(-1, -1, logp.size(2))).gather(2, j[..., None])[..., 0]
    return -(ll * valid).sum() / valid.sum().clamp(min=1), (logp.argmax(2).gather(1, i) == j)[valid].float().mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--val_shards", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro_batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--steps_per_epoch", type=int, default=2000, help="optimizer steps, identical on all ranks")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--val_batches", type=int, default=100)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    shards = sorted(glob.glob(args.shards))
    assert len(shards) >= world * args.workers, f"{len(shards)} shards for {world} ranks x {args.workers} workers"
    train_stream = SceneShardStream(shards, rank, world)
    train_dl = DataLoader(train_stream, batch_size=args.micro_batch, num_workers=args.workers, pin_memory=True)
    val_shards = sorted(glob.glob(args.val_shards))
    assert len(val_shards) >= world, "need at least one validation shard per rank"
    val_dl = DataLoader(SceneShardStream(val_shards, rank, world, seed=123), batch_size=8, num_workers=1)

    model = DDP(CoarseMatcher().to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * args.steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / 1000) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        train_stream.set_epoch(epoch)
        model.train()
        it = iter(train_dl)
        meter = torch.zeros(3, device=dev)
        for step in range(args.steps_per_epoch):
            for micro in range(args.accum):
                im0, im1, corr = (t.to(dev, non_blocking=True) for t in next(it))
                # all-reduce only on the last micro-batch of the accumulation window
                ctx = model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext()
                with ctx:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        logp = model(im0, im1)
                    loss, acc = coarse_nll(logp.float(), corr)
                    (loss / args.accum).backward()
                meter += torch.stack([loss.detach(), acc.detach(), torch.ones((), device=dev)])
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        del it  # shut down this epoch's workers before the next set_epoch

        model.eval()
        vm = torch.zeros(3, device=dev)
        vit = iter(val_dl)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(args.val_batches):
                im0, im1, corr = (t.to(dev) for t in next(vit))
                loss, acc = coarse_nll(model.module(im0, im1).float(), corr)
                vm += torch.stack([loss, acc, torch.ones((), device=dev)])
        del vit
        dist.all_reduce(meter)
        dist.all_reduce(vm)
        if rank == 0:
            print(f"epoch {epoch}: train nll {meter[0] / meter[2]:.3f} acc {meter[1] / meter[2]:.3f} | "
                  f"val nll {vm[0] / vm[2]:.3f} acc {vm[1] / vm[2]:.3f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path + ".partial")
            os.replace(ckpt_path + ".partial", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
