"""Flan-T5-XL summarization fine-tune with FSDP1 (T5Block wrapping, bf16).

Keeps the checkpoint with the best validation loss as a single .pt file that
the offline ROUGE job loads with T5ForConditionalGeneration.load_state_dict.

    torchrun --nproc_per_node=8 09_t5_fsdp1_summarization.py --train /data/sum/train.jsonl --val /data/sum/val.jsonl
"""
import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="google/flan-t5-xl")
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--out", default="/checkpoints/flan-t5-xl-sum")
    p.add_argument("--src-len", type=int, default=1024)
    p.add_argument("--tgt-len", type=int, default=256)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class SummDataset(Dataset):
    def __init__(self, path, tok, src_len, tgt_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.src_len, self.tgt_len = tok, src_len, tgt_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return "summarize: " + r["document"], r["summary"]


def make_collate(tok, src_len, tgt_len):
    def collate(batch):
        src, tgt = zip(*batch)
        enc = tok(list(src), max_length=src_len, truncation=True, padding=True, return_tensors="pt")
        lab = tok(list(tgt), max_length=tgt_len, truncation=True, padding=True, return_tensors="pt").input_ids
        lab[lab == tok.pad_token_id] = -100
        return enc.input_ids, enc.attention_mask, lab
    return collate


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def save_model(model, path):
    if dist.get_rank() != 0:
        return
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path)
    print(f"saved {path}", flush=True)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    agg = torch.zeros(2, device=device)
    for ids, mask, lab in loader:
        ids, mask, lab = ids.to(device), mask.to(device), lab.to(device)
        out = model(input_ids=ids, attention_mask=mask, labels=lab)
        ntok = (lab != -100).sum()
        agg[0] += out.loss.float() * ntok
        agg[1] += ntok
    dist.all_reduce(agg, op=dist.ReduceOp.SUM)
    model.train()
    return (agg[0] / agg[1]).item()


def main():
    args = parse_args()
    rank, world, local_rank = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = T5ForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float32)

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.cuda.current_device(),
        forward_prefetch=True,
    )

    collate = make_collate(tok, args.src_len, args.tgt_len)
    train_ds = SummDataset(args.train, tok, args.src_len, args.tgt_len)
    val_ds = SummDataset(args.val, tok, args.src_len, args.tgt_len)
    train_sampler = DistributedSampler(train_ds, rank=rank, num_replicas=world, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs * 2, collate_fn=collate, num_workers=2,
                            sampler=DistributedSampler(val_ds, rank=rank, num_replicas=world, shuffle=False))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total,
                                                    pct_start=0.05, anneal_strategy="linear")

    best = float("inf")
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for ids, mask, lab in train_loader:
            ids, mask, lab = ids.to(device), mask.to(device), lab.to(device)
            loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
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
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                val_loss = validate(model, val_loader, device)
                if rank == 0:
                    print(f"step {step} val_loss {val_loss:.4f} (best {best:.4f})", flush=True)
                if val_loss < best:
                    best = val_loss
                    save_model(model, os.path.join(args.out, "best.pt"))

    val_loss = validate(model, val_loader, device)
    if val_loss < best:
        save_model(model, os.path.join(args.out, "best.pt"))
    if rank == 0:
        print(f"done. final val_loss {val_loss:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
