"""Continued masked-LM pretraining of ESM-2 650M on a metagenomic protein set with FSDP.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        07_fsdp_esm_pretrain.py --train_fasta /shared/mgnify/train.fasta --val_fasta /shared/mgnify/val.fasta \
        --output_dir /shared/runs/esm2_mgnify
"""
import argparse
import functools
import math
import os
import random
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import DataCollatorForLanguageModeling, EsmForMaskedLM, EsmTokenizer
from transformers.models.esm.modeling_esm import EsmLayer


def read_fasta(path):
    seqs, cur = [], []
    with open(path) as f:
        for line in f:
            if line.startswith(">"):
                if cur:
                    seqs.append("".join(cur))
                cur = []
            else:
                cur.append(line.strip())
    if cur:
        seqs.append("".join(cur))
    return seqs


class CroppedSequences(Dataset):
    def __init__(self, seqs, tokenizer, max_len, random_crop):
        self.seqs, self.tok, self.max_len, self.random_crop = seqs, tokenizer, max_len, random_crop

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        if len(s) > self.max_len:
            start = random.randint(0, len(s) - self.max_len) if self.random_crop else 0
            s = s[start:start + self.max_len]
        return self.tok(s, return_special_tokens_mask=True)


def save_checkpoint(model, optimizer, scheduler, step, path, rank):
    model_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    # every rank has to take part in gathering the full state; only rank 0 writes it
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, model_cfg, optim_cfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        torch.save({"model": model_state, "optimizer": optim_state,
                    "scheduler": scheduler.state_dict(), "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def load_checkpoint(model, optimizer, scheduler, path):
    ckpt = torch.load(path, map_location="cpu")
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, ckpt["optimizer"]))
    scheduler.load_state_dict(ckpt["scheduler"])
    return ckpt["step"]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        n = (batch["labels"] != -100).sum()
        totals[0] += out.loss.double() * n
        totals[1] += n
    dist.all_reduce(totals)
    model.train()
    return math.exp(totals[0].item() / totals[1].item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_fasta", required=True)
    ap.add_argument("--val_fasta", required=True)
    ap.add_argument("--model_name", default="facebook/esm2_t33_650M_UR50D")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_len", type=int, default=1022)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--max_steps", type=int, default=50000)
    ap.add_argument("--eval_every", type=int, default=2500)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    tokenizer = EsmTokenizer.from_pretrained(args.model_name)
    model = EsmForMaskedLM.from_pretrained(args.model_name, torch_dtype=torch.float32)

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={EsmLayer})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=bf16,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.cuda.current_device(),
                 limit_all_gathers=True, use_orig_params=True)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, EsmLayer))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.0, 1 - s / args.max_steps))

    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, pad_to_multiple_of=8)
    train_set = CroppedSequences(read_fasta(args.train_fasta), tokenizer, args.max_len, random_crop=True)
    val_set = CroppedSequences(read_fasta(args.val_fasta), tokenizer, args.max_len, random_crop=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    # same number of batches on every rank (FSDP forwards are collective); drop_last avoids duplicates
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            collate_fn=collator, num_workers=2)

    ckpt_path = os.path.join(args.output_dir, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt_path):
        step = load_checkpoint(model, optimizer, scheduler, ckpt_path)
        if rank == 0:
            print(f"resumed from step {step}", flush=True)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    epoch = step // len(train_loader)
    t0 = time.time()
    model.train()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0 or step == args.max_steps:
                ppl = evaluate(model, val_loader, device)
                if rank == 0:
                    print(f"step {step} val ppl {ppl:.3f}", flush=True)
                save_checkpoint(model, optimizer, scheduler, step, ckpt_path, rank)
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
