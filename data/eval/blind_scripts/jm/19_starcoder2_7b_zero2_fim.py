"""StarCoder2-7B FIM fine-tune with DeepSpeed ZeRO-2 (bf16, CPU-free), 4k packed context.

Runs on the 4x H100 workstation:
    deepspeed --num_gpus 4 19_starcoder2_7b_zero2_fim.py --data_dir /data/fim_corpus
"""
import argparse
import glob
import json
import math
import os

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

DS_CONFIG = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 16,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 2e8,
        "reduce_bucket_size": 2e8,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": 3000, "warmup_num_steps": 100, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1},
    },
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bigcode/starcoder2-7b")
    p.add_argument("--data_dir", required=True)
    p.add_argument("--output_dir", default="/data/ckpt/sc2-7b-fim")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--fim_rate", type=float, default=0.5)
    p.add_argument("--max_steps", type=int, default=3000)
    p.add_argument("--eval_every", type=int, default=250)
    p.add_argument("--save_every", type=int, default=500)
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--seed", type=int, default=99)
    return p.parse_args()


def fim_permute(ids, rng, rate, pre, mid, suf):
    if len(ids) < 3 or rng.random() > rate:
        return ids
    lo, hi = np.sort(rng.choice(len(ids) + 1, size=2, replace=False))
    return [pre] + ids[:lo] + [suf] + ids[hi:] + [mid] + ids[lo:hi]


class FIMBlocks(Dataset):
    def __init__(self, files, tok, seq_len, fim_rate, seed):
        rng = np.random.default_rng(seed)
        pre, mid, suf = tok.convert_tokens_to_ids(["<fim_prefix>", "<fim_middle>", "<fim_suffix>"])
        stream = []
        for fn in files:
            with open(fn) as f:
                for line in f:
                    ids = tok(json.loads(line)["content"], add_special_tokens=False)["input_ids"]
                    stream += fim_permute(ids, rng, fim_rate, pre, mid, suf)
                    stream.append(tok.eos_token_id)
        n = len(stream) // seq_len
        self.data = torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def evaluate(engine, loader):
    engine.eval()
    acc = torch.zeros(2, device=engine.device)
    with torch.no_grad():
        for x in loader:
            x = x.to(engine.device)
            acc[0] += engine(input_ids=x, labels=x).loss.float()
            acc[1] += 1
    dist.all_reduce(acc)
    engine.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_files = sorted(glob.glob(os.path.join(args.data_dir, "train", "*.jsonl")))
    val_files = sorted(glob.glob(os.path.join(args.data_dir, "valid", "*.jsonl")))
    train_ds = FIMBlocks(train_files, tok, args.seq_len, args.fim_rate, args.seed)
    val_ds = FIMBlocks(val_files, tok, args.seq_len, args.fim_rate, args.seed + 1)

    micro_bs = DS_CONFIG["train_micro_batch_size_per_gpu"]
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=micro_bs, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=micro_bs, num_workers=2,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=DS_CONFIG,
    )
    if rank == 0:
        print(f"{len(train_ds)} train blocks, world {world}, "
              f"global batch {engine.train_batch_size()} sequences", flush=True)

    epoch, done = 0, False
    while not done:
        sampler.set_epoch(epoch)
        for i, x in enumerate(loader):
            x = x.to(engine.device, non_blocking=True)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            if (i + 1) % engine.gradient_accumulation_steps() != 0:
                continue
            step = engine.global_steps
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step}/{args.max_steps} loss {loss.item():.4f} "
                      f"lr {engine.get_lr()[0]:.2e}", flush=True)
            if step % args.eval_every == 0:
                vl = evaluate(engine, val_loader)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            if step % args.save_every == 0:
                engine.save_checkpoint(args.output_dir, tag=f"step{step}")
            if step >= args.max_steps:
                done = True
                break
        epoch += 1

    engine.save_checkpoint(args.output_dir, tag="final")
    if rank == 0:
        engine.module.save_pretrained(os.path.join(args.output_dir, "hf_final"))
        tok.save_pretrained(os.path.join(args.output_dir, "hf_final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
