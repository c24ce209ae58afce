#!/usr/bin/env python3
"""
Token classification (NER) with BERT on CoNLL-style files
(one token per line, `token<TAB>tag`, blank line between sentences).

Feature extraction is slow for the big corpus, so tokenised features are cached
next to the data and reused by later runs.

    torchrun --nproc_per_node=8 10_bert_ner_conll.py --data-dir data/ner_corpus
"""
import argparse
import hashlib
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from seqeval.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForTokenClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("ner")
IGNORE = -100


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--model", default="bert-base-cased")
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup-ratio", type=float, default=0.1)
    ap.add_argument("--output-dir", default="outputs/bert_ner")
    ap.add_argument("--overwrite-cache", action="store_true")
    ap.add_argument("--seed", type=int, default=13)
    return ap.parse_args()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return local_rank


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def read_conll(path):
    sentences, tokens, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                if tokens:
                    sentences.append((tokens, tags))
                    tokens, tags = [], []
                continue
            tok, tag = line.split("\t")
            tokens.append(tok)
            tags.append(tag)
    if tokens:
        sentences.append((tokens, tags))
    return sentences


def build_label_list(data_dir):
    labels = set()
    for split in ("train", "dev"):
        for _, tags in read_conll(os.path.join(data_dir, f"{split}.txt")):
            labels.update(tags)
    return sorted(labels)


def encode(sentences, tokenizer, label2id, max_len):
    all_ids, all_mask, all_labels = [], [], []
    for tokens, tags in tqdm(sentences, desc="encoding", disable=not is_main_process()):
        enc = tokenizer(tokens, is_split_into_words=True, truncation=True, max_length=max_len,
                        padding="max_length")
        word_ids = enc.word_ids()
        label_ids, prev = [], None
        for wid in word_ids:
            if wid is None or wid == prev:
                label_ids.append(IGNORE)
            else:
                label_ids.append(label2id[tags[wid]])
            prev = wid
        all_ids.append(enc["input_ids"])
        all_mask.append(enc["attention_mask"])
        all_labels.append(label_ids)
    return TensorDataset(torch.tensor(all_ids), torch.tensor(all_mask), torch.tensor(all_labels))


def load_features(args, split, tokenizer, label2id):
    key = hashlib.md5(f"{args.model}-{args.max_seq_len}-{split}".encode()).hexdigest()[:10]
    cache_file = os.path.join(args.data_dir, f"cached_{split}_{key}.pt")
    if os.path.exists(cache_file) and not args.overwrite_cache:
        logger.info("loading cached features from %s", cache_file)
        tensors = torch.load(cache_file)
        return TensorDataset(*tensors)

    sentences = read_conll(os.path.join(args.data_dir, f"{split}.txt"))
    dataset = encode(sentences, tokenizer, label2id, args.max_seq_len)
    logger.info("saving features to %s", cache_file)
    torch.save(dataset.tensors, cache_file)
    return dataset


@torch.no_grad()
def evaluate(model, loader, device, id2label):
    model.eval()
    loss_sum = torch.zeros(2, device=device)
    pred_seqs, gold_seqs = [], []
    for input_ids, mask, labels in loader:
        input_ids, mask, labels = input_ids.to(device), mask.to(device), labels.to(device)
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
        loss_sum[0] += out.loss * input_ids.size(0)
        loss_sum[1] += input_ids.size(0)
        preds = out.logits.argmax(-1)
        for p, g in zip(preds.cpu().tolist(), labels.cpu().tolist()):
            pred_seqs.append([id2label[pi] for pi, gi in zip(p, g) if gi != IGNORE])
            gold_seqs.append([id2label[gi] for gi in g if gi != IGNORE])
    dist.all_reduce(loss_sum)
    # entity-level F1 needs the full sequences, gather them from every rank
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (pred_seqs, gold_seqs))
    all_pred = [s for part in gathered for s in part[0]]
    all_gold = [s for part in gathered for s in part[1]]
    model.train()
    return (loss_sum[0] / loss_sum[1]).item(), f1_score(all_gold, all_pred)


def main():
    args = parse_args()
    local_rank = setup_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if is_main_process() else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    seed_everything(args.seed)

    label_list = build_label_list(args.data_dir)
    label2id = {l: i for i, l in enumerate(label_list)}
    id2label = {i: l for l, i in label2id.items()}

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds = load_features(args, "train", tokenizer, label2id)
    dev_ds = load_features(args, "dev", tokenizer, label2id)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=64, sampler=dev_sampler, num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(label_list), id2label=id2label, label2id=label2id)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    best_f1 = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for input_ids, mask, labels in tqdm(train_loader, disable=not is_main_process(),
                                            desc=f"epoch {epoch}"):
            input_ids = input_ids.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

        dev_loss, dev_f1 = evaluate(model, dev_loader, device, id2label)
        logger.info("epoch %d  dev_loss %.4f  dev_f1 %.4f", epoch, dev_loss, dev_f1)
        if is_main_process() and dev_f1 > best_f1:
            best_f1 = dev_f1
            model.module.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
            logger.info("saved best model (f1 %.4f)", best_f1)
        dist.barrier()

    cleanup()


if __name__ == "__main__":
    main()
