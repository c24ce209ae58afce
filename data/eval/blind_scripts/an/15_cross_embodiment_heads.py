"""Cross-embodiment policy: shared ViT-S trunk + one action-chunk head per robot.
Batches are homogeneous in embodiment so each head sees full batches.

    torchrun --nproc_per_node=8 15_cross_embodiment_heads.py --config configs/xembodiment.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
import wandb

DEFAULT_CFG = {
    "embodiments": {
        "franka": {"path": "/data/xemb/franka.npz", "action_dim": 7, "proprio_dim": 8, "weight": 0.5},
        "ur5": {"path": "/data/xemb/ur5.npz", "action_dim": 7, "proprio_dim": 7, "weight": 0.2},
        "aloha": {"path": "/data/xemb/aloha.npz", "action_dim": 14, "proprio_dim": 14, "weight": 0.3},
    },
    "chunk": 16,
    "batch_size": 64,
    "lr": 3e-4,
    "weight_decay": 0.05,
    "total_steps": 200_000,
    "warmup": 2000,
    "log_every": 100,
    "save_every": 10_000,
    "out_dir": "runs/xemb",
    "seed": 0,
}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f))
    return cfg


class EmbodimentDataset(Dataset):
    """Concatenation of per-embodiment frame datasets; item = (name, image, proprio, action chunk)."""

    def __init__(self, emb_cfg, chunk):
        self.names, self.data, self.offsets, self.stats = [], {}, [0], {}
        for name, c in emb_cfg.items():
            d = np.load(c["path"], mmap_mode="r")
            self.data[name] = d
            self.names.append(name)
            self.offsets.append(self.offsets[-1] + len(d["actions"]))
            self.stats[name] = (np.asarray(d["action_mean"]), np.asarray(d["action_std"]) + 1e-6)
        self.chunk = chunk

    def __len__(self):
        return self.offsets[-1]

    def locate(self, i):
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.names[k], i - self.offsets[k]

    def __getitem__(self, i):
        name, j = self.locate(i)
        d = self.data[name]
        ep_end = int(d["episode_end"][j])
        idx = np.minimum(np.arange(j, j + self.chunk), ep_end - 1)
        mean, std = self.stats[name]
        return {
            "emb": self.names.index(name),
            "image": torch.from_numpy(np.ascontiguousarray(d["images"][j])).permute(2, 0, 1),
            "proprio": torch.from_numpy(np.asarray(d["proprio"][j], dtype=np.float32)),
            "action": torch.from_numpy(((np.asarray(d["actions"][idx]) - mean) / std).astype(np.float32)),
        }


class DistributedEmbodimentBatchSampler(Sampler):
    """Each rank draws its own batches; a batch contains a single embodiment."""

    def __init__(self, dataset, weights, batch_size, rank, world, seed):
        self.ds, self.bs = dataset, batch_size
        self.p = np.array(weights) / np.sum(weights)
        self.rank, self.world, self.seed, self.epoch = rank, world, seed, 0
        self.batches_per_epoch = len(dataset) // (batch_size * world)

    def set_epoch(self, e):
        self.epoch = e

    def __len__(self):
        return self.batches_per_epoch

    def __iter__(self):
        rng = np.random.default_rng((self.seed, self.epoch, self.rank))
        for _ in range(self.batches_per_epoch):
            k = rng.choice(len(self.p), p=self.p)
            lo, hi = self.ds.offsets[k], self.ds.offsets[k + 1]
            yield rng.integers(lo, hi, size=self.bs).tolist()


class CrossEmbodimentPolicy(nn.Module):
    def __init__(self, emb_cfg, chunk):
        super().__init__()
        self.names = list(emb_cfg)
        self.trunk = timm.create_model("vit_small_patch16_224", pretrained=True, num_classes=0)
        d = self.trunk.num_features
        self.proprio = nn.ModuleDict({n: nn.Linear(c["proprio_dim"], d) for n, c in emb_cfg.items()})
        self.heads = nn.ModuleDict({
            n: nn.Sequential(nn.Linear(2 * d, 1024), nn.GELU(), nn.Linear(1024, chunk * c["action_dim"]))
            for n, c in emb_cfg.items()})
        self.chunk = chunk
        self.register_buffer("mean", torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1))

    def forward(self, emb_name, image, proprio):
        x = F.interpolate(image.float() / 255.0, size=224, mode="bilinear", align_corners=False)
        feat = self.trunk((x - self.mean) / self.std)
        h = torch.cat([feat, self.proprio[emb_name](proprio)], -1)
        return self.heads[emb_name](h).view(image.shape[0], self.chunk, -1)


def lr_lambda(step, warmup, total):
    if step < warmup:
        return step / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def main():
    cfg = load_cfg()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    emb_cfg = cfg["embodiments"]
    dataset = EmbodimentDataset(emb_cfg, cfg["chunk"])
    batch_sampler = DistributedEmbodimentBatchSampler(dataset, [c["weight"] for c in emb_cfg.values()],
                                                      cfg["batch_size"], rank, world, cfg["seed"])
    loader = DataLoader(dataset, batch_sampler=batch_sampler, num_workers=10, pin_memory=True,
                        persistent_workers=True)

    model = CrossEmbodimentPolicy(emb_cfg, cfg["chunk"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, cfg["warmup"], cfg["total_steps"]))

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        wandb.init(project="cross-embodiment", config=cfg)

    step, epoch = 0, 0
    per_emb = torch.zeros(len(emb_cfg), 2, device=device)
    t0 = time.time()
    while step < cfg["total_steps"]:
        batch_sampler.set_epoch(epoch)
        for batch in loader:
            name = dataset.names[int(batch["emb"][0])]
            image = batch["image"].to(device, non_blocking=True)
            proprio = batch["proprio"].to(device, non_blocking=True)
            target = batch["action"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(name, image, proprio)
            loss = F.l1_loss(pred.float(), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            k = dataset.names.index(name)
            per_emb[k] += torch.stack([loss.detach(), torch.ones((), device=device)])

            if step % cfg["log_every"] == 0:
                dist.all_reduce(per_emb)
                if rank == 0:
                    logs = {f"loss/{n}": (per_emb[i, 0] / per_emb[i, 1].clamp_min(1)).item()
                            for i, n in enumerate(dataset.names)}
                    logs.update({"lr": sched.get_last_lr()[0], "steps_per_s": cfg["log_every"] / (time.time() - t0)})
                    wandb.log(logs, step=step)
                per_emb.zero_()
                t0 = time.time()

            if step % cfg["save_every"] == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step,
                                "action_stats": dataset.stats, "cfg": cfg},
                               os.path.join(cfg["out_dir"], f"step_{step:07d}.pt"))
                dist.barrier()
            if step >= cfg["total_steps"]:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
