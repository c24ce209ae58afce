"""Fine-tune a pretrained R3M ResNet-18 representation end-to-end with a BC head on
Meta-World MT10 expert demos (images from the corner camera), multi-GPU.

    MUJOCO_GL=egl torchrun --nproc_per_node=4 19_metaworld_r3m_finetune.py --demo_dir data/mw_mt10_demos
"""
import argparse
import os
import pickle

import metaworld
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from r3m import load_r3m
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
import wandb


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo_dir", required=True)
    ap.add_argument("--out", default="checkpoints/r3m_bc_mt10")
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--enc_lr", type=float, default=1e-5)
    ap.add_argument("--head_lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--eval_eps_per_task", type=int, default=8)
    ap.add_argument("--max_path_length", type=int, default=500)
    ap.add_argument("--seed", type=int, default=123)
    return ap.parse_args()


class MTDemoDataset(Dataset):
    """Pickled list of trajectories per task: {"images": (T, 224, 224, 3) uint8, "state": (T, 39), "actions": (T, 4)}."""

    def __init__(self, demo_dir, task_names):
        self.items = []
        self.frames, self.states, self.actions = [], [], []
        for tid, name in enumerate(task_names):
            with open(os.path.join(demo_dir, f"{name}.pkl"), "rb") as f:
                trajs = pickle.load(f)
            for tr in trajs:
                base = len(self.frames)
                self.frames.append(tr["images"])
                self.states.append(tr["state"][:, :4].astype(np.float32))  # hand pos + gripper
                self.actions.append(tr["actions"].astype(np.float32))
                self.items += [(base, t, tid) for t in range(len(tr["actions"]))]
        self.n_tasks = len(task_names)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        k, t, tid = self.items[i]
        img = torch.from_numpy(self.frames[k][t]).permute(2, 0, 1)
        return img, torch.from_numpy(self.states[k][t]), torch.from_numpy(self.actions[k][t]), tid


class R3MPolicy(nn.Module):
    def __init__(self, n_tasks, state_dim=4, act_dim=4):
        super().__init__()
        self.r3m = load_r3m("resnet18").module  # unwrap R3M's own DataParallel
        self.task = nn.Embedding(n_tasks, 64)
        self.head = nn.Sequential(nn.Linear(512 + state_dim + 64, 256), nn.ReLU(),
                                  nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, act_dim), nn.Tanh())

    def forward(self, img, state, task):
        z = self.r3m(img.float())  # R3M expects 0-255 pixels
        return self.head(torch.cat([z, state, self.task(task)], -1))


@torch.no_grad()
def evaluate(policy, mt, task_names, episodes, rank, world, device, max_len):
    successes = torch.zeros(len(task_names), 2, device=device)
    for tid, name in enumerate(task_names):
        env = mt.train_classes[name](render_mode="rgb_array", camera_name="corner")
        tasks = [t for t in mt.train_tasks if t.env_name == name]
        for ep in range(rank, episodes, world):
            env.set_task(tasks[ep % len(tasks)])
            obs, _ = env.reset()
            success = 0.0
            for _ in range(max_len):
                img = torch.from_numpy(env.render().copy()).permute(2, 0, 1)[None].to(device)
                img = F.interpolate(img.float(), size=224, mode="bilinear", align_corners=False)
                a = policy(img, torch.as_tensor(obs[:4], dtype=torch.float32, device=device)[None],
                           torch.tensor([tid], device=device))[0]
                obs, _, _, trunc, info = env.step(a.cpu().numpy())
                if info["success"] > 0:
                    success = 1.0
                    break
                if trunc:
                    break
            successes[tid] += torch.tensor([success, 1.0], device=device)
        env.close()
    dist.all_reduce(successes)
    return successes[:, 0] / successes[:, 1].clamp_min(1)


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    mt = metaworld.MT10(seed=args.seed)
    task_names = sorted(mt.train_classes.keys())
    dataset = MTDemoDataset(args.demo_dir, task_names)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)

    policy = R3MPolicy(dataset.n_tasks).to(device)
    model = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.Adam([
        {"params": model.module.r3m.parameters(), "lr": args.enc_lr},
        {"params": list(model.module.task.parameters()) + list(model.module.head.parameters()), "lr": args.head_lr},
    ])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="r3m-metaworld", config=vars(args))

    best = -1.0
    for epoch in range(args.epochs):
        model.train()
        stats = torch.zeros(2, device=device)
        for img, state, action, tid in loader:
            img, state = img.to(device, non_blocking=True), state.to(device, non_blocking=True)
            action, tid = action.to(device, non_blocking=True), tid.to(device, non_blocking=True)
            loss = F.mse_loss(model(img, state, tid), action)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(stats)
        log = {"train/mse": (stats[0] / stats[1]).item(), "epoch": epoch}

        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            rates = evaluate(model.module, mt, task_names, args.eval_eps_per_task, rank, world, device,
                             args.max_path_length)
            log.update({f"success/{n}": r.item() for n, r in zip(task_names, rates)})
            log["success/mean"] = rates.mean().item()
            if rank == 0 and log["success/mean"] > best:
                best = log["success/mean"]
                torch.save({"policy": model.module.state_dict(), "epoch": epoch, "success": best},
                           os.path.join(args.out, "best.pt"))

        if rank == 0:
            wandb.log(log)
            torch.save({"policy": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
