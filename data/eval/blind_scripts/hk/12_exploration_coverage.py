"""Exploration (area coverage reward) with DD-PPO, auto-resuming on the 24h-limited queue.

Every job of the chain starts the same way and picks up the newest checkpoint in
--run-dir, if there is one.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        explore_ddppo.py --run-dir /shared/runs/explore_gibson --exp-config configs/explore_gibson.yaml
"""
import argparse
import glob
import os
import re
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from habitat import logger
from habitat_baselines.common.env_utils import construct_envs
from habitat_baselines.common.environments import get_env_class
from habitat_baselines.common.obs_transformers import apply_obs_transforms_batch, get_active_obs_transforms
from habitat_baselines.common.rollout_storage import RolloutStorage
from habitat_baselines.config.default import get_config
from habitat_baselines.rl.ddppo.policy import PointNavResNetPolicy
from habitat_baselines.utils.common import batch_obs


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--exp-config", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--keep-last", type=int, default=5)
    p.add_argument("opts", nargs=argparse.REMAINDER)
    return p.parse_args()


def latest_checkpoint(run_dir):
    ckpts = glob.glob(os.path.join(run_dir, "ckpt.*.pth"))
    if not ckpts:
        return None
    return max(ckpts, key=lambda p: int(re.search(r"ckpt\.(\d+)\.pth", p).group(1)))


class EvalActionsDDP(nn.Module):
    def __init__(self, ac):
        super().__init__()
        self.ac = ac

    def forward(self, *args):
        return self.ac.evaluate_actions(*args)


def main():
    args = parse_args()
    config = get_config(args.exp_config, args.opts)
    ppo = config.RL.PPO
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    tracker = dist.PrefixStore("rollout_tracker", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, rank == 0))
    tracker.set("num_done", "0")

    config.defrost()
    config.TORCH_GPU_ID = config.SIMULATOR_GPU_ID = local_rank
    config.TASK_CONFIG.SEED += rank * config.NUM_ENVIRONMENTS
    config.freeze()
    torch.manual_seed(config.TASK_CONFIG.SEED)
    np.random.seed(config.TASK_CONFIG.SEED)

    envs = construct_envs(config, get_env_class(config.ENV_NAME))
    obs_transforms = get_active_obs_transforms(config)
    ac = PointNavResNetPolicy.from_config(config, envs.observation_spaces[0], envs.action_spaces[0]).to(device)
    optimizer = torch.optim.Adam(ac.parameters(), lr=ppo.lr, eps=ppo.eps)

    update0, count_steps, ckpt_idx = 0, 0, 0
    resume_path = latest_checkpoint(args.run_dir)
    if resume_path is not None:
        ckpt = torch.load(resume_path)
        ac.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optim_state"])
        update0, count_steps, ckpt_idx = ckpt["update"], ckpt["count_steps"], ckpt["ckpt_idx"] + 1
        if rank == 0:
            logger.info(f"resuming from {resume_path} (update {update0}, {count_steps} frames)")
    ddp = nn.parallel.DistributedDataParallel(EvalActionsDDP(ac), device_ids=[local_rank], output_device=local_rank)

    rollouts = RolloutStorage(ppo.num_steps, envs.num_envs, envs.observation_spaces[0], envs.action_spaces[0],
                              ppo.hidden_size, num_recurrent_layers=ac.net.num_recurrent_layers)
    rollouts.to(device)
    rollouts.buffers["observations"][0] = apply_obs_transforms_batch(batch_obs(envs.reset(), device=device),
                                                                     obs_transforms)
    ep_rew = torch.zeros(envs.num_envs, 1, device=device)
    window = deque(maxlen=ppo.reward_window_size)
    t0, steps_at_start = time.time(), count_steps

    for update in range(update0, config.NUM_UPDATES):
        for g in optimizer.param_groups:
            g["lr"] = ppo.lr * (1 - update / config.NUM_UPDATES)
        ac.eval()
        for step in range(ppo.num_steps):
            b = rollouts.buffers[rollouts.current_rollout_step_idx]
            with torch.no_grad():
                v, a, lp, h = ac.act(b["observations"], b["recurrent_hidden_states"], b["prev_actions"], b["masks"])
            obs, rews, dones, infos = [list(x) for x in zip(*envs.step([x.item() for x in a.cpu()]))]
            r = torch.tensor(rews, dtype=torch.float, device=device).unsqueeze(1)
            nd = torch.tensor([[not d] for d in dones], dtype=torch.bool, device=device)
            ep_rew += r
            for i, d in enumerate(dones):
                if d:
                    window.append((ep_rew[i].item(), infos[i]["area_coverage"], infos[i]["num_collisions"]))
            ep_rew.masked_fill_(~nd, 0.0)
            rollouts.insert(next_observations=apply_obs_transforms_batch(batch_obs(obs, device=device), obs_transforms),
                            rewards=r, next_masks=nd, actions=a, action_log_probs=lp, value_preds=v,
                            next_recurrent_hidden_states=h)
            rollouts.advance_rollout()
            if step + 1 >= 0.25 * ppo.num_steps and int(tracker.get("num_done")) >= config.RL.DDPPO.sync_frac * world:
                break
        tracker.add("num_done", 1)

        T = rollouts.current_rollout_step_idx
        with torch.no_grad():
            b = rollouts.buffers[T]
            nv = ac.get_value(b["observations"], b["recurrent_hidden_states"], b["prev_actions"], b["masks"])
        rollouts.compute_returns(nv, ppo.use_gae, ppo.gamma, ppo.tau)
        adv = rollouts.buffers["returns"][:T] - rollouts.buffers["value_preds"][:T]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)
        ac.train()
        for _ in range(ppo.ppo_epoch):
            for mb in rollouts.recurrent_generator(adv, ppo.num_mini_batch):
                values, logp, ent, _ = ddp(mb["observations"], mb["recurrent_hidden_states"], mb["prev_actions"],
                                           mb["masks"], mb["actions"])
                ratio = torch.exp(logp - mb["action_log_probs"])
                pg = -torch.min(ratio * mb["advantages"],
                                ratio.clamp(1 - ppo.clip_param, 1 + ppo.clip_param) * mb["advantages"]).mean()
                vl = 0.5 * (mb["returns"] - values).pow(2).mean()
                optimizer.zero_grad()
                (pg + ppo.value_loss_coef * vl - ppo.entropy_coef * ent).backward()
                nn.utils.clip_grad_norm_(ac.parameters(), ppo.max_grad_norm)
                optimizer.step()
        rollouts.after_update()

        w = np.asarray(window, dtype=np.float64).reshape(-1, 3)
        stats = torch.tensor([T * envs.num_envs, len(w), *w.sum(0)], dtype=torch.float64, device=device)
        dist.all_reduce(stats)
        count_steps += int(stats[0].item())
        if rank == 0:
            tracker.set("num_done", "0")

        if rank == 0 and update % config.LOG_INTERVAL == 0:
            n = max(stats[1].item(), 1)
            logger.info(f"update {update} frames {count_steps} "
                        f"fps {(count_steps - steps_at_start) / (time.time() - t0):.0f} reward {stats[2] / n:.3f} "
                        f"coverage {stats[3] / n:.2f} collisions {stats[4] / n:.1f}")
        if (update + 1) % config.CHECKPOINT_INTERVAL == 0:
            if rank == 0:
                os.makedirs(args.run_dir, exist_ok=True)
                path = os.path.join(args.run_dir, f"ckpt.{ckpt_idx}.pth")
                torch.save({"state_dict": ac.state_dict(), "optim_state": optimizer.state_dict(),
                            "update": update + 1, "count_steps": count_steps, "ckpt_idx": ckpt_idx,
                            "config": config}, path + ".tmp")
                os.replace(path + ".tmp", path)
                old = ckpt_idx - args.keep_last
                if old >= 0 and os.path.exists(os.path.join(args.run_dir, f"ckpt.{old}.pth")):
                    os.remove(os.path.join(args.run_dir, f"ckpt.{old}.pth"))
            ckpt_idx += 1
            dist.barrier()

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
