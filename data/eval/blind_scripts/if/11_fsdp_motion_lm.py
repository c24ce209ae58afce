"""MotionLM-style autoregressive motion-token model (scene encoder + causal decoder) trained with FSDP.

Agent futures are discretized into per-step (dx, dy) action tokens on a 13x13 grid; the decoder
predicts the next token of each agent given the scene encoding and the previous tokens.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        11_fsdp_motion_lm.py --data /nfs/womd/tokens_v2 --ckpt-dir /nfs/ckpt/motionlm_1b
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
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import FullStateDictConfig, FullOptimStateDictConfig, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

GRID = 13
VOCAB = GRID * GRID + 1  # + BOS
BOS = VOCAB - 1
FUT_TOKENS = 16  # 8 s at 2 Hz
MAX_DELTA = 9.0  # metres per 0.5 s


class TokenizedScenes(Dataset):
    def __init__(self, root, split):
        self.files = sorted(os.path.join(root, split, f) for f in os.listdir(os.path.join(root, split)))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        return {
            "agent_feats": torch.from_numpy(d["agent_feats"].astype(np.float32)),  # [A, 11*7]
            "agent_mask": torch.from_numpy(d["agent_mask"]),  # [A]
            "road": torch.from_numpy(d["road"].astype(np.float32)),  # [R, 20, 5]
            "road_mask": torch.from_numpy(d["road_mask"]),  # [R]
            "tokens": torch.from_numpy(d["tokens"].astype(np.int64)),  # [A, 16]
            "token_valid": torch.from_numpy(d["token_valid"]),  # [A, 16]
            "fut_xy": torch.from_numpy(d["fut_xy"].astype(np.float32)),  # [A, 16, 2]
        }


def detokenize(tokens):
    ix, iy = tokens // GRID, tokens % GRID
    step = 2 * MAX_DELTA / (GRID - 1)
    delta = torch.stack([ix * step - MAX_DELTA, iy * step - MAX_DELTA], -1)
    return delta.cumsum(-2)


class Block(nn.Module):
    def __init__(self, d, heads, cross):
        super().__init__()
        self.n1 = nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.cross = cross
        if cross:
            self.n2 = nn.LayerNorm(d)
            self.cross_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.n3 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, pad=None, causal=None, mem=None, mem_pad=None):
        h = self.n1(x)
        x = x + self.self_attn(h, h, h, key_padding_mask=pad, attn_mask=causal, need_weights=False)[0]
        if self.cross:
            h = self.n2(x)
            x = x + self.cross_attn(h, mem, mem, key_padding_mask=mem_pad, need_weights=False)[0]
        return x + self.mlp(self.n3(x))


class MotionLM(nn.Module):
    def __init__(self, d=1024, heads=16, enc_layers=12, dec_layers=12):
        super().__init__()
        self.agent_in = nn.Linear(11 * 7, d)
        self.road_in = nn.Sequential(nn.Linear(5, d), nn.GELU(), nn.Linear(d, d))
        self.encoder = nn.ModuleList(Block(d, heads, cross=False) for _ in range(enc_layers))
        self.tok_emb = nn.Embedding(VOCAB, d)
        self.step_emb = nn.Embedding(FUT_TOKENS, d)
        self.decoder = nn.ModuleList(Block(d, heads, cross=True) for _ in range(dec_layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB - 1)

    def encode(self, b):
        x = torch.cat([self.agent_in(b["agent_feats"]), self.road_in(b["road"]).max(2).values], 1)
        pad = ~torch.cat([b["agent_mask"], b["road_mask"]], 1)
        for blk in self.encoder:
            x = blk(x, pad=pad)
        return x, pad

    def forward(self, b, in_tokens):  # in_tokens [B, A, T] starting with BOS
        mem, mem_pad = self.encode(b)
        B, A, T = in_tokens.shape
        steps = torch.arange(T, device=in_tokens.device)
        agent_ctx = mem[:, :A]
        x = self.tok_emb(in_tokens) + self.step_emb(steps)[None, None] + agent_ctx[:, :, None]
        x = x.reshape(B, A * T, -1)
        # causal in time, all agents see each other's past tokens (joint rollout)
        t_idx = steps.repeat(A)
        causal = t_idx[None, :] > t_idx[:, None]
        for blk in self.decoder:
            x = blk(x, causal=causal, mem=mem, mem_pad=mem_pad)
        return self.lm_head(self.norm(x)).view(B, A, T, -1)


def shift_right(tokens):
    bos = torch.full_like(tokens[..., :1], BOS)
    return torch.cat([bos, tokens[..., :-1]], -1)


def save_checkpoint(model, optimizer, epoch, path, rank):
    # every rank takes part in gathering the full state; only rank 0 receives and writes it
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        torch.save({"model": model_state, "optim": optim_state, "epoch": epoch}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--init-from", default="")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model = MotionLM()
    if args.init_from:
        # a full (unsharded) checkpoint written by save_checkpoint; loaded before sharding
        state = torch.load(args.init_from, map_location="cpu")
        model.load_state_dict(state["model"])

    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=mp, device_id=local_rank,
                 sharding_strategy=ShardingStrategy.HYBRID_SHARD, use_orig_params=True)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    train_ds, val_ds = TokenizedScenes(args.data, "train"), TokenizedScenes(args.data, "val")
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=6, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=6, drop_last=True)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / args.warmup, 0.5 * (
        1 + math.cos(math.pi * min(s, total) / total))))

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, b in enumerate(train_dl):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            logits = model(b, shift_right(b["tokens"]))
            valid = b["token_valid"] & b["agent_mask"][..., None]
            loss = F.cross_entropy(logits.float()[valid], b["tokens"][valid])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        model.eval()
        stats = torch.zeros(3, device=device)  # nll sum, correct tokens, tokens
        ade_stats = torch.zeros(2, device=device)  # greedy ADE sum, agents
        with torch.no_grad():
            for b in val_dl:
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                valid = b["token_valid"] & b["agent_mask"][..., None]
                logits = model(b, shift_right(b["tokens"])).float()
                nll = F.cross_entropy(logits[valid], b["tokens"][valid], reduction="sum")
                correct = (logits.argmax(-1) == b["tokens"])[valid].sum()
                stats += torch.stack([nll, correct.float(), valid.sum().float()])
                # greedy joint rollout: same number of decoder calls on every rank
                gen = torch.full_like(b["tokens"], BOS)
                out_tok = torch.zeros_like(b["tokens"])
                for t in range(FUT_TOKENS):
                    nxt = model(b, gen)[:, :, t].argmax(-1)
                    out_tok[:, :, t] = nxt
                    if t + 1 < FUT_TOKENS:
                        gen[:, :, t + 1] = nxt
                xy = detokenize(out_tok)
                full = valid.all(-1)
                ade = (xy - b["fut_xy"]).norm(dim=-1).mean(-1)
                ade_stats += torch.stack([ade[full].sum(), full.sum().float()])
        dist.all_reduce(stats)
        dist.all_reduce(ade_stats)
        if rank == 0:
            print(f"epoch {epoch} val ppl {math.exp((stats[0] / stats[2]).item()):.2f} "
                  f"acc {(stats[1] / stats[2]).item():.3f} greedy ADE {(ade_stats[0] / ade_stats[1].clamp(min=1)).item():.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)

        save_checkpoint(model, optimizer, epoch, os.path.join(args.ckpt_dir, f"motionlm_ep{epoch}.pt"), rank)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
