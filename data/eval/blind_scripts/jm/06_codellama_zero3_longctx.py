"""Long-context (16k) infilling fine-tune of CodeLlama-7B with DeepSpeed ZeRO-3.

    deepspeed --num_gpus 8 06_codellama_zero3_longctx.py --train_glob "/data/repos/train-*.jsonl"
"""
import argparse
import glob
import json
import math
import os
import random

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="codellama/CodeLlama-7b-hf")
    ap.add_argument("--train_glob", required=True)
    ap.add_argument("--val_glob", default="/data/repos/val-*.jsonl")
    ap.add_argument("--output_dir", default="/data/ckpt/codellama7b-infill-16k")
    ap.add_argument("--seq_len", type=int, default=16384)
    ap.add_argument("--micro_bs", type=int, default=1)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--fim_rate", type=float, default=0.9)
    ap.add_argument("--save_interval", type=int, default=200)
    ap.add_argument("--local_rank", type=int, default=-1)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def ds_config(args, world_size, total_steps):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bs * args.grad_accum * world_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": total_steps, "warmup_num_steps": args.warmup},
        },
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
        },
        "steps_per_print": 50,
        "wall_clock_breakdown": False,
    }


class InfillBlocks(Dataset):
    """Whole files, optionally FIM-permuted into CodeLlama's <PRE>/<SUF>/<MID> format, packed."""

    def __init__(self, files, tok, seq_len, fim_rate, seed):
        rng = random.Random(seed)
        buf = []
        for fn in files:
            with open(fn) as f:
                for line in f:
                    ids = tok.encode(json.loads(line)["content"], add_special_tokens=False)
                    if len(ids) > 16 and rng.random() < fim_rate:
                        i, j = sorted(rng.sample(range(len(ids)), 2))
                        ids = ([tok.bos_token_id, tok.prefix_id] + ids[:i] + [tok.suffix_id] + ids[j:]
                               + [tok.middle_id] + ids[i:j] + [tok.eot_id])
                    else:
                        ids = [tok.bos_token_id] + ids + [tok.eos_token_id]
                    buf.extend(ids)
        n = len(buf) // seq_len
        self.data = torch.tensor(buf[: n * seq_len], dtype=torch.long).view(n, seq_len)

    def __len__(self):
        return self.data.size(0)

    def __getitem__(self, i):
        return self.data[i]


def evaluate(engine, loader):
    engine.eval()
    tot = torch.zeros(2, device=engine.device)
    with torch.no_grad():
        for x in loader:
            x = x.to(engine.device)
            tot[0] += engine(input_ids=x, labels=x).loss.float()
            tot[1] += 1
    dist.all_reduce(tot)
    engine.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_files = sorted(glob.glob(args.train_glob))
    val_files = sorted(glob.glob(args.val_glob))
    train_ds = InfillBlocks(train_files, tok, args.seq_len, args.fim_rate, args.seed)
    val_ds = InfillBlocks(val_files, tok, args.seq_len, args.fim_rate, args.seed + 1)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=2, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))

    total_steps = math.ceil(len(loader) / args.grad_accum) * args.epochs
    cfg = ds_config(args, world, total_steps)
    dschf = HfDeepSpeedConfig(cfg)  # keep a reference; transformers looks it up in from_pretrained

    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        torch_dtype=torch.bfloat16,
        attn_implementation="flash_attention_2",
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    if rank == 0:
        print(f"files={len(train_files)} blocks={len(train_ds)} steps={total_steps} world={world}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, x in enumerate(loader):
            x = x.to(engine.device, non_blocking=True)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()

            if (it + 1) % args.grad_accum == 0:
                gs = engine.global_steps
                if gs % 10 == 0 and rank == 0:
                    print(f"epoch {epoch} step {gs} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e}", flush=True)
                if gs % args.save_interval == 0:
                    engine.save_checkpoint(args.output_dir, tag=f"step{gs}")

        val = evaluate(engine, val_loader)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val:.4f} ppl {math.exp(val):.2f}", flush=True)

    if rank == 0:
        final_dir = os.path.join(args.output_dir, "hf_final")
        engine.module.save_pretrained(final_dir, safe_serialization=True)
        tok.save_pretrained(final_dir)
        print(f"saved {final_dir}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
