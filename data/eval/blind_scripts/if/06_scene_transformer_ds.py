"""Scene Transformer (joint multi-agent prediction, factorized agent/time attention) with DeepSpeed ZeRO-3.

    deepspeed --num_gpus 8 06_scene_transformer_ds.py --data-root /fsx/womd/joint_npz \
        --save-dir /fsx/checkpoints/scene_tf_joint
"""
import argparse
import glob
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

T_HIST, T_FUT = 11, 80
T_ALL = T_HIST + T_FUT
MAX_AGENTS = 32
MAX_ROAD = 512


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--modes", type=int, default=6)
    p.add_argument("--local_rank", type=int, default=-1)  # filled by the deepspeed launcher
    return p.parse_args()


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr, "warmup_num_steps": 2000,
                                 "total_num_steps": args.total_steps}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 200,
        "wall_clock_breakdown": False,
    }


class JointScenes(Dataset):
    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        n = min(len(d["agents"]), MAX_AGENTS)
        agents = np.zeros((MAX_AGENTS, T_ALL, 7), np.float32)
        agents[:n] = d["agents"][:n]
        valid = np.zeros((MAX_AGENTS, T_ALL), np.bool_)
        valid[:n] = d["valid"][:n]
        r = min(len(d["road"]), MAX_ROAD)
        road = np.zeros((MAX_ROAD, 6), np.float32)
        road[:r] = d["road"][:r]
        return {"agents": torch.from_numpy(agents), "valid": torch.from_numpy(valid),
                "road": torch.from_numpy(road), "road_mask": torch.arange(MAX_ROAD) < r}


class AxialBlock(nn.Module):
    def __init__(self, d, axis):
        super().__init__()
        self.axis = axis
        self.attn = nn.MultiheadAttention(d, 8, batch_first=True)
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):  # x [B, A, T, d], mask [B, A, T] True = valid
        B, A, T, D = x.shape
        if self.axis == "time":
            h = x.reshape(B * A, T, D)
            m = mask.reshape(B * A, T)
        else:
            h = x.transpose(1, 2).reshape(B * T, A, D)
            m = mask.transpose(1, 2).reshape(B * T, A)
        m = m.clone()
        m[:, 0] = True  # never attend over an all-padded row
        hn = self.n1(h)
        h = h + self.attn(hn, hn, hn, key_padding_mask=~m)[0]
        h = h + self.ff(self.n2(h))
        if self.axis == "time":
            return h.view(B, A, T, D)
        return h.view(B, T, A, D).transpose(1, 2)


class SceneTransformer(nn.Module):
    def __init__(self, d=256, modes=6, n_layers=6):
        super().__init__()
        self.modes = modes
        self.agent_in = nn.Linear(7 + 1, d)
        self.time_embed = nn.Embedding(T_ALL, d)
        self.road_in = nn.Sequential(nn.Linear(6, d), nn.ReLU(), nn.Linear(d, d))
        self.mode_embed = nn.Embedding(modes, d)
        self.enc = nn.ModuleList(AxialBlock(d, "time" if i % 2 == 0 else "agent") for i in range(n_layers))
        self.road_xattn = nn.MultiheadAttention(d, 8, batch_first=True)
        self.dec = nn.ModuleList(AxialBlock(d, "time" if i % 2 == 0 else "agent") for i in range(4))
        self.out = nn.Linear(d, 4)
        self.score = nn.Linear(d, 1)

    def forward(self, agents, valid, road, road_mask):
        B, A, T, _ = agents.shape
        obs = torch.zeros_like(valid)
        obs[:, :, :T_HIST] = valid[:, :, :T_HIST]
        obs_f = obs[..., None].to(agents.dtype)
        inp = torch.cat([agents * obs_f, obs_f], -1)
        steps = torch.arange(T, device=agents.device)
        x = self.agent_in(inp) + self.time_embed(steps)[None, None]
        agent_mask = valid[:, :, :T_HIST].any(-1, keepdim=True).expand(-1, -1, T)
        for blk in self.enc:
            x = blk(x, agent_mask)
        r = self.road_in(road)
        x = x + self.road_xattn(x.flatten(1, 2), r, r, key_padding_mask=~road_mask)[0].view_as(x)
        modes = self.mode_embed(torch.arange(self.modes, device=agents.device))
        x = x[:, None] + modes[None, :, None, None]  # [B, K, A, T, d]
        x = x.flatten(0, 1)
        m = agent_mask[:, None].expand(-1, self.modes, -1, -1).flatten(0, 1)
        for blk in self.dec:
            x = blk(x, m)
        x = x.view(B, self.modes, A, T, -1)
        out = self.out(x)
        joint_logit = self.score(x.mean(dim=(2, 3))).squeeze(-1)  # one score per joint future
        return out[..., :2], out[..., 2:].clamp(-5, 5), joint_logit


def joint_loss(mu, log_b, logits, agents, valid):
    gt = agents[..., :2]
    fut = valid.clone()
    fut[:, :, :T_HIST] = False
    fm = fut[:, None].float()
    err = (mu - gt[:, None]).norm(dim=-1)  # [B, K, A, T]
    scene_err = (err * fm).sum(dim=(2, 3)) / fm.sum(dim=(2, 3)).clamp(min=1)
    best = scene_err.argmin(-1)
    r = torch.arange(len(best), device=mu.device)
    nll = (torch.abs(gt - mu[r, best]) / log_b[r, best].exp() + log_b[r, best]).sum(-1)
    nll = (nll * fut).sum() / fut.sum().clamp(min=1)
    return nll + F.cross_entropy(logits.float(), best)


def joint_displacement(mu, agents, valid):
    """Scene-level minADE / minFDE: the same mode index for every agent of a scene."""
    gt = agents[..., :2]
    fut = valid.clone()
    fut[:, :, :T_HIST] = False
    fm = fut[:, None].float()
    err = (mu - gt[:, None]).norm(dim=-1)
    ade = ((err * fm).sum(dim=(2, 3)) / fm.sum(dim=(2, 3)).clamp(min=1)).min(-1).values
    last = fut[:, None, :, -1].float()
    fde = ((err[..., -1] * last).sum(-1) / last.sum(-1).clamp(min=1)).min(-1).values
    return ade, fde


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="nccl")
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()

    files = sorted(glob.glob(os.path.join(args.data_root, "*.npz")))
    val_files = [f for f in files if os.path.basename(f).startswith("validation")]
    train_files = [f for f in files if os.path.basename(f).startswith("training")]
    train_ds, val_ds = JointScenes(train_files), JointScenes(val_files)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    # ZeRO-3 gathers parameters in every forward, so each rank must see the same number of val batches
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_batch, sampler=val_sampler, num_workers=8)
    args.total_steps = args.epochs * len(train_dl) // args.grad_accum

    with deepspeed.zero.Init(config_dict_or_path=ds_config(args)):
        model = SceneTransformer(args.d_model, args.modes)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args))
    device = engine.device

    _, client_state = engine.load_checkpoint(args.save_dir)  # (None, None) on a fresh run
    start_epoch = client_state["epoch"] + 1 if client_state else 0

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            agents = batch["agents"].to(torch.bfloat16)
            mu, log_b, logits = engine(agents, batch["valid"], batch["road"].to(torch.bfloat16),
                                       batch["road_mask"])
            loss = joint_loss(mu.float(), log_b.float(), logits, batch["agents"], batch["valid"])
            engine.backward(loss)
            engine.step()
            if rank == 0 and engine.is_gradient_accumulation_boundary() and engine.global_steps % 200 == 0:
                print(f"epoch {epoch} step {engine.global_steps} loss {loss.item():.4f} "
                      f"lr {engine.get_lr()[0]:.2e}", flush=True)

        engine.eval()
        sums = torch.zeros(3, device=device)  # joint minADE sum, joint minFDE sum, scenes
        with torch.no_grad():
            for batch in val_dl:
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                mu, _, _ = engine(batch["agents"].to(torch.bfloat16), batch["valid"],
                                  batch["road"].to(torch.bfloat16), batch["road_mask"])
                ade, fde = joint_displacement(mu.float(), batch["agents"], batch["valid"])
                sums += torch.stack([ade.sum(), fde.sum(), torch.tensor(float(len(ade)), device=device)])
        dist.all_reduce(sums)

        with deepspeed.zero.GatheredParameters(engine.module.mode_embed.weight, modifier_rank=None):
            mode_spread = torch.pdist(engine.module.mode_embed.weight.float()).mean().item()
        if rank == 0:
            n = sums[2].clamp(min=1)
            print(f"epoch {epoch}: joint minADE {(sums[0] / n).item():.3f} "
                  f"joint minFDE {(sums[1] / n).item():.3f} mode spread {mode_spread:.3f}", flush=True)

        # every rank writes its own ZeRO partition; rank 0 also writes the module states
        engine.save_checkpoint(args.save_dir, tag=f"epoch{epoch}", client_state={"epoch": epoch})

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
