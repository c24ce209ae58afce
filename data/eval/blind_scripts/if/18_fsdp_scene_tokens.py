"""SMART-style next-token prediction over scene tokens (agent motion tokens + road-segment tokens),
large decoder-only model sharded with FSDP.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        18_fsdp_scene_tokens.py --data /lustre/womd/smart_tokens --out /lustre/ckpt/smart_large
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

AGENT_VOCAB = 2048  # k-disks motion-token vocabulary (0.5 s per token)
ROAD_VOCAB = 1024
STEPS = 18  # 9 s of 0.5 s tokens (2 history + 16 future)
MAX_AGENTS = 64
MAX_ROAD = 256


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--save-every", type=int, default=2)
    return p.parse_args()


class SceneTokenShards(Dataset):
    def __init__(self, root, split):
        self.files = sorted(os.path.join(root, split, f) for f in os.listdir(os.path.join(root, split)))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        return {
            "agent_tok": torch.from_numpy(d["agent_tokens"].astype(np.int64)),  # [A, STEPS]
            "agent_pos": torch.from_numpy(d["agent_pos"].astype(np.float32)),  # [A, STEPS, 3]
            "agent_valid": torch.from_numpy(d["agent_valid"]),  # [A, STEPS]
            "agent_type": torch.from_numpy(d["agent_type"].astype(np.int64)),  # [A]
            "road_tok": torch.from_numpy(d["road_tokens"].astype(np.int64)),  # [R]
            "road_pos": torch.from_numpy(d["road_pos"].astype(np.float32)),  # [R, 3]
            "road_valid": torch.from_numpy(d["road_valid"]),  # [R]
        }


def fourier_pos(pos, dim):
    freqs = torch.exp(torch.linspace(0, math.log(1000.0), dim // 6, device=pos.device))
    ang = pos[..., None] * freqs * 0.01
    return torch.cat([ang.sin(), ang.cos()], -1).flatten(-2)


class DecoderLayer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.n1, self.n2, self.n3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.temporal = nn.MultiheadAttention(d, heads, batch_first=True)
        self.map_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.social = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, valid, road, road_pad):  # x [B, A, T, d]
        B, A, T, D = x.shape
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        h = self.n1(x).reshape(B * A, T, D)
        x = x + self.temporal(h, h, h, attn_mask=causal, need_weights=False)[0].view(B, A, T, D)
        h = self.n2(x).reshape(B, A * T, D)
        x = x + self.map_attn(h, road, road, key_padding_mask=road_pad, need_weights=False)[0].view(B, A, T, D)
        h = self.n3(x).transpose(1, 2).reshape(B * T, A, D)
        pad = ~valid.transpose(1, 2).reshape(B * T, A)
        pad[:, 0] = False
        x = x + self.social(h, h, h, key_padding_mask=pad, need_weights=False)[0].view(B, T, A, D).transpose(1, 2)
        return x + self.mlp(x)


class SceneTokenLM(nn.Module):
    def __init__(self, d=1024, layers=16, heads=16):
        super().__init__()
        self.d = d
        self.agent_emb = nn.Embedding(AGENT_VOCAB, d)
        self.type_emb = nn.Embedding(3, d)
        self.road_emb = nn.Embedding(ROAD_VOCAB, d)
        self.pos_proj = nn.Linear(6 * (d // 6), d)
        self.road_enc = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, heads, 4 * d, 0.0, batch_first=True, norm_first=True), 3)
        self.layers = nn.ModuleList(DecoderLayer(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, AGENT_VOCAB)

    def forward(self, b):
        road = self.road_emb(b["road_tok"]) + self.pos_proj(fourier_pos(b["road_pos"], self.d))
        road_pad = ~b["road_valid"]
        road = self.road_enc(road, src_key_padding_mask=road_pad)
        x = self.agent_emb(b["agent_tok"]) + self.type_emb(b["agent_type"])[:, :, None]
        x = x + self.pos_proj(fourier_pos(b["agent_pos"], self.d))
        for layer in self.layers:
            x = layer(x, b["agent_valid"], road, road_pad)
        return self.head(self.norm(x))


def next_token_loss(logits, b):
    tgt = b["agent_tok"][:, :, 1:]
    m = b["agent_valid"][:, :, 1:] & b["agent_valid"][:, :, :-1]
    lg = logits[:, :, :-1]
    return F.cross_entropy(lg[m].float(), tgt[m]), (lg.argmax(-1) == tgt)[m].float().mean()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model = SceneTokenLM(args.d_model, args.layers)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=local_rank,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                 limit_all_gathers=True)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters()) * world
        print(f"~{n_params / 1e6:.0f}M parameters (sharded over {world} ranks)", flush=True)

    train_set, val_set = SceneTokenShards(args.data, "train"), SceneTokenShards(args.data, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler, num_workers=8,
                            drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    total = args.epochs * len(train_loader)
    warm = min(4000, total // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, b in enumerate(train_loader):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            loss, acc = next_token_loss(model(b), b)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} acc {acc.item():.3f}",
                      flush=True)

        model.eval()
        agg = torch.zeros(3, device=device)
        with torch.no_grad():
            for b in val_loader:
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                loss, acc = next_token_loss(model(b), b)
                agg += torch.stack([loss, acc, torch.ones((), device=device)])
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch} val nll {(agg[0] / agg[2]).item():.4f} top1 {(agg[1] / agg[2]).item():.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
                    state = model.state_dict()
                torch.save({"model": state, "epoch": epoch, "args": vars(args)},
                           os.path.join(args.out, f"smart_ep{epoch + 1:03d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
