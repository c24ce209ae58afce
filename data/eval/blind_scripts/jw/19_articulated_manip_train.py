"""Where2Act-style actionability learning for articulated objects (PartNet-Mobility).

For each manipulation primitive (pull, push, pull-open, push-close) a separate
head predicts per-point actionability and a gripper action direction.  Samples
come from interaction trials in SAPIEN; a trial is a success if the part moved
by more than 1 cm in the intended direction.

Each optimisation step trains one primitive (all ranks step through the
primitives in the same order), so the heads of the other primitives receive no
gradient in that step.

    torchrun --nproc_per_node=4 19_articulated_manip_train.py --data /data/where2act \
        --init-backbone ckpts/pointnet2_partseg.pth --out runs/w2a_multi
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from sapien_env import ArticulationTrialEnv  # thin wrapper around SAPIEN used for data collection

PRIMITIVES = ["pull", "push", "pull-open", "push-close"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--init-backbone", default="")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--points", type=int, default=10000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sim-trials", type=int, default=400, help="per primitive, all ranks together")
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


class TrialDataset(Dataset):
    def __init__(self, root, primitive, split, points):
        d = np.load(os.path.join(root, f"{primitive}_{split}.npz"), allow_pickle=True)
        self.clouds = d["clouds"]            # object array of (N, 3)
        self.contact = d["contact_idx"]      # (T,)
        self.cloud_id = d["cloud_id"]        # (T,)
        self.direction = d["direction"].astype(np.float32)  # (T, 3)
        self.success = d["success"].astype(np.float32)
        self.points = points

    def __len__(self):
        return len(self.success)

    def __getitem__(self, i):
        pc = self.clouds[self.cloud_id[i]].astype(np.float32)
        c = self.contact[i]
        rest = np.random.choice(len(pc), self.points - 1, replace=len(pc) <= self.points)
        sel = np.concatenate([[c], rest])  # contact point always at index 0
        return torch.from_numpy(pc[sel]), torch.from_numpy(self.direction[i]), torch.tensor(self.success[i])


class Backbone(nn.Module):
    def __init__(self, c=128):
        super().__init__()
        self.local = nn.Sequential(nn.Conv1d(3, 64, 1), nn.GroupNorm(8, 64), nn.ReLU(),
                                   nn.Conv1d(64, c, 1), nn.GroupNorm(8, c), nn.ReLU())
        self.glob = nn.Sequential(nn.Conv1d(c, 512, 1), nn.GroupNorm(16, 512), nn.ReLU())
        self.fuse = nn.Sequential(nn.Conv1d(c + 512, c, 1), nn.GroupNorm(8, c), nn.ReLU())

    def forward(self, pc):
        f = self.local(pc.transpose(1, 2))
        g = self.glob(f).max(-1, keepdim=True)[0].expand(-1, -1, f.shape[-1])
        return self.fuse(torch.cat([f, g], 1))  # B,c,N


class PrimitiveHead(nn.Module):
    def __init__(self, c=128):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(c + 3, 128), nn.ReLU(), nn.Linear(128, 1))
        self.actor = nn.Sequential(nn.Linear(c, 128), nn.ReLU(), nn.Linear(128, 3))
        self.actionability = nn.Sequential(nn.Linear(c, 128), nn.ReLU(), nn.Linear(128, 1))


class Where2ActMulti(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.heads = nn.ModuleDict({p.replace("-", "_"): PrimitiveHead() for p in PRIMITIVES})

    def forward(self, pc, direction, primitive):
        head = self.heads[primitive.replace("-", "_")]
        f = self.backbone(pc)[:, :, 0]                       # feature at the contact point
        critic = head.critic(torch.cat([f, direction], -1)).squeeze(-1)
        proposal = F.normalize(head.actor(f), dim=-1)
        # the actor is trained to maximise the critic's score of its proposed direction
        actor_score = head.critic(torch.cat([f.detach(), proposal], -1)).squeeze(-1)
        actionability = head.actionability(f.detach()).squeeze(-1)
        return critic, actor_score, actionability

    @torch.no_grad()
    def propose(self, pc, primitive):
        head = self.heads[primitive.replace("-", "_")]
        f = self.backbone(pc)                                # B,c,N
        ft = f.transpose(1, 2)
        score = head.actionability(ft).squeeze(-1)
        best = score.argmax(-1)
        fb = ft[torch.arange(ft.shape[0]), best]
        return best, F.normalize(head.actor(fb), dim=-1)


def load_backbone(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("model", sd)
    # this checkpoint was saved from the DDP wrapper of the segmentation run
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    sd = {k[len("backbone."):]: v for k, v in sd.items() if k.startswith("backbone.")}
    missing, unexpected = model.backbone.load_state_dict(sd, strict=False)
    return missing, unexpected


@torch.no_grad()
def sim_success(model, primitive, n_trials, rank, world, points, device):
    env = ArticulationTrialEnv(primitive=primitive, headless=True, seed=12345 + rank)
    succ = torch.zeros(2, device=device)
    for _ in range(rank, n_trials, world):
        pc = env.reset_random_object()
        sel = np.random.choice(len(pc), points, replace=len(pc) < points)
        pcs = torch.from_numpy(pc[sel].astype(np.float32))[None].to(device)
        idx, direction = model.propose(pcs, primitive)
        ok = env.execute(contact=pc[sel][int(idx[0])], direction=direction[0].cpu().numpy())
        succ += torch.tensor([float(ok), 1.0], device=device)
    env.close()
    dist.all_reduce(succ)
    return (succ[0] / succ[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3)

    loaders, samplers = {}, {}
    for p in PRIMITIVES:
        ds = TrialDataset(args.data, p, "train", args.points)
        samplers[p] = DistributedSampler(ds, shuffle=True, drop_last=True)
        loaders[p] = DataLoader(ds, batch_size=args.batch_size, sampler=samplers[p], num_workers=args.workers,
                                pin_memory=True, drop_last=True)
    steps_per_epoch = min(len(l) for l in loaders.values()) * len(PRIMITIVES)

    model = Where2ActMulti()
    if args.init_backbone:
        missing, _ = load_backbone(model, args.init_backbone)
        if rank == 0:
            print(f"loaded backbone from {args.init_backbone}; missing keys: {missing}", flush=True)
    model = DDP(model.to(device), device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        for p in PRIMITIVES:
            samplers[p].set_epoch(epoch)
        iters = {p: iter(l) for p, l in loaders.items()}
        model.train()
        t0 = time.time()
        stats = torch.zeros(len(PRIMITIVES), 2, device=device)
        for step in range(steps_per_epoch):
            pi = step % len(PRIMITIVES)
            prim = PRIMITIVES[pi]
            pc, direction, success = next(iters[prim])
            pc, direction, success = pc.to(device), direction.to(device), success.to(device)
            critic, actor_score, actionability = model(pc, direction, prim)
            l_critic = F.binary_cross_entropy_with_logits(critic, success)
            l_actor = -torch.sigmoid(actor_score).mean()
            l_act = F.mse_loss(torch.sigmoid(actionability), torch.sigmoid(actor_score).detach())
            loss = l_critic + 0.1 * l_actor + l_act
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats[pi] += torch.stack([l_critic.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)

        model.eval()
        rates = {p: sim_success(model.module, p, args.sim_trials, rank, world, args.points, device)
                 for p in PRIMITIVES}
        if rank == 0:
            crit = {p: (stats[i, 0] / stats[i, 1]).item() for i, p in enumerate(PRIMITIVES)}
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) critic {crit} sim success {rates}", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sim_success": rates}, os.path.join(args.out, f"w2a_{epoch:03d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
