"""RoBERTa-base style MLM pretraining from scratch with DDP + fp16 + grad accumulation.

torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node01:29400 \
    11_ddp_mlm_pretrain.py --data /lustre/corpus/roberta_512.bin --save_dir /lustre/ckpt/roberta_base
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import DataCollatorForLanguageModeling, RobertaConfig, RobertaForMaskedLM, RobertaTokenizerFast


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="int32 token ids, rows of --seq_len")
    p.add_argument("--tokenizer", default="roberta-base")
    p.add_argument("--save_dir", required=True)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--peak_lr", type=float, default=6e-4)
    p.add_argument("--warmup_updates", type=int, default=24000)
    p.add_argument("--total_updates", type=int, default=500000)
    p.add_argument("--log_interval", type=int, default=100)
    p.add_argument("--save_interval", type=int, default=10000)
    return p.parse_args()


class PackedRows(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.int32, mode="r").reshape(-1, seq_len)

    def __len__(self):
        return self.data.shape[0]

    def __getitem__(self, i):
        return {"input_ids": torch.from_numpy(self.data[i].astype(np.int64))}


def poly_lr(step, args):
    if step < args.warmup_updates:
        return step / args.warmup_updates
    return max(0.0, (args.total_updates - step) / (args.total_updates - args.warmup_updates))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = RobertaTokenizerFast.from_pretrained(args.tokenizer)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)
    ds = PackedRows(args.data, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=17)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collator,
                        num_workers=4, pin_memory=True, drop_last=True)

    config = RobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=args.seq_len + 2,
                           hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           intermediate_size=3072, type_vocab_size=1)
    model = RobertaForMaskedLM(config).to(device)
    model = DDP(model, device_ids=[local_rank], bucket_cap_mb=50)

    no_decay = ["bias", "LayerNorm.weight"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.peak_lr, betas=(0.9, 0.98), eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: poly_lr(s, args))
    scaler = torch.cuda.amp.GradScaler(init_scale=2**7, growth_interval=2000)

    updates, epoch = 0, 0
    ckpt_file = os.path.join(args.save_dir, "checkpoint_last.pt")
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        updates, epoch = ck["updates"], ck["epoch"]

    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"params {n / 1e6:.1f}M | world {world} | tokens/update "
              f"{args.batch_size * args.accum * world * args.seq_len}", flush=True)

    model.train()
    start = time.time()
    while updates < args.total_updates:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            is_update = (i + 1) % args.accum == 0
            with (contextlib.nullcontext() if is_update else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                scaler.scale(loss / args.accum).backward()
            if not is_update:
                continue

            scaler.unscale_(optimizer)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            updates += 1

            if rank == 0 and updates % args.log_interval == 0:
                stats = torch.stack([loss.detach().float(), gnorm.float()])
                dist.all_reduce(stats, op=dist.ReduceOp.SUM)
                stats /= world
                elapsed = time.time() - start
                print(f"upd {updates} | loss {stats[0].item():.4f} | ppl {math.exp(stats[0].item()):.2f} "
                      f"| gnorm {stats[1].item():.3f} | lr {scheduler.get_last_lr()[0]:.3e} "
                      f"| scale {scaler.get_scale():.0f} | {elapsed / args.log_interval:.2f}s/upd", flush=True)
                start = time.time()

            if updates % args.save_interval == 0:
                if rank == 0:
                    os.makedirs(args.save_dir, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                                "updates": updates, "epoch": epoch}, ckpt_file + ".tmp")
                    os.replace(ckpt_file + ".tmp", ckpt_file)
                dist.barrier()
            if updates >= args.total_updates:
                break
        epoch += 1

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.save_dir, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
