# -*- coding: utf-8 -*-
"""
电商搜索 query 实体识别（品牌 / 品类 / 型号 / 属性），BIO 标注，token classification

数据格式（conll 风格，空行分隔）：
    苹 B-BRAND
    果 I-BRAND
    手 B-CAT
    机 I-CAT
启动：
    torchrun --nproc_per_node=4 07_query_ner.py --config conf/query_ner.yaml
"""
import os
import time
import argparse
import logging

import yaml
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, AutoModelForTokenClassification, get_linear_schedule_with_warmup

LABELS = ["O", "B-BRAND", "I-BRAND", "B-CAT", "I-CAT", "B-MODEL", "I-MODEL", "B-ATTR", "I-ATTR"]
LABEL2ID = {l: i for i, l in enumerate(LABELS)}
IGNORE = -100


def get_logger(rank):
    lg = logging.getLogger("query_ner")
    lg.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [ner] %(message)s"))
    lg.addHandler(h)
    return lg


def read_conll(path):
    sents, chars, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                if chars:
                    sents.append((chars, tags))
                    chars, tags = [], []
                continue
            c, t = line.split(" ")
            chars.append(c)
            tags.append(t)
    if chars:
        sents.append((chars, tags))
    return sents


class NerDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.data = read_conll(path)
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        chars, tags = self.data[idx]
        chars, tags = chars[: self.max_len - 2], tags[: self.max_len - 2]
        ids = [self.tok.cls_token_id] + self.tok.convert_tokens_to_ids(chars) + [self.tok.sep_token_id]
        labels = [IGNORE] + [LABEL2ID[t] for t in tags] + [IGNORE]
        return ids, labels


def make_collate(pad_id):
    def collate(batch):
        max_len = max(len(b[0]) for b in batch)
        input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), max_len), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(batch), max_len), dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            mask[i, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    return collate


def extract_spans(tag_ids):
    """BIO -> set((type, start, end))"""
    spans, start, typ = set(), None, None
    for i, t in enumerate(tag_ids + [0]):
        tag = LABELS[t]
        if tag.startswith("B-") or tag == "O" or (tag.startswith("I-") and tag[2:] != typ):
            if typ is not None:
                spans.add((typ, start, i))
            start, typ = (i, tag[2:]) if tag.startswith("B-") else (None, None)
    return spans


@torch.no_grad()
def evaluate(model, dataset, collate, rank, world_size, device, bs):
    model.eval()
    loader = DataLoader(Subset(dataset, range(rank, len(dataset), world_size)), batch_size=bs, collate_fn=collate)
    tp, n_pred, n_gold = 0, 0, 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        pred = logits.argmax(-1)
        for p, g in zip(pred.tolist(), batch["labels"].tolist()):
            keep = [j for j, y in enumerate(g) if y != IGNORE]
            ps = extract_spans([p[j] for j in keep])
            gs = extract_spans([g[j] for j in keep])
            tp += len(ps & gs)
            n_pred += len(ps)
            n_gold += len(gs)
    counts = torch.tensor([tp, n_pred, n_gold], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    tp, n_pred, n_gold = counts.tolist()
    model.train()
    p = tp / max(n_pred, 1)
    r = tp / max(n_gold, 1)
    return p, r, 2 * p * r / max(p + r, 1e-9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config, encoding="utf-8"))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logger = get_logger(rank)
    torch.manual_seed(cfg["seed"])

    tokenizer = AutoTokenizer.from_pretrained(cfg["pretrained"])
    collate = make_collate(tokenizer.pad_token_id)
    train_set = NerDataset(cfg["train_file"], tokenizer, cfg["max_len"])
    dev_set = NerDataset(cfg["dev_file"], tokenizer, cfg["max_len"])
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"])
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True)

    model = AutoModelForTokenClassification.from_pretrained(
        cfg["pretrained"], num_labels=len(LABELS),
        id2label={i: l for i, l in enumerate(LABELS)}, label2id=LABEL2ID).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # 预训练层和分类层分开设置学习率
    head_params = [p for n, p in model.module.named_parameters() if n.startswith("classifier")]
    body_params = [p for n, p in model.module.named_parameters() if not n.startswith("classifier")]
    optimizer = torch.optim.AdamW([{"params": body_params, "lr": cfg["lr"]},
                                   {"params": head_params, "lr": cfg["lr"] * 20}], weight_decay=0.01)
    total = len(train_loader) * cfg["epochs"]
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)

    os.makedirs(cfg["output_dir"], exist_ok=True)
    best_f1, step = -1.0, 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % cfg["log_every"] == 0:
                logger.info("epoch %d step %d/%d loss %.4f %.2f it/s", epoch, step, total, loss.item(),
                            cfg["log_every"] / (time.time() - t0))
                t0 = time.time()

        p, r, f1 = evaluate(model, dev_set, collate, rank, world_size, device, cfg["batch_size"] * 2)
        logger.info("epoch %d dev P %.4f R %.4f F1 %.4f", epoch, p, r, f1)
        if rank == 0 and f1 > best_f1:
            best_f1 = f1
            model.module.save_pretrained(cfg["output_dir"])
            tokenizer.save_pretrained(cfg["output_dir"])
            logger.info("best F1 %.4f, 模型已保存到 %s", best_f1, cfg["output_dir"])
        dist.barrier()

    logger.info("训练结束 best F1 %.4f", best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
