#!/usr/bin/env python
# Protein MLM pretraining (ESM-2 architecture, ~650M params) with PyTorch FSDP.
# Sequences are pre-tokenized and cropped to 1024 by prepare_uniref.py into
# uint8 .npy shards + an index of (offset, length).
#
#   torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
#       --rdzv_endpoint=$MASTER:29500 04_protein_lm_fsdp.py --data /shared/uniref50_tok
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import EsmConfig, EsmForMaskedLM, EsmTokenizer
from transformers.models.esm.modeling_esm import EsmLayer


class TokenShards(Dataset):
    """Flat token array + (offset, length) index; items already contain <cls> ... <eos>."""

    def __init__(self, root, split):
        self.tokens = np.load(os.path.join(root, f"{split}_tokens.npy"), mmap_mode="r")
        self.index = np.load(os.path.join(root, f"{split}_index.npy"))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        off, n = self.index[i]
        return torch.from_numpy(self.tokens[off:off + n].astype(np.int64))


class MLMCollator:
    def __init__(self, tok, max_len=1026, p=0.15):
        self.pad, self.mask = tok.pad_token_id, tok.mask_token_id
        self.special = torch.tensor(tok.all_special_ids)
        self.vocab = len(tok)
        self.max_len, self.p = max_len, p

    def __call__(self, batch):
        L = min(self.max_len, max(x.numel() for x in batch))
        ids = torch.full((len(batch), L), self.pad, dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, : min(L, x.numel())] = x[:L]
        attn = ids.ne(self.pad).long()
        labels = ids.clone()
        prob = torch.full(ids.shape, self.p)
        prob[torch.isin(ids, self.special)] = 0.0
        sel = torch.bernoulli(prob).bool()
        labels[~sel] = -100
        r = torch.rand(ids.shape)
        ids[sel & (r < 0.8)] = self.mask
        rnd = sel & (r >= 0.8) & (r < 0.9)
        ids[rnd] = torch.randint(4, 24, (int(rnd.sum()),))
        return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def cosine_lr(step, warmup, total, peak, floor=0.1):
    if step < warmup:
        return peak * step / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def save_checkpoint(model, optimizer, step, out_dir):
    if dist.get_rank() == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            model_state = model.state_dict()
            optim_state = FSDP.optim_state_dict(model, optimizer)
        path = os.path.join(out_dir, f"step_{step:07d}.pt")
        torch.save({"model": model_state, "optimizer": optim_state, "step": step}, path)
        print(f"saved {path}", flush=True)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device, max_batches=200):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = out.logits.float()
        n = (batch["labels"] != -100).sum()
        loss = torch.nn.functional.cross_entropy(
            logits.view(-1, logits.size(-1)), batch["labels"].view(-1), ignore_index=-100, reduction="sum")
        tot[0] += loss.double()
        tot[1] += n.double()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/shared/ckpt/esm650_fsdp")
    ap.add_argument("--tokenizer", default="facebook/esm2_t33_650M_UR50D")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=500_000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--eval-every", type=int, default=2000)
    ap.add_argument("--save-every", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = EsmTokenizer.from_pretrained(args.tokenizer)
    config = EsmConfig(
        vocab_size=len(tok), hidden_size=1280, num_hidden_layers=33, num_attention_heads=20,
        intermediate_size=5120, max_position_embeddings=1026, position_embedding_type="rotary",
        pad_token_id=tok.pad_token_id, mask_token_id=tok.mask_token_id, token_dropout=True,
        emb_layer_norm_before=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = EsmForMaskedLM(config)

    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={EsmLayer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=mp,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=local_rank,
                 limit_all_gathers=True, use_orig_params=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)

    collate = MLMCollator(tok)
    train_ds = TokenShards(args.data, "train")
    valid_full = TokenShards(args.data, "valid")
    n_valid = len(valid_full) // (world * args.micro_batch) * (world * args.micro_batch)
    valid_ds = Subset(valid_full, range(n_valid))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler,
                              collate_fn=collate, num_workers=8, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.micro_batch, sampler=valid_sampler,
                              collate_fn=collate, num_workers=4)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world size {world}, tokens/step ~{world * args.micro_batch * args.accum * 1024}", flush=True)

    step, micro, epoch = 0, 0, 0
    model.train()
    t0 = time.time()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(**batch)
            (out.loss / args.accum).backward()
            micro += 1
            if micro % args.accum != 0:
                continue
            model.clip_grad_norm_(1.0)
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, args.warmup, args.max_steps, args.lr)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                loss = out.loss.detach().clone()
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.2e} "
                          f"{(time.time() - t0) / 50:.2f}s/step", flush=True)
                    t0 = time.time()
            if step % args.eval_every == 0:
                vl = evaluate(model, valid_loader, device)
                if rank == 0:
                    print(f"step {step} valid loss {vl:.4f} ppl {math.exp(vl):.3f}", flush=True)
            if step % args.save_every == 0:
                save_checkpoint(model, opt, step, args.out)
            if step >= args.max_steps:
                break
        epoch += 1

    save_checkpoint(model, opt, step, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
