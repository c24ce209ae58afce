"""
Visuomotor imitation policy for the tabletop pick-and-place rig: wrist + front RGB (96x96)
and 7-D proprio -> chunk of 16 future joint-velocity actions. Trained from teleop episodes
recorded with our ROS bag -> zarr converter (episodes/*.zarr, one group per episode).

    torchrun --nproc_per_node=4 15_visuomotor_act_chunk.py --data episodes/ --epochs 300
"""
import argparse
import glob
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import zarr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

CHUNK = 16
DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def to_device(batch, device=DEVICE):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class EpisodeDataset(Dataset):
    """Random (t, t+CHUNK) windows from every episode; actions padded with the last action."""

    def __init__(self, paths, stats=None):
        self.eps = []
        for p in paths:
            g = zarr.open(p, "r")
            self.eps.append({
                "front": g["front_rgb"][:],   # (T, 96, 96, 3) uint8
                "wrist": g["wrist_rgb"][:],
                "qpos": g["qpos"][:].astype(np.float32),    # (T, 7)
                "action": g["action"][:].astype(np.float32),  # (T, 7)
            })
        self.index = [(e, t) for e, ep in enumerate(self.eps) for t in range(len(ep["action"]))]
        if stats is None:
            q = np.concatenate([ep["qpos"] for ep in self.eps])
            a = np.concatenate([ep["action"] for ep in self.eps])
            stats = {"q_mean": q.mean(0), "q_std": q.std(0) + 1e-4, "a_mean": a.mean(0), "a_std": a.std(0) + 1e-4}
        self.stats = stats

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        e, t = self.index[i]
        ep = self.eps[e]
        T = len(ep["action"])
        idx = np.minimum(np.arange(t, t + CHUNK), T - 1)
        img = lambda a: torch.from_numpy(a[t]).permute(2, 0, 1).float() / 255.0  # noqa: E731
        return {
            "front": img(ep["front"]),
            "wrist": img(ep["wrist"]),
            "qpos": torch.from_numpy((ep["qpos"][t] - self.stats["q_mean"]) / self.stats["q_std"]),
            "actions": torch.from_numpy((ep["action"][idx] - self.stats["a_mean"]) / self.stats["a_std"]),
            "is_pad": torch.from_numpy(np.arange(t, t + CHUNK) >= T),
        }


def resnet18_trunk():
    m = torchvision.models.resnet18(weights="IMAGENET1K_V1")
    m.fc = nn.Identity()
    # GroupNorm instead of BatchNorm, as in diffusion policy / ACT code
    def bn_to_gn(mod):
        for name, child in mod.named_children():
            if isinstance(child, nn.BatchNorm2d):
                setattr(mod, name, nn.GroupNorm(child.num_features // 16, child.num_features))
            else:
                bn_to_gn(child)
    bn_to_gn(m)
    return m


class ChunkPolicy(nn.Module):
    def __init__(self, hidden=512):
        super().__init__()
        self.front_enc = resnet18_trunk()
        self.wrist_enc = resnet18_trunk()
        self.q_enc = nn.Sequential(nn.Linear(7, 64), nn.ReLU())
        self.register_buffer("img_mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("img_std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
        self.head = nn.Sequential(
            nn.Linear(512 + 512 + 64, hidden), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, CHUNK * 7),
        )

    def forward(self, front, wrist, qpos):
        f = self.front_enc((front - self.img_mean) / self.img_std)
        w = self.wrist_enc((wrist - self.img_mean) / self.img_std)
        h = torch.cat([f, w, self.q_enc(qpos)], dim=-1)
        return self.head(h).view(-1, CHUNK, 7)


def chunk_l1(pred, target, is_pad):
    l1 = F.l1_loss(pred, target, reduction="none").mean(-1)
    return (l1 * (~is_pad)).sum() / (~is_pad).sum().clamp(min=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="episodes")
    ap.add_argument("--val_episodes", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default="ckpts/pickplace_chunk")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    paths = sorted(glob.glob(os.path.join(args.data, "*.zarr")))
    train_ds = EpisodeDataset(paths[:-args.val_episodes])
    val_ds = EpisodeDataset(paths[-args.val_episodes:], stats=train_ds.stats)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=128, num_workers=2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dataset_stats.pkl"), "wb") as f:
            pickle.dump(train_ds.stats, f)

    policy = ChunkPolicy().to(device)
    model = DDP(policy, device_ids=[local_rank])
    backbone_params = [p for n, p in policy.named_parameters() if "_enc." in n and "q_enc" not in n]
    other_params = [p for n, p in policy.named_parameters() if not ("_enc." in n and "q_enc" not in n)]
    opt = torch.optim.AdamW([{"params": backbone_params, "lr": args.lr * 0.1},
                             {"params": other_params, "lr": args.lr}], weight_decay=1e-4)

    best_val = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for batch in tqdm(loader, disable=rank != 0, leave=False):
            batch = to_device(batch)
            pred = model(batch["front"], batch["wrist"], batch["qpos"])
            loss = chunk_l1(pred, batch["actions"], batch["is_pad"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tr)

        policy.eval()
        va = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in val_loader:
                batch = to_device(batch, device)
                pred = policy(batch["front"], batch["wrist"], batch["qpos"])
                va += torch.stack([chunk_l1(pred, batch["actions"], batch["is_pad"]) * len(pred),
                                   torch.tensor(float(len(pred)), device=device)])
        dist.all_reduce(va)
        val_l1 = (va[0] / va[1]).item()
        if rank == 0:
            print(f"epoch {epoch:03d} train L1 {(tr[0] / tr[1]).item():.4f} val L1 {val_l1:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if val_l1 < best_val:
                best_val = val_l1
                torch.save(policy.state_dict(), os.path.join(args.out, "policy_best.ckpt"))
            if epoch % 50 == 0:
                torch.save(policy.state_dict(), os.path.join(args.out, f"policy_epoch_{epoch}.ckpt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
