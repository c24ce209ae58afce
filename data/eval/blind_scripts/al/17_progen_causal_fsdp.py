"""ProGen-style autoregressive protein language model, FSDP full sharding + activation checkpointing.

    torchrun --standalone --nproc_per_node=8 17_progen_causal_fsdp.py --train data/uniref90_train.txt \
        --val data/uniref90_val.txt --out ckpt/progen_small
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import (BackwardPrefetch, FullOptimStateDictConfig, FullStateDictConfig,
                                    MixedPrecision, ShardingStrategy, StateDictType)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

TOKENS = "<pad>,<bos>,<eos>,A,C,D,E,F,G,H,I,K,L,M,N,P,Q,R,S,T,V,W,Y,X,B,U,Z,O".split(",")
STOI = {t: i for i, t in enumerate(TOKENS)}
PAD, BOS, EOS = 0, 1, 2


class SeqFile(Dataset):
    def __init__(self, path, max_len):
        with open(path) as f:
            self.seqs = [l.strip() for l in f if l.strip()]
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i][: self.max_len - 2]
        return torch.tensor([BOS] + [STOI.get(c, STOI["X"]) for c in s] + [EOS])


def collate(batch):
    L = max(len(b) for b in batch)
    out = torch.full((len(batch), L), PAD, dtype=torch.long)
    for i, b in enumerate(batch):
        out[i, : len(b)] = b
    return out


class DecoderBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class ProGen(nn.Module):
    def __init__(self, d=1024, layers=24, heads=16, max_len=1024):
        super().__init__()
        self.tok = nn.Embedding(len(TOKENS), d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([DecoderBlock(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, len(TOKENS), bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits, idx, reduction="mean"):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1),
                           ignore_index=PAD, reduction=reduction)


def save(model, opt, sched, step, path, rank):
    # every rank takes part in gathering the full state; only rank 0 receives and writes it
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        torch.save({"model": msd, "optim": osd, "sched": sched.state_dict(), "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def load(model, opt, sched, path):
    ck = torch.load(path, map_location="cpu")
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
        model.load_state_dict(ck["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ck["optim"]))
    sched.load_state_dict(ck["sched"])
    return ck["step"]


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for idx in loader:
        idx = idx.to(device)
        s[0] += lm_loss(model(idx), idx, reduction="sum").double()
        s[1] += (idx[:, 1:] != PAD).sum()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds, val_ds = SeqFile(args.train, args.max_len), SeqFile(args.val, args.max_len)
    val_ds = Subset(val_ds, range(min(len(val_ds), 20000)))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, args.micro_batch, sampler=sampler, collate_fn=collate, num_workers=4,
                    pin_memory=True, drop_last=True)
    # FSDP all-gathers in every forward, so each rank must run the same number of eval batches
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_dl = DataLoader(val_ds, 32, sampler=val_sampler, collate_fn=collate, drop_last=True)

    model = ProGen(max_len=args.max_len)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={DecoderBlock})
    model = FSDP(model, auto_wrap_policy=policy, device_id=torch.cuda.current_device(),
                 sharding_strategy=ShardingStrategy.FULL_SHARD, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 limit_all_gathers=True, use_orig_params=True)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, DecoderBlock))

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.max_steps) / args.max_steps)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    ck_path = os.path.join(args.out, "latest.pt")
    step = 0
    if os.path.exists(ck_path):
        step = load(model, opt, sched, ck_path)
        if rank == 0:
            print(f"resumed at step {step}", flush=True)

    epoch = step // len(dl)
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for idx in dl:
            idx = idx.to(device, non_blocking=True)
            loss = lm_loss(model(idx), idx)
            loss.backward()
            gn = model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} gnorm {gn.item():.2f} "
                          f"{(time.time() - t0) / 100 * 1000:.0f}ms/step", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0 or step == args.max_steps:
                vl = validate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} val loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
                save(model, opt, sched, step, ck_path, rank)
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
