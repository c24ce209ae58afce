"""AudioGoal navigation (SoundSpaces 2.0, Matterport3D) with DD-PPO.

Visual (depth) + binaural spectrogram encoders feeding a GRU; trained from scratch.

    torchrun --nproc_per_node=8 --master_port=29511 train_audionav.py --exp-config ss_configs/audiogoal_depth.yaml
"""
import argparse
import os
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as distrib
import torch.nn as nn
import torch.nn.functional as F

from habitat import logger
from habitat_baselines.common.rollout_storage import RolloutStorage
from habitat_baselines.utils.common import batch_obs
from ss_baselines.common.env_utils import construct_envs
from ss_baselines.common.environments import get_env_class
from ss_baselines.av_nav.config import get_config

DEFAULT_PORT = 8738


def init_distrib(backend="nccl"):
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = int(os.environ.get("MASTER_PORT", DEFAULT_PORT))
    torch.cuda.set_device(local_rank)
    tcp_store = distrib.TCPStore(master_addr, master_port, world_size, world_rank == 0)
    distrib.init_process_group(backend, store=tcp_store, rank=world_rank, world_size=world_size)
    return local_rank, world_rank, world_size, tcp_store


class AudioCNN(nn.Module):
    def __init__(self, in_ch=2, out=128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_ch, 32, 5, 2), nn.ReLU(True), nn.Conv2d(32, 64, 3, 2), nn.ReLU(True),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(True), nn.AdaptiveAvgPool2d((4, 4)), nn.Flatten(),
            nn.Linear(64 * 16, out), nn.ReLU(True))

    def forward(self, spec):
        return self.net(torch.log1p(spec.permute(0, 3, 1, 2)))


class AudioNavPolicy(nn.Module):
    def __init__(self, num_actions, hidden=512):
        super().__init__()
        self.visual = nn.Sequential(
            nn.Conv2d(1, 32, 8, 4), nn.ReLU(True), nn.Conv2d(32, 64, 4, 2), nn.ReLU(True),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(True), nn.AdaptiveAvgPool2d((4, 4)), nn.Flatten(),
            nn.Linear(64 * 16, hidden), nn.ReLU(True))
        self.audio = AudioCNN()
        self.gru = nn.GRU(hidden + 128, hidden)
        self.actor = nn.Linear(hidden, num_actions)
        self.critic = nn.Linear(hidden, 1)
        self.num_recurrent_layers = 1

    def _core(self, obs, h, masks):
        x = torch.cat([self.visual(obs["depth"].permute(0, 3, 1, 2)), self.audio(obs["spectrogram"])], 1)
        n = h.size(0)
        x, masks = x.view(-1, n, x.size(1)), masks.view(-1, n, 1).float()
        h = h.permute(1, 0, 2)
        outs = []
        for t in range(x.size(0)):
            o, h = self.gru(x[t:t + 1], h * masks[t].unsqueeze(0))
            outs.append(o.squeeze(0))
        return torch.stack(outs).flatten(0, 1), h.permute(1, 0, 2)

    def act(self, obs, h, prev_actions, masks):
        f, h = self._core(obs, h, masks)
        d = torch.distributions.Categorical(logits=self.actor(f))
        a = d.sample()
        return self.critic(f), a.unsqueeze(1), d.log_prob(a).unsqueeze(1), h

    def get_value(self, obs, h, prev_actions, masks):
        return self.critic(self._core(obs, h, masks)[0])

    def forward(self, obs, h, prev_actions, masks, actions):
        f, _ = self._core(obs, h, masks)
        d = torch.distributions.Categorical(logits=self.actor(f))
        return self.critic(f), d.log_prob(actions.squeeze(1)).unsqueeze(1), d.entropy().mean()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--exp-config", required=True)
    p.add_argument("opts", nargs=argparse.REMAINDER)
    args = p.parse_args()
    config = get_config(args.exp_config, args.opts)
    ppo = config.RL.PPO

    local_rank, rank, world, tcp_store = init_distrib(config.RL.DDPPO.distrib_backend)
    device = torch.device("cuda", local_rank)
    done_store = distrib.PrefixStore("rollout_tracker", tcp_store)
    done_store.set("num_done", "0")

    config.defrost()
    config.TORCH_GPU_ID = local_rank
    config.SIMULATOR_GPU_ID = local_rank
    config.SEED += rank * config.NUM_PROCESSES
    config.TASK_CONFIG.SEED = config.SEED
    config.freeze()
    torch.manual_seed(config.SEED)
    np.random.seed(config.SEED)

    envs = construct_envs(config, get_env_class(config.ENV_NAME))
    policy = AudioNavPolicy(envs.action_spaces[0].n, ppo.hidden_size).to(device)
    ddp = nn.parallel.DistributedDataParallel(policy, device_ids=[local_rank], output_device=local_rank)
    optim = torch.optim.Adam(policy.parameters(), lr=ppo.lr, eps=ppo.eps)

    rollouts = RolloutStorage(ppo.num_steps, envs.num_envs, envs.observation_spaces[0], envs.action_spaces[0],
                              ppo.hidden_size, num_recurrent_layers=1)
    rollouts.to(device)
    rollouts.buffers["observations"][0] = batch_obs(envs.reset(), device=device)

    ep_rew = torch.zeros(envs.num_envs, 1, device=device)
    window = deque(maxlen=ppo.reward_window_size)
    count_steps, t0 = 0, time.time()
    if rank == 0:
        os.makedirs(config.CHECKPOINT_FOLDER, exist_ok=True)

    for update in range(config.NUM_UPDATES):
        for g in optim.param_groups:
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
            if (step + 1 >= ppo.num_steps * 0.25
                    and int(done_store.get("num_done")) >= config.RL.DDPPO.sync_frac * world):
                break
        done_store.add("num_done", 1)

        T = rollouts.current_rollout_step_idx
        with torch.no_grad():
            b = rollouts.buffers[T]
            nv = policy.get_value(b["observations"], b["recurrent_hidden_states"], b["prev_actions"], b["masks"])
        rollouts.compute_returns(nv, ppo.use_gae, ppo.gamma, ppo.tau)
        adv = rollouts.buffers["returns"][:T] - rollouts.buffers["value_preds"][:T]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)
        for _ in range(ppo.ppo_epoch):
            for mb in rollouts.recurrent_generator(adv, ppo.num_mini_batch):
                value, logp, ent = ddp(mb["observations"], mb["recurrent_hidden_states"], mb["prev_actions"],
                                       mb["masks"], mb["actions"])
                ratio = torch.exp(logp - mb["action_log_probs"])
                pg = -torch.min(ratio * mb["advantages"],
                                ratio.clamp(1 - ppo.clip_param, 1 + ppo.clip_param) * mb["advantages"]).mean()
                vl = 0.5 * (mb["returns"] - value).pow(2).mean()
                optim.zero_grad()
                (pg + ppo.value_loss_coef * vl - ppo.entropy_coef * ent).backward()
                nn.utils.clip_grad_norm_(policy.parameters(), ppo.max_grad_norm)
                optim.step()
        rollouts.after_update()

        w = np.asarray(window, dtype=np.float64).reshape(-1, 3)
        stats = torch.tensor([T * envs.num_envs, len(w), *w.sum(0)], dtype=torch.float64, device=device)
        distrib.all_reduce(stats)
        if rank == 0:
            done_store.set("num_done", "0")
        count_steps += int(stats[0].item())

        if rank == 0 and update % config.LOG_INTERVAL == 0:
            n = max(stats[1].item(), 1.0)
            logger.info(f"update {update}  frames {count_steps}  fps {count_steps / (time.time() - t0):.0f}  "
                        f"reward {stats[2] / n:.3f}  success {stats[3] / n:.3f}  spl {stats[4] / n:.3f}")
        if rank == 0 and (update + 1) % config.CHECKPOINT_INTERVAL == 0:
            torch.save({"state_dict": policy.state_dict(), "config": config, "count_steps": count_steps},
                       os.path.join(config.CHECKPOINT_FOLDER, f"ckpt.{(update + 1) // config.CHECKPOINT_INTERVAL}.pth"))

    envs.close()
    distrib.destroy_process_group()


if __name__ == "__main__":
    main()
