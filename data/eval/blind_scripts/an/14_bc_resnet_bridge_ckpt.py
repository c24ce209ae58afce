"""Goal-image conditioned BC (ResNet-34 + MLP, discretised gripper) on Bridge-style
episodes stored as one .npz per trajectory. Multi-GPU with torchrun.

    torchrun --nnodes=1 --nproc_per_node=4 14_bc_resnet_bridge_ckpt.py --data_root /datasets/bridge_npz --exp bridge_gcbc
"""
import argparse
import glob
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--exp", default="gcbc")
    p.add_argument("--ckpt_root", default="/checkpoints")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--img", type=int, default=128)
    p.add_argument("--goal_window", type=int, default=20)
    p.add_argument("--val_frac", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class GoalConditionedDataset(Dataset):
    """Each item: (obs_img, goal_img, proprio) -> 7-dof delta action."""

    def __init__(self, files, goal_window, img, train):
        self.files, self.goal_window, self.train = files, goal_window, train
        self.lengths = []
        for f in files:
            with np.load(f) as d:
                self.lengths.append(len(d["actions"]))
        self.cum = np.cumsum(self.lengths)
        self.resize = torchvision.transforms.Resize((img, img), antialias=True)
        self.jitter = torchvision.transforms.ColorJitter(0.2, 0.2, 0.2, 0.05)

    def __len__(self):
        return int(self.cum[-1])

    def __getitem__(self, i):
        ep = int(np.searchsorted(self.cum, i, side="right"))
        t = i - (self.cum[ep - 1] if ep > 0 else 0)
        with np.load(self.files[ep]) as d:
            imgs, actions, state = d["images"], d["actions"], d["state"]
            g = min(len(actions), t + random.randint(1, self.goal_window)) if self.train else len(actions)
            obs = torch.from_numpy(imgs[t]).permute(2, 0, 1)
            goal = torch.from_numpy(imgs[min(g, len(imgs) - 1)]).permute(2, 0, 1)
            a, s = actions[t].astype(np.float32), state[t].astype(np.float32)
        obs, goal = self.resize(obs), self.resize(goal)
        if self.train:
            obs, goal = self.jitter(obs), self.jitter(goal)
        return obs, goal, torch.from_numpy(s), torch.from_numpy(a)


class GCBCPolicy(nn.Module):
    def __init__(self, state_dim=7, act_dim=7):
        super().__init__()
        rn = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        rn.conv1 = nn.Conv2d(6, 64, 7, 2, 3, bias=False)  # obs + goal stacked channel-wise
        rn.fc = nn.Identity()
        self.encoder = nn.SyncBatchNorm.convert_sync_batchnorm(rn)
        self.mlp = nn.Sequential(nn.Linear(512 + state_dim, 512), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(512, 512), nn.ReLU())
        self.arm = nn.Linear(512, act_dim - 1)
        self.grip = nn.Linear(512, 2)
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406] * 2).view(1, 6, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225] * 2).view(1, 6, 1, 1))

    def forward(self, obs, goal, state):
        x = (torch.cat([obs, goal], 1).float() / 255.0 - self.mean) / self.std
        h = self.mlp(torch.cat([self.encoder(x), state], -1))
        return self.arm(h), self.grip(h)


def bc_loss(arm, grip_logits, action):
    arm_l = F.mse_loss(arm, action[:, :-1])
    grip_l = F.cross_entropy(grip_logits, (action[:, -1] > 0.5).long())
    return arm_l + grip_l, arm_l, grip_l


def save_checkpoint(path, model, opt, sched, epoch, best):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "epoch": epoch, "best_val": best}, path)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(args.data_root, "**", "*.npz"), recursive=True))
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(files))
    n_val = max(1, int(len(files) * args.val_frac))
    val_files = [files[i] for i in perm[:n_val]]
    train_files = [files[i] for i in perm[n_val:]]
    train_ds = GoalConditionedDataset(train_files, args.goal_window, args.img, train=True)
    val_ds = GoalConditionedDataset(val_files, args.goal_window, args.img, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=4)

    model = DDP(GCBCPolicy().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl), pct_start=0.05)

    ckpt_dir = os.path.join(args.ckpt_root, args.exp)
    last_path = os.path.join(ckpt_dir, "last.pt")
    start_epoch, best_val = 0, float("inf")
    if args.resume and os.path.exists(last_path):
        ck = torch.load(last_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best_val = ck["epoch"] + 1, ck["best_val"]

    if rank == 0:
        wandb.init(project="bridge-gcbc", name=args.exp, config=vars(args), resume="allow")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (obs, goal, state, action) in enumerate(train_dl):
            obs, goal = obs.to(device, non_blocking=True), goal.to(device, non_blocking=True)
            state, action = state.to(device, non_blocking=True), action.to(device, non_blocking=True)
            arm, grip = model(obs, goal, state)
            loss, arm_l, grip_l = bc_loss(arm, grip, action)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/arm_mse": arm_l.item(), "train/grip_ce": grip_l.item(),
                           "lr": sched.get_last_lr()[0]})

        model.eval()
        tot = torch.zeros(3, device=device)
        with torch.no_grad():
            for obs, goal, state, action in val_dl:
                arm, grip = model(obs.to(device), goal.to(device), state.to(device))
                action = action.to(device)
                loss, _, _ = bc_loss(arm, grip, action)
                grip_acc = (grip.argmax(-1) == (action[:, -1] > 0.5).long()).float().mean()
                tot += torch.stack([loss * len(obs), grip_acc * len(obs), torch.tensor(float(len(obs)), device=device)])
        dist.all_reduce(tot)
        val_loss = (tot[0] / tot[2]).item()
        if rank == 0:
            wandb.log({"val/loss": val_loss, "val/grip_acc": (tot[1] / tot[2]).item(), "epoch": epoch})
            print(f"epoch {epoch}: val loss {val_loss:.4f}", flush=True)

        save_checkpoint(last_path, model, opt, sched, epoch, min(best_val, val_loss))
        if val_loss < best_val:
            best_val = val_loss
            save_checkpoint(os.path.join(ckpt_dir, "best.pt"), model, opt, sched, epoch, best_val)

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
