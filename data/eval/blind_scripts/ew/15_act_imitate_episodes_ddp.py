"""imitate_episodes.py (ACT) ported to DistributedDataParallel.

    torchrun --nproc_per_node=4 15_act_imitate_episodes_ddp.py --task_name sim_transfer_cube_scripted \
        --dataset_dir data/sim_transfer_cube_scripted --ckpt_dir ckpt/act_cube --num_episodes 50 \
        --kl_weight 10 --chunk_size 100 --hidden_dim 512 --batch_size 8 --dim_feedforward 3200 \
        --num_epochs 2000 --lr 1e-5 --seed 0
"""
import argparse
import os
import pickle
from copy import deepcopy

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

CAMERA_NAMES = ["top"]


def set_seed(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)


class EpisodicDataset(Dataset):
    def __init__(self, episode_ids, dataset_dir, norm_stats, chunk_size):
        self.episode_ids, self.dataset_dir, self.norm_stats, self.chunk_size = episode_ids, dataset_dir, norm_stats, chunk_size

    def __len__(self):
        return len(self.episode_ids)

    def __getitem__(self, index):
        path = os.path.join(self.dataset_dir, f"episode_{self.episode_ids[index]}.hdf5")
        with h5py.File(path, "r") as root:
            episode_len = root["/action"].shape[0]
            start_ts = np.random.choice(episode_len)
            qpos = root["/observations/qpos"][start_ts]
            image = np.stack([root[f"/observations/images/{c}"][start_ts] for c in CAMERA_NAMES])
            action = root["/action"][start_ts:]
        padded = np.zeros((episode_len, action.shape[1]), dtype=np.float32)
        padded[: len(action)] = action
        is_pad = np.zeros(episode_len, dtype=bool)
        is_pad[len(action):] = True
        padded, is_pad = padded[: self.chunk_size], is_pad[: self.chunk_size]
        s = self.norm_stats
        image = torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255.0
        qpos = torch.from_numpy((qpos - s["qpos_mean"]) / s["qpos_std"]).float()
        action = torch.from_numpy((padded - s["action_mean"]) / s["action_std"]).float()
        return image, qpos, action, torch.from_numpy(is_pad)


def get_norm_stats(dataset_dir, num_episodes):
    qpos, action = [], []
    for i in range(num_episodes):
        with h5py.File(os.path.join(dataset_dir, f"episode_{i}.hdf5"), "r") as root:
            qpos.append(root["/observations/qpos"][()])
            action.append(root["/action"][()])
    qpos, action = np.concatenate(qpos), np.concatenate(action)
    return {"action_mean": action.mean(0), "action_std": np.clip(action.std(0), 1e-2, np.inf),
            "qpos_mean": qpos.mean(0), "qpos_std": np.clip(qpos.std(0), 1e-2, np.inf)}


class DETRVAE(nn.Module):
    def __init__(self, state_dim, num_queries, hidden_dim, nheads, enc_layers, dec_layers, dim_feedforward, latent_dim=32):
        super().__init__()
        self.num_queries, self.latent_dim = num_queries, latent_dim
        resnet = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        self.backbones = nn.ModuleList([nn.Sequential(*list(resnet.children())[:-2]) for _ in CAMERA_NAMES])
        self.input_proj = nn.Conv2d(512, hidden_dim, kernel_size=1)
        self.transformer = nn.Transformer(hidden_dim, nheads, enc_layers, dec_layers, dim_feedforward, 0.1, batch_first=True)
        self.action_head = nn.Linear(hidden_dim, state_dim)
        self.is_pad_head = nn.Linear(hidden_dim, 1)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.input_proj_robot_state = nn.Linear(state_dim, hidden_dim)
        self.pos_embed = nn.Parameter(torch.randn(1, 300 * len(CAMERA_NAMES), hidden_dim) * 0.02)
        # CVAE encoder
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(hidden_dim, nheads, dim_feedforward, 0.1, batch_first=True), enc_layers)
        self.cls_embed = nn.Embedding(1, hidden_dim)
        self.encoder_action_proj = nn.Linear(state_dim, hidden_dim)
        self.encoder_joint_proj = nn.Linear(state_dim, hidden_dim)
        self.latent_proj = nn.Linear(hidden_dim, latent_dim * 2)
        self.encoder_pos = nn.Parameter(torch.randn(1, 1 + 1 + num_queries, hidden_dim) * 0.02)
        self.latent_out_proj = nn.Linear(latent_dim, hidden_dim)
        self.additional_pos_embed = nn.Embedding(2, hidden_dim)
        self.register_buffer("img_mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("img_std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, qpos, image, actions=None, is_pad=None):
        bs = qpos.shape[0]
        if actions is not None:
            cls = self.cls_embed.weight.unsqueeze(0).repeat(bs, 1, 1)
            x = torch.cat([cls, self.encoder_joint_proj(qpos).unsqueeze(1), self.encoder_action_proj(actions)], 1)
            mask = torch.cat([torch.zeros(bs, 2, dtype=torch.bool, device=qpos.device), is_pad], 1)
            out = self.encoder(x + self.encoder_pos, src_key_padding_mask=mask)[:, 0]
            latent_info = self.latent_proj(out)
            mu, logvar = latent_info[:, : self.latent_dim], latent_info[:, self.latent_dim:]
            latent_sample = mu + torch.randn_like(mu) * torch.exp(logvar / 2)
        else:
            mu = logvar = None
            latent_sample = torch.zeros(bs, self.latent_dim, device=qpos.device)
        latent_input = self.latent_out_proj(latent_sample)
        feats = []
        for cam_id in range(len(CAMERA_NAMES)):
            img = (image[:, cam_id] - self.img_mean) / self.img_std
            feats.append(self.input_proj(self.backbones[cam_id](img)).flatten(2).transpose(1, 2))
        src = torch.cat([latent_input.unsqueeze(1), self.input_proj_robot_state(qpos).unsqueeze(1), *feats], 1)
        pos = torch.cat([self.additional_pos_embed.weight.unsqueeze(0).repeat(bs, 1, 1),
                         self.pos_embed.repeat(bs, 1, 1)], 1)
        hs = self.transformer(src + pos, self.query_embed.weight.unsqueeze(0).repeat(bs, 1, 1))
        return self.action_head(hs), self.is_pad_head(hs), [mu, logvar]


def kl_divergence(mu, logvar):
    klds = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp())
    return klds.sum(1).mean(0, True), klds.mean(0), klds.mean(1).mean(0, True)


class ACTPolicy(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.model = DETRVAE(14, args.chunk_size, args.hidden_dim, args.nheads, args.enc_layers,
                             args.dec_layers, args.dim_feedforward)
        self.kl_weight = args.kl_weight

    def forward(self, qpos, image, actions=None, is_pad=None):
        if actions is not None:  # training / validation
            a_hat, is_pad_hat, (mu, logvar) = self.model(qpos, image, actions, is_pad)
            total_kld, _, _ = kl_divergence(mu, logvar)
            all_l1 = F.l1_loss(actions, a_hat, reduction="none")
            l1 = (all_l1 * ~is_pad.unsqueeze(-1)).mean()
            return {"l1": l1, "kl": total_kld[0], "loss": l1 + total_kld[0] * self.kl_weight}
        a_hat, _, _ = self.model(qpos, image)
        return a_hat


def compute_dict_mean(dicts):
    return {k: sum(d[k] for d in dicts) / len(dicts) for k in dicts[0]}


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)  # same split on every rank

    shuffled = np.random.permutation(args.num_episodes)
    train_ids = shuffled[: int(0.8 * args.num_episodes)]
    val_ids = shuffled[int(0.8 * args.num_episodes):]
    norm_stats = get_norm_stats(args.dataset_dir, args.num_episodes)
    torch.manual_seed(args.seed + rank)  # different CVAE / start_ts sampling on each rank from here on
    train_set = EpisodicDataset(train_ids, args.dataset_dir, norm_stats, args.chunk_size)
    val_set = EpisodicDataset(val_ids, args.dataset_dir, norm_stats, args.chunk_size)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world_size))),
                            batch_size=args.batch_size, shuffle=False, num_workers=2)

    policy = ACTPolicy(args).to(device)
    ddp_policy = DDP(policy, device_ids=[local_rank])
    backbone_params = [p for n, p in policy.named_parameters() if "backbones" in n]
    other_params = [p for n, p in policy.named_parameters() if "backbones" not in n]
    # per-GPU batch is kept at --batch_size, so the global batch is world_size x larger
    optimizer = torch.optim.AdamW([{"params": other_params},
                                   {"params": backbone_params, "lr": args.lr_backbone * world_size}],
                                  lr=args.lr * world_size, weight_decay=1e-4)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        with open(os.path.join(args.ckpt_dir, "dataset_stats.pkl"), "wb") as f:
            pickle.dump(norm_stats, f)

    min_val_loss, best_ckpt_info = np.inf, None
    for epoch in range(args.num_epochs):
        # validation
        policy.eval()
        with torch.inference_mode():
            sums = torch.zeros(3, device=device)
            for image, qpos, actions, is_pad in val_loader:
                d = policy(qpos.to(device), image.to(device), actions.to(device), is_pad.to(device))
                sums += torch.stack([d["loss"], d["l1"], d["kl"]]) * qpos.shape[0]
            n = torch.tensor([float(len(val_loader.dataset))], device=device)
            dist.all_reduce(sums)
            dist.all_reduce(n)
            val_loss, val_l1, val_kl = (sums / n).tolist()
        if val_loss < min_val_loss:
            min_val_loss = val_loss
            best_ckpt_info = (epoch, min_val_loss, deepcopy(policy.state_dict()))

        # training
        policy.train()
        train_sampler.set_epoch(epoch)
        train_history = []
        for image, qpos, actions, is_pad in train_loader:
            image, qpos = image.to(device, non_blocking=True), qpos.to(device, non_blocking=True)
            actions, is_pad = actions.to(device, non_blocking=True), is_pad.to(device, non_blocking=True)
            forward_dict = ddp_policy(qpos, image, actions, is_pad)
            loss = forward_dict["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            train_history.append({k: v.detach() for k, v in forward_dict.items()})
        train_summary = torch.stack(list(compute_dict_mean(train_history).values()))
        dist.all_reduce(train_summary, op=dist.ReduceOp.AVG)

        if rank == 0:
            tr = dict(zip(train_history[0].keys(), train_summary.tolist()))
            print(f"Epoch {epoch} | val loss {val_loss:.5f} (l1 {val_l1:.4f} kl {val_kl:.4f}) | "
                  f"train loss {tr['loss']:.5f} (l1 {tr['l1']:.4f} kl {tr['kl']:.4f})")
            if epoch % 100 == 0:
                torch.save(policy.state_dict(), os.path.join(args.ckpt_dir, f"policy_epoch_{epoch}_seed_{args.seed}.ckpt"))

    if rank == 0:
        torch.save(policy.state_dict(), os.path.join(args.ckpt_dir, "policy_last.ckpt"))
        best_epoch, min_val_loss, best_state_dict = best_ckpt_info
        torch.save(best_state_dict, os.path.join(args.ckpt_dir, "policy_best.ckpt"))
        print(f"Training finished: seed {args.seed}, val loss {min_val_loss:.6f} at epoch {best_epoch}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--task_name", required=True)
    parser.add_argument("--dataset_dir", required=True)
    parser.add_argument("--ckpt_dir", required=True)
    parser.add_argument("--num_episodes", type=int, default=50)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--num_epochs", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--lr_backbone", type=float, default=1e-5)
    parser.add_argument("--kl_weight", type=float, default=10)
    parser.add_argument("--chunk_size", type=int, default=100)
    parser.add_argument("--hidden_dim", type=int, default=512)
    parser.add_argument("--dim_feedforward", type=int, default=3200)
    parser.add_argument("--nheads", type=int, default=8)
    parser.add_argument("--enc_layers", type=int, default=4)
    parser.add_argument("--dec_layers", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    main(parser.parse_args())
