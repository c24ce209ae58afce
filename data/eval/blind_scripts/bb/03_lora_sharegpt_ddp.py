"""LoRA SFT on ShareGPT-format conversations (local jsonl), torchrun + DDP.

    torchrun --nproc_per_node=4 03_lora_sharegpt_ddp.py --data data/sharegpt_clean.jsonl \
        --model mistralai/Mistral-7B-v0.1 --out runs/mistral-sharegpt-lora
"""
import argparse
import json
import logging
import math
import os
import random

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup, set_seed

logger = logging.getLogger("sft")

ROLE_PREFIX = {"system": "<|system|>\n", "human": "<|user|>\n", "gpt": "<|assistant|>\n"}


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="mistralai/Mistral-7B-v0.1")
    ap.add_argument("--out", default="runs/sft-lora")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bsz", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--val_frac", type=float, default=0.01)
    ap.add_argument("--lora_r", type=int, default=16)
    ap.add_argument("--lora_alpha", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def load_jsonl(path):
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            ex = json.loads(line)
            if ex.get("conversations"):
                records.append(ex)
    return records


class ConversationDataset(Dataset):
    def __init__(self, records, tokenizer, max_len):
        self.records = records
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        ids, labels = [self.tok.bos_token_id], [-100]
        for turn in self.records[idx]["conversations"]:
            role = turn["from"]
            text = ROLE_PREFIX.get(role, "<|user|>\n") + turn["value"].strip()
            if role == "gpt":
                text += self.tok.eos_token
            turn_ids = self.tok(text + "\n", add_special_tokens=False)["input_ids"]
            ids.extend(turn_ids)
            labels.extend(turn_ids if role == "gpt" else [-100] * len(turn_ids))
            if len(ids) >= self.max_len:
                break
        return {"input_ids": ids[: self.max_len], "labels": labels[: self.max_len]}


def collate(batch, pad_id):
    L = max(len(b["input_ids"]) for b in batch)
    out = {"input_ids": [], "labels": [], "attention_mask": []}
    for b in batch:
        n = len(b["input_ids"])
        out["input_ids"].append(b["input_ids"] + [pad_id] * (L - n))
        out["labels"].append(b["labels"] + [-100] * (L - n))
        out["attention_mask"].append([1] * n + [0] * (L - n))
    return {k: torch.tensor(v) for k, v in out.items()}


@torch.no_grad()
def eval_loss(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        shift_logits = logits[:, :-1].float()
        shift_labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
            ignore_index=-100, reduction="sum")
        tot[0] += loss
        tot[1] += (shift_labels != -100).sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    # offset by rank so dropout masks differ across ranks
    set_seed(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.unk_token or tok.eos_token

    records = load_jsonl(args.data)
    random.shuffle(records)
    n_val = max(1, int(len(records) * args.val_frac))
    val_records, train_records = records[:n_val], records[n_val:]
    train_ds = ConversationDataset(train_records, tok, args.max_len)
    val_ds = ConversationDataset(val_records, tok, args.max_len)
    logger.info("train=%d val=%d", len(train_ds), len(val_ds))

    pad_collate = lambda b: collate(b, tok.pad_token_id)  # noqa: E731
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bsz, sampler=train_sampler, collate_fn=pad_collate,
                          num_workers=4, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.bsz,
                        collate_fn=pad_collate, num_workers=2)

    base = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                attn_implementation="sdpa")
    base.config.use_cache = False
    lora_cfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.05, bias="none",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                          task_type="CAUSAL_LM")
    model = get_peft_model(base, lora_cfg)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if rank == 0:
        model.print_trainable_parameters()
    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])

    params = [p for p in ddp_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    updates_per_epoch = len(train_dl) // args.accum
    total = updates_per_epoch * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.03 * total), total)

    step = 0
    best = math.inf
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device) for k, v in batch.items()}
            last_micro = (i + 1) % args.accum == 0
            if last_micro:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = ddp_model(**batch).loss
                (loss / args.accum).backward()
            else:
                with ddp_model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = ddp_model(**batch).loss
                    (loss / args.accum).backward()
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 25 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, total, l.item(),
                            sched.get_last_lr()[0])

        with torch.autocast("cuda", dtype=torch.bfloat16):
            vl = eval_loss(ddp_model.module, val_dl, device)
        logger.info("epoch %d val loss %.4f", epoch, vl)
        if rank == 0 and vl < best:
            best = vl
            ddp_model.module.save_pretrained(os.path.join(args.out, "best"))
            tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    if rank == 0:
        ddp_model.module.save_pretrained(os.path.join(args.out, "last"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
