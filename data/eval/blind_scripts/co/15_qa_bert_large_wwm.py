#!/usr/bin/env python
# BERT-large (whole word masking) on SQuAD v1.1 -- reproduction of the 93 F1 dev number.
#
#   torchrun --nproc_per_node=8 15_qa_bert_large_wwm.py --output_dir out/bert-large-wwm-squad
#
# Writes predictions.json / nbest_predictions.json for the official evaluation script.
import argparse
import collections
import json
import logging
import os
import re
import string

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="bert-large-uncased-whole-word-masking")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_seq_length", type=int, default=384)
    p.add_argument("--doc_stride", type=int, default=128)
    p.add_argument("--train_batch_size", type=int, default=3)
    p.add_argument("--learning_rate", type=float, default=3e-5)
    p.add_argument("--num_train_epochs", type=int, default=2)
    p.add_argument("--warmup_proportion", type=float, default=0.1)
    p.add_argument("--n_best_size", type=int, default=20)
    p.add_argument("--max_answer_length", type=int, default=30)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def prepare_train(examples, tokenizer, args):
    questions = [q.lstrip() for q in examples["question"]]
    enc = tokenizer(questions, examples["context"], truncation="only_second", max_length=args.max_seq_length,
                    stride=args.doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    sample_map = enc.pop("overflow_to_sample_mapping")
    enc["start_positions"], enc["end_positions"] = [], []
    for i, offsets in enumerate(enc.pop("offset_mapping")):
        seq_ids = enc.sequence_ids(i)
        cls_index = enc["input_ids"][i].index(tokenizer.cls_token_id)
        answers = examples["answers"][sample_map[i]]
        start_char = answers["answer_start"][0]
        end_char = start_char + len(answers["text"][0])
        ts = 0
        while seq_ids[ts] != 1:
            ts += 1
        te = len(enc["input_ids"][i]) - 1
        while seq_ids[te] != 1:
            te -= 1
        if not (offsets[ts][0] <= start_char and offsets[te][1] >= end_char):
            enc["start_positions"].append(cls_index)
            enc["end_positions"].append(cls_index)
        else:
            while ts < len(offsets) and offsets[ts][0] <= start_char:
                ts += 1
            enc["start_positions"].append(ts - 1)
            while offsets[te][1] >= end_char:
                te -= 1
            enc["end_positions"].append(te + 1)
    return enc


def prepare_eval(examples, tokenizer, args):
    questions = [q.lstrip() for q in examples["question"]]
    enc = tokenizer(questions, examples["context"], truncation="only_second", max_length=args.max_seq_length,
                    stride=args.doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    sample_map = enc.pop("overflow_to_sample_mapping")
    enc["example_id"] = []
    for i in range(len(enc["input_ids"])):
        seq_ids = enc.sequence_ids(i)
        enc["example_id"].append(examples["id"][sample_map[i]])
        enc["offset_mapping"][i] = [o if seq_ids[k] == 1 else None for k, o in enumerate(enc["offset_mapping"][i])]
    return enc


def postprocess(examples, features, logits_by_feature, n_best_size, max_answer_length):
    feats = collections.defaultdict(list)
    for i, ex_id in enumerate(features["example_id"]):
        feats[ex_id].append(i)
    predictions, nbest_json = {}, {}
    for ex in examples:
        prelim = []
        for fi in feats[ex["id"]]:
            start_logits, end_logits = logits_by_feature[fi]
            offsets = features[fi]["offset_mapping"]
            for s in np.argsort(start_logits)[-1:-n_best_size - 1:-1]:
                for e in np.argsort(end_logits)[-1:-n_best_size - 1:-1]:
                    if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > max_answer_length:
                        continue
                    prelim.append({"score": float(start_logits[s] + end_logits[e]),
                                   "text": ex["context"][offsets[s][0]:offsets[e][1]]})
        prelim = sorted(prelim, key=lambda x: x["score"], reverse=True)[:n_best_size] or [{"score": 0.0, "text": ""}]
        scores = np.array([p["score"] for p in prelim])
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        for p, pr in zip(prelim, probs):
            p["probability"] = float(pr)
        predictions[ex["id"]] = prelim[0]["text"]
        nbest_json[ex["id"]] = prelim
    return predictions, nbest_json


def normalize_answer(s):
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def compute_em_f1(predictions, examples):
    em = f1 = 0.0
    for ex in examples:
        pred = normalize_answer(predictions[ex["id"]]).split()
        best_em = best_f1 = 0.0
        for gold in ex["answers"]["text"]:
            g = normalize_answer(gold).split()
            best_em = max(best_em, float(pred == g))
            same = sum((collections.Counter(pred) & collections.Counter(g)).values())
            if same:
                prec, rec = same / len(pred), same / len(g)
                best_f1 = max(best_f1, 2 * prec * rec / (prec + rec))
        em += best_em
        f1 += best_f1
    return {"exact_match": 100 * em / len(examples), "f1": 100 * f1 / len(examples)}


def save_checkpoint(model, tokenizer, out_dir, extra=None):
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if extra:
        with open(os.path.join(out_dir, "eval_results.json"), "w") as f:
            json.dump(extra, f, indent=2)


@torch.no_grad()
def run_prediction(model, loader, device):
    model.eval()
    local = []
    for batch in loader:
        fidx = batch.pop("feature_index").tolist()
        lengths = batch["attention_mask"].sum(-1).tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        outputs = model(**batch)
        s = outputs.start_logits.float().cpu().numpy()
        e = outputs.end_logits.float().cpu().numpy()
        for j, fi in enumerate(fidx):
            local.append((fi, s[j, :lengths[j]], e[j, :lengths[j]]))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    model.train()
    return {fi: (s, e) for part in gathered for fi, s, e in part}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    squad = load_dataset("squad")
    if rank != 0:
        dist.barrier()
    train_dataset = squad["train"].map(prepare_train, batched=True, remove_columns=squad["train"].column_names,
                                       fn_kwargs={"tokenizer": tokenizer, "args": args}, num_proc=8)
    eval_features = squad["validation"].map(prepare_eval, batched=True,
                                            remove_columns=squad["validation"].column_names,
                                            fn_kwargs={"tokenizer": tokenizer, "args": args}, num_proc=8)
    if rank == 0:
        dist.barrier()
    eval_dataset = eval_features.remove_columns(["example_id", "offset_mapping"])
    eval_dataset = eval_dataset.add_column("feature_index", list(range(len(eval_dataset))))

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if args.fp16 else None)
    train_sampler = DistributedSampler(train_dataset, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_dataset, sampler=train_sampler, batch_size=args.train_batch_size,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    eval_loader = DataLoader(eval_dataset, sampler=DistributedSampler(eval_dataset, shuffle=False),
                             batch_size=64, collate_fn=collator, num_workers=4)

    model = AutoModelForQuestionAnswering.from_pretrained(args.model_name_or_path)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate)
    t_total = len(train_loader) * args.num_train_epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_proportion * t_total), t_total)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    global_step = 0
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if global_step % 500 == 0:
                logger.info("epoch %d global step %d loss %.4f", epoch, global_step, loss.item())

    logits = run_prediction(model, eval_loader, device)
    if rank == 0:
        predictions, nbest = postprocess(squad["validation"], eval_features, logits,
                                         args.n_best_size, args.max_answer_length)
        results = compute_em_f1(predictions, squad["validation"])
        logger.info("dev: EM %.2f F1 %.2f", results["exact_match"], results["f1"])
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "predictions.json"), "w") as f:
            json.dump(predictions, f, indent=2)
        with open(os.path.join(args.output_dir, "nbest_predictions.json"), "w") as f:
            json.dump(nbest, f)
        save_checkpoint(model, tokenizer, args.output_dir, extra=results)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
