#!/usr/bin/env python
# Pairwise reward-model training (Bradley-Terry) on preference data, FSDP1.
#
#   torchrun --nnodes=1 --nproc_per_node=8 11_reward_model_fsdp1.py \
#       --base Qwen/Qwen2-7B --data /prefs/hh_rlhf_tok --out /ckpt/rm-qwen2-7b
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from datasets import load_from_disk
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="Qwen/Qwen2-7B")
    p.add_argument("--data", default="/prefs/hh_rlhf_tok")
    p.add_argument("--out", default="/ckpt/rm")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--bs", type=int, default=4, help="pairs per GPU")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=9e-6)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=300)
    return p.parse_args()


def pad(seqs, pad_id, max_len):
    L = min(max_len, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        s = s[-L:]  # keep the end of the conversation (the response) when truncating
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


class PairCollator:
    def __init__(self, pad_id, max_len):
        self.pad_id, self.max_len = pad_id, max_len

    def __call__(self, rows):
        seqs = [r["chosen_ids"] for r in rows] + [r["rejected_ids"] for r in rows]
        return pad(seqs, self.pad_id, self.max_len)


def pair_forward(model, ids, mask):
    rewards = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
    n = ids.size(0) // 2
    return rewards[:n], rewards[n:]


def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for ids, mask in loader:
            r_c, r_r = pair_forward(model, ids.to(device), mask.to(device))
            loss_sum += -F.logsigmoid(r_c - r_r).sum().item()
            correct += (r_c > r_r).sum().item()
            total += r_c.numel()
    stats = torch.tensor([loss_sum, correct, total], dtype=torch.float64)
    dist.all_reduce(stats)
    model.train()
    return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item()


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.base)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(args.base, num_labels=1, torch_dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    model.config.use_cache = False

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Qwen2DecoderLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=device,
        use_orig_params=True,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Qwen2DecoderLayer),
    )

    ds = load_from_disk(args.data)
    collate = PairCollator(tok.pad_token_id, args.max_len)
    tr_sampler = DistributedSampler(ds["train"], shuffle=True, seed=0, drop_last=True)
    tr_loader = DataLoader(ds["train"], batch_size=args.bs, sampler=tr_sampler, collate_fn=collate,
                           num_workers=4, pin_memory=True, drop_last=True)
    ev_loader = DataLoader(ds["test"], batch_size=args.bs, sampler=DistributedSampler(ds["test"], shuffle=False),
                           collate_fn=collate, num_workers=2)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(tr_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps) * max(0.0, 1 - s / total))

    step = 0
    model.train()
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        for ids, mask in tr_loader:
            r_c, r_r = pair_forward(model, ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))
            loss = -F.logsigmoid(r_c - r_r).mean()
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            sched.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                acc = (r_c > r_r).float().mean().detach()
                m = torch.stack([loss.detach(), acc])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} loss {m[0]:.4f} acc {m[1]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 20:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0 or step == total:
                ev_loss, ev_acc = evaluate(model, ev_loader, device)
                if rank == 0:
                    print(f"[eval] step {step} loss {ev_loss:.4f} acc {ev_acc:.4f}", flush=True)

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(args.out, "final"))
    if rank == 0:
        tok.save_pretrained(os.path.join(args.out, "final"))
        model.module.config.save_pretrained(os.path.join(args.out, "final"))
        print("saved", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
