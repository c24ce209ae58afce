"""
Mamba-2 (SSD) long-context pretraining with FSDP, 32k-token packed sequences.

Documents are packed back to back; `seq_idx` tells the SSD scan and the causal conv
where each document starts, so no state leaks across document boundaries.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        05_mamba2_fsdp_32k.py --train /shared/data/longctx/train.u32 --val /shared/data/longctx/val.u32
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import (FullStateDictConfig, MixedPrecision, ShardingStrategy,
                                    StateDictType)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from mamba_ssm.models.config_mamba import MambaConfig
from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
from mamba_ssm.modules.block import Block

EOS_ID = 0


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--seq_len", type=int, default=32768)
    ap.add_argument("--d_model", type=int, default=2048)
    ap.add_argument("--n_layer", type=int, default=48)
    ap.add_argument("--vocab_size", type=int, default=50280)
    ap.add_argument("--micro_bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--eval_every", type=int, default=1000)
    ap.add_argument("--eval_iters", type=int, default=20)
    ap.add_argument("--save_every", type=int, default=5000)
    ap.add_argument("--save_dir", default="/shared/ckpt/mamba2_2.7b_32k")
    return ap.parse_args()


class PackedTokens(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint32, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        x = torch.from_numpy(self.data[s:s + self.seq_len + 1].astype(np.int64))
        return x


def make_seq_idx(inp):
    # a new document starts right after every EOS token
    starts = torch.zeros_like(inp, dtype=torch.int32)
    starts[:, 1:] = (inp[:, :-1] == EOS_ID).to(torch.int32)
    return torch.cumsum(starts, dim=1, dtype=torch.int32)


def lr_lambda(step, warmup, total):
    if step < warmup:
        return step / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))


@torch.no_grad()
def evaluate(model, loader, iters, device):
    model.eval()
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for i, seq in enumerate(loader):
        if i == iters:
            break
        seq = seq.to(device)
        inp, tgt = seq[:, :-1], seq[:, 1:]
        logits = model(inp, seq_idx=make_seq_idx(inp)).logits
        totals[0] += F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), reduction="sum")
        totals[1] += tgt.numel()
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def save_full_checkpoint(model, step, save_dir, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        os.makedirs(save_dir, exist_ok=True)
        torch.save({"model": state, "step": step}, os.path.join(save_dir, f"model_{step:06d}.pt"))
        print(f"saved step {step}", flush=True)
    dist.barrier()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.cuda.current_device()
    torch.manual_seed(0)

    config = MambaConfig(
        d_model=args.d_model, n_layer=args.n_layer, vocab_size=args.vocab_size,
        ssm_cfg={"layer": "Mamba2", "d_state": 128, "headdim": 64, "chunk_size": 256},
        rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=16,
    )
    model = MambaLMHeadModel(config, device="cpu", dtype=torch.float32)

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                        buffer_dtype=torch.float32)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=mp,
                 sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=local_rank,
                 use_orig_params=True, limit_all_gathers=True)

    no_decay_keys = ("A_log", "D", "dt_bias", "norm", "bias")
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if any(k in n for k in no_decay_keys) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, args.warmup, args.steps))

    train_ds = PackedTokens(args.train, args.seq_len)
    val_ds = PackedTokens(args.val, args.seq_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_bs, sampler=val_sampler, num_workers=2)

    if rank == 0:
        print(f"world={world} seq_len={args.seq_len} tokens/step={world * args.micro_bs * args.seq_len}")

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.steps:
        train_sampler.set_epoch(epoch)
        for seq in train_dl:
            seq = seq.to(device, non_blocking=True)
            inp, tgt = seq[:, :-1], seq[:, 1:]
            logits = model(inp, seq_idx=make_seq_idx(inp)).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
            loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.time() - t0) / 10
                    print(f"step {step} loss {l.item():.4f} gnorm {gnorm.item():.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {dt:.2f}s/it "
                          f"mem {torch.cuda.max_memory_allocated() / 2**30:.1f}G", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                vl = evaluate(model, val_dl, args.eval_iters, device)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f}", flush=True)

            if step % args.save_every == 0:
                save_full_checkpoint(model, step, args.save_dir, rank)

            if step >= args.steps:
                break
        epoch += 1

    save_full_checkpoint(model, step, args.save_dir, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
