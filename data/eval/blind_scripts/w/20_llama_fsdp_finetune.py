"""
Full fine-tune of Llama-3.2-1B on a domain corpus (pre-tokenized .bin of uint32 token ids)
with PyTorch FSDP (FULL_SHARD, bf16 mixed precision).

    torchrun --nproc_per_node=8 20_llama_fsdp_finetune.py --train_bin data/train.bin --val_bin data/val.bin
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--train_bin", default="data/train.bin")
    ap.add_argument("--val_bin", default="data/val.bin")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--min_lr", type=float, default=2e-6)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--out", default="llama1b-domain")
    return ap.parse_args()


class TokenBlocks(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint32, mode="r")
        self.seq_len = seq_len
        self.n = (len(self.data) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = i * self.seq_len
        chunk = torch.from_numpy(self.data[start: start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def lr_at(step, total, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, total - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device, max_batches=50):
    model.eval()
    tot = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.to(device), y.to(device)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1))
        tot += torch.stack([loss, torch.ones((), device=device)])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def save_full_model(model, tokenizer, out_dir, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        os.makedirs(out_dir, exist_ok=True)
        model.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        print(f"saved full model to {out_dir}")


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.config.use_cache = False

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=bf16,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
        limit_all_gathers=True,
    )

    train_ds = TokenBlocks(args.train_bin, args.seq_len)
    val_ds = TokenBlocks(args.val_bin, args.seq_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95),
                                  fused=True)
    total_steps = len(train_loader) * args.epochs

    if rank == 0:
        print(f"{len(train_ds)} train blocks of {args.seq_len} tokens, {total_steps} steps, "
              f"{args.batch_size * world * args.seq_len / 1e6:.2f}M tokens/step")

    step, best_val = 0, float("inf")
    model.train()
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, total_steps, args)

            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1))
            loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tps = 20 * args.batch_size * world * args.seq_len / (time.time() - t0)
                    print(f"step {step}/{total_steps} loss {l.item():.4f} gnorm {gnorm.item():.2f} "
                          f"lr {optimizer.param_groups[0]['lr']:.2e} {tps / 1e3:.1f}k tok/s")
                    t0 = time.time()

            if step % args.eval_every == 0:
                val_loss = evaluate(model, val_loader, device)
                if rank == 0:
                    print(f"[eval] step {step} val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")
                if val_loss < best_val:
                    best_val = val_loss
                    save_full_model(model, tokenizer, os.path.join(args.out, "best"), rank)
                dist.barrier()

    save_full_model(model, tokenizer, os.path.join(args.out, "final"), rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
