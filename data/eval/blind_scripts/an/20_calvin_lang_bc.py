"""Language-conditioned BC on CALVIN (ABC->D): FiLM-conditioned ResNet on static +
gripper cameras, actions as relative 7-DoF chunks. Trained with torchrun / DDP.

    torchrun --nproc_per_node=8 20_calvin_lang_bc.py --root /data/calvin/task_ABC_D
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--lang_key", default="lang_annotations/auto_lang_ann.npy")
    p.add_argument("--out", default="runs/calvin_film_bc")
    p.add_argument("--chunk", type=int, default=10)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--val_max", type=int, default=20000)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


class CalvinLangWindows(Dataset):
    """Windows inside language-annotated segments; frames are stored as episode_XXXXXXX.npz."""

    def __init__(self, split_dir, lang_key, chunk):
        ann = np.load(os.path.join(split_dir, lang_key), allow_pickle=True).item()
        self.dir = split_dir
        self.emb = ann["language"]["emb"].squeeze(1).astype(np.float32)  # (N, 384) MiniLM
        self.segments = ann["info"]["indx"]
        self.chunk = chunk
        self.index = [(s, t) for s, (a, b) in enumerate(self.segments) for t in range(a, b - chunk + 2)]

    def __len__(self):
        return len(self.index)

    def _frame(self, t):
        return np.load(os.path.join(self.dir, f"episode_{t:07d}.npz"))

    def __getitem__(self, i):
        s, t = self.index[i]
        f = self._frame(t)
        acts = np.stack([self._frame(t + k)["rel_actions"] for k in range(self.chunk)]).astype(np.float32)
        return {
            "static": torch.from_numpy(f["rgb_static"]).permute(2, 0, 1),
            "gripper": torch.from_numpy(f["rgb_gripper"]).permute(2, 0, 1),
            "state": torch.from_numpy(f["robot_obs"].astype(np.float32)),
            "lang": torch.from_numpy(self.emb[s]),
            "actions": torch.from_numpy(acts),
        }


class FiLMResNet(nn.Module):
    def __init__(self, lang_dim):
        super().__init__()
        rn = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(rn.conv1, rn.bn1, rn.relu, rn.maxpool)
        self.stages = nn.ModuleList([rn.layer1, rn.layer2, rn.layer3, rn.layer4])
        self.films = nn.ModuleList([nn.Linear(lang_dim, 2 * c) for c in (64, 128, 256, 512)])
        for f in self.films:
            nn.init.zeros_(f.weight)
            nn.init.zeros_(f.bias)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
                m.weight.requires_grad_(False)
                m.bias.requires_grad_(False)

    def train(self, mode=True):
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()  # keep ImageNet statistics
        return self

    def forward(self, x, lang):
        h = self.stem(x)
        for stage, film in zip(self.stages, self.films):
            h = stage(h)
            g, b = film(lang).chunk(2, -1)
            h = h * (1 + g[..., None, None]) + b[..., None, None]
        return F.adaptive_avg_pool2d(h, 1).flatten(1)


class LangBCPolicy(nn.Module):
    def __init__(self, lang_dim=384, state_dim=15, act_dim=7, chunk=10):
        super().__init__()
        self.static_enc, self.gripper_enc = FiLMResNet(lang_dim), FiLMResNet(lang_dim)
        self.head = nn.Sequential(nn.Linear(1024 + state_dim + lang_dim, 1024), nn.GELU(),
                                  nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, chunk * act_dim))
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
        self.chunk, self.act_dim = chunk, act_dim

    def forward(self, static, gripper, state, lang):
        s = self.static_enc((static.float() / 255 - self.mean) / self.std, lang)
        g = self.gripper_enc((F.interpolate(gripper.float(), size=static.shape[-2:]) / 255 - self.mean) / self.std,
                             lang)
        out = self.head(torch.cat([s, g, state, lang], -1)).view(-1, self.chunk, self.act_dim)
        return torch.cat([out[..., :6], torch.tanh(out[..., 6:])], -1)


def chunk_loss(pred, target):
    arm = F.mse_loss(pred[..., :6], target[..., :6])
    grip = F.binary_cross_entropy((pred[..., 6] + 1) / 2, (target[..., 6] > 0).float())
    return arm + 0.01 * grip


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    train_ds = CalvinLangWindows(os.path.join(args.root, "training"), args.lang_key, args.chunk)
    val_full = CalvinLangWindows(os.path.join(args.root, "validation"), args.lang_key, args.chunk)
    val_idx = np.random.default_rng(0).permutation(len(val_full))[:args.val_max]
    val_ds = Subset(val_full, val_idx[rank::world].tolist())

    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(val_ds, batch_size=64, shuffle=False, num_workers=4)

    model = DDP(LangBCPolicy(chunk=args.chunk).to(device), device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))
    writer = SummaryWriter(args.out) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for batch in train_dl:
            b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            pred = model(b["static"], b["gripper"], b["state"], b["lang"])
            loss = chunk_loss(pred, b["actions"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in val_dl:
                b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                pred = model.module(b["static"], b["gripper"], b["state"], b["lang"])
                n = b["actions"].shape[0]
                tot += torch.stack([chunk_loss(pred, b["actions"]) * n, torch.tensor(float(n), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            val = (tot[0] / tot[1]).item()
            writer.add_scalar("val/loss", val, epoch)
            print(f"epoch {epoch} val {val:.4f} time {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, f"epoch_{epoch:02d}.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
