# -*- coding: utf-8 -*-
"""
车载语音助手 NLU 多任务训练：意图分类 + 槽位填充 + 领域分类

三份标注数据来自不同的标注批次（意图和领域的标注量大，槽位标注贵、量少），
共享一个中文 BERT 编码器，按 step 轮流从三个任务的数据里取 batch 训练。

启动：
    torchrun --nproc_per_node=8 19_voice_assistant_mtl.py --conf conf/nlu_mtl.yaml
"""
import os
import json
import time
import itertools
import argparse
import logging

import yaml
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertTokenizerFast, BertModel, get_linear_schedule_with_warmup

logger = logging.getLogger("nlu_mtl")
TASKS = ["intent", "slot", "domain"]


def load_labels(path):
    with open(path, encoding="utf-8") as f:
        return {l.strip(): i for i, l in enumerate(f) if l.strip()}


class TaskDataset(Dataset):
    """jsonl：{"text": ..., "label": ...}；槽位任务 label 为与字对齐的 BIO 列表"""

    def __init__(self, path, task, label2id, tokenizer, max_len=64):
        self.rows = [json.loads(l) for l in open(path, encoding="utf-8")]
        self.task, self.label2id, self.tok, self.max_len = task, label2id, tokenizer, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def collate(self, batch):
        texts = [list(r["text"])[: self.max_len - 2] for r in batch]
        enc = self.tok(texts, is_split_into_words=True, padding=True, return_tensors="pt")
        if self.task == "slot":
            labels = torch.full(enc["input_ids"].shape, -100, dtype=torch.long)
            for i, r in enumerate(batch):
                tags = [self.label2id[t] for t in r["label"][: self.max_len - 2]]
                labels[i, 1:1 + len(tags)] = torch.tensor(tags)
        else:
            labels = torch.tensor([self.label2id[r["label"]] for r in batch])
        return enc["input_ids"], enc["attention_mask"], labels


class NLUModel(nn.Module):
    def __init__(self, pretrained, num_intent, num_slot, num_domain):
        super().__init__()
        self.bert = BertModel.from_pretrained(pretrained)
        h = self.bert.config.hidden_size
        self.dropout = nn.Dropout(0.1)
        self.heads = nn.ModuleDict({
            "intent": nn.Linear(h, num_intent),
            "slot": nn.Linear(h, num_slot),
            "domain": nn.Linear(h, num_domain),
        })

    def forward(self, input_ids, attention_mask, task):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
        if task == "slot":
            return self.heads["slot"](self.dropout(out.last_hidden_state))
        return self.heads[task](self.dropout(out.pooler_output))


def compute_loss(logits, labels, task):
    if task == "slot":
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def evaluate(model, dev_sets, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model.module
    net.eval()
    res = {}
    for task, ds in dev_sets.items():
        loader = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=128, collate_fn=ds.collate)
        stat = torch.zeros(2, device=device)
        for ids, mask, labels in loader:
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            pred = net(ids, mask, task).argmax(-1)
            valid = labels != -100
            stat[0] += ((pred == labels) & valid).sum()
            stat[1] += valid.sum()
        dist.all_reduce(stat)
        res[task] = (stat[0] / stat[1].clamp(min=1)).item()  # 槽位为 token 级准确率
    net.train()
    return res


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conf", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().conf, encoding="utf-8"))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(cfg["seed"])

    tok = BertTokenizerFast.from_pretrained(cfg["pretrained"])
    label_maps = {t: load_labels(cfg["data"][t]["labels"]) for t in TASKS}
    train_iters, dev_sets = {}, {}
    for t in TASKS:
        ds = TaskDataset(cfg["data"][t]["train"], t, label_maps[t], tok, cfg["max_len"])
        sampler = DistributedSampler(ds, shuffle=True, seed=cfg["seed"])
        loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, collate_fn=ds.collate,
                            num_workers=2, drop_last=True)
        train_iters[t] = infinite(loader, sampler)
        dev_sets[t] = TaskDataset(cfg["data"][t]["dev"], t, label_maps[t], tok, cfg["max_len"])
        logger.info("任务 %s: 训练 %d 条, 标签 %d 个", t, len(ds), len(label_maps[t]))

    model = NLUModel(cfg["pretrained"], len(label_maps["intent"]), len(label_maps["slot"]),
                     len(label_maps["domain"])).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, cfg["warmup_steps"], cfg["total_steps"])
    task_cycle = itertools.cycle(TASKS)  # 各 rank 的任务顺序一致
    save_dir = cfg["save_dir"]
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)

    best, t0 = 0.0, time.time()
    model.train()
    for step in range(1, cfg["total_steps"] + 1):
        task = next(task_cycle)
        ids, mask, labels = [x.to(device, non_blocking=True) for x in next(train_iters[task])]
        logits = model(ids, mask, task)
        loss = compute_loss(logits, labels, task) * cfg["task_weight"][task]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()

        if step % cfg["log_every"] == 0:
            logger.info("step %d task %s loss %.4f lr %.2e %.1fs", step, task, loss.item(),
                        scheduler.get_last_lr()[0], time.time() - t0)
            t0 = time.time()
        if step % cfg["eval_every"] == 0:
            res = evaluate(model, dev_sets, device)
            score = sum(res.values()) / len(res)
            logger.info("step %d dev %s avg %.4f", step, res, score)
            if rank == 0 and score > best:
                best = score
                torch.save({"model": model.module.state_dict(), "label_maps": label_maps, "step": step},
                           os.path.join(save_dir, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
