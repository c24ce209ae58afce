"""ACT-style action chunking policy for ALOHA sim tasks (insertion / transfer cube).

    torchrun --nproc_per_node=8 02_act_aloha_chunking.py --dataset_dir data/sim_transfer_cube_scripted --task sim_transfer_cube
"""
import argparse
import glob
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from sim_env import make_sim_env  # ALOHA sim (dm_control) from the act repo


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset_dir", required=True)
    ap.add_argument("--task", default="sim_transfer_cube")
    ap.add_argument("--ckpt_dir", default="ckpts/act")
    ap.add_argument("--chunk_size", type=int, default=100)
    ap.add_argument("--hidden_dim", type=int, default=512)
    ap.add_argument("--kl_weight", type=float, default=10.0)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--lr_backbone", type=float, default=1e-5)
    ap.add_argument("--num_epochs", type=int, default=2000)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--num_rollouts", type=int, default=48)
    ap.add_argument("--episode_len", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


CAMERAS = ["top"]


class EpisodicDataset(Dataset):
    def __init__(self, files, stats, chunk_size):
        self.files = files
        self.stats = stats
        self.chunk_size = chunk_size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with h5py.File(self.files[i], "r") as f:
            T = f["/action"].shape[0]
            t = np.random.randint(T)
            qpos = f["/observations/qpos"][t]
            imgs = np.stack([f[f"/observations/images/{c}"][t] for c in CAMERAS])
            action = f["/action"][t:]
        pad = np.zeros((self.chunk_size, action.shape[1]), np.float32)
        is_pad = np.ones(self.chunk_size, bool)
        n = min(len(action), self.chunk_size)
        pad[:n] = action[:n]
        is_pad[:n] = False
        qpos = (qpos - self.stats["qpos_mean"]) / self.stats["qpos_std"]
        pad = (pad - self.stats["action_mean"]) / self.stats["action_std"]
        imgs = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255.0
        return imgs, torch.from_numpy(qpos).float(), torch.from_numpy(pad).float(), torch.from_numpy(is_pad)


def compute_stats(files):
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


class ACTPolicy(nn.Module):
    def __init__(self, state_dim=14, hidden=512, chunk=100, latent=32):
        super().__init__()
        resnet = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(resnet.children())[:-2])
        self.input_proj = nn.Conv2d(512, hidden, 1)
        self.qpos_proj = nn.Linear(state_dim, hidden)
        self.latent_proj = nn.Linear(latent, hidden)
        self.latent_dim = latent
        # CVAE encoder over (cls, qpos, action sequence)
        self.enc_action = nn.Linear(state_dim, hidden)
        self.enc_qpos = nn.Linear(state_dim, hidden)
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(hidden, 8, 3200, batch_first=True), 4)
        self.latent_out = nn.Linear(hidden, 2 * latent)
        self.transformer = nn.Transformer(hidden, 8, 4, 7, 3200, batch_first=True)
        self.query = nn.Parameter(torch.randn(1, chunk, hidden) * 0.02)
        self.action_head = nn.Linear(hidden, state_dim)
        self.register_buffer("img_mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("img_std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def _memory(self, imgs, qpos, z):
        b, ncam = imgs.shape[:2]
        x = (imgs.flatten(0, 1) - self.img_mean) / self.img_std
        feat = self.input_proj(self.backbone(x))
        feat = feat.flatten(2).transpose(1, 2).reshape(b, -1, feat.shape[1])
        return torch.cat([self.latent_proj(z)[:, None], self.qpos_proj(qpos)[:, None], feat], dim=1)

    def forward(self, imgs, qpos, actions, is_pad):
        b = qpos.shape[0]
        tokens = torch.cat([self.cls.expand(b, -1, -1), self.enc_qpos(qpos)[:, None], self.enc_action(actions)], 1)
        pad_mask = torch.cat([torch.zeros(b, 2, dtype=torch.bool, device=qpos.device), is_pad], 1)
        h = self.enc(tokens, src_key_padding_mask=pad_mask)[:, 0]
        mu, logvar = self.latent_out(h).chunk(2, -1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        out = self.transformer(self._memory(imgs, qpos, z), self.query.expand(b, -1, -1))
        a_hat = self.action_head(out)
        l1 = (F.l1_loss(a_hat, actions, reduction="none") * ~is_pad[..., None]).mean()
        kl = (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp())).sum(-1).mean()
        return l1, kl

    @torch.no_grad()
    def predict_chunk(self, imgs, qpos):
        z = torch.zeros(qpos.shape[0], self.latent_dim, device=qpos.device)
        out = self.transformer(self._memory(imgs, qpos, z), self.query.expand(qpos.shape[0], -1, -1))
        return self.action_head(out)


def rollout(policy, stats, args, seed, device):
    env = make_sim_env(args.task)
    np.random.seed(seed)
    ts = env.reset()
    all_actions = torch.zeros(args.episode_len, args.episode_len + args.chunk_size, 14, device=device)
    rewards = []
    for t in range(args.episode_len):
        obs = ts.observation
        qpos = torch.from_numpy((obs["qpos"] - stats["qpos_mean"]) / stats["qpos_std"]).float()[None].to(device)
        imgs = np.stack([obs["images"][c] for c in CAMERAS])
        imgs = torch.from_numpy(imgs).permute(0, 3, 1, 2).float().div(255.0)[None].to(device)
        all_actions[t, t:t + args.chunk_size] = policy.predict_chunk(imgs, qpos)[0]
        # temporal ensembling over all chunks that cover step t
        cands = all_actions[:, t]
        cands = cands[cands.abs().sum(-1) != 0]
        w = torch.exp(-0.01 * torch.arange(len(cands), device=device)).unsqueeze(1)
        a = ((cands * w).sum(0) / w.sum()).cpu().numpy()
        ts = env.step(a * stats["action_std"] + stats["action_mean"])
        rewards.append(ts.reward)
    return float(np.max(rewards) == env.task.max_reward)


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    files = sorted(glob.glob(os.path.join(args.dataset_dir, "episode_*.hdf5")))
    stats = compute_stats(files)
    train_ds = EpisodicDataset(files, stats, args.chunk_size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=2, pin_memory=True)

    policy = ACTPolicy(hidden=args.hidden_dim, chunk=args.chunk_size).to(device)
    param_groups = [
        {"params": [p for n, p in policy.named_parameters() if not n.startswith("backbone")]},
        {"params": [p for n, p in policy.named_parameters() if n.startswith("backbone")], "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, weight_decay=1e-4)
    policy = DDP(policy, device_ids=[local_rank])

    writer = SummaryWriter(os.path.join(args.ckpt_dir, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        policy.train()
        tot = torch.zeros(3, device=device)
        for imgs, qpos, actions, is_pad in train_dl:
            imgs, qpos = imgs.to(device), qpos.to(device)
            actions, is_pad = actions.to(device), is_pad.to(device)
            l1, kl = policy(imgs, qpos, actions, is_pad)
            loss = l1 + args.kl_weight * kl
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tot += torch.stack([l1.detach(), kl.detach(), torch.ones((), device=device)])

        dist.all_reduce(tot)
        if rank == 0:
            writer.add_scalar("train/l1", (tot[0] / tot[2]).item(), epoch)
            writer.add_scalar("train/kl", (tot[1] / tot[2]).item(), epoch)

        if (epoch + 1) % args.eval_every == 0:
            policy.eval()
            succ = []
            for ep in range(rank, args.num_rollouts, world):
                succ.append(rollout(policy, stats, args, seed=1000 + ep, device=device))
            s = torch.tensor([sum(succ), len(succ)], dtype=torch.float32, device=device)
            dist.all_reduce(s)
            if rank == 0:
                writer.add_scalar("eval/success", (s[0] / s[1]).item(), epoch)
                torch.save({"model": policy.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "stats": stats, "epoch": epoch},
                           os.path.join(args.ckpt_dir, f"policy_epoch_{epoch + 1}.ckpt"))
            dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
