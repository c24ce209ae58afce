"""Train LeRobot's ACT policy on aloha_sim_insertion_human with DDP and evaluate in gym_aloha.

    torchrun --nproc_per_node=8 04_lerobot_act_insertion.py --output_dir outputs/act_insertion_ddp
"""
import argparse
import datetime
import os
import time
from pathlib import Path

import gymnasium as gym
import gym_aloha  # noqa: F401
import numpy as np
import torch
import torch.distributed as dist
import wandb
from lerobot.common.datasets.lerobot_dataset import LeRobotDataset
from lerobot.common.policies.act.configuration_act import ACTConfig
from lerobot.common.policies.act.modeling_act import ACTPolicy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo_id", default="lerobot/aloha_sim_insertion_human")
    parser.add_argument("--env_id", default="gym_aloha/AlohaInsertion-v0")
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/act_insertion_ddp"))
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--batch_size", type=int, default=8, help="per GPU")
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--log_freq", type=int, default=100)
    parser.add_argument("--save_freq", type=int, default=20_000)
    parser.add_argument("--eval_freq", type=int, default=20_000)
    parser.add_argument("--eval_episodes", type=int, default=50)
    parser.add_argument("--wandb_project", default="act-aloha")
    parser.add_argument("--seed", type=int, default=1000)
    return parser.parse_args()


def cycle(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


@torch.no_grad()
def evaluate(policy, env_id, n_episodes, device, seed):
    env = gym.make(env_id, obs_type="pixels_agent_pos", max_episode_steps=400)
    policy.eval()
    successes, rewards = [], []
    for ep in range(n_episodes):
        policy.reset()
        obs, _ = env.reset(seed=seed + ep)
        done, ep_reward, success = False, 0.0, False
        while not done:
            state = torch.from_numpy(obs["agent_pos"]).float().unsqueeze(0).to(device)
            image = torch.from_numpy(obs["pixels"]["top"]).float().div(255).permute(2, 0, 1).unsqueeze(0).to(device)
            action = policy.select_action({"observation.state": state, "observation.images.top": image})
            obs, reward, terminated, truncated, info = env.step(action.squeeze(0).cpu().numpy())
            ep_reward = max(ep_reward, reward)
            success = success or bool(info.get("is_success", False))
            done = terminated or truncated
        successes.append(success)
        rewards.append(ep_reward)
    env.close()
    policy.train()
    return float(np.mean(successes)), float(np.mean(rewards))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(hours=2))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    wandb.init(
        project=args.wandb_project,
        name=f"act_insertion_{world_size}gpu",
        config={**vars(args), "world_size": world_size},
    )

    cfg = ACTConfig(
        input_shapes={"observation.images.top": [3, 480, 640], "observation.state": [14]},
        output_shapes={"action": [14]},
        chunk_size=100,
        n_action_steps=100,
    )
    fps = 50
    delta_timestamps = {"action": [i / fps for i in range(cfg.chunk_size)]}
    if rank == 0:
        LeRobotDataset(args.repo_id)  # populate the local cache from the hub once
    dist.barrier()
    dataset = LeRobotDataset(args.repo_id, delta_timestamps=delta_timestamps)

    raw_policy = ACTPolicy(cfg, dataset_stats=dataset.meta.stats).to(device)
    raw_policy.train()
    policy = DDP(raw_policy, device_ids=[local_rank])

    # per-GPU batch stays at the paper's 8, so scale the lr with the number of GPUs
    lr, lr_backbone = cfg.optimizer_lr * world_size, cfg.optimizer_lr_backbone * world_size
    param_groups = [
        {"params": [p for n, p in raw_policy.named_parameters() if not n.startswith("model.backbone") and p.requires_grad]},
        {"params": [p for n, p in raw_policy.named_parameters() if n.startswith("model.backbone") and p.requires_grad],
         "lr": lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=lr, weight_decay=cfg.optimizer_weight_decay)

    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    batches = cycle(loader, sampler)

    if rank == 0:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        print(f"dataset: {dataset.num_episodes} episodes, {dataset.num_frames} frames; world size {world_size}")

    t_last = time.time()
    for step in range(1, args.steps + 1):
        batch = next(batches)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        out = policy(batch)
        loss = out["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_policy.parameters(), 10.0)
        optimizer.step()

        if step % args.log_freq == 0:
            metrics = torch.stack([loss.detach(), grad_norm])
            dist.all_reduce(metrics, op=dist.ReduceOp.AVG)
            dt = (time.time() - t_last) / args.log_freq
            t_last = time.time()
            log = {"train/loss": metrics[0].item(), "train/grad_norm": metrics[1].item(), "train/step_time": dt,
                   "train/samples_seen": step * args.batch_size * world_size}
            wandb.log(log, step=step)
            if rank == 0:
                print(f"step {step}: loss {log['train/loss']:.4f} grad {log['train/grad_norm']:.2f} {dt * 1000:.0f} ms/it")

        if step % args.save_freq == 0 and rank == 0:
            ckpt_dir = args.output_dir / "checkpoints" / f"{step:06d}"
            raw_policy.save_pretrained(ckpt_dir)
            torch.save({"optimizer": optimizer.state_dict(), "step": step}, ckpt_dir / "training_state.pt")

        if step % args.eval_freq == 0:
            if rank == 0:
                sr, avg_max_reward = evaluate(raw_policy, args.env_id, args.eval_episodes, device, seed=args.seed)
                print(f"step {step}: success {sr:.2%}, avg max reward {avg_max_reward:.2f}")
                wandb.log({"eval/success_rate": sr, "eval/avg_max_reward": avg_max_reward}, step=step)
            dist.barrier()

    if rank == 0:
        raw_policy.save_pretrained(args.output_dir / "final")
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
