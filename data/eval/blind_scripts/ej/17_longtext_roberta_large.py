# -*- coding: utf-8 -*-
"""
长文本分类：CAIL2018 罪名预测（单标签版本，取 top-1 罪名，202 类）
裁判文书事实部分动辄上千字，按 510 字切块，每篇最多 4 块，
块向量做 max-pooling 后分类。模型 chinese-roberta-wwm-ext-large，显存吃紧，开了梯度检查点。

    torchrun --nproc_per_node=8 17_longtext_roberta_large.py \
        --model_path /models/chinese-roberta-wwm-ext-large --data_dir /data/cail2018 --out_dir exp/cail_large
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("cail")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_path", required=True)
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--chunk_len", type=int, default=512)
    ap.add_argument("--max_chunks", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1.5e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--seed", type=int, default=3407)
    return ap.parse_args()


def load_cail(path, charge2id):
    docs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            charges = d["meta"]["accusation"]
            if not charges or charges[0] not in charge2id:
                continue
            docs.append((d["fact"].strip(), charge2id[charges[0]]))
    return docs


class ChunkedDocDataset(Dataset):
    def __init__(self, docs, tokenizer, chunk_len, max_chunks):
        self.docs = docs
        self.tok = tokenizer
        self.body = chunk_len - 2
        self.max_chunks = max_chunks
        self.chunk_len = chunk_len

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        text, label = self.docs[i]
        ids = self.tok.encode(text, add_special_tokens=False)
        chunks = []
        for s in range(0, max(len(ids), 1), self.body):
            piece = [self.tok.cls_token_id] + ids[s: s + self.body] + [self.tok.sep_token_id]
            chunks.append(piece + [self.tok.pad_token_id] * (self.chunk_len - len(piece)))
            if len(chunks) == self.max_chunks:
                break
        n = len(chunks)
        while len(chunks) < self.max_chunks:
            chunks.append([self.tok.pad_token_id] * self.chunk_len)
        return torch.tensor(chunks), n, label


def collate(batch):
    chunks, n, labels = zip(*batch)
    return torch.stack(chunks), torch.tensor(n), torch.tensor(labels)


class LongDocClassifier(nn.Module):
    def __init__(self, model_path, num_labels):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(model_path)
        self.dropout = nn.Dropout(0.1)
        self.fc = nn.Linear(self.encoder.config.hidden_size, num_labels)

    def forward(self, chunks, n_chunks, pad_id=0):
        B, C, L = chunks.shape
        flat = chunks.view(B * C, L)
        attn = (flat != pad_id).long()
        cls = self.encoder(input_ids=flat, attention_mask=attn).last_hidden_state[:, 0]  # [B*C, H]
        cls = cls.view(B, C, -1)
        valid = torch.arange(C, device=chunks.device)[None, :] < n_chunks[:, None]
        cls = cls.masked_fill(~valid[..., None], float("-inf"))
        doc_vec = cls.max(dim=1).values
        return self.fc(self.dropout(doc_vec))


@torch.no_grad()
def evaluate(model, loader, device, pad_id, amp_dtype):
    model.eval()
    acc = torch.zeros(2, device=device)
    for chunks, n, labels in loader:
        chunks, n, labels = chunks.to(device), n.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(chunks, n, pad_id)
        acc[0] += (logits.argmax(-1) == labels).sum()
        acc[1] += labels.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data_dir, "accu.txt"), encoding="utf-8") as f:
        charges = [x.strip() for x in f if x.strip()]
    charge2id = {c: i for i, c in enumerate(charges)}

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    train_docs = load_cail(os.path.join(args.data_dir, "data_train.json"), charge2id)
    valid_docs = load_cail(os.path.join(args.data_dir, "data_valid.json"), charge2id)
    train_ds = ChunkedDocDataset(train_docs, tokenizer, args.chunk_len, args.max_chunks)
    valid_ds = ChunkedDocDataset(valid_docs, tokenizer, args.chunk_len, args.max_chunks)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=6, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=8, collate_fn=collate, num_workers=4,
                              sampler=DistributedSampler(valid_ds, shuffle=False, drop_last=True))

    model = LongDocClassifier(args.model_path, len(charges))
    model.encoder.gradient_checkpointing_enable()
    model.to(device)
    # 只取 last_hidden_state 的 [CLS]，encoder 自带的 pooler 不参与计算
    model = DDP(model, device_ids=[local_rank], output_device=local_rank, find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(total * 0.06), total)
    amp_dtype = torch.bfloat16 if args.bf16 else None
    pad_id = tokenizer.pad_token_id

    logger.info("罪名 %d 类 | train %d | valid %d | %d 卡 | 总步数 %d",
                len(charges), len(train_ds), len(valid_ds), world, total)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (chunks, n, labels) in enumerate(train_loader):
            chunks, n, labels = chunks.to(device), n.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(chunks, n, pad_id)
            loss = F.cross_entropy(logits.float(), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())

        acc = evaluate(model.module, valid_loader, device, pad_id, amp_dtype)
        logger.info("epoch %d valid acc %.4f", epoch, acc)
        if rank == 0 and acc > best:
            best = acc
            os.makedirs(args.out_dir, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.out_dir, "best.bin"))
            with open(os.path.join(args.out_dir, "charges.json"), "w", encoding="utf-8") as f:
                json.dump(charges, f, ensure_ascii=False)
        dist.barrier()

    logger.info("best valid acc %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
