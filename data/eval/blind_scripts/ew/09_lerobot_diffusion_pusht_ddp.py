"""Multi-GPU version of LeRobot's diffusion-policy training example (lerobot/pusht).

    torchrun --nproc_per_node=4 09_lerobot_diffusion_pusht_ddp.py --output_dir outputs/train/diffusion_pusht_ddp
"""
import argparse
import datetime
import logging
import os
from pathlib import Path

import gymnasium as gym
import gym_pusht  # noqa: F401
import numpy as np
import torch
import torch.distributed as dist
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from lerobot.common.datasets.lerobot_dataset import LeRobotDataset
from lerobot.common.policies.diffusion.configuration_diffusion import DiffusionConfig
from lerobot.common.policies.diffusion.modeling_diffusion import DiffusionPolicy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
log = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--output_dir", type=Path, default=Path("outputs/train/diffusion_pusht_ddp"))
    ap.add_argument("--num_epochs", type=int, default=800)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup_steps", type=int, default=500)
    ap.add_argument("--num_workers", type=int, default=4)
    ap.add_argument("--ema_power", type=float, default=0.75)
    ap.add_argument("--eval_every", type=int, default=100, help="epochs")
    ap.add_argument("--eval_episodes", type=int, default=50)
    ap.add_argument("--seed", type=int, default=100000)
    return ap.parse_args()


@torch.no_grad()
def eval_pusht(policy, n_episodes, device, seed):
    env = gym.make("gym_pusht/PushT-v0", obs_type="pixels_agent_pos", max_episode_steps=300)
    policy.eval()
    max_rewards, successes = [], []
    for i in range(n_episodes):
        policy.reset()
        obs, _ = env.reset(seed=seed + i)
        done, best, success = False, 0.0, False
        while not done:
            state = torch.from_numpy(obs["agent_pos"]).float().unsqueeze(0).to(device)
            image = torch.from_numpy(obs["pixels"]).float().div(255).permute(2, 0, 1).unsqueeze(0).to(device)
            action = policy.select_action({"observation.state": state, "observation.image": image})
            obs, reward, terminated, truncated, info = env.step(action.squeeze(0).cpu().numpy())
            best = max(best, float(reward))
            success = success or bool(info.get("is_success", False))
            done = terminated or truncated
        max_rewards.append(best)
        successes.append(success)
    env.close()
    policy.train()
    return float(np.mean(max_rewards)), float(np.mean(successes))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    if rank != 0:
        log.setLevel(logging.WARNING)

    delta_timestamps = {
        "observation.image": [-0.1, 0.0],
        "observation.state": [-0.1, 0.0],
        "action": [-0.1, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4],
    }
    if rank == 0:
        LeRobotDataset("lerobot/pusht")  # download into the HF cache once
    dist.barrier()
    dataset = LeRobotDataset("lerobot/pusht", delta_timestamps=delta_timestamps)

    cfg = DiffusionConfig()
    policy = DiffusionPolicy(cfg, dataset_stats=dataset.meta.stats).to(device)
    policy.train()
    ema_policy = DiffusionPolicy(cfg, dataset_stats=dataset.meta.stats).to(device)
    ema_policy.load_state_dict(policy.state_dict())
    ema_policy.requires_grad_(False)
    ema = EMAModel(ema_policy.parameters(), power=args.ema_power)

    ddp_policy = DDP(policy, device_ids=[local_rank])

    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    dataloader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
        pin_memory=True, drop_last=True, persistent_workers=True,
    )

    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr, betas=(0.95, 0.999), eps=1e-8, weight_decay=1e-6)
    steps_per_epoch = len(dataset) // args.batch_size
    lr_scheduler = get_scheduler(
        "cosine", optimizer=optimizer, num_warmup_steps=args.warmup_steps,
        num_training_steps=args.num_epochs * steps_per_epoch,
    )

    if rank == 0:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"{dataset.num_episodes} episodes, {dataset.num_frames} frames, world size {world_size}")

    step = 0
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros(2, device=device)
        for batch in dataloader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
            output_dict = ddp_policy(batch)
            loss = output_dict["loss"]
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 10.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr_scheduler.step()
            ema.step(policy.parameters())
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1
            if step % 250 == 0:
                stats = torch.stack([loss.detach(), grad_norm.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                log.info(f"step {step} loss {stats[0]:.4f} grad_norm {stats[1]:.3f} lr {lr_scheduler.get_last_lr()[0]:.2e}")

        dist.all_reduce(loss_sum)
        log.info(f"epoch {epoch} mean loss {(loss_sum[0] / loss_sum[1]).item():.4f}")

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.num_epochs:
            if rank == 0:
                ema.copy_to(ema_policy.parameters())
                avg_max_reward, pc_success = eval_pusht(ema_policy, args.eval_episodes, device, args.seed)
                log.info(f"epoch {epoch}: avg max reward {avg_max_reward:.3f}, success {pc_success:.1%}")
                ckpt_dir = args.output_dir / f"epoch_{epoch + 1:04d}"
                ema_policy.save_pretrained(ckpt_dir)
                torch.save({"optimizer": optimizer.state_dict(), "lr_scheduler": lr_scheduler.state_dict(),
                            "ema": ema.state_dict(), "policy": policy.state_dict(), "epoch": epoch, "step": step},
                           ckpt_dir / "training_state.pt")
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
