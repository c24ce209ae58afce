#!/usr/bin/env python
# coding=utf-8
"""Extractive QA on SQuAD-format json files (NewsQA / internal QA sets) with ELECTRA.

Features are tokenized once and cached next to the data so repeated runs start fast.

    torchrun --nproc_per_node=8 06_qa_newsqa_electra.py \
        --train_file data/newsqa/train.json --dev_file data/newsqa/dev.json \
        --cache_dir data/newsqa/cache --output_dir out/newsqa-electra-large
"""
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def read_squad_json(path):
    with open(path) as f:
        data = json.load(f)["data"]
    examples = []
    for article in data:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                examples.append({
                    "id": qa["id"],
                    "question": qa["question"].strip(),
                    "context": para["context"],
                    "answers": [a["text"] for a in qa.get("answers", [])],
                    "answer_start": qa["answers"][0]["answer_start"] if qa.get("answers") else -1,
                })
    return examples


def build_features(examples, tokenizer, args, is_training, chunk=1000):
    feats = collections.defaultdict(list)
    for lo in tqdm(range(0, len(examples), chunk), desc="tokenizing"):
        part = examples[lo:lo + chunk]
        enc = tokenizer([e["question"] for e in part], [e["context"] for e in part],
                        truncation="only_second", max_length=args.max_seq_length, stride=args.doc_stride,
                        return_overflowing_tokens=True, return_offsets_mapping=True)
        for i in range(len(enc["input_ids"])):
            ex = part[enc["overflow_to_sample_mapping"][i]]
            seq_ids = enc.sequence_ids(i)
            offsets = enc["offset_mapping"][i]
            feats["input_ids"].append(enc["input_ids"][i])
            feats["token_type_ids"].append(enc["token_type_ids"][i])
            if is_training:
                s_char = ex["answer_start"]
                e_char = s_char + len(ex["answers"][0]) if ex["answers"] else -1
                ctx = [k for k, s in enumerate(seq_ids) if s == 1]
                if s_char < 0 or offsets[ctx[0]][0] > s_char or offsets[ctx[-1]][1] < e_char:
                    feats["start_positions"].append(0)
                    feats["end_positions"].append(0)
                else:
                    s = next(k for k in ctx if offsets[k][1] > s_char)
                    e = next(k for k in reversed(ctx) if offsets[k][0] < e_char)
                    feats["start_positions"].append(s)
                    feats["end_positions"].append(e)
            else:
                feats["example_id"].append(ex["id"])
                feats["offset_mapping"].append([o if seq_ids[k] == 1 else None for k, o in enumerate(offsets)])
    return dict(feats)


def load_or_build_features(split, examples, tokenizer, args, is_training):
    model_tag = args.model_name_or_path.rstrip("/").split("/")[-1]
    cache_path = os.path.join(args.cache_dir, f"cached_{split}_{model_tag}_{args.max_seq_length}_{args.doc_stride}.pt")
    if os.path.exists(cache_path) and not args.overwrite_cache:
        logger.info("Loading features from cached file %s", cache_path)
        return torch.load(cache_path)
    logger.info("Creating features for %s (%d examples)", split, len(examples))
    feats = build_features(examples, tokenizer, args, is_training)
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.save(feats, cache_path)
    return feats


class FeatureDataset(Dataset):
    def __init__(self, feats, keys):
        self.feats, self.keys = feats, keys

    def __len__(self):
        return len(self.feats["input_ids"])

    def __getitem__(self, i):
        item = {k: self.feats[k][i] for k in self.keys}
        item["feature_index"] = i
        return item


def collate(batch, pad_id=0):
    n = max(len(b["input_ids"]) for b in batch)
    out = {
        "input_ids": torch.tensor([b["input_ids"] + [pad_id] * (n - len(b["input_ids"])) for b in batch]),
        "token_type_ids": torch.tensor([b["token_type_ids"] + [0] * (n - len(b["token_type_ids"])) for b in batch]),
        "attention_mask": torch.tensor([[1] * len(b["input_ids"]) + [0] * (n - len(b["input_ids"])) for b in batch]),
        "feature_index": torch.tensor([b["feature_index"] for b in batch]),
    }
    for k in ("start_positions", "end_positions"):
        if k in batch[0]:
            out[k] = torch.tensor([b[k] for b in batch])
    return out


def normalize(s):
    s = "".join(ch for ch in s.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def token_f1(pred, gold):
    p, g = normalize(pred).split(), normalize(gold).split()
    same = sum((collections.Counter(p) & collections.Counter(g)).values())
    if same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(g)
    return 2 * prec * rec / (prec + rec)


def score(examples, feats, logits, args):
    by_ex = collections.defaultdict(list)
    for fi, ex_id in enumerate(feats["example_id"]):
        by_ex[ex_id].append(fi)
    em = f1 = 0.0
    for ex in examples:
        best, best_score = "", -1e9
        for fi in by_ex[ex["id"]]:
            start, end = logits[fi]
            offs = feats["offset_mapping"][fi]
            for s in np.argsort(start)[-args.n_best:]:
                for e in np.argsort(end)[-args.n_best:]:
                    if s >= len(offs) or e >= len(offs) or offs[s] is None or offs[e] is None:
                        continue
                    if e < s or e - s + 1 > args.max_answer_length:
                        continue
                    if start[s] + end[e] > best_score:
                        best_score, best = start[s] + end[e], ex["context"][offs[s][0]:offs[e][1]]
        golds = ex["answers"] or [""]
        em += max(float(normalize(best) == normalize(g)) for g in golds)
        f1 += max(token_f1(best, g) for g in golds)
    return 100 * em / len(examples), 100 * f1 / len(examples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name_or_path", default="google/electra-large-discriminator")
    ap.add_argument("--train_file", required=True)
    ap.add_argument("--dev_file", required=True)
    ap.add_argument("--cache_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--overwrite_cache", action="store_true")
    ap.add_argument("--max_seq_length", type=int, default=512)
    ap.add_argument("--doc_stride", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--n_best", type=int, default=20)
    ap.add_argument("--max_answer_length", type=int, default=64)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    train_examples = read_squad_json(args.train_file)
    dev_examples = read_squad_json(args.dev_file)
    train_feats = load_or_build_features("train", train_examples, tokenizer, args, is_training=True)
    dev_feats = load_or_build_features("dev", dev_examples, tokenizer, args, is_training=False)

    train_ds = FeatureDataset(train_feats, ["input_ids", "token_type_ids", "start_positions", "end_positions"])
    dev_ds = FeatureDataset(dev_feats, ["input_ids", "token_type_ids"])
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev_ds, batch_size=64, sampler=DistributedSampler(dev_ds, shuffle=False),
                        collate_fn=collate, num_workers=4)

    model = AutoModelForQuestionAnswering.from_pretrained(args.model_name_or_path).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * total), total)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch.pop("feature_index")
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        model.eval()
        local = {}
        with torch.no_grad():
            for batch in dev_dl:
                idx = batch.pop("feature_index").tolist()
                lens = batch["attention_mask"].sum(-1).tolist()
                batch = {k: v.to(device) for k, v in batch.items()}
                out = model(**batch)
                s, e = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
                for j, fi in enumerate(idx):
                    local[fi] = (s[j, :lens[j]], e[j, :lens[j]])
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        if rank == 0:
            logits = {k: v for part in gathered for k, v in part.items()}
            em, f1 = score(dev_examples, dev_feats, logits, args)
            logger.info("epoch %d dev EM %.2f F1 %.2f", epoch, em, f1)
            save_to = os.path.join(args.output_dir, f"checkpoint-epoch{epoch}")
            model.module.save_pretrained(save_to)
            tokenizer.save_pretrained(save_to)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
