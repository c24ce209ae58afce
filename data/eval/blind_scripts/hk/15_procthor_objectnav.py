"""ObjectNav in ProcTHOR-10k houses, DD-PPO with a GroupNorm ResNet18 + GRU.

Each rank drives `--envs` AI2-THOR controllers (CloudRendering on its own GPU),
stepped from a thread pool. Submitted with sbatch:

    #!/bin/bash
    #SBATCH --job-name=procthor-objnav
    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=8
    #SBATCH --gpus-per-node=8
    #SBATCH --cpus-per-task=12
    #SBATCH --time=72:00:00
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29500
    srun python procthor_objnav.py --envs 12 --out /shared/runs/procthor_objnav
"""
import argparse
import os
import random
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import prior
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from ai2thor.controller import Controller
from ai2thor.platform import CloudRendering
from torch.nn.parallel import DistributedDataParallel as DDP

TARGETS = ["AlarmClock", "Apple", "BaseballBat", "BasketBall", "Bed", "Bowl", "Chair", "GarbageCan",
           "HousePlant", "Laptop", "Mug", "Sofa", "SprayBottle", "Television", "Toilet", "Vase"]
ACTIONS = ["MoveAhead", "RotateLeft", "RotateRight", "LookUp", "LookDown", "Done"]


class ObjNavEnv:
    def __init__(self, houses, gpu, seed, max_steps=500):
        self.houses, self.rng, self.max_steps = houses, random.Random(seed), max_steps
        self.c = Controller(platform=CloudRendering, gpu_device=gpu, width=224, height=224, gridSize=0.25,
                            rotateStepDegrees=30, visibilityDistance=1.0, snapToGrid=False)

    def reset(self):
        while True:
            house = self.houses[self.rng.randrange(len(self.houses))]
            ev = self.c.reset(scene=house)
            present = sorted({o["objectType"] for o in ev.metadata["objects"]} & set(TARGETS))
            if present:
                break
        self.target = self.rng.choice(present)
        pos = self.rng.choice(self.c.step("GetReachablePositions").metadata["actionReturn"])
        ev = self.c.step("Teleport", position=pos, rotation=dict(x=0, y=self.rng.choice(range(0, 360, 30)), z=0))
        self.t = 0
        return self._obs(ev)

    def _obs(self, ev):
        return {"rgb": ev.frame.copy(), "goal": TARGETS.index(self.target)}

    def _target_visible(self, ev):
        return any(o["visible"] and o["objectType"] == self.target for o in ev.metadata["objects"])

    def step(self, a):
        self.t += 1
        name = ACTIONS[a]
        if name == "Done":
            ev = self.c.last_event
            success = self._target_visible(ev)
            return self.reset(), (10.0 if success else 0.0), True, {"success": float(success), "ep_len": self.t}
        ev = self.c.step(name)
        done = self.t >= self.max_steps
        info = {"success": 0.0, "ep_len": self.t}
        obs = self.reset() if done else self._obs(ev)
        return obs, -0.01 - (0.05 if not ev.metadata["lastActionSuccess"] else 0.0), done, info


class Policy(nn.Module):
    def __init__(self, hidden=512):
        super().__init__()
        r = torchvision.models.resnet18(weights=None, norm_layer=lambda c: nn.GroupNorm(16, c))
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2)
        self.head = nn.Sequential(r.layer3, r.layer4, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.goal = nn.Embedding(len(TARGETS), 64)
        self.gru = nn.GRU(512 + 64, hidden)
        self.pi, self.v = nn.Linear(hidden, len(ACTIONS)), nn.Linear(hidden, 1)

    def forward(self, rgb, goal, h, masks, actions=None):
        x = rgb.permute(0, 3, 1, 2).float() / 255.0
        x = torch.cat([self.head(self.stem(x)), self.goal(goal)], -1)
        n = h.shape[1]
        x, m = x.view(-1, n, x.shape[-1]), masks.view(-1, n, 1)
        outs = []
        for t in range(x.shape[0]):
            o, h = self.gru(x[t:t + 1], h * m[t].unsqueeze(0))
            outs.append(o[0])
        f = torch.stack(outs).flatten(0, 1)
        d = torch.distributions.Categorical(logits=self.pi(f))
        if actions is None:
            actions = d.sample()
        return actions, d.log_prob(actions), d.entropy().mean(), self.v(f).squeeze(-1), h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--envs", type=int, default=12)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--updates", type=int, default=30000)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--mini-batches", type=int, default=2)
    ap.add_argument("--sync-frac", type=float, default=0.6)
    ap.add_argument("--out", default="runs/procthor_objnav")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    store = dist.PrefixStore("tracker", dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                                                      world, rank == 0))
    store.set("num_done", "0")

    houses = prior.load_dataset("procthor-10k")["train"]
    my_houses = [houses[i] for i in range(rank, len(houses), world)]
    envs = [ObjNavEnv(my_houses, local_rank, args.seed + 1000 * rank + i) for i in range(args.envs)]
    pool = ThreadPoolExecutor(max_workers=args.envs)

    policy = Policy().to(dev)
    ddp = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr, eps=1e-5)

    N, T = args.envs, args.steps
    first = list(pool.map(lambda e: e.reset(), envs))
    rgb = torch.zeros(T + 1, N, 224, 224, 3, dtype=torch.uint8, device=dev)
    goal = torch.zeros(T + 1, N, dtype=torch.long, device=dev)
    rgb[0] = torch.as_tensor(np.stack([o["rgb"] for o in first]), device=dev)
    goal[0] = torch.as_tensor([o["goal"] for o in first], device=dev)
    hid = torch.zeros(T + 1, 1, N, 512, device=dev)
    masks = torch.zeros(T + 1, N, device=dev)
    act = torch.zeros(T, N, dtype=torch.long, device=dev)
    logp, rew, val = torch.zeros(T, N, device=dev), torch.zeros(T, N, device=dev), torch.zeros(T + 1, N, device=dev)
    win = deque(maxlen=200)
    frames, t0 = 0, time.time()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for update in range(args.updates):
        L = 0
        for t in range(T):
            with torch.no_grad():
                a, lp, _, v, h = policy(rgb[t], goal[t], hid[t], masks[t])
            res = list(pool.map(lambda ea: ea[0].step(ea[1]), zip(envs, a.tolist())))
            for (_, _, d, info) in res:
                if d:
                    win.append((info["success"], info["ep_len"]))
            rgb[t + 1] = torch.as_tensor(np.stack([r[0]["rgb"] for r in res]), device=dev)
            goal[t + 1] = torch.as_tensor([r[0]["goal"] for r in res], device=dev)
            masks[t + 1] = torch.as_tensor([0.0 if r[2] else 1.0 for r in res], device=dev)
            rew[t] = torch.as_tensor([r[1] for r in res], dtype=torch.float, device=dev)
            hid[t + 1], act[t], logp[t], val[t] = h, a, lp, v
            L = t + 1
            if L >= T // 4 and int(store.get("num_done")) >= args.sync_frac * world:
                break
        store.add("num_done", 1)

        with torch.no_grad():
            val[L] = policy(rgb[L], goal[L], hid[L], masks[L])[3]
        adv, gae = torch.zeros(L, N, device=dev), torch.zeros(N, device=dev)
        for t in reversed(range(L)):
            delta = rew[t] + 0.99 * val[t + 1] * masks[t + 1] - val[t]
            gae = delta + 0.99 * 0.95 * masks[t + 1] * gae
            adv[t] = gae
        ret = adv + val[:L]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)

        per = N // args.mini_batches
        for _ in range(args.epochs):
            perm = torch.randperm(N, device=dev)
            for j in range(args.mini_batches):
                idx = perm[j * per:(j + 1) * per]
                _, nlp, ent, nv, _ = ddp(rgb[:L, idx].flatten(0, 1), goal[:L, idx].flatten(0, 1), hid[0][:, idx],
                                         masks[:L, idx].flatten(0, 1), act[:L, idx].flatten(0, 1))
                ratio = (nlp - logp[:L, idx].flatten()).exp()
                mb_adv = adv[:, idx].flatten()
                pg = -torch.min(ratio * mb_adv, ratio.clamp(0.8, 1.2) * mb_adv).mean()
                vl = 0.5 * (ret[:, idx].flatten() - nv).pow(2).mean()
                opt.zero_grad()
                (pg + 0.5 * vl - 0.01 * ent).backward()
                nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
                opt.step()
        rgb[0], goal[0], hid[0], masks[0] = rgb[L], goal[L], hid[L], masks[L]

        w = np.asarray(win, dtype=np.float64).reshape(-1, 2)
        s = torch.tensor([L * N, len(w), *w.sum(0)], dtype=torch.float64, device=dev)
        dist.all_reduce(s)
        frames += int(s[0].item())
        if rank == 0:
            store.set("num_done", "0")
            if update % 10 == 0:
                n = max(s[1].item(), 1)
                print(f"update {update} frames {frames} fps {frames / (time.time() - t0):.0f} "
                      f"success {s[2] / n:.3f} ep_len {s[3] / n:.1f}", flush=True)
            if (update + 1) % 500 == 0:
                torch.save({"policy": policy.state_dict(), "opt": opt.state_dict(), "update": update + 1},
                           os.path.join(args.out, f"ckpt_{update + 1:06d}.pt"))

    for e in envs:
        e.c.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
