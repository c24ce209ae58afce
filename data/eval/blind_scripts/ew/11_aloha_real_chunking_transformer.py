"""Action-chunking transformer (no CVAE) on real ALOHA recordings with JPEG-compressed cameras.

The raw episodes store each frame as JPEG bytes (aloha `compress=True` recordings). Decoding
and resizing 4 cameras per step is far too slow for the data loader, so the first run decodes
everything once into a uint8 .npy cache (plus normalisation stats) that later runs reuse.

    torchrun --nproc_per_node=8 11_aloha_real_chunking_transformer.py \
        --raw_dir /data/aloha/fold_towel --cache_root /data/cache --out runs/fold_towel_chunk
"""
import argparse
import glob
import json
import os
import time

import cv2
import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops.misc import FrozenBatchNorm2d

CAMERAS = ["cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist"]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw_dir", required=True)
    ap.add_argument("--cache_root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--img_hw", type=int, nargs=2, default=[240, 320])
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--global_batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--save_every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def build_cache(raw_dir, cache_dir, hw):
    files = sorted(glob.glob(os.path.join(raw_dir, "episode_*.hdf5")))
    lengths = []
    for fn in files:
        with h5py.File(fn, "r") as f:
            lengths.append(f["action"].shape[0])
    total = int(sum(lengths))
    os.makedirs(cache_dir, exist_ok=True)
    images = np.lib.format.open_memmap(os.path.join(cache_dir, "images.npy"), mode="w+", dtype=np.uint8,
                                       shape=(total, len(CAMERAS), hw[0], hw[1], 3))
    qpos, action, ptr = [], [], 0
    for fn, n in zip(files, lengths):
        with h5py.File(fn, "r") as f:
            for c_i, cam in enumerate(CAMERAS):
                for t, buf in enumerate(f[f"observations/images/{cam}"]):
                    img = cv2.cvtColor(cv2.imdecode(np.frombuffer(buf, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
                    images[ptr + t, c_i] = cv2.resize(img, (hw[1], hw[0]), interpolation=cv2.INTER_AREA)
            qpos.append(f["observations/qpos"][()].astype(np.float32))
            action.append(f["action"][()].astype(np.float32))
        ptr += n
    images.flush()
    qpos, action = np.concatenate(qpos), np.concatenate(action)
    np.save(os.path.join(cache_dir, "qpos.npy"), qpos)
    np.save(os.path.join(cache_dir, "action.npy"), action)
    np.save(os.path.join(cache_dir, "episode_ends.npy"), np.cumsum(lengths))
    stats = {"qpos_mean": qpos.mean(0).tolist(), "qpos_std": np.clip(qpos.std(0), 1e-2, None).tolist(),
             "action_mean": action.mean(0).tolist(), "action_std": np.clip(action.std(0), 1e-2, None).tolist()}
    with open(os.path.join(cache_dir, "stats.json"), "w") as f:
        json.dump(stats, f)


class CachedChunks(Dataset):
    def __init__(self, cache_dir, chunk):
        self.images = np.load(os.path.join(cache_dir, "images.npy"), mmap_mode="r")
        self.qpos = np.load(os.path.join(cache_dir, "qpos.npy"))
        self.action = np.load(os.path.join(cache_dir, "action.npy"))
        ends = np.load(os.path.join(cache_dir, "episode_ends.npy"))
        with open(os.path.join(cache_dir, "stats.json")) as f:
            self.stats = {k: np.asarray(v, np.float32) for k, v in json.load(f).items()}
        self.ep_end = np.repeat(ends, np.diff(np.concatenate([[0], ends])))  # end index of each frame's episode
        self.chunk = chunk

    def __len__(self):
        return len(self.qpos)

    def __getitem__(self, i):
        end = self.ep_end[i]
        a = self.action[i:min(i + self.chunk, end)]
        pad = self.chunk - len(a)
        a = np.concatenate([a, np.zeros((pad, a.shape[1]), np.float32)]) if pad else a
        s = self.stats
        return {
            "image": torch.from_numpy(np.ascontiguousarray(self.images[i])).permute(0, 3, 1, 2),
            "qpos": torch.from_numpy((self.qpos[i] - s["qpos_mean"]) / s["qpos_std"]),
            "action": torch.from_numpy((a - s["action_mean"]) / s["action_std"]),
            "is_pad": torch.arange(self.chunk) >= self.chunk - pad,
        }


class ChunkTransformer(nn.Module):
    def __init__(self, n_cams, qdim, adim, chunk, d=512, tokens_per_cam=80):
        super().__init__()
        rn = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(rn.children())[:-2])
        self.proj = nn.Conv2d(512, d, 1)
        self.cam_embed = nn.Parameter(torch.zeros(n_cams, 1, d))
        self.pos = nn.Parameter(torch.randn(1, tokens_per_cam, d) * 0.02)
        self.q_proj = nn.Linear(qdim, d)
        self.transformer = nn.Transformer(d, 8, 4, 6, 2048, 0.1, batch_first=True, norm_first=True)
        self.queries = nn.Parameter(torch.randn(1, chunk, d) * 0.02)
        self.head = nn.Linear(d, adim)
        self.register_buffer("mu", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("sigma", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, image, qpos):
        B, N = image.shape[:2]
        x = (image.flatten(0, 1).float() / 255.0 - self.mu) / self.sigma
        f = self.proj(self.backbone(x)).flatten(2).transpose(1, 2)  # (B*N, hw, d)
        f = f.view(B, N, -1, f.shape[-1]) + self.pos.unsqueeze(1) + self.cam_embed.unsqueeze(0)
        src = torch.cat([self.q_proj(qpos)[:, None], f.flatten(1, 2)], 1)
        return self.head(self.transformer(src, self.queries.expand(B, -1, -1)))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    tag = f"{os.path.basename(os.path.normpath(args.raw_dir))}_{args.img_hw[0]}x{args.img_hw[1]}"
    cache_dir = os.path.join(args.cache_root, tag)
    if not os.path.exists(os.path.join(cache_dir, "stats.json")):
        print(f"[rank {rank}] building image cache in {cache_dir}", flush=True)
        build_cache(args.raw_dir, cache_dir, args.img_hw)
    dataset = CachedChunks(cache_dir, args.chunk)

    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.global_batch // world, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    tokens = -(-args.img_hw[0] // 32) * -(-args.img_hw[1] // 32)  # ResNet-18 stride 32, rounded up
    model = ChunkTransformer(len(CAMERAS), dataset.qpos.shape[1], dataset.action.shape[1], args.chunk,
                             args.d_model, tokens).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "backbone" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 and "backbone" not in n]
    backbone = [p for n, p in model.named_parameters() if "backbone" in n]
    opt = torch.optim.AdamW([
        {"params": decay, "weight_decay": 1e-4},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": backbone, "weight_decay": 1e-4, "lr": args.lr * 0.1},
    ], lr=args.lr)
    total_steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 1000) * max(0.0, 1 - s / total_steps))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "stats.json"), "w") as f:
            json.dump({k: v.tolist() for k, v in dataset.stats.items()}, f)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, acc = time.time(), torch.zeros(2, device=device)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            pred = model(batch["image"], batch["qpos"])
            mask = (~batch["is_pad"]).unsqueeze(-1).float()
            loss = (F.l1_loss(pred, batch["action"], reduction="none") * mask).sum() / (mask.sum() * pred.shape[-1])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch}: l1 {(acc[0] / acc[1]).item():.4f}  {time.time() - t0:.0f}s")
            if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.out, f"policy_epoch{epoch + 1}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
