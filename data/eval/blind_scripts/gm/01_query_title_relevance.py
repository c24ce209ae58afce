# -*- coding: utf-8 -*-
"""
搜索相关性模型训练脚本（query-title 二分类 / 三档相关性）

基于中文 BERT 的 cross-encoder，数据为线上标注的 query-title 对。
启动方式：
    torchrun --nnodes=1 --nproc_per_node=8 01_query_title_relevance.py --config conf/relevance_base.yaml
"""
import os
import json
import time
import logging
import argparse

import yaml
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertTokenizerFast, BertForSequenceClassification, get_linear_schedule_with_warmup

logging.basicConfig(
    format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
    datefmt="%Y-%m-%d %H:%M:%S",
    level=logging.INFO,
)
logger = logging.getLogger("relevance")


def parse_args():
    parser = argparse.ArgumentParser(description="query-title 相关性训练")
    parser.add_argument("--config", type=str, required=True, help="yaml 配置文件")
    parser.add_argument("--resume", type=str, default="", help="断点续训的 checkpoint 路径")
    return parser.parse_args()


def load_config(path):
    with open(path, "r", encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    # 默认值
    cfg.setdefault("max_seq_len", 128)
    cfg.setdefault("num_labels", 3)
    cfg.setdefault("epochs", 3)
    cfg.setdefault("batch_size", 64)
    cfg.setdefault("lr", 2e-5)
    cfg.setdefault("warmup_ratio", 0.06)
    cfg.setdefault("log_steps", 50)
    cfg.setdefault("num_workers", 4)
    cfg.setdefault("cache_dir", "/mnt/nas/search/relevance/cache")
    cfg.setdefault("output_dir", "/mnt/nas/search/relevance/output")
    return cfg


def read_jsonl(path):
    samples = []
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            samples.append((obj["query"], obj["title"], int(obj["label"])))
    return samples


def build_features(samples, tokenizer, max_len):
    """分词并转成定长 id，结果缓存到 NAS 上，避免每次重新分词（千万级数据分词要半小时）"""
    queries = [s[0] for s in samples]
    titles = [s[1] for s in samples]
    enc = tokenizer(queries, titles, max_length=max_len, truncation=True,
                    padding="max_length", return_tensors="np")
    labels = np.array([s[2] for s in samples], dtype=np.int64)
    return {
        "input_ids": enc["input_ids"].astype(np.int32),
        "token_type_ids": enc["token_type_ids"].astype(np.int8),
        "attention_mask": enc["attention_mask"].astype(np.int8),
        "labels": labels,
    }


def load_or_build_features(data_path, tokenizer, cfg, split):
    cache_name = "{}_{}_len{}.pt".format(split, os.path.basename(data_path).split(".")[0], cfg["max_seq_len"])
    cache_path = os.path.join(cfg["cache_dir"], cache_name)
    if os.path.exists(cache_path):
        logger.info("加载特征缓存: %s", cache_path)
        return torch.load(cache_path)
    logger.info("未找到缓存，开始分词: %s", data_path)
    samples = read_jsonl(data_path)
    feats = build_features(samples, tokenizer, cfg["max_seq_len"])
    os.makedirs(cfg["cache_dir"], exist_ok=True)
    torch.save(feats, cache_path)
    logger.info("特征已写入缓存: %s (%d 条)", cache_path, len(feats["labels"]))
    return feats


class RelevanceDataset(Dataset):
    def __init__(self, feats):
        self.feats = feats

    def __len__(self):
        return len(self.feats["labels"])

    def __getitem__(self, idx):
        return {
            "input_ids": torch.as_tensor(self.feats["input_ids"][idx], dtype=torch.long),
            "token_type_ids": torch.as_tensor(self.feats["token_type_ids"][idx], dtype=torch.long),
            "attention_mask": torch.as_tensor(self.feats["attention_mask"][idx], dtype=torch.long),
            "labels": torch.as_tensor(self.feats["labels"][idx], dtype=torch.long),
        }


@torch.no_grad()
def evaluate(model, dataset, rank, world_size, device, batch_size):
    """各 rank 评估互不重叠的一段数据，最后 all_reduce 汇总"""
    model.eval()
    indices = list(range(rank, len(dataset), world_size))
    loader = DataLoader(Subset(dataset, indices), batch_size=batch_size, shuffle=False, num_workers=2)
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        out = model.module(**batch)
        bs = batch["labels"].size(0)
        stats[0] += out.loss.item() * bs
        stats[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
        stats[2] += bs
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def save_checkpoint(model, optimizer, scheduler, epoch, step, path):
    state = {
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "step": step,
    }
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def main():
    args = parse_args()
    cfg = load_config(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        logger.setLevel(logging.WARNING)

    torch.manual_seed(cfg.get("seed", 42))
    tokenizer = BertTokenizerFast.from_pretrained(cfg["pretrained"])

    train_feats = load_or_build_features(cfg["train_file"], tokenizer, cfg, "train")
    dev_feats = load_or_build_features(cfg["dev_file"], tokenizer, cfg, "dev")
    train_set = RelevanceDataset(train_feats)
    dev_set = RelevanceDataset(dev_feats)
    logger.info("训练集 %d 条, 验证集 %d 条", len(train_set), len(dev_set))

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.get("seed", 42))
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)

    model = BertForSequenceClassification.from_pretrained(cfg["pretrained"], num_labels=cfg["num_labels"])
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ["bias", "LayerNorm.weight"]
    param_groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=cfg["lr"])
    total_steps = len(train_loader) * cfg["epochs"]
    scheduler = get_linear_schedule_with_warmup(optimizer, int(total_steps * cfg["warmup_ratio"]), total_steps)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, global_step = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, global_step = ckpt["epoch"] + 1, ckpt["step"]
        logger.info("从 %s 恢复训练, epoch=%d step=%d", args.resume, start_epoch, global_step)

    if rank == 0:
        os.makedirs(cfg["output_dir"], exist_ok=True)

    best_acc = 0.0
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.cuda.amp.autocast():
                out = model(**batch)
                loss = out.loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            global_step += 1

            if global_step % cfg["log_steps"] == 0:
                elapsed = time.time() - t0
                logger.info("epoch %d step %d loss %.4f lr %.2e %.1f samples/s",
                            epoch, global_step, loss.item(), scheduler.get_last_lr()[0],
                            cfg["log_steps"] * cfg["batch_size"] * world_size / elapsed)
                t0 = time.time()

        dev_loss, dev_acc = evaluate(model, dev_set, rank, world_size, device, cfg["batch_size"] * 2)
        logger.info("epoch %d 验证集 loss %.4f acc %.4f", epoch, dev_loss, dev_acc)
        if rank == 0:
            save_checkpoint(model, optimizer, scheduler, epoch, global_step,
                            os.path.join(cfg["output_dir"], "last.pt"))
            if dev_acc > best_acc:
                best_acc = dev_acc
                model.module.save_pretrained(os.path.join(cfg["output_dir"], "best"))
                tokenizer.save_pretrained(os.path.join(cfg["output_dir"], "best"))
                logger.info("保存最优模型 acc=%.4f", best_acc)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
