"""PointNav DD-PPO with a depth-reconstruction auxiliary task (Hydra config).

The decoder is expensive, so the reconstruction loss is only added every
`aux.every` PPO updates.

    torchrun --nproc_per_node=8 train_aux.py aux.every=4 aux.coef=0.1 ppo.num_envs=6
"""
import logging
import os
import time
from collections import deque

import hydra
from hydra.core.hydra_config import HydraConfig
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP

import habitat
from habitat.config import read_write
from habitat.config.default import get_config as get_habitat_config
from habitat.gym import make_gym_from_config

log = logging.getLogger(__name__)


def make_env(habitat_cfg, seed):
    env = make_gym_from_config(habitat_cfg)
    env.seed(seed)
    return env


class Encoder(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, 4, 2, 1), nn.GroupNorm(8, 32), nn.ReLU(True),
            nn.Conv2d(32, 64, 4, 2, 1), nn.GroupNorm(8, 64), nn.ReLU(True),
            nn.Conv2d(64, 128, 4, 2, 1), nn.GroupNorm(16, 128), nn.ReLU(True),
            nn.Conv2d(128, 128, 4, 2, 1), nn.GroupNorm(16, 128), nn.ReLU(True))
        self.fc = nn.Linear(128 * 8 * 8, hidden)

    def forward(self, depth):
        z = self.conv(depth)
        return F.relu(self.fc(z.flatten(1))), z


class DepthDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(128, 128, 4, 2, 1), nn.ReLU(True), nn.ConvTranspose2d(128, 64, 4, 2, 1), nn.ReLU(True),
            nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(True), nn.ConvTranspose2d(32, 1, 4, 2, 1))

    def forward(self, z):
        return torch.sigmoid(self.net(z))


class NavAgent(nn.Module):
    def __init__(self, hidden=512, n_actions=4):
        super().__init__()
        self.encoder = Encoder(hidden)
        self.decoder = DepthDecoder()
        self.goal_fc = nn.Linear(3, 32)
        self.prev_a = nn.Embedding(n_actions + 1, 32)
        self.gru = nn.GRUCell(hidden + 64, hidden)
        self.pi = nn.Linear(hidden, n_actions)
        self.v = nn.Linear(hidden, 1)

    def step(self, depth, goal, prev_a, h, mask):
        e, _ = self.encoder(depth.permute(0, 3, 1, 2))
        g = F.relu(self.goal_fc(torch.stack([goal[:, 0], goal[:, 1].cos(), goal[:, 1].sin()], -1)))
        x = torch.cat([e, g, self.prev_a((prev_a + 1) * mask.long())], -1)
        h = self.gru(x, h * mask.unsqueeze(-1))
        return h

    def forward(self, depth, goal, prev_a, h0, masks, actions, with_aux):
        # depth etc: (T, n, ...); replays the GRU over the rollout
        T = depth.shape[0]
        d_flat = depth.flatten(0, 1).permute(0, 3, 1, 2)
        e, z = self.encoder(d_flat)
        e = e.view(T, -1, e.shape[-1])
        g = F.relu(self.goal_fc(torch.stack([goal[..., 0], goal[..., 1].cos(), goal[..., 1].sin()], -1)))
        x = torch.cat([e, g, self.prev_a((prev_a + 1) * masks.long())], -1)
        h, hs = h0, []
        for t in range(T):
            h = self.gru(x[t], h * masks[t].unsqueeze(-1))
            hs.append(h)
        hs = torch.stack(hs).flatten(0, 1)
        dist_ = torch.distributions.Categorical(logits=self.pi(hs))
        aux = F.l1_loss(self.decoder(z), F.interpolate(d_flat, size=(128, 128))) if with_aux else hs.new_zeros(())
        return self.v(hs).squeeze(-1), dist_.log_prob(actions.flatten()), dist_.entropy().mean(), aux


@hydra.main(config_path="conf", config_name="pointnav_aux", version_base=None)
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    if rank == 0:
        log.info("\n" + OmegaConf.to_yaml(cfg))
    torch.manual_seed(cfg.seed)

    hcfg = get_habitat_config(cfg.habitat_config)
    with read_write(hcfg):
        hcfg.habitat.simulator.habitat_sim_v0.gpu_device_id = local_rank
    N, T = cfg.ppo.num_envs, cfg.ppo.num_steps
    envs = habitat.VectorEnv(make_env_fn=make_env,
                             env_fn_args=[(hcfg, cfg.seed + rank * N + i) for i in range(N)])

    agent = NavAgent(cfg.model.hidden, envs.action_spaces[0].n).to(dev)
    model = DDP(agent, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(agent.parameters(), lr=cfg.ppo.lr, eps=1e-5)
    tracker = dist.PrefixStore("tracker", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, rank == 0))
    tracker.set("num_done", "0")

    obs = envs.reset()
    depth = torch.as_tensor(np.stack([o["depth"] for o in obs]), device=dev)
    goal = torch.as_tensor(np.stack([o["pointgoal_with_gps_compass"] for o in obs]), device=dev)
    S = dict(depth=torch.zeros(T + 1, *depth.shape, device=dev), goal=torch.zeros(T + 1, N, 2, device=dev),
             prev_a=torch.zeros(T + 1, N, dtype=torch.long, device=dev), mask=torch.zeros(T + 1, N, device=dev),
             a=torch.zeros(T, N, dtype=torch.long, device=dev), lp=torch.zeros(T, N, device=dev),
             v=torch.zeros(T + 1, N, device=dev), r=torch.zeros(T, N, device=dev),
             h=torch.zeros(T + 1, N, cfg.model.hidden, device=dev))
    S["depth"][0], S["goal"][0] = depth, goal
    win = deque(maxlen=100)
    ep_r = np.zeros(N)
    frames, t0 = 0, time.time()
    out_dir = HydraConfig.get().runtime.output_dir

    for update in range(cfg.ppo.num_updates):
        for g in opt.param_groups:
            g["lr"] = cfg.ppo.lr * (1 - update / cfg.ppo.num_updates)
        L = 0
        for t in range(T):
            with torch.no_grad():
                h = agent.step(S["depth"][t], S["goal"][t], S["prev_a"][t], S["h"][t], S["mask"][t])
                d_ = torch.distributions.Categorical(logits=agent.pi(h))
                a = d_.sample()
                S["a"][t], S["lp"][t], S["v"][t] = a, d_.log_prob(a), agent.v(h).squeeze(-1)
            outs = envs.step(a.tolist())
            obs, rew, done, info = [list(x) for x in zip(*outs)]
            ep_r += rew
            for i in np.flatnonzero(done):
                win.append((ep_r[i], info[i]["success"], info[i]["spl"]))
                ep_r[i] = 0
            S["depth"][t + 1] = torch.as_tensor(np.stack([o["depth"] for o in obs]), device=dev)
            S["goal"][t + 1] = torch.as_tensor(np.stack([o["pointgoal_with_gps_compass"] for o in obs]), device=dev)
            S["prev_a"][t + 1], S["h"][t + 1] = a, h
            S["mask"][t + 1] = torch.as_tensor(~np.asarray(done), dtype=torch.float, device=dev)
            S["r"][t] = torch.as_tensor(rew, dtype=torch.float, device=dev)
            L = t + 1
            if L >= T // 4 and int(tracker.get("num_done")) >= cfg.ddppo.sync_frac * world:
                break
        tracker.add("num_done", 1)

        with torch.no_grad():
            hL = agent.step(S["depth"][L], S["goal"][L], S["prev_a"][L], S["h"][L], S["mask"][L])
            S["v"][L] = agent.v(hL).squeeze(-1)
        adv, gae = torch.zeros(L, N, device=dev), torch.zeros(N, device=dev)
        for t in reversed(range(L)):
            delta = S["r"][t] + cfg.ppo.gamma * S["v"][t + 1] * S["mask"][t + 1] - S["v"][t]
            gae = delta + cfg.ppo.gamma * cfg.ppo.tau * S["mask"][t + 1] * gae
            adv[t] = gae
        ret = adv + S["v"][:L]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)

        with_aux = cfg.aux.coef > 0 and update % cfg.aux.every == 0
        per = N // cfg.ppo.num_mini_batch
        for _ in range(cfg.ppo.ppo_epoch):
            perm = torch.randperm(N, device=dev)
            for j in range(cfg.ppo.num_mini_batch):
                idx = perm[j * per:(j + 1) * per]
                v, lp, ent, aux = model(S["depth"][:L, idx], S["goal"][:L, idx], S["prev_a"][:L, idx], S["h"][0, idx],
                                        S["mask"][:L, idx], S["a"][:L, idx], with_aux)
                ratio = (lp - S["lp"][:L, idx].flatten()).exp()
                mb_adv = adv[:, idx].flatten()
                pg = -torch.min(ratio * mb_adv, ratio.clamp(1 - cfg.ppo.clip, 1 + cfg.ppo.clip) * mb_adv).mean()
                vl = 0.5 * (ret[:, idx].flatten() - v).pow(2).mean()
                loss = pg + cfg.ppo.value_coef * vl - cfg.ppo.entropy_coef * ent + cfg.aux.coef * aux
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), cfg.ppo.max_grad_norm)
                opt.step()
        for k in ("depth", "goal", "prev_a", "mask", "h"):
            S[k][0] = S[k][L]

        w = np.asarray(win, dtype=np.float64).reshape(-1, 3)
        s = torch.tensor([L * N, len(w), *w.sum(0), aux.item()], dtype=torch.float64, device=dev)
        dist.all_reduce(s)
        frames += int(s[0].item())
        if rank == 0:
            tracker.set("num_done", "0")
        if rank == 0 and update % cfg.log_interval == 0:
            n = max(s[1].item(), 1)
            log.info(f"upd {update} frames {frames} fps {frames / (time.time() - t0):.0f} ret {s[2] / n:.2f} "
                     f"succ {s[3] / n:.3f} spl {s[4] / n:.3f} aux {s[5] / world:.4f}")
        if rank == 0 and (update + 1) % cfg.checkpoint_interval == 0:
            torch.save({"agent": agent.state_dict(), "opt": opt.state_dict(), "update": update + 1, "frames": frames},
                       os.path.join(out_dir, f"ckpt_{update + 1:06d}.pt"))

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
