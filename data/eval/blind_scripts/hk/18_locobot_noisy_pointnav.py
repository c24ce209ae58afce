"""PointNav with LoCoBot noisy actuation + noisy depth: DD-PPO training and checkpoint eval.

Train:
    torchrun --nproc_per_node=8 noisy_pointnav.py --exp-config configs/ddppo_pointnav_locobot.yaml
Evaluate one checkpoint on val (single process, single GPU):
    python noisy_pointnav.py --exp-config configs/ddppo_pointnav_locobot.yaml --eval-ckpt runs/locobot/ckpt.40.pth
"""
import argparse
import json
import os
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tqdm

from habitat import logger
from habitat_baselines.common.env_utils import construct_envs
from habitat_baselines.common.environments import get_env_class
from habitat_baselines.common.rollout_storage import RolloutStorage
from habitat_baselines.config.default import get_config
from habitat_baselines.rl.ddppo.policy import PointNavResNetPolicy
from habitat_baselines.utils.common import batch_obs


class PolicyForDDP(nn.Module):
    """PointNavResNetPolicy whose forward() is evaluate_actions, so DDP sees the PPO pass."""

    def __init__(self, config, obs_space, action_space):
        super().__init__()
        self.policy = PointNavResNetPolicy.from_config(config, obs_space, action_space)

    def forward(self, *args):
        return self.policy.evaluate_actions(*args)


def train(config):
    ppo = config.RL.PPO
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    store = dist.PrefixStore("rollout_tracker", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, rank == 0))
    store.set("num_done", "0")

    config.defrost()
    config.TORCH_GPU_ID = config.SIMULATOR_GPU_ID = local_rank
    config.TASK_CONFIG.SEED += rank * config.NUM_ENVIRONMENTS
    config.freeze()
    torch.manual_seed(config.TASK_CONFIG.SEED)
    envs = construct_envs(config, get_env_class(config.ENV_NAME))

    model = PolicyForDDP(config, envs.observation_spaces[0], envs.action_spaces[0]).to(device)
    actor_critic = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    policy = model.policy
    optimizer = torch.optim.Adam(actor_critic.parameters(), lr=ppo.lr, eps=ppo.eps)

    rollouts = RolloutStorage(ppo.num_steps, envs.num_envs, envs.observation_spaces[0], envs.action_spaces[0],
                              ppo.hidden_size, num_recurrent_layers=policy.net.num_recurrent_layers)
    rollouts.to(device)
    rollouts.buffers["observations"][0] = batch_obs(envs.reset(), device=device)
    ep_rew = torch.zeros(envs.num_envs, 1, device=device)
    window = deque(maxlen=ppo.reward_window_size)
    frames, t0 = 0, time.time()
    if rank == 0:
        os.makedirs(config.CHECKPOINT_FOLDER, exist_ok=True)

    for update in range(config.NUM_UPDATES):
        for g in optimizer.param_groups:
            g["lr"] = ppo.lr * (1 - update / config.NUM_UPDATES)
        for step in range(ppo.num_steps):
            b = rollouts.buffers[rollouts.current_rollout_step_idx]
            with torch.no_grad():
                v, a, lp, h = policy.act(b["observations"], b["recurrent_hidden_states"], b["prev_actions"],
                                         b["masks"])
            obs, rews, dones, infos = [list(x) for x in zip(*envs.step([x.item() for x in a.cpu()]))]
            r = torch.tensor(rews, dtype=torch.float, device=device).unsqueeze(1)
            nd = torch.tensor([[not d] for d in dones], dtype=torch.bool, device=device)
            ep_rew += r
            for i, d in enumerate(dones):
                if d:
                    window.append((ep_rew[i].item(), float(infos[i]["success"]), float(infos[i]["spl"])))
            ep_rew.masked_fill_(~nd, 0.0)
            rollouts.insert(next_observations=batch_obs(obs, device=device), rewards=r, next_masks=nd, actions=a,
                            action_log_probs=lp, value_preds=v, next_recurrent_hidden_states=h)
            rollouts.advance_rollout()
            if step + 1 >= 0.25 * ppo.num_steps and int(store.get("num_done")) >= config.RL.DDPPO.sync_frac * world:
                break
        store.add("num_done", 1)

        T = rollouts.current_rollout_step_idx
        with torch.no_grad():
            b = rollouts.buffers[T]
            nv = policy.get_value(b["observations"], b["recurrent_hidden_states"], b["prev_actions"], b["masks"])
        rollouts.compute_returns(nv, ppo.use_gae, ppo.gamma, ppo.tau)
        adv = rollouts.buffers["returns"][:T] - rollouts.buffers["value_preds"][:T]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)
        for _ in range(ppo.ppo_epoch):
            for mb in rollouts.recurrent_generator(adv, ppo.num_mini_batch):
                values, logp, ent, _ = actor_critic(mb["observations"], mb["recurrent_hidden_states"],
                                                    mb["prev_actions"], mb["masks"], mb["actions"])
                ratio = torch.exp(logp - mb["action_log_probs"])
                pg = -torch.min(ratio * mb["advantages"],
                                ratio.clamp(1 - ppo.clip_param, 1 + ppo.clip_param) * mb["advantages"]).mean()
                vl = 0.5 * (mb["returns"] - values).pow(2).mean()
                optimizer.zero_grad()
                (pg + ppo.value_loss_coef * vl - ppo.entropy_coef * ent).backward()
                nn.utils.clip_grad_norm_(actor_critic.parameters(), ppo.max_grad_norm)
                optimizer.step()
        rollouts.after_update()

        w = np.asarray(window, dtype=np.float64).reshape(-1, 3)
        s = torch.tensor([T * envs.num_envs, len(w), *w.sum(0)], dtype=torch.float64, device=device)
        dist.all_reduce(s)
        frames += int(s[0].item())
        if rank == 0:
            store.set("num_done", "0")
            if update % config.LOG_INTERVAL == 0:
                n = max(s[1].item(), 1)
                logger.info(f"update {update} frames {frames} fps {frames / (time.time() - t0):.0f} "
                            f"reward {s[2] / n:.3f} success {s[3] / n:.3f} spl {s[4] / n:.3f}")
            if (update + 1) % config.CHECKPOINT_INTERVAL == 0:
                torch.save({"state_dict": actor_critic.state_dict(), "config": config, "frames": frames},
                           os.path.join(config.CHECKPOINT_FOLDER,
                                        f"ckpt.{(update + 1) // config.CHECKPOINT_INTERVAL}.pth"))

    envs.close()
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(config, ckpt_path, num_episodes):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ckpt = torch.load(ckpt_path, map_location="cpu")
    config.defrost()
    config.TASK_CONFIG.DATASET.SPLIT = "val"
    config.NUM_ENVIRONMENTS = 1
    config.freeze()
    envs = construct_envs(config, get_env_class(config.ENV_NAME))
    model = PolicyForDDP(config, envs.observation_spaces[0], envs.action_spaces[0])
    model.load_state_dict(ckpt["state_dict"])
    policy = model.policy.to(device).eval()

    obs = batch_obs(envs.reset(), device=device)
    h = torch.zeros(1, policy.net.num_recurrent_layers, config.RL.PPO.hidden_size, device=device)
    prev_a = torch.zeros(1, 1, dtype=torch.long, device=device)
    mask = torch.zeros(1, 1, dtype=torch.bool, device=device)
    results = []
    with tqdm.tqdm(total=num_episodes) as pbar:
        while len(results) < num_episodes:
            _, a, _, h = policy.act(obs, h, prev_a, mask, deterministic=True)
            prev_a = a
            out, _, done, info = [list(x) for x in zip(*envs.step([a.item()]))]
            obs = batch_obs(out, device=device)
            mask = torch.tensor([[not done[0]]], dtype=torch.bool, device=device)
            if done[0]:
                results.append({k: float(info[0][k]) for k in ("success", "spl", "distance_to_goal")})
                pbar.update()
    envs.close()
    summary = {k: float(np.mean([r[k] for r in results])) for k in results[0]}
    logger.info(f"{ckpt_path}: {summary}")
    with open(ckpt_path.replace(".pth", "_val.json"), "w") as f:
        json.dump(summary, f, indent=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--exp-config", required=True)
    ap.add_argument("--eval-ckpt", default=None)
    ap.add_argument("--eval-episodes", type=int, default=994)
    ap.add_argument("opts", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    config = get_config(args.exp_config, args.opts)
    if args.eval_ckpt:
        evaluate(config, args.eval_ckpt, args.eval_episodes)
    else:
        train(config)


if __name__ == "__main__":
    main()
