"""Image BC with a GMM action head (robomimic BC-GMM style) on can/ph image data, DDP.

All low-dim observation streams in the dataset are used except the ones in --exclude_keys,
each through its own small projection; cameras go through a ResNet-18 (GroupNorm) each.

    torchrun --nproc_per_node=4 10_robomimic_can_bc_gmm_image.py --data datasets/can/ph/image_v141.hdf5
"""
import argparse
import datetime
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.distributions as D
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import robomimic.utils.env_utils as EnvUtils
import robomimic.utils.file_utils as FileUtils
import robomimic.utils.obs_utils as ObsUtils
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/bc_gmm_can")
    ap.add_argument("--rgb_keys", nargs="+", default=["agentview_image", "robot0_eye_in_hand_image"])
    ap.add_argument("--exclude_keys", nargs="*", default=["object", "robot0_joint_vel", "robot0_gripper_qvel",
                                                           "robot0_eef_vel_lin", "robot0_eef_vel_ang"])
    ap.add_argument("--num_modes", type=int, default=5)
    ap.add_argument("--global_batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=600)
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--eval_episodes", type=int, default=50)
    ap.add_argument("--horizon", type=int, default=400)
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


def read_shape_meta(path, rgb_keys, exclude_keys):
    with h5py.File(path, "r") as f:
        obs = f["data/demo_0/obs"]
        lowdim_keys = {k for k in obs.keys() if obs[k].ndim == 2} - set(exclude_keys)
        shapes = {k: tuple(obs[k].shape[1:]) for k in list(lowdim_keys) + list(rgb_keys)}
        action_dim = f["data/demo_0/actions"].shape[1]
    return lowdim_keys, shapes, action_dim


class FrameDataset(Dataset):
    def __init__(self, path, rgb_keys, lowdim_keys):
        self.rgb_keys, self.lowdim_keys = list(rgb_keys), list(lowdim_keys)
        self.data = {k: [] for k in self.rgb_keys + self.lowdim_keys + ["actions"]}
        with h5py.File(path, "r") as f:
            for demo in f["data"].keys():
                g = f["data"][demo]
                for k in self.rgb_keys + self.lowdim_keys:
                    self.data[k].append(g["obs"][k][()])
                self.data["actions"].append(g["actions"][()])
        self.data = {k: np.concatenate(v) for k, v in self.data.items()}

    def __len__(self):
        return len(self.data["actions"])

    def __getitem__(self, i):
        item = {k: torch.from_numpy(self.data[k][i]).permute(2, 0, 1).float() / 255.0 for k in self.rgb_keys}
        item.update({k: torch.from_numpy(self.data[k][i]).float() for k in self.lowdim_keys})
        item["actions"] = torch.from_numpy(self.data["actions"][i]).float()
        return item


def conv_encoder(out_dim=64):
    net = torchvision.models.resnet18(weights=None, norm_layer=lambda c: nn.GroupNorm(max(1, c // 16), c))
    net.fc = nn.Linear(512, out_dim)
    return net


class BCGMM(nn.Module):
    def __init__(self, rgb_keys, lowdim_keys, shapes, action_dim, num_modes=5, hidden=1024):
        super().__init__()
        self.rgb_keys, self.lowdim_keys = rgb_keys, lowdim_keys
        self.rgb_enc = nn.ModuleDict({k: conv_encoder(64) for k in rgb_keys})
        self.lowdim_enc = nn.ModuleDict({k: nn.Linear(shapes[k][0], 32) for k in lowdim_keys})
        in_dim = 64 * len(rgb_keys) + 32 * len(lowdim_keys)
        self.trunk = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.mean = nn.Linear(hidden, num_modes * action_dim)
        self.scale = nn.Linear(hidden, num_modes * action_dim)
        self.logits = nn.Linear(hidden, num_modes)
        self.num_modes, self.action_dim = num_modes, action_dim

    def forward(self, obs):
        feats = [self.rgb_enc[k](obs[k]) for k in self.rgb_keys]
        feats += [self.lowdim_enc[k](obs[k]) for k in self.lowdim_keys]
        h = self.trunk(torch.cat(feats, -1))
        B = h.shape[0]
        means = torch.tanh(self.mean(h)).view(B, self.num_modes, self.action_dim)
        scales = F.softplus(self.scale(h)).view(B, self.num_modes, self.action_dim) + 1e-4
        comp = D.Independent(D.Normal(means, scales), 1)
        return D.MixtureSameFamily(D.Categorical(logits=self.logits(h)), comp)


@torch.no_grad()
def evaluate(policy, env, args, lowdim_keys, device):
    policy.eval()
    n_success = 0
    for _ in range(args.eval_episodes):
        ob = env.reset()
        for _ in range(args.horizon):
            obs = {k: torch.as_tensor(ob[k], device=device).float()[None] for k in list(args.rgb_keys) + list(lowdim_keys)}
            dist_a = policy(obs)
            # low-noise evaluation: take the mean of the most likely mode
            mode = dist_a.mixture_distribution.probs.argmax(-1)
            action = dist_a.component_distribution.base_dist.loc[0, mode[0]]
            ob, _, done, _ = env.step(action.cpu().numpy())
            if done or env.is_success()["task"]:
                break
        n_success += int(env.is_success()["task"])
    policy.train()
    return n_success / args.eval_episodes


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed + rank)

    lowdim_keys, shapes, action_dim = read_shape_meta(args.data, args.rgb_keys, args.exclude_keys)
    dataset = FrameDataset(args.data, args.rgb_keys, lowdim_keys)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.global_batch // world, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    policy = BCGMM(args.rgb_keys, lowdim_keys, shapes, action_dim, args.num_modes).to(device)
    model = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    env = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"low-dim keys: {sorted(lowdim_keys)}; {len(dataset)} frames")
        env_meta = FileUtils.get_env_metadata_from_dataset(args.data)
        ObsUtils.initialize_obs_utils_with_obs_specs({"obs": {"rgb": args.rgb_keys, "low_dim": sorted(lowdim_keys)}})
        env = EnvUtils.create_env_from_metadata(env_meta, render=False, render_offscreen=True, use_image_obs=True)

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        nll_sum = torch.zeros(2, device=device)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            actions = batch.pop("actions")
            loss = -model(batch).log_prob(actions).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            nll_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(nll_sum)

        if rank == 0:
            print(f"epoch {epoch}: nll {(nll_sum[0] / nll_sum[1]).item():.4f} ({time.time() - t0:.0f}s)")
            state = {"model": policy.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                     "lowdim_keys": sorted(lowdim_keys), "rgb_keys": args.rgb_keys}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if epoch % args.eval_every == 0:
                sr = evaluate(policy, env, args, lowdim_keys, device)
                print(f"epoch {epoch}: success rate {sr:.2f}")
                torch.save(state, os.path.join(args.out, f"epoch{epoch}_sr{sr:.2f}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
