"""DD-PPO PointNav with an inverse-dynamics auxiliary loss, for preemptible Slurm queues.

Started directly by srun (one task per GPU), no torchrun:

    #SBATCH --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=10
    #SBATCH --signal=USR1@300 --requeue
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)
    export MASTER_PORT=8738
    srun python -u ddppo_aux_slurm.py --exp-config configs/ddppo_pointnav_aux.yaml \
        CHECKPOINT_FOLDER /checkpoint/$USER/ddppo_aux
"""
import argparse
import os
import signal
import subprocess
import threading
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as distrib
import torch.nn as nn
import torch.nn.functional as F

from habitat import logger
from habitat_baselines.common.env_utils import construct_envs
from habitat_baselines.common.environments import get_env_class
from habitat_baselines.common.rollout_storage import RolloutStorage
from habitat_baselines.config.default import get_config
from habitat_baselines.rl.ddppo.policy import PointNavResNetPolicy
from habitat_baselines.utils.common import batch_obs

INTERRUPTED = threading.Event()
REQUEUE = threading.Event()


def _on_usr1(signum, frame):
    INTERRUPTED.set()
    REQUEUE.set()


def _on_term(signum, frame):
    INTERRUPTED.set()


def init_distrib_slurm(backend="nccl"):
    local_rank = int(os.environ["SLURM_LOCALID"])
    world_rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    master_addr = os.environ["MASTER_ADDR"]
    master_port = int(os.environ.get("MASTER_PORT", 8738))
    torch.cuda.set_device(local_rank)
    tcp_store = distrib.TCPStore(master_addr, master_port, world_size, world_rank == 0)
    distrib.init_process_group(backend, store=tcp_store, rank=world_rank, world_size=world_size)
    return local_rank, world_rank, world_size, tcp_store


class InverseDynamicsHead(nn.Module):
    """Predicts a_t from (h_t, h_{t+1}); only trained on every `aux_every`-th update."""

    def __init__(self, hidden, num_actions):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * hidden, 256), nn.ReLU(True), nn.Linear(256, num_actions))

    def forward(self, feats, actions, masks, n_envs):
        f = feats.view(-1, n_envs, feats.shape[-1])
        a = actions.view(-1, n_envs)
        valid = masks.view(-1, n_envs)[1:].float()
        logits = self.mlp(torch.cat([f[:-1], f[1:]], -1))
        ce = F.cross_entropy(logits.flatten(0, 1), a[:-1].flatten(), reduction="none")
        return (ce * valid.flatten()).sum() / valid.sum().clamp(min=1.0)


class PolicyWithAux(nn.Module):
    def __init__(self, policy, num_actions):
        super().__init__()
        self.policy = policy
        self.inv_dyn = InverseDynamicsHead(policy.net.output_size, num_actions)

    def forward(self, obs, rnn, prev_actions, masks, actions, n_envs, use_aux):
        feats, _ = self.policy.net(obs, rnn, prev_actions, masks)
        distribution = self.policy.action_distribution(feats)
        values = self.policy.critic(feats)
        log_probs = distribution.log_probs(actions)
        entropy = distribution.entropy().mean()
        aux = self.inv_dyn(feats, actions, masks, n_envs) if use_aux else feats.new_zeros(())
        return values, log_probs, entropy, aux


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--exp-config", required=True)
    parser.add_argument("opts", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    config = get_config(args.exp_config, args.opts)
    ppo, ddppo = config.RL.PPO, config.RL.DDPPO

    signal.signal(signal.SIGUSR1, _on_usr1)
    signal.signal(signal.SIGTERM, _on_term)
    local_rank, rank, world, tcp_store = init_distrib_slurm(ddppo.distrib_backend)
    device = torch.device("cuda", local_rank)
    done_store = distrib.PrefixStore("rollout_tracker", tcp_store)
    done_store.set("num_done", "0")

    config.defrost()
    config.TORCH_GPU_ID = local_rank
    config.SIMULATOR_GPU_ID = local_rank
    config.TASK_CONFIG.SEED += rank * config.NUM_ENVIRONMENTS
    config.freeze()
    torch.manual_seed(config.TASK_CONFIG.SEED)
    np.random.seed(config.TASK_CONFIG.SEED)

    envs = construct_envs(config, get_env_class(config.ENV_NAME))
    n_act = envs.action_spaces[0].n
    policy = PointNavResNetPolicy.from_config(config, envs.observation_spaces[0], envs.action_spaces[0])
    model = PolicyWithAux(policy, n_act).to(device)
    # the inverse-dynamics head is skipped on most updates
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank,
                                              find_unused_parameters=True)
    optim = torch.optim.Adam(model.parameters(), lr=ppo.lr, eps=ppo.eps)

    state_path = os.path.join(config.CHECKPOINT_FOLDER, ".requeue_state.pth")
    start_update, count_steps = 0, 0
    if os.path.exists(state_path):
        st = torch.load(state_path, map_location="cpu")
        model.load_state_dict(st["model"])
        optim.load_state_dict(st["optim"])
        start_update, count_steps = st["update"], st["count_steps"]
        if rank == 0:
            logger.info(f"resumed from update {start_update}")

    rollouts = RolloutStorage(ppo.num_steps, envs.num_envs, envs.observation_spaces[0], envs.action_spaces[0],
                              ppo.hidden_size, num_recurrent_layers=policy.net.num_recurrent_layers)
    rollouts.to(device)
    rollouts.buffers["observations"][0] = batch_obs(envs.reset(), device=device)
    ep_rew = torch.zeros(envs.num_envs, 1, device=device)
    window = deque(maxlen=ppo.reward_window_size)
    t0 = time.time()

    for update in range(start_update, config.NUM_UPDATES):
        for g in optim.param_groups:
            g["lr"] = ppo.lr * (1 - update / config.NUM_UPDATES)
        for step in range(ppo.num_steps):
            i = rollouts.current_rollout_step_idx
            with torch.no_grad():
                b = rollouts.buffers[i]
                values, actions, logp, rnn = policy.act(b["observations"], b["recurrent_hidden_states"],
                                                        b["prev_actions"], b["masks"])
            obs, rews, dones, infos = [list(x) for x in zip(*envs.step([a.item() for a in actions.cpu()]))]
            rews_t = torch.tensor(rews, dtype=torch.float, device=device).unsqueeze(1)
            not_done = torch.tensor([[not d] for d in dones], dtype=torch.bool, device=device)
            ep_rew += rews_t
            for j, d in enumerate(dones):
                if d:
                    window.append((ep_rew[j].item(), infos[j]["success"], infos[j]["spl"]))
            ep_rew.masked_fill_(~not_done, 0.0)
            rollouts.insert(next_observations=batch_obs(obs, device=device), rewards=rews_t, next_masks=not_done,
                            actions=actions, action_log_probs=logp, value_preds=values,
                            next_recurrent_hidden_states=rnn)
            rollouts.advance_rollout()
            if step + 1 >= ppo.num_steps * 0.25 and int(done_store.get("num_done")) >= ddppo.sync_frac * world:
                break
        done_store.add("num_done", 1)

        T = rollouts.current_rollout_step_idx
        with torch.no_grad():
            b = rollouts.buffers[T]
            next_value = policy.get_value(b["observations"], b["recurrent_hidden_states"], b["prev_actions"],
                                          b["masks"])
        rollouts.compute_returns(next_value, ppo.use_gae, ppo.gamma, ppo.tau)
        adv = rollouts.buffers["returns"][:T] - rollouts.buffers["value_preds"][:T]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)
        use_aux = update % config.RL.AUX.every == 0
        for _ in range(ppo.ppo_epoch):
            for mb in rollouts.recurrent_generator(adv, ppo.num_mini_batch):
                v, lp, ent, aux = ddp(mb["observations"], mb["recurrent_hidden_states"], mb["prev_actions"],
                                      mb["masks"], mb["actions"], envs.num_envs // ppo.num_mini_batch, use_aux)
                ratio = torch.exp(lp - mb["action_log_probs"])
                pg = -torch.min(ratio * mb["advantages"],
                                ratio.clamp(1 - ppo.clip_param, 1 + ppo.clip_param) * mb["advantages"]).mean()
                vl = 0.5 * (mb["returns"] - v).pow(2).mean()
                loss = pg + ppo.value_loss_coef * vl - ppo.entropy_coef * ent + config.RL.AUX.coef * aux
                optim.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), ppo.max_grad_norm)
                optim.step()
        rollouts.after_update()

        w = np.array(window, dtype=np.float64).reshape(-1, 3)
        stats = torch.tensor([T * envs.num_envs, *w.sum(0), len(w), float(INTERRUPTED.is_set()),
                              float(REQUEUE.is_set())], dtype=torch.float64, device=device)
        distrib.all_reduce(stats)
        if rank == 0:
            done_store.set("num_done", "0")
        count_steps += int(stats[0].item())

        if rank == 0 and update % config.LOG_INTERVAL == 0:
            n = max(stats[4].item(), 1.0)
            logger.info(f"update {update} frames {count_steps} fps {count_steps / (time.time() - t0):.0f} "
                        f"reward {stats[1] / n:.3f} success {stats[2] / n:.3f} spl {stats[3] / n:.3f}")
        interrupted, requeue = stats[5].item() > 0, stats[6].item() > 0
        if interrupted or (update + 1) % config.CHECKPOINT_INTERVAL == 0:
            if rank == 0:
                os.makedirs(config.CHECKPOINT_FOLDER, exist_ok=True)
                tmp = state_path + ".tmp"
                torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "update": update + 1,
                            "count_steps": count_steps}, tmp)
                os.replace(tmp, state_path)
                if not interrupted:
                    torch.save({"state_dict": policy.state_dict(), "config": config},
                               os.path.join(config.CHECKPOINT_FOLDER, f"ckpt.{update + 1}.pth"))
            distrib.barrier()
        if interrupted:
            if rank == 0 and requeue:
                subprocess.check_call(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]])
            break

    envs.close()
    distrib.destroy_process_group()


if __name__ == "__main__":
    main()
