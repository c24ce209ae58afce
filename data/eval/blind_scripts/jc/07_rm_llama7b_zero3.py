"""Reward model training with DeepSpeed ZeRO-3 (7B base does not fit with plain DDP).

    deepspeed --num_gpus 8 07_rm_llama7b_zero3.py --base meta-llama/Llama-2-7b-hf \
        --train data/prefs/train.jsonl --valid data/prefs/valid.jsonl --out ckpt/rm7b
"""
import argparse
import json
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--micro_bsz", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval_interval", type=int, default=100)
    ap.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    return ap.parse_args()


class JsonlPairs(Dataset):
    def __init__(self, path, tok, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                d = json.loads(line)
                p = d["prompt"]
                c = tok(p + d["chosen"], truncation=True, max_length=max_len)["input_ids"]
                r = tok(p + d["rejected"], truncation=True, max_length=max_len)["input_ids"]
                self.items.append((c, r))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_pairs(batch, pad_id):
    seqs = [b[0] for b in batch] + [b[1] for b in batch]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        att[i, :len(s)] = 1
    return ids, att


class LlamaRM(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.model = AutoModel.from_pretrained(base, torch_dtype=torch.bfloat16)
        self.v_head = nn.Linear(self.model.config.hidden_size, 1, bias=False, dtype=torch.bfloat16)

    def forward(self, input_ids, attention_mask):
        h = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        last = attention_mask.sum(1) - 1
        return self.v_head(h[torch.arange(h.size(0), device=h.device), last]).squeeze(-1).float()


def main():
    args = parse()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bsz,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bsz * args.grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr, "warmup_num_steps": 30,
                                 "total_num_steps": 1000}},
        "steps_per_print": 1000000,
    }
    dschf = HfDeepSpeedConfig(ds_config)  # keep alive: from_pretrained loads straight into ZeRO-3 shards

    tok = AutoTokenizer.from_pretrained(args.base)
    tok.pad_token = tok.unk_token or tok.eos_token
    train_ds = JsonlPairs(args.train, tok, args.max_len)
    valid_ds = JsonlPairs(args.valid, tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.micro_bsz, sampler=sampler, drop_last=True,
                        collate_fn=lambda b: pad_pairs(b, tok.pad_token_id))
    ds_config["scheduler"]["params"]["total_num_steps"] = max(
        1, args.epochs * len(loader) // args.grad_accum)

    model = LlamaRM(args.base)
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    # every rank joins the gather; only rank 0 reads the full tensor
    with deepspeed.zero.GatheredParameters([engine.module.v_head.weight], modifier_rank=None):
        if rank == 0:
            print(f"v_head init norm {engine.module.v_head.weight.float().norm():.4f}, "
                  f"world={world}, micro steps/epoch={len(loader)}", flush=True)

    def evaluate():
        engine.eval()
        mine = valid_ds.items[rank::world]
        # same number of forwards on every rank: ZeRO-3 gathers parameters collectively
        n_batches = torch.tensor([(len(mine) + args.micro_bsz - 1) // args.micro_bsz], device=device)
        dist.all_reduce(n_batches, op=dist.ReduceOp.MAX)
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for b in range(int(n_batches.item())):
                chunk = mine[b * args.micro_bsz:(b + 1) * args.micro_bsz]
                real = len(chunk)
                if real == 0:
                    chunk = valid_ds.items[:1]
                ids, att = pad_pairs(chunk, tok.pad_token_id)
                r = engine(ids.to(device), att.to(device))
                rc, rr = r.chunk(2)
                if real:
                    tot[0] += (rc > rr).sum()
                    tot[1] += real
        dist.all_reduce(tot)
        engine.train()
        return (tot[0] / tot[1]).item()

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for ids, att in loader:
            r = engine(ids.to(device), att.to(device))
            rc, rr = r.chunk(2)
            loss = -F.logsigmoid(rc - rr).mean()
            engine.backward(loss)
            engine.step()
            step += 1
            if step % args.grad_accum == 0:
                opt_step = step // args.grad_accum
                if opt_step % 10 == 0:
                    l = loss.detach().clone()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"epoch {epoch} opt_step {opt_step} loss {l.item():.4f} "
                              f"lr {engine.get_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
                if opt_step % args.eval_interval == 0:
                    acc = evaluate()
                    if rank == 0:
                        print(f"opt_step {opt_step} valid acc {acc:.4f}", flush=True)

        engine.save_checkpoint(os.path.join(args.out, "ds_ckpt"), tag=f"epoch{epoch}")

    acc = evaluate()
    if rank == 0:
        print(f"final valid acc {acc:.4f}")
        os.makedirs(args.out, exist_ok=True)
        tok.save_pretrained(args.out)
    # collective: gathers the ZeRO-3 shards and writes one consolidated bf16 state dict on rank 0
    engine.save_16bit_model(args.out, "reward_model.bin")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
