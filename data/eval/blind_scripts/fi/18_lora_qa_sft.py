#!/usr/bin/env python
"""LoRA SFT for retrieval-augmented QA (answers grounded in retrieved passages).

    torchrun --nproc_per_node=8 18_lora_qa_sft.py --model meta-llama/Llama-2-13b-hf \
        --train data/rag_qa/train.jsonl --dev data/rag_qa/dev.jsonl --out runs/ragqa-lora
"""
import argparse
import contextlib
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup, set_seed
from peft import LoraConfig, get_peft_model
import wandb

logger = logging.getLogger("ragqa")


def build_prompt(ex, k):
    ctx = "\n\n".join(f"[{i + 1}] {p['title']}\n{p['text']}" for i, p in enumerate(ex["passages"][:k]))
    return f"Answer the question using the passages. Cite passages like [1].\n\n{ctx}\n\nQuestion: {ex['question']}\nAnswer:"


class RagQADataset(Dataset):
    def __init__(self, path, tok, max_len, k):
        self.ex = []
        for line in open(path):
            ex = json.loads(line)
            ans = tok(" " + ex["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            prm = tok(build_prompt(ex, k))["input_ids"][: max_len - len(ans)]
            self.ex.append((prm + ans, [-100] * len(prm) + ans))

    def __len__(self):
        return len(self.ex)

    def __getitem__(self, i):
        return self.ex[i]


class Pad:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        n = max(len(x) for x, _ in batch)
        return {
            "input_ids": torch.tensor([x + [self.pad_id] * (n - len(x)) for x, _ in batch]),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x, _ in batch]),
            "labels": torch.tensor([y + [-100] * (n - len(y)) for _, y in batch]),
        }


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot_loss = torch.zeros(1, device=device, dtype=torch.float64)
    tot_tok = torch.zeros(1, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        n = (batch["labels"][:, 1:] != -100).sum()
        tot_loss += loss.double() * n
        tot_tok += n
    dist.all_reduce(tot_loss)
    dist.all_reduce(tot_tok)
    model.train()
    return (tot_loss / tot_tok).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-13b-hf")
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", default="runs/ragqa-lora")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max_len", type=int, default=3072)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--eval_every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.unk_token

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(
        r=args.r, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds = RagQADataset(args.train, tok, args.max_len, args.k)
    dev_ds = RagQADataset(args.dev, tok, args.max_len, args.k)
    pad = Pad(tok.pad_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=pad,
                          num_workers=2, pin_memory=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=2, collate_fn=pad)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    n_updates = math.ceil(len(train_dl) / args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * n_updates), n_updates)

    if rank == 0:
        wandb.init(project="rag-qa", config=vars(args) | {"world_size": world})

    upd, best = 0, float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            boundary = (i + 1) % args.accum == 0 or (i + 1) == len(train_dl)
            with contextlib.nullcontext() if boundary else model.no_sync():
                loss = model(**batch).loss / args.accum
                loss.backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            upd += 1

            if rank == 0 and upd % 10 == 0:
                wandb.log({"train/loss": loss.item() * args.accum, "lr": sched.get_last_lr()[0],
                           "sec_per_update": (time.time() - t0) / 10}, step=upd)
                t0 = time.time()

            if rank == 0 and upd % args.eval_every == 0:
                dev_loss = evaluate(model.module, dev_dl, device)
                wandb.log({"dev/loss": dev_loss, "dev/ppl": math.exp(dev_loss)}, step=upd)
                logger.info("update %d dev loss %.4f", upd, dev_loss)
                if dev_loss < best:
                    best = dev_loss
                    model.module.save_pretrained(os.path.join(args.out, "best"))

        if rank == 0:
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
        dist.barrier()

    if rank == 0:
        tok.save_pretrained(os.path.join(args.out, "best"))
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
