# -*- coding: utf-8 -*-
"""
CBLUE CMeEE 医学实体识别（9 类，允许嵌套）—— BERT + GlobalPointer
训练完用最优模型对 test 出预测文件（CBLUE 提交格式）。

    torchrun --nproc_per_node=4 15_cmeee_ner.py --bert /data/models/medbert-base-wwm-chinese \
        --data_dir /data/CBLUE/CMeEE --out_dir exp/cmeee_gp --accum_steps 2 --fp16
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertModel, BertTokenizerFast, get_linear_schedule_with_warmup

ENT_TYPES = ["dis", "sym", "pro", "equ", "dru", "ite", "bod", "dep", "mic"]
T2I = {t: i for i, t in enumerate(ENT_TYPES)}
logger = logging.getLogger("cmeee")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bert", required=True)
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--accum_steps", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--head_lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


class CMeEEDataset(Dataset):
    def __init__(self, path, tokenizer, max_len, with_label=True):
        with open(path, encoding="utf-8") as f:
            self.data = json.load(f)
        self.tok = tokenizer
        self.max_len = max_len
        self.with_label = with_label

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        item = self.data[idx]
        chars = list(item["text"])[: self.max_len - 2]
        ids = [self.tok.cls_token_id] + self.tok.convert_tokens_to_ids(chars) + [self.tok.sep_token_id]
        spans = []
        if self.with_label:
            for e in item.get("entities", []):
                s, t = e["start_idx"], e["end_idx"]  # end 为闭区间
                if t < len(chars):
                    spans.append((T2I[e["type"]], s + 1, t + 1))  # +1 对齐 [CLS]
        return idx, ids, spans


def collate(batch):
    idxs, ids, spans = zip(*batch)
    L = max(len(x) for x in ids)
    input_ids = torch.zeros(len(batch), L, dtype=torch.long)
    mask = torch.zeros(len(batch), L, dtype=torch.long)
    labels = torch.zeros(len(batch), len(ENT_TYPES), L, L)
    for i, (x, sp) in enumerate(zip(ids, spans)):
        input_ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
        for t, s, e in sp:
            labels[i, t, s, e] = 1
    return torch.tensor(idxs), input_ids, mask, labels


def rope(x):
    """x: [B, L, H, D] 旋转位置编码"""
    _, L, _, D = x.shape
    pos = torch.arange(L, dtype=torch.float, device=x.device).unsqueeze(-1)
    theta = torch.pow(10000.0, -2 * torch.arange(D // 2, dtype=torch.float, device=x.device) / D)
    emb = pos * theta
    sin = torch.sin(emb).repeat_interleave(2, dim=-1)[None, :, None, :]
    cos = torch.cos(emb).repeat_interleave(2, dim=-1)[None, :, None, :]
    x2 = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape(x.shape)
    return x * cos + x2 * sin


class GlobalPointerNer(nn.Module):
    def __init__(self, bert_path, num_types, head_size=64):
        super().__init__()
        self.bert = BertModel.from_pretrained(bert_path, add_pooling_layer=False)
        self.num_types = num_types
        self.head_size = head_size
        self.dense = nn.Linear(self.bert.config.hidden_size, num_types * head_size * 2)

    def forward(self, input_ids, mask):
        h = self.bert(input_ids=input_ids, attention_mask=mask).last_hidden_state
        B, L, _ = h.shape
        out = self.dense(h).view(B, L, self.num_types, 2 * self.head_size)
        q, k = rope(out[..., : self.head_size].float()), rope(out[..., self.head_size:].float())
        logits = torch.einsum("bmhd,bnhd->bhmn", q, k)
        pad = mask[:, None, None, :].float() * mask[:, None, :, None].float()
        logits = logits * pad - (1 - pad) * 1e12
        tril = torch.tril(torch.ones(L, L, device=h.device), diagonal=-1)
        logits = logits - tril * 1e12
        return logits / self.head_size ** 0.5


def multilabel_ce(logits, labels):
    """苏神的多标签交叉熵，logits/labels: [B, T, L, L]"""
    B, T = logits.shape[:2]
    y_pred = logits.reshape(B * T, -1)
    y_true = labels.reshape(B * T, -1)
    y_pred = (1 - 2 * y_true) * y_pred
    y_neg = y_pred - y_true * 1e12
    y_pos = y_pred - (1 - y_true) * 1e12
    zeros = torch.zeros_like(y_pred[:, :1])
    neg_loss = torch.logsumexp(torch.cat([y_neg, zeros], -1), -1)
    pos_loss = torch.logsumexp(torch.cat([y_pos, zeros], -1), -1)
    return (neg_loss + pos_loss).mean()


def decode(logits, mask, threshold=0.0):
    res = []
    for b in range(logits.size(0)):
        n = int(mask[b].sum())
        hits = torch.nonzero(logits[b, :, :n, :n] > threshold).tolist()
        res.append({(t, s, e) for t, s, e in hits if s >= 1 and e <= n - 2})
    return res


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    local = {}
    for idxs, ids, mask, labels in loader:
        logits = model(ids.to(device), mask.to(device))
        preds = decode(logits, mask)
        for i, p, lab in zip(idxs.tolist(), preds, labels):
            gold = {tuple(x) for x in torch.nonzero(lab).tolist()}
            local[i] = (p, gold)
    # 各卡数量不一样（而且 DistributedSampler 会补齐重复样本），用 object 收集后按 idx 去重
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    merged = {}
    for g in gathered:
        merged.update(g)
    tp = sum(len(p & g) for p, g in merged.values())
    n_pred = sum(len(p) for p, _ in merged.values())
    n_gold = sum(len(g) for _, g in merged.values())
    model.train()
    f1 = 2 * tp / max(n_pred + n_gold, 1)
    return f1, len(merged)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = BertTokenizerFast.from_pretrained(args.bert)
    train_ds = CMeEEDataset(os.path.join(args.data_dir, "CMeEE_train.json"), tok, args.max_len)
    dev_ds = CMeEEDataset(os.path.join(args.data_dir, "CMeEE_dev.json"), tok, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_size=16, sampler=DistributedSampler(dev_ds, shuffle=False),
                            collate_fn=collate, num_workers=2)

    model = GlobalPointerNer(args.bert, len(ENT_TYPES)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([
        {"params": model.module.bert.parameters(), "lr": args.lr},
        {"params": model.module.dense.parameters(), "lr": args.head_lr},
    ], weight_decay=0.01)
    updates = (len(train_loader) // args.accum_steps) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * updates), updates)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    best_f1, best_path = 0.0, os.path.join(args.out_dir, "best_model.pt")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (_, ids, mask, labels) in enumerate(train_loader):
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            do_step = (it + 1) % args.accum_steps == 0
            with (model.no_sync() if not do_step else torch.enable_grad()):
                with torch.cuda.amp.autocast(enabled=args.fp16):
                    logits = model(ids, mask)
                loss = multilabel_ce(logits.float(), labels) / args.accum_steps
                scaler.scale(loss).backward()
            if do_step:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if it % 200 == 0:
                logger.info("epoch %d iter %d loss %.4f", epoch, it, loss.item() * args.accum_steps)

        f1, n = evaluate(model.module, dev_loader, device, world_size)
        logger.info("epoch %d dev F1 %.4f (%d 条)", epoch, f1, n)
        if rank == 0 and f1 > best_f1:
            best_f1 = f1
            os.makedirs(args.out_dir, exist_ok=True)
            torch.save(model.module.state_dict(), best_path)
            logger.info("保存最优模型 F1=%.4f", f1)
        dist.barrier()

    # 只在 rank0 上用最优模型预测 test
    if rank == 0:
        model.module.load_state_dict(torch.load(best_path, map_location="cpu"))
        test_ds = CMeEEDataset(os.path.join(args.data_dir, "CMeEE_test.json"), tok, args.max_len, with_label=False)
        test_loader = DataLoader(test_ds, batch_size=16, collate_fn=collate)
        model.module.eval()
        results = []
        with torch.no_grad():
            for idxs, ids, mask, _ in test_loader:
                preds = decode(model.module(ids.to(device), mask.to(device)), mask)
                for i, spans in zip(idxs.tolist(), preds):
                    text = test_ds.data[i]["text"]
                    ents = [{"start_idx": s - 1, "end_idx": e - 1, "type": ENT_TYPES[t], "entity": text[s - 1: e]}
                            for t, s, e in sorted(spans, key=lambda x: (x[1], x[2]))]
                    results.append({"text": text, "entities": ents})
        with open(os.path.join(args.out_dir, "CMeEE_test.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, ensure_ascii=False, indent=2)
        logger.info("test 预测完成，共 %d 条，best dev F1 %.4f", len(results), best_f1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
