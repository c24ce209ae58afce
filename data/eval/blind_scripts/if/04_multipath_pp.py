"""MultiPath++-style GMM trajectory head with learned anchors (Waymo Open Motion, prerendered npz).

    torchrun --nproc_per_node=8 04_multipath_pp.py --config configs/mpp_final.yaml
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class PrerenderedScenes(Dataset):
    def __init__(self, path, max_agents=32, max_roads=512):
        self.files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".npz"))
        self.max_agents, self.max_roads = max_agents, max_roads

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        d = np.load(self.files[idx])
        target = d["target/history/xy"].astype(np.float32)  # [11, 2] in target frame
        target_yaw = d["target/history/yaw"].astype(np.float32)[:, None]
        target_speed = d["target/history/speed"].astype(np.float32)[:, None]
        others = d["other/history/xy"].astype(np.float32)[: self.max_agents]  # [A, 11, 2]
        others_valid = d["other/history/valid"].astype(np.bool_)[: self.max_agents]
        roads = d["road_network_segments"].astype(np.float32)[: self.max_roads]  # [R, 7]
        oth = np.zeros((self.max_agents, 11, 2), np.float32)
        oth[: len(others)] = others
        oth_m = np.zeros((self.max_agents, 11), np.bool_)
        oth_m[: len(others)] = others_valid
        rd = np.zeros((self.max_roads, 7), np.float32)
        rd[: len(roads)] = roads
        return {
            "target": torch.from_numpy(np.concatenate([target, target_yaw, target_speed], -1)),
            "others": torch.from_numpy(oth), "others_valid": torch.from_numpy(oth_m),
            "roads": torch.from_numpy(rd), "roads_valid": torch.arange(self.max_roads) < len(roads),
            "future": torch.from_numpy(d["target/future/xy"].astype(np.float32)),  # [80, 2]
            "future_valid": torch.from_numpy(d["target/future/valid"].astype(np.bool_)),
        }


class MCGBlock(nn.Module):
    """Context-gating block: elementwise gating of element features by a pooled context."""

    def __init__(self, d):
        super().__init__()
        self.s = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.ReLU())
        self.c = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.ReLU())

    def forward(self, s, c, mask):
        s_new = self.s(s) * self.c(c)[:, None]
        s_new = s_new.masked_fill(~mask[..., None], float("-inf"))
        c_new = s_new.max(1).values
        c_new = torch.where(torch.isinf(c_new), torch.zeros_like(c_new), c_new)
        return s_new.masked_fill(~mask[..., None], 0.0) + s, c_new + c


class MultiPathPP(nn.Module):
    def __init__(self, anchors, d=256, n_blocks=3):
        super().__init__()
        self.register_buffer("anchors", anchors)  # [K, T, 2]
        K, T, _ = anchors.shape
        self.num_modes, self.horizon = K, T
        self.target_enc = nn.LSTM(4, d, batch_first=True)
        self.other_enc = nn.Sequential(nn.Linear(22, d), nn.ReLU(), nn.Linear(d, d))
        self.road_enc = nn.Sequential(nn.Linear(7, d), nn.ReLU(), nn.Linear(d, d))
        self.agent_mcg = nn.ModuleList(MCGBlock(d) for _ in range(n_blocks))
        self.road_mcg = nn.ModuleList(MCGBlock(d) for _ in range(n_blocks))
        self.anchor_embed = nn.Sequential(nn.Linear(T * 2, d), nn.ReLU(), nn.Linear(d, d))
        self.decoder = nn.Sequential(nn.Linear(4 * d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU())
        self.out_traj = nn.Linear(d, T * 5)  # dx, dy, log_sx, log_sy, rho
        self.out_logit = nn.Linear(d, 1)

    def forward(self, batch):
        B = batch["target"].shape[0]
        _, (h, _) = self.target_enc(batch["target"])
        ctx = h[-1]
        oth = self.other_enc(batch["others"].flatten(2))
        om = batch["others_valid"].any(-1)
        agent_ctx = ctx
        for blk in self.agent_mcg:
            oth, agent_ctx = blk(oth, agent_ctx, om)
        roads = self.road_enc(batch["roads"])
        road_ctx = ctx
        for blk in self.road_mcg:
            roads, road_ctx = blk(roads, road_ctx, batch["roads_valid"])
        scene = torch.cat([ctx, agent_ctx, road_ctx], -1)
        a = self.anchor_embed(self.anchors.flatten(1))  # [K, d]
        x = self.decoder(torch.cat([scene[:, None].expand(-1, self.num_modes, -1),
                                    a[None].expand(B, -1, -1)], -1))
        out = self.out_traj(x).view(B, self.num_modes, self.horizon, 5)
        mean = self.anchors[None] + out[..., :2]
        log_std = out[..., 2:4].clamp(-4.0, 4.0)
        rho = torch.tanh(out[..., 4]) * 0.95
        return mean, log_std, rho, self.out_logit(x).squeeze(-1)

    @torch.no_grad()
    def predict_topk(self, batch, k=6):
        mean, _, _, logits = self.forward(batch)
        probs = logits.softmax(-1)
        top = probs.topk(k, dim=-1)
        idx = top.indices[..., None, None].expand(-1, -1, self.horizon, 2)
        return mean.gather(1, idx), top.values


def gmm_nll(mean, log_std, rho, logits, gt, valid):
    dx = gt[:, None, :, 0] - mean[..., 0]
    dy = gt[:, None, :, 1] - mean[..., 1]
    sx, sy = log_std[..., 0].exp(), log_std[..., 1].exp()
    one_m_r2 = 1 - rho ** 2
    z = (dx / sx) ** 2 + (dy / sy) ** 2 - 2 * rho * dx * dy / (sx * sy)
    log_n = -z / (2 * one_m_r2) - log_std.sum(-1) - 0.5 * torch.log(one_m_r2) - math.log(2 * math.pi)
    log_n = (log_n * valid[:, None]).sum(-1)  # [B, K]
    nll = -torch.logsumexp(F.log_softmax(logits, -1) + log_n, -1)
    return (nll / valid.sum(-1).clamp(min=1)).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    seed = cfg.get("seed", 42)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    anchors = torch.from_numpy(np.load(cfg["anchors_path"]).astype(np.float32))  # k-means, 64 x 80 x 2
    model = MultiPathPP(anchors, d=cfg["d_model"]).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds = PrerenderedScenes(cfg["train_path"])
    val_ds = PrerenderedScenes(cfg["val_path"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                          num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler,
                        num_workers=cfg["num_workers"], pin_memory=True)

    lr = cfg["lr"] * world
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=2)
    tb = SummaryWriter(cfg["log_dir"]) if rank == 0 else None
    ckpt_dir = cfg["checkpoint_dir"]
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    global_step = 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            mean, log_std, rho, logits = model(batch)
            loss = gmm_nll(mean, log_std, rho, logits, batch["future"], batch["future_valid"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.4)
            optimizer.step()
            global_step += 1
            if tb is not None and global_step % 200 == 0:
                tb.add_scalar("train/nll", loss.item(), global_step)

        model.eval()
        acc = torch.zeros(4, device=device)
        for batch in val_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            trajs, probs = model.predict_topk(batch, k=6)
            gt, gv = batch["future"], batch["future_valid"]
            err = (trajs - gt[:, None]).norm(dim=-1)  # [B, 6, T]
            ade = (err * gv[:, None]).sum(-1) / gv.sum(-1, keepdim=True).clamp(min=1)
            full = gv[:, -1]
            fde = err[..., -1].min(-1).values
            acc += torch.stack([ade.min(-1).values[full].sum(), fde[full].sum(),
                                (fde[full] > 2.0).float().sum(), full.float().sum()])
        dist.all_reduce(acc)
        n = acc[3].clamp(min=1)
        min_ade, min_fde, mr = (acc[0] / n).item(), (acc[1] / n).item(), (acc[2] / n).item()
        scheduler.step(min_ade)

        if rank == 0:
            print(f"epoch {epoch}: minADE {min_ade:.3f} minFDE {min_fde:.3f} MR {mr:.3f}", flush=True)
            tb.add_scalar("val/minADE", min_ade, epoch)
            tb.add_scalar("val/minFDE", min_fde, epoch)
            tb.add_scalar("val/MR", mr, epoch)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, os.path.join(ckpt_dir, f"mpp_e{epoch:02d}.pt"))

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
