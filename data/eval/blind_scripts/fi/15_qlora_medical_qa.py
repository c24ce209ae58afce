#!/usr/bin/env python
"""QLoRA fine-tuning on de-identified clinical Q&A (MedQA-style multiple choice + rationale).

    torchrun --nproc_per_node=4 15_qlora_medical_qa.py --model_id epfl-llm/meditron-7b \
        --train_path data/medqa/train.jsonl --eval_path data/medqa/dev.jsonl \
        --save_dir runs/medqa-qlora
"""
import argparse
import json
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    get_linear_schedule_with_warmup,
)
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

log = logging.getLogger("medqa")
LETTERS = "ABCDE"


def format_question(ex):
    opts = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(ex["options"]))
    return f"Question: {ex['question']}\nOptions:\n{opts}\nAnswer with the letter, then explain.\nAnswer:"


class MedQADataset(Dataset):
    def __init__(self, path, tok, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                q = tok(format_question(ex))["input_ids"]
                a = f" {ex['answer_idx']}. {ex.get('rationale', '')}".rstrip()
                a_ids = tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                ids = (q + a_ids)[:max_len]
                self.items.append({"input_ids": ids,
                                   "labels": ([-100] * len(q) + a_ids)[:max_len],
                                   "answer_pos": len(q)})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, feats):
        L = max(len(f["input_ids"]) for f in feats)
        ids = torch.full((len(feats), L), self.pad_id, dtype=torch.long)
        labels = torch.full((len(feats), L), -100, dtype=torch.long)
        mask = torch.zeros((len(feats), L), dtype=torch.long)
        for i, f in enumerate(feats):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = torch.tensor(f["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "answer_pos": torch.tensor([f["answer_pos"] for f in feats])}


@torch.no_grad()
def evaluate(model, loader, device):
    """Token loss + letter accuracy (argmax at the first answer token)."""
    model.eval()
    agg = torch.zeros(4, device=device)  # loss*tokens, tokens, correct, total
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        pos = batch.pop("answer_pos")
        out = model(**batch)
        ntok = (batch["labels"][:, 1:] != -100).sum()
        agg[0] += out.loss.float() * ntok
        agg[1] += ntok
        rows = torch.arange(pos.size(0), device=device)
        pred = out.logits[rows, pos - 1].argmax(-1)  # first answer token is the option letter
        gold = batch["input_ids"][rows, pos]
        agg[2] += (pred == gold).sum()
        agg[3] += pos.size(0)
    dist.all_reduce(agg)
    model.train()
    return (agg[0] / agg[1]).item(), (agg[2] / agg[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_id", default="epfl-llm/meditron-7b")
    ap.add_argument("--train_path", required=True)
    ap.add_argument("--eval_path", required=True)
    ap.add_argument("--save_dir", default="runs/medqa-qlora")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lora_r", type=int, default=16)
    ap.add_argument("--seed", type=int, default=2024)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    tok = AutoTokenizer.from_pretrained(args.model_id)
    tok.pad_token_id = 0 if tok.pad_token_id is None else tok.pad_token_id

    model = AutoModelForCausalLM.from_pretrained(
        args.model_id,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True,
                                               bnb_4bit_compute_dtype=torch.bfloat16),
        torch_dtype=torch.bfloat16,
        device_map={"": local_rank},
    )
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.1,
                                             target_modules=["q_proj", "v_proj", "k_proj", "o_proj"],
                                             task_type="CAUSAL_LM"))
    if rank == 0:
        model.print_trainable_parameters()
    model = DDP(model, device_ids=[local_rank])

    train_ds = MedQADataset(args.train_path, tok, args.max_len)
    eval_ds = MedQADataset(args.eval_path, tok, args.max_len)
    collate = Collate(tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, pin_memory=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.batch_size, sampler=eval_sampler, collate_fn=collate)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.05 * total), total)

    best_acc = -1.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            batch.pop("answer_pos")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                log.info("ep %d step %d/%d loss %.4f", epoch, step, total, loss.item())

        with torch.autocast("cuda", dtype=torch.bfloat16):
            eval_loss, eval_acc = evaluate(model, eval_loader, device)
        log.info("epoch %d eval loss %.4f ppl %.2f acc %.4f", epoch, eval_loss, math.exp(eval_loss), eval_acc)

        if eval_acc > best_acc:
            best_acc = eval_acc
            if rank == 0:
                out = os.path.join(args.save_dir, "best")
                model.save_pretrained(out)
                tok.save_pretrained(out)
                with open(os.path.join(out, "metrics.json"), "w") as f:
                    json.dump({"epoch": epoch, "eval_loss": eval_loss, "eval_acc": eval_acc}, f)
            dist.barrier()

    log.info("best eval acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
