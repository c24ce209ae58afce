"""Single-node DD-PPO on Gibson PointNav launched with torch.multiprocessing.spawn
(our workstation cluster has no torchrun wrapper in the job template).

The visual encoder keeps BatchNorm (it is initialised from a BN ResNet trained on
Gibson frames), converted to SyncBatchNorm for the PPO update.

    python gibson_spawn_ddppo.py --gpus 8 --exp-config configs/ddppo_pointnav_bn.yaml
"""
import argparse
import os
import socket
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torchvision

from habitat import logger
from habitat_baselines.common.env_utils import construct_envs
from habitat_baselines.common.environments import get_env_class
from habitat_baselines.common.rollout_storage import RolloutStorage
from habitat_baselines.config.default import get_config
from habitat_baselines.utils.common import batch_obs


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BNPointNavPolicy(nn.Module):
    def __init__(self, n_actions, hidden=512, encoder_ckpt=None):
        super().__init__()
        r = torchvision.models.resnet18(weights=None)
        r.conv1 = nn.Conv2d(4, 64, 7, 2, 3, bias=False)
        r.fc = nn.Identity()
        if encoder_ckpt:
            r.load_state_dict(torch.load(encoder_ckpt, map_location="cpu"), strict=False)
        self.encoder = r
        self.goal = nn.Linear(3, 32)
        self.prev_a = nn.Embedding(n_actions + 1, 32)
        self.rnn = nn.GRU(512 + 64, hidden)
        self.actor, self.critic = nn.Linear(hidden, n_actions), nn.Linear(hidden, 1)

    def core(self, obs, h, prev_a, masks):
        x = torch.cat([obs["rgb"].float() / 255.0, obs["depth"]], -1).permute(0, 3, 1, 2)
        g = obs["pointgoal_with_gps_compass"]
        g = torch.stack([g[:, 0], g[:, 1].cos(), g[:, 1].sin()], -1)
        x = torch.cat([self.encoder(x), torch.relu(self.goal(g)),
                       self.prev_a(((prev_a + 1) * masks.long()).squeeze(-1))], -1)
        h = h.permute(1, 0, 2)
        n = h.shape[1]
        x, m = x.view(-1, n, x.shape[-1]), masks.view(-1, n, 1).float()
        outs = []
        for t in range(x.shape[0]):
            o, h = self.rnn(x[t:t + 1], h * m[t].unsqueeze(0))
            outs.append(o[0])
        return torch.stack(outs).flatten(0, 1), h.permute(1, 0, 2)

    def act(self, obs, h, prev_a, masks):
        f, h = self.core(obs, h, prev_a, masks)
        d = torch.distributions.Categorical(logits=self.actor(f))
        a = d.sample()
        return self.critic(f), a.unsqueeze(-1), d.log_prob(a).unsqueeze(-1), h

    def get_value(self, obs, h, prev_a, masks):
        return self.critic(self.core(obs, h, prev_a, masks)[0])

    def forward(self, obs, h, prev_a, masks, actions):
        f, _ = self.core(obs, h, prev_a, masks)
        d = torch.distributions.Categorical(logits=self.actor(f))
        return self.critic(f), d.log_prob(actions.squeeze(-1)).unsqueeze(-1), d.entropy().mean()


def worker(rank, world_size, port, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    store = dist.PrefixStore("rollout_tracker", dist.TCPStore("127.0.0.1", port + 1, world_size, rank == 0))
    store.set("num_done", "0")

    config = get_config(args.exp_config, args.opts)
    ppo = config.RL.PPO
    config.defrost()
    config.TORCH_GPU_ID = config.SIMULATOR_GPU_ID = rank
    config.TASK_CONFIG.SEED += rank * config.NUM_ENVIRONMENTS
    config.freeze()
    torch.manual_seed(config.TASK_CONFIG.SEED)

    policy = BNPointNavPolicy(4, ppo.hidden_size, args.encoder_ckpt)
    policy = nn.SyncBatchNorm.convert_sync_batchnorm(policy).to(device)
    ddp = nn.parallel.DistributedDataParallel(policy, device_ids=[rank], output_device=rank)
    optim = torch.optim.Adam(policy.parameters(), lr=ppo.lr, eps=ppo.eps)

    # envs come up after CUDA is initialised; construct_envs uses forkserver workers
    envs = construct_envs(config, get_env_class(config.ENV_NAME))
    rollouts = RolloutStorage(ppo.num_steps, envs.num_envs, envs.observation_spaces[0], envs.action_spaces[0],
                              ppo.hidden_size, num_recurrent_layers=1)
    rollouts.to(device)
    rollouts.buffers["observations"][0] = batch_obs(envs.reset(), device=device)
    ep_rew = torch.zeros(envs.num_envs, 1, device=device)
    window = deque(maxlen=ppo.reward_window_size)
    frames, t0 = 0, time.time()
    if rank == 0:
        os.makedirs(config.CHECKPOINT_FOLDER, exist_ok=True)

    for update in range(config.NUM_UPDATES):
        for g in optim.param_groups:
            g["lr"] = ppo.lr * (1 - update / config.NUM_UPDATES)
        # eval mode while acting: BN uses running stats, so no SyncBN collectives
        # happen during the (per-rank, preemptible) rollout
        policy.eval()
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
            if step + 1 >= 0.25 * ppo.num_steps and int(store.get("num_done")) >= args.sync_frac * world_size:
                break
        store.add("num_done", 1)

        T = rollouts.current_rollout_step_idx
        with torch.no_grad():
            b = rollouts.buffers[T]
            nv = policy.get_value(b["observations"], b["recurrent_hidden_states"], b["prev_actions"], b["masks"])
        rollouts.compute_returns(nv, ppo.use_gae, ppo.gamma, ppo.tau)
        adv = rollouts.buffers["returns"][:T] - rollouts.buffers["value_preds"][:T]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)

        policy.train()
        for _ in range(ppo.ppo_epoch):
            for mb in rollouts.recurrent_generator(adv, ppo.num_mini_batch):
                values, logp, ent = ddp(mb["observations"], mb["recurrent_hidden_states"], mb["prev_actions"],
                                        mb["masks"], mb["actions"])
                ratio = torch.exp(logp - mb["action_log_probs"])
                pg = -torch.min(ratio * mb["advantages"],
                                ratio.clamp(1 - ppo.clip_param, 1 + ppo.clip_param) * mb["advantages"]).mean()
                vl = 0.5 * (mb["returns"] - values).pow(2).mean()
                optim.zero_grad()
                (pg + ppo.value_loss_coef * vl - ppo.entropy_coef * ent).backward()
                nn.utils.clip_grad_norm_(policy.parameters(), ppo.max_grad_norm)
                optim.step()
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
                torch.save({"state_dict": policy.state_dict(), "config": config, "frames": frames},
                           os.path.join(config.CHECKPOINT_FOLDER,
                                        f"ckpt.{(update + 1) // config.CHECKPOINT_INTERVAL}.pth"))

    envs.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--exp-config", required=True)
    ap.add_argument("--encoder-ckpt", default="data/pretrained/gibson_bn_resnet18.pth")
    ap.add_argument("--sync-frac", type=float, default=0.6)
    ap.add_argument("opts", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    port = free_port()
    mp.spawn(worker, args=(args.gpus, port, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
