#!/usr/bin/env python
"""Sweep driver for DD-PPO PointNav (MP3D, RGB-D) built on habitat_baselines pieces.

Each sweep run picks a random base seed on rank 0 unless --seed is given, so the
seed has to be shared before the env seeds are derived from it.

    torchrun --nproc_per_node=8 sweep_pointnav.py --exp-config configs/ddppo_pointnav_mp3d.yaml \
        --run-name lr3e-4 RL.PPO.lr 3e-4
"""
import argparse
import json
import os
import random
import time
from collections import defaultdict, deque

import numpy as np
import torch
import torch.distributed as dist

from habitat import logger
from habitat_baselines.common.env_utils import construct_envs
from habitat_baselines.common.environments import get_env_class
from habitat_baselines.common.rollout_storage import RolloutStorage
from habitat_baselines.config.default import get_config
from habitat_baselines.rl.ddppo.algo import DDPPO
from habitat_baselines.rl.ddppo.policy import PointNavResNetPolicy
from habitat_baselines.utils.common import batch_obs


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--exp-config", required=True)
    p.add_argument("--run-name", default="default")
    p.add_argument("--seed", type=int, default=-1)
    p.add_argument("--out-root", default="/checkpoint/nav_sweeps")
    p.add_argument("opts", nargs=argparse.REMAINDER)
    return p.parse_args()


def init_distributed(requested_seed):
    dist.init_process_group(backend="nccl")
    if requested_seed >= 0:
        seed = torch.tensor([requested_seed], dtype=torch.long, device="cuda")
    else:
        seed = torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.long, device="cuda")
    dist.broadcast(seed, src=0)
    return dist.get_rank(), dist.get_world_size(), int(seed.item())


def main():
    args = get_args()
    rank, world_size, base_seed = init_distributed(args.seed)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    config = get_config(args.exp_config, args.opts)
    ppo_cfg = config.RL.PPO
    run_dir = os.path.join(args.out_root, args.run_name)
    config.defrost()
    config.TORCH_GPU_ID = local_rank
    config.SIMULATOR_GPU_ID = local_rank
    config.TASK_CONFIG.SEED = base_seed + rank * config.NUM_ENVIRONMENTS
    config.CHECKPOINT_FOLDER = os.path.join(run_dir, "checkpoints")
    config.freeze()
    random.seed(config.TASK_CONFIG.SEED)
    np.random.seed(config.TASK_CONFIG.SEED)
    torch.manual_seed(config.TASK_CONFIG.SEED)

    if rank == 0:
        os.makedirs(config.CHECKPOINT_FOLDER, exist_ok=True)
        with open(os.path.join(run_dir, "run.json"), "w") as f:
            json.dump({"seed": base_seed, "world_size": world_size, "opts": args.opts}, f, indent=2)

    store = dist.PrefixStore("rollout_tracker", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world_size, rank == 0))
    store.set("num_done", "0")

    envs = construct_envs(config, get_env_class(config.ENV_NAME))
    policy = PointNavResNetPolicy.from_config(config, envs.observation_spaces[0], envs.action_spaces[0])
    policy.to(device)
    agent = DDPPO(actor_critic=policy, clip_param=ppo_cfg.clip_param, ppo_epoch=ppo_cfg.ppo_epoch,
                  num_mini_batch=ppo_cfg.num_mini_batch, value_loss_coef=ppo_cfg.value_loss_coef,
                  entropy_coef=ppo_cfg.entropy_coef, lr=ppo_cfg.lr, eps=ppo_cfg.eps,
                  max_grad_norm=ppo_cfg.max_grad_norm, use_normalized_advantage=ppo_cfg.use_normalized_advantage)
    agent.init_distributed(find_unused_params=False)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(
        agent.optimizer, lambda u: 1 - u / config.NUM_UPDATES if ppo_cfg.use_linear_lr_decay else 1.0)

    rollouts = RolloutStorage(ppo_cfg.num_steps, envs.num_envs, envs.observation_spaces[0],
                              envs.action_spaces[0], ppo_cfg.hidden_size,
                              num_recurrent_layers=policy.net.num_recurrent_layers)
    rollouts.to(device)
    rollouts.buffers["observations"][0] = batch_obs(envs.reset(), device=device)

    ep_reward = torch.zeros(envs.num_envs, 1, device=device)
    window = defaultdict(lambda: deque(maxlen=ppo_cfg.reward_window_size))
    count_steps, t0 = 0, time.time()

    for update in range(config.NUM_UPDATES):
        lr_sched.step()
        agent.eval()
        for step in range(ppo_cfg.num_steps):
            i = rollouts.current_rollout_step_idx
            with torch.no_grad():
                b = rollouts.buffers[i]
                values, actions, log_probs, rnn = policy.act(
                    b["observations"], b["recurrent_hidden_states"], b["prev_actions"], b["masks"])
            outs = envs.step([a.item() for a in actions.cpu()])
            obs, rews, dones, infos = [list(x) for x in zip(*outs)]
            rews_t = torch.tensor(rews, dtype=torch.float, device=device).unsqueeze(1)
            not_done = torch.tensor([[not d] for d in dones], dtype=torch.bool, device=device)
            ep_reward += rews_t
            for j, d in enumerate(dones):
                if d:
                    window["reward"].append(ep_reward[j].item())
                    window["success"].append(float(infos[j]["success"]))
                    window["spl"].append(float(infos[j]["spl"]))
            ep_reward.masked_fill_(~not_done, 0.0)
            rollouts.insert(next_observations=batch_obs(obs, device=device), rewards=rews_t,
                            next_masks=not_done, actions=actions, action_log_probs=log_probs,
                            value_preds=values, next_recurrent_hidden_states=rnn)
            rollouts.advance_rollout()
            if (step + 1 >= ppo_cfg.num_steps * 0.25
                    and int(store.get("num_done")) >= config.RL.DDPPO.sync_frac * world_size):
                break
        store.add("num_done", 1)
        n_steps = rollouts.current_rollout_step_idx * envs.num_envs

        agent.train()
        with torch.no_grad():
            b = rollouts.buffers[rollouts.current_rollout_step_idx]
            next_value = policy.get_value(b["observations"], b["recurrent_hidden_states"],
                                          b["prev_actions"], b["masks"])
        rollouts.compute_returns(next_value, ppo_cfg.use_gae, ppo_cfg.gamma, ppo_cfg.tau)
        value_loss, action_loss, entropy = agent.update(rollouts)
        rollouts.after_update()

        stats = torch.tensor([float(n_steps), sum(window["reward"]), sum(window["success"]),
                              sum(window["spl"]), float(len(window["reward"])), value_loss, action_loss],
                             dtype=torch.float, device=device)
        dist.all_reduce(stats)
        if rank == 0:
            store.set("num_done", "0")
        count_steps += int(stats[0].item())

        if rank == 0 and update % config.LOG_INTERVAL == 0:
            n = max(stats[4].item(), 1.0)
            logger.info(
                f"update {update} frames {count_steps} fps {count_steps / (time.time() - t0):.1f} "
                f"reward {stats[1] / n:.3f} success {stats[2] / n:.3f} spl {stats[3] / n:.3f} "
                f"vloss {stats[5] / world_size:.4f} ploss {stats[6] / world_size:.4f}")
        if rank == 0 and update > 0 and update % config.CHECKPOINT_INTERVAL == 0:
            torch.save({"state_dict": agent.state_dict(), "config": config, "count_steps": count_steps,
                        "seed": base_seed},
                       os.path.join(config.CHECKPOINT_FOLDER, f"ckpt.{update // config.CHECKPOINT_INTERVAL}.pth"))

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
