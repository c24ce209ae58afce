"""LoRA instruction tuning of GPT-2-XL with DDP, packed sequences, tokenized once and cached.

    torchrun --nproc_per_node=8 18_lora_gpt2_instruct.py --data data/alpaca_cleaned.json \
        --cache-dir /shared/cache/tok --out /shared/runs/gpt2xl_lora
"""
import argparse
import hashlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

TEMPLATE = ("Below is an instruction that describes a task. Write a response that appropriately completes "
            "the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--data", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--eval-frac", type=float, default=0.02)
    ap.add_argument("--micro-bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--r", type=int, default=16)
    return ap.parse_args()


def format_example(ex):
    inp = f"### Input:\n{ex['input']}\n\n" if ex.get("input") else ""
    return TEMPLATE.format(instruction=ex["instruction"], input_block=inp), ex["output"]


def pack(tokenizer, examples, seq_len):
    """Concatenate prompt+response pairs into fixed-length blocks; prompt tokens are not trained on."""
    ids_stream, lab_stream = [], []
    for ex in examples:
        prompt, answer = format_example(ex)
        p = tokenizer(prompt)["input_ids"]
        a = tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]
        ids_stream += p + a
        lab_stream += [-100] * len(p) + a
    n_blocks = len(ids_stream) // seq_len
    ids = torch.tensor(ids_stream[: n_blocks * seq_len]).view(n_blocks, seq_len)
    labels = torch.tensor(lab_stream[: n_blocks * seq_len]).view(n_blocks, seq_len)
    return ids, labels


def load_or_build(args, tokenizer):
    key = hashlib.md5(f"{args.data}|{args.model}|{args.seq_len}|{args.eval_frac}".encode()).hexdigest()[:12]
    path = os.path.join(args.cache_dir, f"packed_{key}.pt")
    if os.path.exists(path):
        return torch.load(path)
    with open(args.data) as f:
        examples = json.load(f)
    n_eval = int(len(examples) * args.eval_frac)
    data = {
        "train": pack(tokenizer, examples[n_eval:], args.seq_len),
        "eval": pack(tokenizer, examples[:n_eval], args.seq_len),
    }
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.save(data, path)
    return data


class Blocks(Dataset):
    def __init__(self, ids, labels):
        self.ids, self.labels = ids, labels

    def __len__(self):
        return self.ids.size(0)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**b).loss
        n = (b["labels"][:, 1:] != -100).sum()
        t += torch.stack([loss.float() * n, n.float()])
    dist.all_reduce(t)
    model.train()
    return (t[0] / t[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = load_or_build(args, tokenizer)
    train_ds, eval_ds = Blocks(*data["train"]), Blocks(*data["eval"])

    model = AutoModelForCausalLM.from_pretrained(args.model)
    lcfg = LoraConfig(r=args.r, lora_alpha=2 * args.r, lora_dropout=0.05, target_modules=["c_attn", "c_proj"],
                      fan_in_fan_out=True, task_type="CAUSAL_LM")
    model = get_peft_model(model, lcfg).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=train_sampler, num_workers=2, pin_memory=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.micro_bs, sampler=eval_sampler, num_workers=2)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    updates = args.epochs * (len(train_dl) // args.accum)
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * updates), updates)
    if rank == 0:
        print(f"{len(train_ds)} train blocks, {len(eval_ds)} eval blocks; {updates} updates; "
              f"tokens/update {args.micro_bs * args.accum * world * args.seq_len}")

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            boundary = (i + 1) % args.accum == 0
            if boundary:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.accum
                loss.backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(**batch).loss / args.accum
                    loss.backward()
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"ep {epoch} upd {step}/{updates} loss {loss.item() * args.accum:.4f} "
                      f"{(time.time() - t0) / (i + 1):.2f}s/it")

        ev = evaluate(model, eval_dl, device)
        if rank == 0:
            print(f"epoch {epoch} eval loss {ev:.4f} ppl {math.exp(ev):.2f}")
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
        dist.barrier()

    if rank == 0:
        merged = model.module.merge_and_unload()
        merged.save_pretrained(os.path.join(args.out, "merged"), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(args.out, "merged"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
