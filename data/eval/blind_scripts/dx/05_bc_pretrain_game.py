"""Behaviour-cloning pre-training of the game agent from human demonstrations.

The demonstrations are recorded by the game client as one .npz per episode
(uint8 frames, 4x84x84 after the client-side stack) plus a manifest.jsonl with the
high-level action label the player pressed on each frame ("MOVE_LEFT", "JUMP",
"MOVE_RIGHT+JUMP", ...). The resulting policy initialises the PPO fine-tuning run.

    torchrun --nproc_per_node=8 bc_pretrain_game.py --data /mnt/shared/demos/platformer_v3
"""
import argparse
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("bc")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/mnt/shared/checkpoints/bc_platformer")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--warmup-steps", type=int, default=1000)
    ap.add_argument("--val-every-nth", type=int, default=10, help="every n-th episode goes to validation")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--label-smoothing", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def load_manifest(root):
    episodes = []
    with open(Path(root) / "manifest.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if len(rec["actions"]) < 8:
                continue  # aborted recordings
            episodes.append(rec)
    episodes.sort(key=lambda r: r["episode_id"])
    return episodes


class DemoFrames(Dataset):
    def __init__(self, root, episodes, action_to_idx):
        self.root = Path(root)
        self.index = []
        self.labels = []
        for ep in episodes:
            for t, a in enumerate(ep["actions"]):
                self.index.append((ep["npz"], t))
                self.labels.append(action_to_idx[a])
        self._cache_path, self._cache = None, None

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        path, t = self.index[i]
        if path != self._cache_path:
            self._cache = np.load(self.root / path)["frames"]
            self._cache_path = path
        frame = torch.from_numpy(np.ascontiguousarray(self._cache[t]))
        return frame, self.labels[i]


class PolicyNet(nn.Module):
    """Same torso as the PPO agent so the weights transfer directly."""

    def __init__(self, n_actions):
        super().__init__()
        self.torso = nn.Sequential(
            nn.Conv2d(4, 32, 8, 4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(),
            nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(),
        )
        self.actor = nn.Linear(512, n_actions)

    def forward(self, x):
        return self.actor(self.torso(x.float() / 255.0))


def cosine_with_warmup(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    for frames, labels in loader:
        frames, labels = frames.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(frames)
        stats[0] += F.cross_entropy(logits, labels, reduction="sum")
        stats[1] += (logits.argmax(-1) == labels).sum()
        stats[2] += labels.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    episodes = load_manifest(args.data)
    action_names = list({a for ep in episodes for a in ep["actions"]})
    action_to_idx = {a: i for i, a in enumerate(action_names)}
    train_eps = [ep for i, ep in enumerate(episodes) if i % args.val_every_nth != 0]
    val_eps = [ep for i, ep in enumerate(episodes) if i % args.val_every_nth == 0]
    logger.info("%d train episodes, %d val episodes, %d actions", len(train_eps), len(val_eps), len(action_names))

    train_ds = DemoFrames(args.data, train_eps, action_to_idx)
    val_ds = DemoFrames(args.data, val_eps, action_to_idx)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    # strided shard of the validation frames: every frame counted exactly once over all ranks
    val_shard = Subset(val_ds, range(rank, len(val_ds), world))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    # class weights: rare actions (e.g. special moves) are heavily under-represented
    counts = np.bincount(train_ds.labels, minlength=len(action_names)).astype(np.float64)
    class_w = torch.tensor((counts.sum() / np.maximum(counts, 1.0)) ** 0.5, dtype=torch.float32, device=device)
    class_w = class_w / class_w.mean()

    model = DDP(PolicyNet(len(action_names)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_with_warmup(s, args.warmup_steps, total_steps))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "actions.json"), "w") as f:
            json.dump(action_names, f)

    best_acc, step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        for frames, labels in train_loader:
            frames = frames.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            logits = model(frames)
            loss = F.cross_entropy(logits, labels, weight=class_w, label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            running += torch.stack([loss.detach() * labels.numel(), torch.tensor(float(labels.numel()), device=device)])
            if step % 200 == 0:
                dist.all_reduce(running)
                logger.info("epoch %d step %d lr %.2e train_loss %.4f", epoch, step,
                            sched.get_last_lr()[0], (running[0] / running[1]).item())
                running.zero_()

        val_loss, val_acc = validate(model, val_loader, device)
        logger.info("epoch %d val_loss %.4f val_acc %.4f", epoch, val_loss, val_acc)
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "epoch": epoch, "actions": action_names, "val_acc": val_acc}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
