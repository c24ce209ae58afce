"""ViT weather emulator (ClimaX-style variable tokenisation) trained with FSDP.

Started directly by srun, one task per GPU (no torchrun):

    #SBATCH --nodes=8 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=16 --constraint=a100
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
    export MASTER_PORT=29517
    srun --cpu-bind=cores python 07_vit_weather_fsdp.py --config cfg/vit_1p4.yaml
"""
import argparse
import functools
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
import zarr
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def slurm_env():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    return rank, world_size, local_rank


class ZarrForecastDataset(Dataset):
    def __init__(self, store, t_slice, mean, std, lead_steps):
        self.arr = zarr.open(store, mode="r")["fields"]  # (T, C, H, W), 6-hourly
        self.t0, self.t1 = t_slice
        self.mean = mean[:, None, None].astype(np.float32)
        self.std = std[:, None, None].astype(np.float32)
        self.lead = lead_steps

    def __len__(self):
        return self.t1 - self.t0 - self.lead

    def __getitem__(self, i):
        t = self.t0 + i
        x = (self.arr[t] - self.mean) / self.std
        y = (self.arr[t + self.lead] - self.mean) / self.std
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class WeatherViT(nn.Module):
    def __init__(self, n_vars, img=(128, 256), patch=4, dim=1024, depth=24, heads=16):
        super().__init__()
        self.n_vars, self.patch = n_vars, patch
        self.gh, self.gw = img[0] // patch, img[1] // patch
        # one patch embedding per variable, then cross-variable aggregation
        self.var_embed = nn.Conv2d(n_vars, n_vars * dim, patch, stride=patch, groups=n_vars)
        self.var_query = nn.Parameter(torch.zeros(1, 1, dim))
        self.var_agg = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.pos = nn.Parameter(torch.zeros(1, self.gh * self.gw, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_vars * patch * patch)
        nn.init.trunc_normal_(self.pos, std=0.02)
        nn.init.trunc_normal_(self.var_query, std=0.02)

    def forward(self, x):
        B = x.shape[0]
        tok = self.var_embed(x)  # B, V*D, gh, gw
        D = tok.shape[1] // self.n_vars
        tok = tok.view(B, self.n_vars, D, -1).permute(0, 3, 1, 2).reshape(-1, self.n_vars, D)
        q = self.var_query.expand(tok.shape[0], -1, -1)
        tok = self.var_agg(q, tok, tok, need_weights=False)[0].view(B, -1, D) + self.pos
        for blk in self.blocks:
            tok = blk(tok)
        out = self.head(self.norm(tok))  # B, L, V*p*p
        out = out.view(B, self.gh, self.gw, self.n_vars, self.patch, self.patch)
        out = out.permute(0, 3, 1, 4, 2, 5).reshape(B, self.n_vars, self.gh * self.patch, self.gw * self.patch)
        return x + out


def save_checkpoint(model, optimizer, epoch, path, rank):
    # every rank takes part in gathering the full state; only rank 0 ends up holding it
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        tmp = path + ".tmp"
        torch.save({"model": model_state, "optimizer": optim_state, "epoch": epoch}, tmp)
        os.replace(tmp, path)
    dist.barrier()


def load_checkpoint(model, optimizer, path):
    ckpt = torch.load(path, map_location="cpu")
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, ckpt["optimizer"]))
    return ckpt["epoch"] + 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    rank, world_size, local_rank = slurm_env()
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    stats = np.load(cfg["stats"])
    mean, std = stats["mean"], stats["std"]
    train_ds = ZarrForecastDataset(cfg["store"], cfg["train_t"], mean, std, cfg["lead_steps"])
    val_ds = ZarrForecastDataset(cfg["store"], cfg["val_t"], mean, std, cfg["lead_steps"])
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg["micro_batch"], sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_idx = list(range(rank, len(val_ds), world_size))
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=cfg["micro_batch"], num_workers=4)

    model = WeatherViT(len(mean), dim=cfg["dim"], depth=cfg["depth"], heads=cfg["heads"])
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=bf16,
                 device_id=local_rank,
                 use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05, betas=(0.9, 0.95))

    ckpt_path = os.path.join(cfg["ckpt_dir"], "checkpoint.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        start_epoch = load_checkpoint(model, optimizer, ckpt_path)
    elif rank == 0:
        os.makedirs(cfg["ckpt_dir"], exist_ok=True)

    lat = torch.linspace(-87.1875, 87.1875, 128, device=device)
    w_lat = torch.cos(torch.deg2rad(lat))
    w_lat = (w_lat / w_lat.mean()).view(1, 1, -1, 1)
    std_t = torch.as_tensor(std, device=device, dtype=torch.float32)

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x)
            loss = (w_lat * (pred.float() - y) ** 2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)

        model.eval()
        sse = torch.zeros(len(mean) + 1, device=device)
        with torch.no_grad():
            # FSDP forward is a collective: pad shorter shards with a dummy batch so every rank runs
            # the same number of forwards
            n_batches = torch.tensor(len(val_loader), device=device)
            dist.all_reduce(n_batches, op=dist.ReduceOp.MAX)
            it = iter(val_loader)
            for _ in range(int(n_batches)):
                batch = next(it, None)
                if batch is None:
                    model(torch.zeros(1, len(mean), 128, 256, device=device))
                    continue
                x, y = batch[0].to(device), batch[1].to(device)
                err = w_lat * (model(x).float() - y) ** 2
                sse[:-1] += err.mean(dim=(-2, -1)).sum(0)
                sse[-1] += x.shape[0]
        dist.all_reduce(sse)
        rmse = torch.sqrt(sse[:-1] / sse[-1]) * std_t
        if rank == 0:
            print(f"epoch {epoch} val RMSE (phys units) {rmse.tolist()} time {time.time() - t0:.0f}s", flush=True)

        save_checkpoint(model, optimizer, epoch, ckpt_path, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
