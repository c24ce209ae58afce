# -*- coding: utf-8 -*-
"""
中文语料 GPT 预训练 (FSDP, bf16)

启动方式: torchrun --nnodes=2 --nproc_per_node=8 --max-restarts=3 \
    --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 02_fsdp_gpt_pretrain.py
重启后自动从 --ckpt-dir 中最新的 checkpoint 恢复.
"""
import argparse
import functools
import glob
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/mnt/lustre/corpus/zh_tokens_uint16.bin")
    p.add_argument("--val-data", default="/mnt/lustre/corpus/zh_val_uint16.bin")
    p.add_argument("--ckpt-dir", default="/mnt/lustre/ckpt/gpt_zh_1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-bsz", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-batches", type=int, default=50)
    p.add_argument("--keep", type=int, default=2)
    return p.parse_args()


class TokenBlocks(Dataset):
    """把 uint16 的 token 流切成定长块, 用 memmap 避免每个进程都把文件读进内存."""

    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.n = (len(self.data) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.seq_len
        chunk = torch.from_numpy(self.data[s: s + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    ratio = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(ratio, 1.0)))


def list_ckpts(ckpt_dir):
    done = [p for p in glob.glob(os.path.join(ckpt_dir, "step_*"))
            if p.rsplit("_", 1)[-1].isdigit()]
    return sorted(done, key=lambda p: int(p.rsplit("_", 1)[-1]))


def save(model, optimizer, step, data_state, args, rank):
    # 所有 rank 都要进入 state_dict(), 里面有 all-gather; rank0_only 只在 rank 0 上返回完整权重
    full_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_cfg, optim_cfg):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, optimizer)

    if rank == 0:
        out = os.path.join(args.ckpt_dir, f"step_{step}")
        tmp = out + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        torch.save(model_sd, os.path.join(tmp, "model.pt"))
        torch.save(optim_sd, os.path.join(tmp, "optim.pt"))
        torch.save({"step": step, "data": data_state, "rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state()}, os.path.join(tmp, "meta.pt"))
        os.rename(tmp, out)
        # 只保留最近 keep 个
        for old in list_ckpts(args.ckpt_dir)[:-args.keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


@torch.no_grad()
def evaluate(model, val_loader, args, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    # FSDP 的 forward 里有 all-gather, 每个 rank 必须跑相同的 batch 数
    for i, (x, y) in enumerate(val_loader):
        if i >= args.eval_batches:
            break
        x, y = x.to(device), y.to(device)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        tot[0] += loss
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    cfg = GPT2Config(vocab_size=65536, n_positions=args.seq_len, n_embd=2048,
                     n_layer=24, n_head=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(1234)
    model = GPT2LMHeadModel(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # 先在 CPU 上把完整权重加载进未包装的模型, 再交给 FSDP 切分
    ckpts = list_ckpts(args.ckpt_dir) if os.path.isdir(args.ckpt_dir) else []
    resume = ckpts[-1] if ckpts else None
    meta = None
    if resume is not None:
        model.load_state_dict(torch.load(os.path.join(resume, "model.pt"), map_location="cpu"))
        meta = torch.load(os.path.join(resume, "meta.pt"), map_location="cpu")

    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                        buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=mp,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 device_id=torch.cuda.current_device(), use_orig_params=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)
    step = 0
    epoch, consumed = 0, 0
    if resume is not None:
        full_osd = torch.load(os.path.join(resume, "optim.pt"), map_location="cpu")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            osd = FSDP.optim_state_dict_to_load(model, optimizer, full_osd)
        optimizer.load_state_dict(osd)
        step = meta["step"]
        epoch, consumed = meta["data"]["epoch"], meta["data"]["consumed"]
        torch.set_rng_state(meta["rng"])
        if rank == 0:
            print(f"从 {resume} 恢复, step={step}", flush=True)

    train_ds = TokenBlocks(args.data, args.seq_len)
    val_ds = TokenBlocks(args.val_data, args.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_bsz, sampler=val_sampler, num_workers=2)

    model.train()
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        loader = DataLoader(train_ds, batch_size=args.micro_bsz, sampler=sampler,
                            num_workers=4, pin_memory=True, drop_last=True)
        it = iter(loader)
        # 跳过本 epoch 已经训练过的 batch (consumed 按全局样本数记录, 与 world size 无关)
        skip = consumed // (args.micro_bsz * world)
        for _ in range(skip):
            next(it)
        for x, y in it:
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, args)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                                     y.view(-1))
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            consumed += args.micro_bsz * world

            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tok_s = 20 * args.micro_bsz * args.seq_len * world / (time.time() - t0)
                    print(f"step {step} loss {l.item():.4f} lr {lr_at(step, args):.2e} "
                          f"tok/s {tok_s:,.0f}", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                vl = evaluate(model, val_loader, args, device)
                if rank == 0:
                    print(f"[eval] step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            if step % args.save_every == 0:
                save(model, optimizer, step, {"epoch": epoch, "consumed": consumed}, args, rank)
            if step >= args.max_steps:
                break
        else:
            epoch += 1
            consumed = 0

    if step % args.save_every != 0:
        save(model, optimizer, step, {"epoch": epoch, "consumed": consumed}, args, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
