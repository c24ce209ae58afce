"""
Pairwise reward-model training (Bradley-Terry loss) for a 7B backbone with DeepSpeed
ZeRO-Offload: ZeRO stage 2, fp32 master weights + Adam state on the CPU (DeepSpeedCPUAdam),
bf16 on the GPUs, HF gradient checkpointing.

    deepspeed --num_gpus 4 18_ds_offload_reward_model.py --data Anthropic/hh-rlhf --output rm-7b
"""
import argparse
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from deepspeed.ops.adam import DeepSpeedCPUAdam
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModel, AutoTokenizer


class RewardModel(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name, torch_dtype=torch.bfloat16)
        self.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.backbone.config.use_cache = False
        self.v_head = nn.Linear(self.backbone.config.hidden_size, 1, bias=False, dtype=torch.bfloat16)

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(dim=1) - 1  # right padding: index of the final real token
        pooled = h[torch.arange(h.size(0), device=h.device), last]
        return self.v_head(pooled).squeeze(-1).float()


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mistralai/Mistral-7B-v0.1")
    ap.add_argument("--data", default="Anthropic/hh-rlhf")
    ap.add_argument("--output", default="rm-7b")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--eval_every", type=int, default=200)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


def make_collate(tok, max_len):
    def collate(rows):
        chosen = tok([r["chosen"] for r in rows], truncation=True, max_length=max_len, padding=True,
                     return_tensors="pt")
        rejected = tok([r["rejected"] for r in rows], truncation=True, max_length=max_len, padding=True,
                       return_tensors="pt")
        return chosen["input_ids"], chosen["attention_mask"], rejected["input_ids"], rejected["attention_mask"]
    return collate


def pair_loss(model, batch, device):
    c_ids, c_mask, r_ids, r_mask = (t.to(device, non_blocking=True) for t in batch)
    r_c = model(c_ids, c_mask)
    r_r = model(r_ids, r_mask)
    return -nn.functional.logsigmoid(r_c - r_r).mean(), r_c, r_r


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for batch in loader:
        loss, r_c, r_r = pair_loss(engine, batch, engine.device)
        correct += (r_c > r_r).sum().item()
        total += r_c.numel()
        loss_sum += loss.item() * r_c.numel()
    stats = torch.tensor([correct, total, loss_sum], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    engine.train()
    return (stats[0] / stats[1]).item(), (stats[2] / stats[1]).item()


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token
    tok.padding_side = "right"

    raw = load_dataset(args.data)
    train, test = raw["train"], raw["test"].select(range(2048))
    collate = make_collate(tok, args.max_len)
    train_sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train_loader = DataLoader(train, batch_size=args.micro_bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=2, drop_last=True)
    test_loader = DataLoader(test, batch_size=args.micro_bs * 2,
                             sampler=DistributedSampler(test, num_replicas=world, rank=rank, shuffle=False),
                             collate_fn=collate)

    model = RewardModel(args.model)
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    updates = args.epochs * len(train_loader) // args.accum
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 2e8,
        },
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": updates, "warmup_num_steps": max(1, updates // 30)}},
        "steps_per_print": 10**9,
    }
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    micro = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            loss, _, _ = pair_loss(engine, batch, engine.device)
            engine.backward(loss)
            engine.step()
            micro += 1
            if micro % args.accum:
                continue
            step = micro // args.accum
            if rank == 0 and step % 10 == 0:
                print(f"step {step}/{updates} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 10:.1f}s/step", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                acc, vloss = evaluate(engine, test_loader)
                if rank == 0:
                    print(f"[eval] step {step} pair-acc {acc:.4f} loss {vloss:.4f}", flush=True)

    acc, vloss = evaluate(engine, test_loader)
    if rank == 0:
        print(f"final pair-acc {acc:.4f} loss {vloss:.4f}", flush=True)
    engine.save_checkpoint(os.path.join(args.output, "ds"), tag="final")
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        torch.save(engine.module.state_dict(), os.path.join(args.output, "reward_model.pt"))
        tok.save_pretrained(args.output)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
