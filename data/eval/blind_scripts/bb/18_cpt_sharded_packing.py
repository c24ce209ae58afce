"""Continued pretraining on a large jsonl corpus with sequence packing, torchrun + DDP.

The corpus is big, so each rank only reads and tokenizes its own contiguous slice of the
documents (no rank ever touches the whole file), then packs its slice into fixed-length blocks.

    torchrun --nproc_per_node=8 18_cpt_sharded_packing.py --train_file /data/pile_subset.jsonl \
        --eval_file /data/pile_val_5k.jsonl --model Qwen/Qwen2.5-1.5B --out runs/q1.5b-cpt
"""
import argparse
import itertools
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_cosine_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_file", required=True)
    ap.add_argument("--eval_file", required=True)
    ap.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    ap.add_argument("--out", default="runs/cpt")
    ap.add_argument("--block_size", type=int, default=4096)
    ap.add_argument("--micro_bsz", type=int, default=1)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval_every", type=int, default=200)
    ap.add_argument("--save_every", type=int, default=1000)
    return ap.parse_args()


def tokenize_and_pack(tok, block_size):
    def fn(batch):
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        stream = list(itertools.chain.from_iterable(x + [tok.eos_token_id] for x in ids))
        n = len(stream) // block_size
        blocks = [stream[i * block_size:(i + 1) * block_size] for i in range(n)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return fn


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            tot[0] += model(**batch).loss.float()
        tot[1] += 1
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    pack = tokenize_and_pack(tok, args.block_size)

    # training data: this rank's slice of the documents only
    train_docs = load_dataset("json", data_files=args.train_file, split="train")
    train_docs = train_docs.shard(num_shards=world, index=rank, contiguous=True)
    train_ds = train_docs.map(pack, batched=True, batch_size=1000, remove_columns=train_docs.column_names,
                              num_proc=8, desc=f"pack rank {rank}")
    train_dl = DataLoader(train_ds, batch_size=args.micro_bsz, shuffle=True, collate_fn=default_data_collator,
                          num_workers=4, pin_memory=True, drop_last=True)

    # eval data is small: packed once by rank 0, then every rank takes a strided share of the blocks
    if rank != 0:
        dist.barrier()
    eval_docs = load_dataset("json", data_files=args.eval_file, split="train")
    eval_ds = eval_docs.map(pack, batched=True, batch_size=1000, remove_columns=eval_docs.column_names)
    if rank == 0:
        dist.barrier()
    n_eval = (len(eval_ds) // world) * world
    eval_dl = DataLoader(Subset(eval_ds, range(rank, n_eval, world)), batch_size=args.micro_bsz,
                         collate_fn=default_data_collator)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = len(train_dl) // args.accum
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, total)
    print(f"[rank {rank}] {len(train_docs)} docs -> {len(train_ds)} blocks, {total} optimizer steps", flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    t0 = time.time()
    model.train()
    for i, batch in enumerate(train_dl):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        sync = (i + 1) % args.accum == 0
        if sync:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            (loss / args.accum).backward()
        else:
            with model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss
                (loss / args.accum).backward()
            continue

        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            l = loss.detach().float()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                tps = 10 * args.accum * args.micro_bsz * args.block_size * world / (time.time() - t0)
                print(f"step {step}/{total} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"tok/s {tps:,.0f}", flush=True)
            t0 = time.time()

        if step % args.eval_every == 0:
            vl = run_eval(model, eval_dl, device)
            if rank == 0:
                print(f"step {step} eval_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

        if step % args.save_every == 0:
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.out, f"step_{step}"))
            dist.barrier()

    vl = run_eval(model, eval_dl, device)
    if rank == 0:
        print(f"final eval_loss {vl:.4f}", flush=True)
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
