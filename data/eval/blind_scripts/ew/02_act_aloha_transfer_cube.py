"""ACT (Action Chunking with Transformers) on ALOHA sim episodes, multi-GPU.

Episodes are the scripted/human demos in the original ACT layout:
    <dataset_dir>/episode_<i>.hdf5 with /observations/qpos, /observations/images/<cam>, /action

Usage:
    torchrun --nproc_per_node=4 02_act_aloha_transfer_cube.py \
        --dataset_dir data/sim_transfer_cube_scripted --ckpt_dir ckpt/act_transfer_cube
"""
import argparse
import contextlib
import glob
import os

import gymnasium as gym
import gym_aloha  # noqa: F401  (registers gym_aloha/* envs)
import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops.misc import FrozenBatchNorm2d

os.environ.setdefault("MUJOCO_GL", "egl")

parser = argparse.ArgumentParser()
parser.add_argument("--dataset_dir", required=True)
parser.add_argument("--ckpt_dir", required=True)
parser.add_argument("--camera_names", nargs="+", default=["top"])
parser.add_argument("--env_id", default="gym_aloha/AlohaTransferCube-v0")
parser.add_argument("--chunk_size", type=int, default=100)
parser.add_argument("--hidden_dim", type=int, default=512)
parser.add_argument("--kl_weight", type=float, default=10.0)
parser.add_argument("--global_batch_size", type=int, default=64, help="samples per optimizer step, all GPUs")
parser.add_argument("--batch_size", type=int, default=8, help="per-GPU micro batch")
parser.add_argument("--lr", type=float, default=4e-5)
parser.add_argument("--lr_backbone", type=float, default=4e-5)
parser.add_argument("--num_epochs", type=int, default=2000)
parser.add_argument("--samples_per_episode", type=int, default=8)
parser.add_argument("--eval_every", type=int, default=500)
parser.add_argument("--num_rollouts", type=int, default=50)
parser.add_argument("--val_ratio", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--resume", default="")


# ----------------------------------------------------------------------------- data
def get_norm_stats(files):
    qpos, action = [], []
    for fn in files:
        with h5py.File(fn, "r") as f:
            qpos.append(f["/observations/qpos"][()])
            action.append(f["/action"][()])
    qpos, action = np.concatenate(qpos), np.concatenate(action)
    return {
        "qpos_mean": qpos.mean(0), "qpos_std": np.clip(qpos.std(0), 1e-2, None),
        "action_mean": action.mean(0), "action_std": np.clip(action.std(0), 1e-2, None),
    }


class EpisodicDataset(Dataset):
    def __init__(self, files, camera_names, stats, chunk_size, samples_per_episode=1):
        self.files, self.camera_names, self.stats = files, camera_names, stats
        self.chunk_size, self.samples_per_episode = chunk_size, samples_per_episode

    def __len__(self):
        return len(self.files) * self.samples_per_episode

    def __getitem__(self, index):
        fn = self.files[index % len(self.files)]
        with h5py.File(fn, "r") as f:
            ep_len = f["/action"].shape[0]
            start = int(torch.randint(0, ep_len, (1,)))
            qpos = f["/observations/qpos"][start]
            images = np.stack([f[f"/observations/images/{c}"][start] for c in self.camera_names])
            action = f["/action"][start:start + self.chunk_size]
        padded = np.zeros((self.chunk_size, action.shape[1]), dtype=np.float32)
        padded[: len(action)] = action
        is_pad = np.zeros(self.chunk_size, dtype=bool)
        is_pad[len(action):] = True
        s = self.stats
        return {
            "qpos": torch.from_numpy((qpos - s["qpos_mean"]) / s["qpos_std"]).float(),
            "image": torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0,
            "action": torch.from_numpy((padded - s["action_mean"]) / s["action_std"]).float(),
            "is_pad": torch.from_numpy(is_pad),
        }


# ---------------------------------------------------------------------------- model
def sinusoid_table(n_pos, dim):
    pos = np.arange(n_pos)[:, None]
    div = np.power(10000, 2 * (np.arange(dim) // 2) / dim)
    table = pos / div
    table[:, 0::2], table[:, 1::2] = np.sin(table[:, 0::2]), np.cos(table[:, 1::2])
    return torch.from_numpy(table).float().unsqueeze(0)


class ACT(nn.Module):
    def __init__(self, n_cams, state_dim=14, action_dim=14, chunk_size=100, hidden_dim=512,
                 latent_dim=32, nheads=8, enc_layers=4, dec_layers=7, dim_ff=3200, feat_hw=(15, 20)):
        super().__init__()
        self.latent_dim = latent_dim
        resnet = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(resnet.children())[:-2])
        self.input_proj = nn.Conv2d(512, hidden_dim, 1)
        self.register_buffer("img_mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("img_std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
        self.img_pos = nn.Parameter(torch.randn(1, n_cams * feat_hw[0] * feat_hw[1], hidden_dim) * 0.02)
        self.transformer = nn.Transformer(hidden_dim, nheads, enc_layers, dec_layers, dim_ff, 0.1, batch_first=True)
        # CVAE encoder over [CLS, qpos, action chunk]
        enc_layer = nn.TransformerEncoderLayer(hidden_dim, nheads, dim_ff, 0.1, batch_first=True)
        self.vae_encoder = nn.TransformerEncoder(enc_layer, num_layers=4)
        self.cls_embed = nn.Embedding(1, hidden_dim)
        self.encoder_joint_proj = nn.Linear(state_dim, hidden_dim)
        self.encoder_action_proj = nn.Linear(action_dim, hidden_dim)
        self.latent_proj = nn.Linear(hidden_dim, latent_dim * 2)
        self.register_buffer("vae_pos", sinusoid_table(2 + chunk_size, hidden_dim))
        self.latent_out_proj = nn.Linear(latent_dim, hidden_dim)
        self.input_proprio_proj = nn.Linear(state_dim, hidden_dim)
        self.additional_pos_embed = nn.Embedding(2, hidden_dim)
        self.query_embed = nn.Embedding(chunk_size, hidden_dim)
        self.action_head = nn.Linear(hidden_dim, action_dim)

    def forward(self, qpos, image, actions=None, is_pad=None):
        B = qpos.shape[0]
        if actions is not None:
            tokens = torch.cat([
                self.cls_embed.weight.expand(B, 1, -1),
                self.encoder_joint_proj(qpos).unsqueeze(1),
                self.encoder_action_proj(actions),
            ], dim=1) + self.vae_pos
            pad = torch.cat([torch.zeros(B, 2, dtype=torch.bool, device=qpos.device), is_pad], dim=1)
            h = self.vae_encoder(tokens, src_key_padding_mask=pad)[:, 0]
            mu, logvar = self.latent_proj(h).chunk(2, dim=-1)
            z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        else:
            mu = logvar = None
            z = qpos.new_zeros(B, self.latent_dim)
        feats = []
        for i in range(image.shape[1]):
            x = (image[:, i] - self.img_mean) / self.img_std
            feats.append(self.input_proj(self.backbone(x)).flatten(2).transpose(1, 2))
        src = torch.cat([self.latent_out_proj(z).unsqueeze(1), self.input_proprio_proj(qpos).unsqueeze(1), *feats], 1)
        pos = torch.cat([self.additional_pos_embed.weight.expand(B, -1, -1), self.img_pos.expand(B, -1, -1)], 1)
        hs = self.transformer(src + pos, self.query_embed.weight.expand(B, -1, -1))
        return self.action_head(hs), mu, logvar


def act_loss(model, batch, kl_weight):
    a_hat, mu, logvar = model(batch["qpos"], batch["image"], batch["action"], batch["is_pad"])
    l1 = (F.l1_loss(a_hat, batch["action"], reduction="none") * ~batch["is_pad"].unsqueeze(-1)).mean()
    kl = (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp())).sum(-1).mean()
    return l1 + kl_weight * kl, l1.detach(), kl.detach()


# --------------------------------------------------------------------------- helpers
@torch.no_grad()
def evaluate_val(net, val_set, device, rank, world_size, kl_weight):
    """Each rank scores its own, non-overlapping slice of the validation samples."""
    net.eval()
    mine = Subset(val_set, list(range(rank, len(val_set), world_size)))
    totals = torch.zeros(2, device=device)  # [sum of l1, number of batches' samples]
    for batch in DataLoader(mine, batch_size=16, num_workers=2):
        batch = {k: v.to(device) for k, v in batch.items()}
        _, l1, _ = act_loss(net, batch, kl_weight)
        n = batch["qpos"].shape[0]
        totals += torch.stack([l1 * n, torch.tensor(float(n), device=device)])
    dist.all_reduce(totals)
    net.train()
    return (totals[0] / totals[1].clamp_min(1)).item()


@torch.no_grad()
def rollout(net, stats, args, device, rank, world_size, max_steps=400):
    """Rollouts are spread over the ranks; every rank takes every world_size-th seed."""
    net.eval()
    env = gym.make(args.env_id, obs_type="pixels_agent_pos")
    a_mean, a_std = (torch.as_tensor(stats[k], device=device).float() for k in ("action_mean", "action_std"))
    q_mean, q_std = (torch.as_tensor(stats[k], device=device).float() for k in ("qpos_mean", "qpos_std"))
    counts = torch.zeros(2, device=device)  # [successes, episodes]
    for ep in range(rank, args.num_rollouts, world_size):
        obs, _ = env.reset(seed=10_000 + ep)
        max_reward, chunk = 0.0, None
        for t in range(max_steps):
            if t % args.chunk_size == 0 or chunk is None:
                qpos = (torch.as_tensor(obs["agent_pos"], device=device).float() - q_mean) / q_std
                img = np.stack([obs["pixels"][c] for c in args.camera_names])
                img = torch.as_tensor(img, device=device).permute(0, 3, 1, 2).float().div(255).unsqueeze(0)
                a_hat, _, _ = net(qpos.unsqueeze(0), img)
                chunk = (a_hat[0] * a_std + a_mean).cpu().numpy()
            obs, reward, terminated, truncated, _ = env.step(chunk[t % args.chunk_size])
            max_reward = max(max_reward, reward)
            if terminated or truncated:
                break
        counts += torch.tensor([float(max_reward == env.unwrapped.task.max_reward), 1.0], device=device)
    env.close()
    dist.all_reduce(counts)
    net.train()
    return (counts[0] / counts[1]).item()


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed + rank)
    assert args.global_batch_size % (args.batch_size * world_size) == 0
    grad_accum = args.global_batch_size // (args.batch_size * world_size)

    files = sorted(glob.glob(os.path.join(args.dataset_dir, "episode_*.hdf5")))
    perm = np.random.default_rng(args.seed).permutation(len(files))
    n_val = max(1, int(len(files) * args.val_ratio))
    val_files = [files[i] for i in perm[:n_val]]
    train_files = [files[i] for i in perm[n_val:]]
    stats = get_norm_stats(train_files)

    train_set = EpisodicDataset(train_files, args.camera_names, stats, args.chunk_size, args.samples_per_episode)
    val_set = EpisodicDataset(val_files, args.camera_names, stats, args.chunk_size, 4)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, persistent_workers=True, drop_last=True)

    model = ACT(len(args.camera_names), chunk_size=args.chunk_size, hidden_dim=args.hidden_dim).to(device)
    param_groups = [
        {"params": [p for n, p in model.named_parameters() if not n.startswith("backbone")]},
        {"params": [p for n, p in model.named_parameters() if n.startswith("backbone")], "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, weight_decay=1e-4)
    start_epoch, best_val = 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_val = ckpt["epoch"] + 1, ckpt["best_val"]
    ddp_model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        torch.save(stats, os.path.join(args.ckpt_dir, "dataset_stats.pt"))

    for epoch in range(start_epoch, args.num_epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            boundary = (i + 1) % grad_accum == 0
            ctx = contextlib.nullcontext() if boundary else ddp_model.no_sync()
            with ctx:
                loss, l1, kl = act_loss(ddp_model, batch, args.kl_weight)
                (loss / grad_accum).backward()
            if boundary:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        train_log = torch.stack([loss.detach(), l1, kl])
        dist.all_reduce(train_log, op=dist.ReduceOp.AVG)
        val_l1 = evaluate_val(model, val_set, device, rank, world_size, args.kl_weight)
        if rank == 0:
            tl, tl1, tkl = train_log.tolist()
            print(f"epoch {epoch}: train loss {tl:.4f} (l1 {tl1:.4f} kl {tkl:.4f}) val l1 {val_l1:.4f}")
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "best_val": min(best_val, val_l1), "args": vars(args)}
            torch.save(state, os.path.join(args.ckpt_dir, "last.ckpt"))
            if val_l1 < best_val:
                torch.save(state, os.path.join(args.ckpt_dir, "policy_best.ckpt"))
        best_val = min(best_val, val_l1)

        if (epoch + 1) % args.eval_every == 0:
            success = rollout(model, stats, args, device, rank, world_size)
            if rank == 0:
                print(f"epoch {epoch}: success rate {success:.2%} over {args.num_rollouts} rollouts")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
