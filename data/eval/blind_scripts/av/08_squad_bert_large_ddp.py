"""BERT-large (wwm) on SQuAD v1.1 -- hand-written DDP loop with sliding windows.

torchrun --nproc_per_node=8 08_squad_bert_large_ddp.py --output_dir runs/squad_bert_large
"""
import argparse
import collections
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForQuestionAnswering, AutoTokenizer, default_data_collator,
                          get_linear_schedule_with_warmup)
import evaluate


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert-large-uncased-whole-word-masking")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_seq_length", type=int, default=384)
    p.add_argument("--doc_stride", type=int, default=128)
    p.add_argument("--train_bs", type=int, default=4)
    p.add_argument("--eval_bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--n_best", type=int, default=20)
    p.add_argument("--max_answer_length", type=int, default=30)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def build_features(raw, tokenizer, args):
    pad_right = tokenizer.padding_side == "right"

    def prepare_train(examples):
        questions = [q.lstrip() for q in examples["question"]]
        enc = tokenizer(questions, examples["context"], truncation="only_second", max_length=args.max_seq_length,
                        stride=args.doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
                        padding="max_length")
        sample_map = enc.pop("overflow_to_sample_mapping")
        offsets_all = enc.pop("offset_mapping")
        enc["start_positions"], enc["end_positions"] = [], []
        for i, offsets in enumerate(offsets_all):
            input_ids = enc["input_ids"][i]
            cls_index = input_ids.index(tokenizer.cls_token_id)
            seq_ids = enc.sequence_ids(i)
            answers = examples["answers"][sample_map[i]]
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])
            ts = 0
            while seq_ids[ts] != (1 if pad_right else 0):
                ts += 1
            te = len(input_ids) - 1
            while seq_ids[te] != (1 if pad_right else 0):
                te -= 1
            if not (offsets[ts][0] <= start_char and offsets[te][1] >= end_char):
                enc["start_positions"].append(cls_index)
                enc["end_positions"].append(cls_index)
                continue
            while ts < len(offsets) and offsets[ts][0] <= start_char:
                ts += 1
            enc["start_positions"].append(ts - 1)
            while offsets[te][1] >= end_char:
                te -= 1
            enc["end_positions"].append(te + 1)
        return enc

    def prepare_eval(examples):
        questions = [q.lstrip() for q in examples["question"]]
        enc = tokenizer(questions, examples["context"], truncation="only_second", max_length=args.max_seq_length,
                        stride=args.doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
                        padding="max_length")
        sample_map = enc.pop("overflow_to_sample_mapping")
        enc["example_id"] = []
        for i in range(len(enc["input_ids"])):
            seq_ids = enc.sequence_ids(i)
            enc["example_id"].append(examples["id"][sample_map[i]])
            enc["offset_mapping"][i] = [o if seq_ids[k] == 1 else None for k, o in enumerate(enc["offset_mapping"][i])]
        return enc

    train = raw["train"].map(prepare_train, batched=True, num_proc=8, remove_columns=raw["train"].column_names)
    dev = raw["validation"].map(prepare_eval, batched=True, num_proc=8, remove_columns=raw["validation"].column_names)
    return train, dev


def postprocess(examples, features, start_logits, end_logits, args):
    feats_per_example = collections.defaultdict(list)
    for i, ex_id in enumerate(features["example_id"]):
        feats_per_example[ex_id].append(i)
    preds = {}
    for ex in examples:
        best, best_score = "", -float("inf")
        for fi in feats_per_example[ex["id"]]:
            offsets = features[fi]["offset_mapping"]
            s_idx = np.argsort(start_logits[fi])[-1:-args.n_best - 1:-1]
            e_idx = np.argsort(end_logits[fi])[-1:-args.n_best - 1:-1]
            for s in s_idx:
                for e in e_idx:
                    if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > args.max_answer_length:
                        continue
                    score = start_logits[fi][s] + end_logits[fi][e]
                    if score > best_score:
                        best_score, best = score, ex["context"][offsets[s][0]:offsets[e][1]]
        preds[ex["id"]] = best
    return preds


@torch.no_grad()
def evaluate_squad(model, dev_raw, dev_feats, args, device, rank, world_size, metric):
    model.eval()
    sampler = DistributedSampler(dev_feats, num_replicas=world_size, rank=rank, shuffle=False)
    my_idx = list(iter(sampler))
    model_inputs = dev_feats.remove_columns(["example_id", "offset_mapping"])
    loader = DataLoader(model_inputs, batch_size=args.eval_bs, sampler=sampler, collate_fn=default_data_collator)
    all_start, all_end = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(**batch)
        all_start.append(out.start_logits.float().cpu().numpy())
        all_end.append(out.end_logits.float().cpu().numpy())
    start_logits = np.concatenate(all_start)
    end_logits = np.concatenate(all_end)

    my_feats = dev_feats.select(my_idx)
    my_ids = set(my_feats["example_id"])
    my_examples = dev_raw.filter(lambda ex: ex["id"] in my_ids)
    preds = postprocess(my_examples, my_feats, start_logits, end_logits, args)
    refs = [{"id": ex["id"], "answers": ex["answers"]} for ex in my_examples]
    result = metric.compute(predictions=[{"id": k, "prediction_text": v} for k, v in preds.items()], references=refs)
    model.train()
    return result, preds


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = load_dataset("squad")
    # rank 0 builds the datasets cache first; everyone else reads it after the barrier
    if rank == 0:
        train_feats, dev_feats = build_features(raw, tokenizer, args)
    dist.barrier()
    if rank != 0:
        train_feats, dev_feats = build_features(raw, tokenizer, args)
    train_feats.set_format("torch")

    train_sampler = DistributedSampler(train_feats, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_feats, batch_size=args.train_bs, sampler=train_sampler,
                              collate_fn=default_data_collator, num_workers=4, pin_memory=True)

    model = AutoModelForQuestionAnswering.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(total * args.warmup_ratio), total)
    scaler = torch.cuda.amp.GradScaler()
    metric = evaluate.load("squad")

    best_f1 = 0.0
    history = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 500 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{len(train_loader)} loss {l.item():.4f} "
                          f"({time.time() - t0:.0f}s)", flush=True)

        result, preds = evaluate_squad(model.module, raw["validation"], dev_feats, args, device, rank, world_size, metric)
        if rank == 0:
            print(f"epoch {epoch}: EM {result['exact_match']:.2f}  F1 {result['f1']:.2f}", flush=True)
            history.append({"epoch": epoch, **result})
            os.makedirs(args.output_dir, exist_ok=True)
            if result["f1"] > best_f1:
                best_f1 = result["f1"]
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
                with open(os.path.join(args.output_dir, "dev_predictions.json"), "w") as f:
                    json.dump(preds, f, indent=1)
            with open(os.path.join(args.output_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
