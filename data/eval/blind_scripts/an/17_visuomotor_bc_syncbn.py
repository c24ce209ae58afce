"""Visuomotor BC for a real UR5 pick-place setup: ResNet-50 encoder initialised from
our in-house contrastive pretraining run (saved from a DDP job), partially frozen,
fine-tuned with SyncBatchNorm. Frames are decoded once into a uint8 memmap cache.

    torchrun --nproc_per_node=8 17_visuomotor_bc_syncbn.py --episodes /data/ur5_pickplace --pretrained /ckpt/contrastive_r50/ep100.pth
"""
import argparse
import contextlib
import datetime
import glob
import json
import os

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", required=True)
    p.add_argument("--pretrained", default="")
    p.add_argument("--cache_dir", default="/scratch/bc_cache")
    p.add_argument("--out", default="runs/ur5_bc")
    p.add_argument("--img", type=int, default=160)
    p.add_argument("--batch_size", type=int, default=32, help="per GPU, per micro-step")
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--freeze_stages", type=int, default=2)
    p.add_argument("--val_every", type=int, default=2)
    return p.parse_args()


def build_cache(episode_dir, cache_dir, img):
    """Decode every episode's mp4 into one memmap, plus actions / proprio arrays."""
    eps = sorted(glob.glob(os.path.join(episode_dir, "ep_*")))
    lowdim = [np.load(os.path.join(ep, "lowdim.npz")) for ep in eps]
    ends = np.cumsum([len(m["actions"]) for m in lowdim])
    os.makedirs(cache_dir, exist_ok=True)
    tmp = os.path.join(cache_dir, "frames.tmp.npy")
    mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(int(ends[-1]), img, img, 3))
    start = 0
    for ep, end in zip(eps, ends):
        cap = cv2.VideoCapture(os.path.join(ep, "wrist.mp4"))
        for i in range(start, end):
            ok, f = cap.read()
            if not ok:
                raise RuntimeError(f"{ep}: video shorter than lowdim ({i - start} frames)")
            mm[i] = cv2.resize(cv2.cvtColor(f, cv2.COLOR_BGR2RGB), (img, img), interpolation=cv2.INTER_AREA)
        cap.release()
        start = end
    mm.flush()
    del mm
    np.savez(os.path.join(cache_dir, "lowdim.npz"),
             actions=np.concatenate([m["actions"] for m in lowdim]).astype(np.float32),
             proprio=np.concatenate([m["proprio"] for m in lowdim]).astype(np.float32), ends=ends)
    os.replace(tmp, os.path.join(cache_dir, "frames.npy"))
    with open(os.path.join(cache_dir, "DONE"), "w") as f:
        json.dump({"episodes": len(eps), "frames": int(ends[-1])}, f)


class CachedFrames(Dataset):
    def __init__(self, cache_dir, train):
        self.frames = np.load(os.path.join(cache_dir, "frames.npy"), mmap_mode="r")
        low = np.load(os.path.join(cache_dir, "lowdim.npz"))
        self.actions, self.proprio, self.ends = low["actions"], low["proprio"], low["ends"]
        self.a_mean, self.a_std = self.actions.mean(0), self.actions.std(0) + 1e-6
        self.train = train
        self.aug = torchvision.transforms.Compose([
            torchvision.transforms.RandomResizedCrop(self.frames.shape[1], scale=(0.85, 1.0), antialias=True),
            torchvision.transforms.ColorJitter(0.3, 0.3, 0.3, 0.05)])

    def __len__(self):
        return len(self.actions)

    def __getitem__(self, i):
        img = torch.from_numpy(np.array(self.frames[i])).permute(2, 0, 1)
        if self.train:
            img = self.aug(img)
        a = (self.actions[i] - self.a_mean) / self.a_std
        return img, torch.from_numpy(self.proprio[i]), torch.from_numpy(a.astype(np.float32))


class Policy(nn.Module):
    def __init__(self, proprio_dim, act_dim):
        super().__init__()
        self.encoder = torchvision.models.resnet50(weights=None)
        self.encoder.fc = nn.Identity()
        self.head = nn.Sequential(nn.Linear(2048 + proprio_dim, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                  nn.Linear(512, act_dim))
        self.register_buffer("mu", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255)
        self.register_buffer("sigma", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255)

    def forward(self, img, proprio):
        z = self.encoder((img.float() - self.mu) / self.sigma)
        return self.head(torch.cat([z, proprio], -1))


def load_pretrained_encoder(encoder, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("state_dict", sd)
    cleaned = {}
    for k, v in sd.items():
        k = k[len("module."):] if k.startswith("module.") else k
        if k.startswith("backbone."):
            cleaned[k[len("backbone."):]] = v
    missing, unexpected = encoder.load_state_dict(cleaned, strict=False)
    return missing, unexpected


def freeze_stages(resnet, n):
    modules = [resnet.conv1, resnet.bn1] + [resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4][:n]
    for m in modules:
        for p in m.parameters():
            p.requires_grad_(False)


def main():
    args = parse_args()
    # rank 0 may spend a long time decoding videos below; keep the others waiting at the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    if rank == 0 and not os.path.exists(os.path.join(args.cache_dir, "DONE")):
        build_cache(args.episodes, args.cache_dir, args.img)
    dist.barrier()

    full_train = CachedFrames(args.cache_dir, train=True)
    full_eval = CachedFrames(args.cache_dir, train=False)
    ends = full_train.ends
    n_val_eps = max(1, len(ends) // 20)
    split = int(ends[-n_val_eps - 1])  # last 5% of episodes held out
    train_ds = Subset(full_train, range(split))
    val_ds = Subset(full_eval, range(split + rank, len(full_eval), world))

    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 128, shuffle=False, num_workers=4)

    policy = Policy(full_train.proprio.shape[1], full_train.actions.shape[1])
    if args.pretrained:
        missing, unexpected = load_pretrained_encoder(policy.encoder, args.pretrained)
        if rank == 0:
            print(f"pretrained encoder: {len(missing)} missing, {len(unexpected)} unexpected keys")
    freeze_stages(policy.encoder, args.freeze_stages)
    policy = nn.SyncBatchNorm.convert_sync_batchnorm(policy).to(device)
    model = DDP(policy, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)
    steps = args.epochs * (len(train_dl) // args.accum)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="ur5-bc", config=vars(args))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        run = torch.zeros(2, device=device)
        n_micro = (len(train_dl) // args.accum) * args.accum
        for i, (img, prop, act) in enumerate(train_dl):
            if i >= n_micro:
                break
            img, prop, act = img.to(device, non_blocking=True), prop.to(device), act.to(device)
            last_micro = (i + 1) % args.accum == 0
            with (contextlib.nullcontext() if last_micro else model.no_sync()):
                loss = F.smooth_l1_loss(model(img, prop), act)
                (loss / args.accum).backward()
            if last_micro:
                nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            run += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(run)
        log = {"train/loss": (run[0] / run[1]).item(), "lr": sched.get_last_lr()[0], "epoch": epoch}

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            err = torch.zeros(2, device=device)
            with torch.no_grad():
                for img, prop, act in val_dl:
                    pred = model.module(img.to(device), prop.to(device))
                    err += torch.stack([F.l1_loss(pred, act.to(device), reduction="sum"),
                                        torch.tensor(float(act.numel()), device=device)])
            dist.all_reduce(err)
            log["val/l1"] = (err[0] / err[1]).item()

        if rank == 0:
            wandb.log(log)
            sd = {k: v.cpu() for k, v in model.module.state_dict().items()}
            torch.save({"policy": sd, "action_mean": full_train.a_mean, "action_std": full_train.a_std,
                        "epoch": epoch}, os.path.join(args.out, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
