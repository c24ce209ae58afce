"""Single-task Diffusion Policy on a LIBERO task, trained with DDP, evaluated in LIBERO sim.

    torchrun --nproc_per_node=4 13_libero_diffusion_policy_rollouts.py \
        --suite libero_object --task_id 3 --demo_file data/libero_object/pick_up_the_ketchup_and_place_it_in_the_basket_demo.hdf5
"""
import argparse
import copy
import datetime
import math
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from diffusers import DDIMScheduler
from libero.libero import benchmark, get_libero_path
from libero.libero.envs import OffScreenRenderEnv
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="libero_object")
    ap.add_argument("--task_id", type=int, default=0)
    ap.add_argument("--demo_file", required=True)
    ap.add_argument("--out", default="runs/libero_dp")
    ap.add_argument("--n_obs", type=int, default=2)
    ap.add_argument("--horizon", type=int, default=16)
    ap.add_argument("--n_act", type=int, default=8)
    ap.add_argument("--global_batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--ema", action="store_true", help="evaluate and save an EMA copy of the weights")
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--n_eval", type=int, default=20)
    ap.add_argument("--max_steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class LiberoDemos(Dataset):
    def __init__(self, path, n_obs, horizon):
        self.n_obs, self.horizon, self.eps = n_obs, horizon, []
        with h5py.File(path, "r") as f:
            for k in sorted(f["data"].keys(), key=lambda s: int(s.split("_")[1])):
                o = f["data"][k]["obs"]
                self.eps.append({
                    "agentview": o["agentview_rgb"][()], "wrist": o["eye_in_hand_rgb"][()],
                    "proprio": np.concatenate([o["joint_states"][()], o["gripper_states"][()]], -1).astype(np.float32),
                    "action": f["data"][k]["actions"][()].astype(np.float32),
                })
        self.index = [(e, t) for e, ep in enumerate(self.eps) for t in range(len(ep["action"]))]
        # LIBERO actions are already in [-1, 1]; proprio gets mean/std over all demos
        allp = np.concatenate([ep["proprio"] for ep in self.eps])
        self.p_mean, self.p_std = allp.mean(0), allp.std(0) + 1e-4

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        e, t = self.index[i]
        ep = self.eps[e]
        T = len(ep["action"])
        o_idx = np.clip(np.arange(t - self.n_obs + 1, t + 1), 0, T - 1)
        a_idx = np.clip(np.arange(t - self.n_obs + 1, t - self.n_obs + 1 + self.horizon), 0, T - 1)
        img = lambda x: torch.from_numpy(x[o_idx]).permute(0, 3, 1, 2).float() / 255.0
        return {"agentview": img(ep["agentview"]), "wrist": img(ep["wrist"]),
                "proprio": torch.from_numpy((ep["proprio"][o_idx] - self.p_mean) / self.p_std),
                "action": torch.from_numpy(ep["action"][a_idx])}


def gn_resnet18():
    m = torchvision.models.resnet18(weights=None, norm_layer=lambda c: nn.GroupNorm(c // 16, c))
    m.fc = nn.Identity()
    return m


class FiLMBlock(nn.Module):
    def __init__(self, cin, cout, cond):
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv1d(cin, cout, 5, padding=2), nn.GroupNorm(8, cout), nn.Mish())
        self.c2 = nn.Sequential(nn.Conv1d(cout, cout, 5, padding=2), nn.GroupNorm(8, cout), nn.Mish())
        self.film = nn.Linear(cond, 2 * cout)
        self.skip = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, c):
        s, b = self.film(c).unsqueeze(-1).chunk(2, 1)
        return self.c2(self.c1(x) * (1 + s) + b) + self.skip(x)


class DiffusionPolicy(nn.Module):
    def __init__(self, proprio_dim, action_dim, n_obs, horizon, n_act, p_mean, p_std, temb=128):
        super().__init__()
        self.enc_agent, self.enc_wrist = gn_resnet18(), gn_resnet18()
        cond = n_obs * (1024 + proprio_dim) + temb
        self.temb = temb
        self.blocks = nn.ModuleList([FiLMBlock(action_dim, 256, cond), FiLMBlock(256, 512, cond),
                                     FiLMBlock(512, 256, cond)])
        self.final = nn.Conv1d(256, action_dim, 1)
        self.scheduler = DDIMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True)
        self.n_obs, self.horizon, self.n_act, self.action_dim = n_obs, horizon, n_act, action_dim
        self.register_buffer("p_mean", torch.as_tensor(p_mean))
        self.register_buffer("p_std", torch.as_tensor(p_std))

    def _t_embed(self, t):
        half = self.temb // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
        return torch.cat([torch.sin(t[:, None] * f), torch.cos(t[:, None] * f)], -1)

    def _cond(self, obs):
        B, T = obs["proprio"].shape[:2]
        a = self.enc_agent(obs["agentview"].flatten(0, 1)).view(B, T, -1)
        w = self.enc_wrist(obs["wrist"].flatten(0, 1)).view(B, T, -1)
        return torch.cat([a, w, obs["proprio"]], -1).flatten(1)

    def _denoise(self, x, t, cond):
        c = torch.cat([cond, self._t_embed(t.float())], -1)
        h = x.transpose(1, 2)
        for blk in self.blocks:
            h = blk(h, c)
        return self.final(h).transpose(1, 2)

    def forward(self, batch):
        """Training loss (epsilon prediction)."""
        action = batch["action"]
        noise = torch.randn_like(action)
        t = torch.randint(0, self.scheduler.config.num_train_timesteps, (action.shape[0],), device=action.device)
        noisy = self.scheduler.add_noise(action, noise, t)
        return F.mse_loss(self._denoise(noisy, t, self._cond(batch)), noise)

    @torch.no_grad()
    def predict_action(self, obs):
        obs = dict(obs, proprio=(obs["proprio"] - self.p_mean) / self.p_std)
        cond = self._cond(obs)
        x = torch.randn(cond.shape[0], self.horizon, self.action_dim, device=cond.device)
        self.scheduler.set_timesteps(10)
        for t in self.scheduler.timesteps:
            x = self.scheduler.step(self._denoise(x, t.to(cond.device).expand(x.shape[0]), cond), t, x).prev_sample
        start = self.n_obs - 1
        return x[:, start:start + self.n_act]


class LiberoRunner:
    def __init__(self, suite, task_id, n_eval, max_steps, n_obs, device):
        self.suite = benchmark.get_benchmark_dict()[suite]()
        task = self.suite.get_task(task_id)
        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        self.env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=128, camera_widths=128)
        self.init_states = self.suite.get_task_init_states(task_id)
        self.n_eval, self.max_steps, self.n_obs, self.device = n_eval, max_steps, n_obs, device

    def _obs(self, hist):
        to = lambda x: torch.as_tensor(np.stack(x), device=self.device)
        # LIBERO renders upside down relative to the stored demos
        return {"agentview": to([o["agentview_image"][::-1].copy() for o in hist]).permute(0, 3, 1, 2)[None].float() / 255,
                "wrist": to([o["robot0_eye_in_hand_image"][::-1].copy() for o in hist]).permute(0, 3, 1, 2)[None].float() / 255,
                "proprio": to([np.concatenate([o["robot0_joint_pos"], o["robot0_gripper_qpos"]]) for o in hist])[None].float()}

    def run(self, policy):
        policy.eval()
        successes = 0
        for i in range(self.n_eval):
            self.env.reset()
            obs = self.env.set_init_state(self.init_states[i % len(self.init_states)])
            for _ in range(10):  # let objects settle
                obs, _, _, _ = self.env.step(np.zeros(7))
            hist, done, steps = [obs] * self.n_obs, False, 0
            while not done and steps < self.max_steps:
                actions = policy.predict_action(self._obs(hist[-self.n_obs:]))[0].cpu().numpy()
                for a in actions:
                    obs, _, done, _ = self.env.step(a)
                    hist.append(obs)
                    steps += 1
                    if done:
                        break
            successes += int(done)
        policy.train()
        return successes / self.n_eval


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    data = LiberoDemos(args.demo_file, args.n_obs, args.horizon)
    sampler = DistributedSampler(data, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=args.global_batch // world_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    policy = DiffusionPolicy(data.eps[0]["proprio"].shape[1], data.eps[0]["action"].shape[1], args.n_obs,
                             args.horizon, args.n_act, data.p_mean, data.p_std).to(device)
    ema_policy = copy.deepcopy(policy).requires_grad_(False) if args.ema else None
    policy = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader), eta_min=1e-6)

    runner = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        runner = LiberoRunner(args.suite, args.task_id, args.n_eval, args.max_steps, args.n_obs, device)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        acc = torch.zeros(2, device=device)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = policy(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if ema_policy is not None:
                with torch.no_grad():
                    for pe, p in zip(ema_policy.parameters(), policy.module.parameters()):
                        pe.lerp_(p, 1e-3)
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)

        if rank == 0:
            print(f"epoch {epoch}: loss {(acc[0] / acc[1]).item():.5f}")
            if (epoch + 1) % args.eval_every == 0:
                eval_policy = ema_policy if ema_policy is not None else policy
                sr = runner.run(eval_policy)
                print(f"epoch {epoch}: success rate {sr:.2f}")
                weights = (ema_policy if ema_policy is not None else policy.module).state_dict()
                torch.save({"model": weights, "epoch": epoch, "success": sr}, os.path.join(args.out, f"ep{epoch + 1}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
