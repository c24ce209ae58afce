"""Behaviour cloning with action chunks on a LeRobot dataset, multi-GPU, resumable.

    torchrun --nproc_per_node=4 09_lerobot_bc_resume.py --repo_id lerobot/aloha_sim_insertion_human --resume
"""
import argparse
import logging
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from lerobot.common.datasets.lerobot_dataset import LeRobotDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("bc")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo_id", default="lerobot/aloha_sim_insertion_human")
    ap.add_argument("--output_dir", default="outputs/bc_chunk")
    ap.add_argument("--camera", default="observation.images.top")
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--fps", type=int, default=50)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--save_freq", type=int, default=10_000)
    ap.add_argument("--log_freq", type=int, default=200)
    ap.add_argument("--num_workers", type=int, default=8)
    ap.add_argument("--val_episodes", type=int, default=5)
    ap.add_argument("--val_freq", type=int, default=5000)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


class Normalizer(nn.Module):
    def __init__(self, stats, keys):
        super().__init__()
        for k in keys:
            name = k.replace(".", "_")
            self.register_buffer(f"{name}_mean", torch.as_tensor(stats[k]["mean"]).float())
            self.register_buffer(f"{name}_std", torch.as_tensor(stats[k]["std"]).float().clamp_min(1e-4))

    def norm(self, key, x):
        name = key.replace(".", "_")
        return (x - getattr(self, f"{name}_mean")) / getattr(self, f"{name}_std")

    def unnorm(self, key, x):
        name = key.replace(".", "_")
        return x * getattr(self, f"{name}_std") + getattr(self, f"{name}_mean")


class ChunkBCPolicy(nn.Module):
    def __init__(self, state_dim, act_dim, chunk, stats, camera):
        super().__init__()
        self.camera = camera
        self.normalizer = Normalizer(stats, ["observation.state", "action"])
        rn = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.vision = nn.Sequential(*list(rn.children())[:-1])
        self.state_proj = nn.Linear(state_dim, 256)
        self.head = nn.Sequential(nn.Linear(512 + 256, 1024), nn.GELU(), nn.Dropout(0.1),
                                  nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, chunk * act_dim))
        self.chunk, self.act_dim = chunk, act_dim
        self.register_buffer("img_mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("img_std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, batch):
        img = (batch[self.camera] - self.img_mean) / self.img_std
        state = self.normalizer.norm("observation.state", batch["observation.state"])
        feat = torch.cat([self.vision(img).flatten(1), self.state_proj(state)], -1)
        pred = self.head(feat).view(-1, self.chunk, self.act_dim)
        target = self.normalizer.norm("action", batch["action"])
        mask = ~batch["action_is_pad"]
        return (F.l1_loss(pred, target, reduction="none").mean(-1) * mask).sum() / mask.sum().clamp_min(1)


def cosine_with_warmup(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def save_checkpoint(path, step, model, optimizer, scheduler):
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        n = batch["action"].shape[0]
        tot += torch.stack([model.module(batch) * n, torch.tensor(float(n), device=device)])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1].clamp_min(1)).item()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)

    delta_timestamps = {"action": [i / args.fps for i in range(args.chunk)]}
    if rank == 0:
        LeRobotDataset(args.repo_id)  # download / verify the local cache once
    dist.barrier()
    n_episodes = LeRobotDataset(args.repo_id).meta.total_episodes
    train_eps = list(range(n_episodes - args.val_episodes))
    val_eps = list(range(n_episodes - args.val_episodes, n_episodes))
    dataset = LeRobotDataset(args.repo_id, episodes=train_eps, delta_timestamps=delta_timestamps)
    val_set = LeRobotDataset(args.repo_id, episodes=val_eps, delta_timestamps=delta_timestamps)
    stats = dataset.meta.stats
    state_dim = dataset.meta.features["observation.state"]["shape"][0]
    act_dim = dataset.meta.features["action"]["shape"][0]

    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=args.batch_size,
                            num_workers=4)

    policy = ChunkBCPolicy(state_dim, act_dim, args.chunk, stats, args.camera).to(device)
    model = DDP(policy, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_with_warmup(s, args.warmup, args.steps))

    out = Path(args.output_dir)
    ckpt_path = out / "checkpoints" / "last.pt"
    step = 0
    if args.resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        step = ckpt["step"]
        if rank == 0:
            log.info(f"resumed from {ckpt_path} at step {step}")
    if rank == 0:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)

    epoch = step // len(loader)
    sampler.set_epoch(epoch)
    data_iter = iter(loader)
    model.train()
    running = torch.zeros(2, device=device)
    while step < args.steps:
        try:
            batch = next(data_iter)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            data_iter = iter(loader)
            batch = next(data_iter)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}

        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()
        scheduler.step()
        step += 1
        running += torch.stack([loss.detach().float(), torch.ones((), device=device)])

        if step % args.log_freq == 0:
            dist.all_reduce(running)
            if rank == 0:
                log.info(f"step {step} loss {(running[0] / running[1]).item():.4f} "
                         f"grad_norm {grad_norm.item():.3f} lr {scheduler.get_last_lr()[0]:.2e}")
            running.zero_()

        if step % args.val_freq == 0:
            val_loss = validate(model, val_loader, device)
            if rank == 0:
                log.info(f"step {step} val_l1 {val_loss:.4f}")

        if step % args.save_freq == 0 or step == args.steps:
            if rank == 0:
                save_checkpoint(ckpt_path, step, model, optimizer, scheduler)
                torch.save(model.module.state_dict(), out / "checkpoints" / f"policy_{step:07d}.pt")
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
