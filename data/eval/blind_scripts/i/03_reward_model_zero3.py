#!/usr/bin/env python
# Bradley-Terry reward model on preference pairs, DeepSpeed ZeRO-3.
#   deepspeed --num_gpus 8 03_reward_model_zero3.py --base mistralai/Mistral-7B-v0.3 \
#       --train data/prefs_train.jsonl --eval data/prefs_eval.jsonl --out rm/mistral7b
import argparse
import functools
import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--out", default="rm/out")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--micro_bsz", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=9e-6)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--margin_weight", type=float, default=0.0)
    ap.add_argument("--eval_every", type=int, default=200)
    ap.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    return ap.parse_args()


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bsz,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.total_steps, "warmup_num_steps": 50,
                                 "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }


class PrefPairs(Dataset):
    def __init__(self, path, tok, max_len):
        self.rows = [json.loads(l) for l in open(path)]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def _enc(self, prompt, resp):
        text = self.tok.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": resp}], tokenize=False)
        return self.tok(text, truncation=True, max_length=self.max_len, add_special_tokens=False)["input_ids"]

    def __getitem__(self, i):
        r = self.rows[i]
        return self._enc(r["prompt"], r["chosen"]), self._enc(r["prompt"], r["rejected"]), r.get("margin", 0.0)


def collate(batch, pad_id):
    seqs = [b[0] for b in batch] + [b[1] for b in batch]
    n = max(map(len, seqs))
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, -len(s):] = torch.tensor(s)  # left pad so the score head reads the last token
        att[i, -len(s):] = 1
    margin = torch.tensor([b[2] for b in batch], dtype=torch.float)
    return ids, att, margin


def pairwise_loss(rewards, margin, margin_weight):
    half = rewards.size(0) // 2
    r_c, r_r = rewards[:half], rewards[half:]
    loss = -F.logsigmoid(r_c - r_r - margin_weight * margin).mean()
    return loss, (r_c > r_r).float()


@torch.no_grad()
def evaluate(engine, loader, device, args):
    engine.eval()
    correct = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for ids, att, margin in loader:
        ids, att, margin = ids.to(device), att.to(device), margin.to(device)
        rewards = engine(input_ids=ids, attention_mask=att).logits.squeeze(-1).float()
        _, acc = pairwise_loss(rewards, margin, args.margin_weight)
        correct += acc.sum()
        count += acc.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    engine.train()
    return (correct / count).item()


def export_reward_model(engine, tok, out_dir):
    if dist.get_rank() != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in engine.module.state_dict().items()}
    torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))
    engine.module.config.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    print(f"exported reward model to {out_dir} ({len(state)} tensors)")


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.base)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    train_ds = PrefPairs(args.train, tok, args.max_len)
    eval_ds = PrefPairs(args.eval, tok, args.max_len)
    pad = tok.pad_token_id
    collate_fn = functools.partial(collate, pad_id=pad)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bsz, sampler=train_sampler,
                          collate_fn=collate_fn, num_workers=2, drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.micro_bsz * 2, sampler=DistributedSampler(eval_ds, shuffle=False),
                         collate_fn=collate_fn, num_workers=2)
    args.total_steps = max(1, math.ceil(len(train_dl) / args.grad_accum) * args.epochs)

    config = ds_config(args)
    dschf = HfDeepSpeedConfig(config)  # keep alive: makes from_pretrained load straight into ZeRO-3 shards
    model = AutoModelForSequenceClassification.from_pretrained(args.base, num_labels=1,
                                                               torch_dtype=torch.bfloat16)
    model.config.pad_token_id = pad
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for it, (ids, att, margin) in enumerate(train_dl):
            ids, att, margin = ids.to(device), att.to(device), margin.to(device)
            rewards = engine(input_ids=ids, attention_mask=att).logits.squeeze(-1).float()
            loss, acc = pairwise_loss(rewards, margin, args.margin_weight)
            engine.backward(loss)
            engine.step()

            if engine.is_gradient_accumulation_boundary() and engine.global_steps % 10 == 0:
                stats = torch.stack([loss.detach(), acc.mean()])
                dist.all_reduce(stats)
                stats /= world
                if rank == 0:
                    print(f"ep {epoch} step {engine.global_steps} loss {stats[0]:.4f} "
                          f"acc {stats[1]:.3f} lr {engine.get_lr()[0]:.2e}", flush=True)

            if engine.is_gradient_accumulation_boundary() and engine.global_steps % args.eval_every == 0:
                acc = evaluate(engine, eval_dl, device, args)
                if rank == 0:
                    print(f"[eval] step {engine.global_steps} pair_acc {acc:.4f}", flush=True)
                engine.save_checkpoint(os.path.join(args.out, "ds_ckpt"), tag=f"step{engine.global_steps}")
                if acc > best:
                    best = acc
                    export_reward_model(engine, tok, os.path.join(args.out, "best"))

    export_reward_model(engine, tok, os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
