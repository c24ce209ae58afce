"""Padding-free SFT with FlashAttention-2 (examples concatenated into one row, position_ids
reset per example via DataCollatorWithFlattening), torchrun + DDP.

    torchrun --nproc_per_node=8 15_sft_flatten_fa2.py --model Qwen/Qwen2.5-3B --out runs/q3b-tulu
"""
import argparse
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening, get_wsd_schedule


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-3B")
    ap.add_argument("--dataset", default="allenai/tulu-3-sft-mixture")
    ap.add_argument("--out", default="runs/sft")
    ap.add_argument("--max_len", type=int, default=4096)
    ap.add_argument("--examples_per_batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--decay", type=int, default=1000)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--n_eval", type=int, default=2048)
    ap.add_argument("--save_every", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def make_encoder(tok, max_len):
    def encode(ex):
        msgs = ex["messages"]
        ids, labels = [], []
        for k in range(len(msgs)):
            prefix = tok.apply_chat_template(msgs[:k], tokenize=False) if k else ""
            upto = tok.apply_chat_template(msgs[: k + 1], tokenize=False)
            seg = tok(upto[len(prefix):], add_special_tokens=False)["input_ids"]
            ids.extend(seg)
            labels.extend(seg if msgs[k]["role"] == "assistant" else [-100] * len(seg))
        return {"input_ids": ids[:max_len], "labels": labels[:max_len]}

    return encode


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    num = torch.zeros((), device=device, dtype=torch.float64)
    den = torch.zeros((), device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        n = (batch["labels"][:, 1:] != -100).sum()
        num += out.loss.double() * n
        den += n
    dist.all_reduce(num)
    dist.all_reduce(den)
    model.train()
    return (num / den).item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)

    if rank != 0:
        dist.barrier()
    ds = load_dataset(args.dataset, split="train")
    ds = ds.train_test_split(test_size=args.n_eval, seed=args.seed)
    ds = ds.map(make_encoder(tok, args.max_len), remove_columns=ds["train"].column_names, num_proc=32)
    ds = ds.filter(lambda ex: any(l != -100 for l in ex["labels"]), num_proc=32)
    if rank == 0:
        dist.barrier()

    collator = DataCollatorWithFlattening(return_position_ids=True)
    train_sampler = DistributedSampler(ds["train"], shuffle=True, seed=args.seed, drop_last=True)
    eval_sampler = DistributedSampler(ds["test"], shuffle=False)
    train_dl = DataLoader(ds["train"], batch_size=args.examples_per_batch, sampler=train_sampler,
                          collate_fn=collator, num_workers=4, pin_memory=True)
    eval_dl = DataLoader(ds["test"], batch_size=args.examples_per_batch, sampler=eval_sampler,
                         collate_fn=collator, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank], bucket_cap_mb=100)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = get_wsd_schedule(opt, num_warmup_steps=args.warmup, num_decay_steps=args.decay,
                             num_stable_steps=args.steps - args.warmup - args.decay)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    it = infinite(train_dl, train_sampler)
    model.train()
    t0 = time.time()
    ntok = 0
    for step in range(1, args.steps + 1):
        batch = {k: v.to(device, non_blocking=True) for k, v in next(it).items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        ntok += batch["input_ids"].numel()

        if step % 20 == 0:
            stats = torch.tensor([loss.item(), float(ntok)], device=device)
            dist.all_reduce(stats)
            if rank == 0:
                dt = time.time() - t0
                print(f"step {step}/{args.steps} loss {stats[0].item() / world:.4f} gnorm {gnorm.item():.2f} "
                      f"lr {sched.get_last_lr()[0]:.2e} tok/s {stats[1].item() / dt:,.0f}", flush=True)
            t0, ntok = time.time(), 0

        if rank == 0 and step % args.eval_every == 0:
            vl = evaluate(model.module, eval_dl, device)
            print(f"step {step} eval_loss {vl:.4f} eval_ppl {math.exp(vl):.2f}", flush=True)

        if step % args.save_every == 0:
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.out, f"step-{step}"))
                tok.save_pretrained(os.path.join(args.out, f"step-{step}"))
            dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
