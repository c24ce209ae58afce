"""Short supervised fine-tune of a T5 model on a QA set, then exact-match / F1 eval.

torchrun --nproc_per_node=4 04_finetune_then_eval_qa.py --model t5-base --epochs 2
"""
import argparse
import collections
import json
import math
import os
import re
import string

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from datasets import load_dataset
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    get_linear_schedule_with_warmup,
)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="t5-base")
    parser.add_argument("--dataset", default="squad")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup_ratio", type=float, default=0.06)
    parser.add_argument("--train_bs", type=int, default=16)
    parser.add_argument("--eval_bs", type=int, default=64)
    parser.add_argument("--max_src", type=int, default=512)
    parser.add_argument("--max_tgt", type=int, default=32)
    parser.add_argument("--eval_limit", type=int, default=None)
    parser.add_argument("--output_dir", default="runs/t5_squad")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


def normalize_answer(s):
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(pred, gold):
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    common = collections.Counter(p) & collections.Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def preprocess(tokenizer, args):
    def fn(batch):
        src = [f"question: {q} context: {c}" for q, c in zip(batch["question"], batch["context"])]
        model_inputs = tokenizer(src, max_length=args.max_src, truncation=True)
        tgt = [a["text"][0] for a in batch["answers"]]
        labels = tokenizer(text_target=tgt, max_length=args.max_tgt, truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs
    return fn


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = load_dataset(args.dataset)
    cols = raw["train"].column_names
    train_ds = raw["train"].map(preprocess(tokenizer, args), batched=True, remove_columns=cols)
    eval_raw = raw["validation"]
    if args.eval_limit:
        eval_raw = eval_raw.select(range(args.eval_limit))

    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    collator = DataCollatorForSeq2Seq(tokenizer, model=None, padding="longest")
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.train_bs, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * total_steps), total_steps
    )

    step = 0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 100 == 0:
                loss_t = loss.detach().clone()
                dist.all_reduce(loss_t, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total_steps} loss {loss_t.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        if rank == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            model.module.save_pretrained(os.path.join(args.output_dir, f"epoch{epoch}"))
            tokenizer.save_pretrained(os.path.join(args.output_dir, f"epoch{epoch}"))
        dist.barrier()

    # ---- evaluation: each rank decodes a strided slice of the validation set ----
    model.eval()
    my_idx = list(range(rank, len(eval_raw), world_size))
    local_preds = []
    with torch.no_grad():
        for s in range(0, len(my_idx), args.eval_bs):
            idx = my_idx[s : s + args.eval_bs]
            exs = eval_raw.select(idx)
            src = [f"question: {q} context: {c}" for q, c in zip(exs["question"], exs["context"])]
            enc = tokenizer(src, max_length=args.max_src, truncation=True,
                            padding=True, return_tensors="pt").to(device)
            out = model.generate(**enc, max_new_tokens=args.max_tgt, num_beams=1)
            texts = tokenizer.batch_decode(out, skip_special_tokens=True)
            local_preds.extend(zip(idx, texts))

    gathered = [None] * world_size
    dist.all_gather_object(gathered, local_preds)

    if rank == 0:
        preds = dict(p for part in gathered for p in part)
        em_total, f1_total = 0.0, 0.0
        for i in range(len(eval_raw)):
            golds = eval_raw[i]["answers"]["text"]
            em_total += max(float(normalize_answer(preds[i]) == normalize_answer(g)) for g in golds)
            f1_total += max(f1_score(preds[i], g) for g in golds)
        n = len(eval_raw)
        metrics = {"exact_match": 100 * em_total / n, "f1": 100 * f1_total / n, "n": n}
        print(json.dumps(metrics, indent=2))
        with open(os.path.join(args.output_dir, "eval_results.json"), "w") as f:
            json.dump(metrics, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
